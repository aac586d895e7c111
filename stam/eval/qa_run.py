"""Evidence-level QA evaluation on MIMIC-QA: what each system would put in front of a reader.

For each question (``stam.eval.mimic_qa``), each system builds its context for the patient as of the
question's time, counted with the same tokenizer; reported per system: gold-evidence recall (share of the
question's supporting rows in the context), questions with all their evidence served, served tokens (mean,
median), by question type, and paired comparisons against STAM (exact McNemar on "all evidence served",
paired bootstrap CI and sign-flip test on evidence recall). Systems:

- ``stam``: the read path (``QueryService.packet``: store-aware retrieval, the store gate, labels) over the
  STAM replay; ``as_of`` questions read the state rebuilt from the transition log at that time.
- ``stam-both``: the same with HISTORY always served (the gate forced open).
- ``append-only``: the same read path over an append-only replay (every memory stays ACTIVE), k = the sum of
  STAM's two budgets.
- ``flat-rag``: each entry is one chunk (the text of its memories); semantic top-k over the patient's chunks
  up to the question's time.
- ``full-context``: every entry up to the question's time in time order, oldest dropped first to the token
  budget.

Every system's context is rendered the same way for a reader (one ``- [date] text`` line per memory or entry;
STAM's packet adds its Current/Historical labels) and counted with the same tokenizer. With a reader (any
OpenAI-compatible endpoint, or a packaged GGUF model in process), each system's answers are scored by token
F1 and exact match against the rows' answer, with the same paired tests (McNemar on EM, bootstrap and
sign-flip on F1). Context matching (the paper's appendix C.5): ``match=<system>`` runs STAM once more with a
token budget equal to that system's median context (k large enough that the budget decides; one ranking over
both stores, HISTORY in it when the gate opens) and reports the ratio of the medians (matched within 0.8-1.25).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from schemas import RecordEntry, Store
from schemas.query import GateMode, QueryRequest
from stam.eval.mimic_qa import Question
from stam.eval.paired import mcnemar_exact, paired_bootstrap, sign_flip_permutation
from stam.eval.qa import exact_match, token_f1
from stam.eval.state import Replayed, replay_mimic
from stam.read.reader import SYSTEM

SYSTEMS = ("stam", "stam-both", "append-only", "flat-rag", "full-context")


def _when(e: RecordEntry) -> datetime | None:
    return e.effective_at or e.recorded_at


def _chunks(run: Replayed, pid: str) -> list[tuple[RecordEntry, str]]:
    """Per entry, the text of its memories (the same surface every system reads)."""
    texts: dict[str, list[str]] = defaultdict(list)
    for ev in run.events[pid]:
        if ev.memory is not None:
            texts[ev.entry_id].append(ev.memory.text)
    return [(e, "\n".join(texts[e.entry_id])) for e in run.entries[pid] if texts.get(e.entry_id)]


READER_SYSTEM = (SYSTEM + " Reply with the answer only: a value with its unit, a medication name or a number, "
                 "no sentence.")
MATCH_K = 200
"""Per-store retrieval budget of a context-matched STAM run: the token budget, not k, decides the size."""


def _line(e: RecordEntry, text: str) -> str:
    when = _when(e)
    return f"- [{when.date().isoformat() if when else '?'}] " + text.replace("\n", "; ")


def _render_entries(chunks: Sequence[tuple[RecordEntry, str]], idx: Sequence[int], header: str) -> str:
    return "\n".join([header, *(_line(*chunks[i]) for i in idx)] if idx else [header, "(no entry retrieved)"])


def evaluate_qa(root: Path, questions: Sequence[Question], *, workdir: Path, embedder: Any = None,
                tokenizer: Any = None, k_active: int = 8, k_history: int = 8, rag_k: int = 16,
                budget: int = 4000, tables: Sequence[str] = ("admissions", "poe", "pharmacy", "labevents"),
                progress: Any = None, reader: Any = None, match: str | None = None, keep_rows: bool = False,
                answer_progress: Any = None) -> dict[str, Any]:
    """Contexts of every system for every question; with ``reader``, its answers scored by token F1 / EM;
    with ``match`` (a comparator system), STAM again at a token budget equal to that system's median."""
    from stam.embedding import Embedder
    from stam.read.gate import StoreGate
    from stam.read.service import QueryService
    from stam.read.tokens import load_tokenizer

    embedder = embedder or Embedder()
    tokenizer = tokenizer or load_tokenizer("all-MiniLM-L6-v2")
    subjects = sorted({q.patient_id for q in questions})
    stam = replay_mimic(root, subjects=subjects, tables=tables, variant="stam", workdir=workdir / "stam",
                        embedder=embedder, progress=progress)
    append = replay_mimic(root, subjects=subjects, tables=tables, variant="append-only",
                          workdir=workdir / "append", embedder=embedder)
    systems = [*SYSTEMS]
    try:
        services = {name: QueryService(states=run.deps.states, vectors=run.deps.vectors, embedder=embedder,
                                       tokenizer=tokenizer, gate=StoreGate(), projection=run.deps.projection)
                    for name, run in (("stam", stam), ("append-only", append))}

        def read_path(name: str, q: Question, mode: GateMode, ka: int, kh: int,
                      token_budget: int | None = None) -> dict[str, Any]:
            service, run = (services["stam"], stam) if name.startswith("stam") else (services["append-only"], append)
            as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
            # Filled to a token budget, the packet takes items by rank: one ranking over both stores (the gate
            # still decides whether HISTORY is in it), or ACTIVE would crowd out every HISTORY item.
            req = QueryRequest(request_id=q.question_id, patient_id=q.patient_id, question=q.question,
                               k_active=ka, k_history=kh, gate=mode, as_of=as_of, token_budget=token_budget,
                               ranking="joint" if token_budget is not None else "separate")
            pkt = service.packet(req, run.events[q.patient_id] if as_of else None)
            return _row(q, {i.source_entry_id for i in pkt.items}, pkt.tokens, pkt.rendered,
                        history=sum(i.store is Store.HISTORY for i in pkt.items))

        chunk_cache: dict[str, tuple[list[tuple[RecordEntry, str]], np.ndarray, list[int]]] = {}
        rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for q in questions:
            as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
            rows["stam"].append(read_path("stam", q, GateMode.AUTO, k_active, k_history))
            rows["stam-both"].append(read_path("stam-both", q, GateMode.BOTH, k_active, k_history))
            rows["append-only"].append(read_path("append-only", q, GateMode.ACTIVE, k_active + k_history, 0))
            if q.patient_id not in chunk_cache:
                chunks = _chunks(stam, q.patient_id)
                vecs = embedder.embed([t for _, t in chunks]) if chunks else np.zeros((0, embedder.dim))
                chunk_cache[q.patient_id] = (chunks, vecs, tokenizer.count_many([_line(*c) for c in chunks]))
            chunks, vecs, counts = chunk_cache[q.patient_id]
            visible = [i for i, (e, _) in enumerate(chunks)
                       if as_of is None or (_when(e) is not None and _when(e) <= as_of)]  # type: ignore[operator]
            qv = embedder.embed([q.question])[0]
            ranked = sorted(visible, key=lambda i: -float(vecs[i] @ qv))[:rag_k]
            text = _render_entries(chunks, ranked, "Patient record entries (most relevant first):")
            rows["flat-rag"].append(_row(q, {chunks[i][0].entry_id for i in ranked}, tokenizer.count(text), text))
            kept: list[int] = []
            used = tokenizer.count("Patient record entries (oldest first):")
            for i in reversed(visible):  # newest first; the oldest are what the budget drops
                if used + counts[i] > budget:
                    break
                kept.append(i)
                used += counts[i]
            text = _render_entries(chunks, kept[::-1], "Patient record entries (oldest first):")
            rows["full-context"].append(_row(q, {chunks[i][0].entry_id for i in kept}, tokenizer.count(text), text,
                                             truncated=len(kept) < len(visible)))
        matching = None
        if match is not None:
            if match not in rows or match.startswith("stam"):
                raise ValueError(f"match against one of append-only, flat-rag, full-context, not {match!r}")
            target = int(statistics.median(r["tokens"] for r in rows[match]))
            name = f"stam@{match}"
            rows[name] = [read_path("stam", q, GateMode.AUTO, MATCH_K, MATCH_K, token_budget=target)
                          for q in questions]
            systems.append(name)
            median = statistics.median(r["tokens"] for r in rows[name])
            matching = {"comparator": match, "target_tokens": target, "stam_median_tokens": median,
                        "ratio": round(median / target, 3) if target else None,
                        "matched": bool(target) and 0.8 <= median / target <= 1.25}
    finally:
        stam.close()
        append.close()
    if reader is not None:
        _answer(reader, questions, rows, answer_progress)
    report: dict[str, Any] = {
        "questions": len(questions), "patients": len(subjects), "budget": budget, "rag_k": rag_k,
        "k_active": k_active, "k_history": k_history, "reader": getattr(reader, "name", None),
        "systems": {s: _summary(rows[s]) for s in systems},
        "paired_vs_stam": {s: _paired(rows["stam"], rows[s]) for s in systems if s != "stam"}}
    if matching is not None:
        report["matching"] = matching
    if reader is not None and hasattr(reader, "usage"):
        report["reader_usage"] = dict(reader.usage)
    if keep_rows:
        report["rows"] = {s: [{k: v for k, v in r.items() if k != "context"} for r in rows[s]] for s in systems}
    return report


def _answer(reader: Any, questions: Sequence[Question], rows: dict[str, list[dict[str, Any]]],
            progress: Any) -> None:
    """The reader's answer to each (question, context) once (systems that serve the same context share it)."""
    import asyncio

    cache: dict[tuple[str, str], str] = {}
    done = 0
    for rs in rows.values():
        for q, r in zip(questions, rs, strict=True):
            key = (q.question, r["context"])
            if key not in cache:
                cache[key] = (reader.answer_sync(q.question, r["context"]) if hasattr(reader, "answer_sync")
                              else asyncio.run(reader.answer(q.question, r["context"])))
            r["prediction"] = cache[key]
            r["f1"] = token_f1(r["prediction"], q.answer)
            r["em"] = exact_match(r["prediction"], q.answer)
            done += 1
            if progress is not None:
                progress(done)


def _row(q: Question, served: set[str], tokens: int, context: str, **extra: Any) -> dict[str, Any]:
    gold = set(q.evidence)
    hit = len(gold & served)
    return {"question_id": q.question_id, "qtype": q.qtype, "recall": hit / len(gold) if gold else 1.0,
            "all": hit == len(gold), "tokens": tokens, "context": context, **extra}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_type[r["qtype"]].append(r)

    def agg(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"n": len(rs), "evidence_recall": round(statistics.fmean(r["recall"] for r in rs), 4),
               "all_evidence": round(statistics.fmean(r["all"] for r in rs), 4),
               "tokens_mean": round(statistics.fmean(r["tokens"] for r in rs), 1),
               "tokens_median": statistics.median(r["tokens"] for r in rs)}
        if rs and "f1" in rs[0]:
            out["f1"] = round(statistics.fmean(r["f1"] for r in rs), 4)
            out["em"] = round(statistics.fmean(r["em"] for r in rs), 4)
        return out

    out = agg(rows)
    out["type_macro_recall"] = round(statistics.fmean(agg(v)["evidence_recall"] for v in by_type.values()), 4)
    if rows and "f1" in rows[0]:
        out["type_macro_f1"] = round(statistics.fmean(agg(v)["f1"] for v in by_type.values()), 4)
    out["by_type"] = {t: agg(v) for t, v in sorted(by_type.items())}
    if rows and "truncated" in rows[0]:
        out["truncated"] = sum(r["truncated"] for r in rows)
    if rows and "history" in rows[0]:
        out["served_history"] = round(statistics.fmean(r["history"] > 0 for r in rows), 4)
    return out


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    answers = {}
    if a and "f1" in a[0]:
        answers = {"mcnemar_em": mcnemar_exact([r["em"] == 1.0 for r in a], [r["em"] == 1.0 for r in b]),
                   "bootstrap_f1": paired_bootstrap([r["f1"] for r in a], [r["f1"] for r in b], n_resamples=2000),
                   "sign_flip_f1": sign_flip_permutation([r["f1"] for r in a], [r["f1"] for r in b],
                                                         n_permutations=2000)}
    return {**answers, "mcnemar_all_evidence": mcnemar_exact([r["all"] for r in a], [r["all"] for r in b]),
            "bootstrap_recall": paired_bootstrap([r["recall"] for r in a], [r["recall"] for r in b], n_resamples=2000),
            "sign_flip_recall": sign_flip_permutation([r["recall"] for r in a], [r["recall"] for r in b],
                                                      n_permutations=2000)}
