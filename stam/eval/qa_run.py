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

This measures retrieval and context only. Answer F1/EM need a reader (``stam.eval.qa.token_f1``); none runs
here yet.
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
from stam.eval.state import Replayed, replay_mimic

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


def evaluate_qa(root: Path, questions: Sequence[Question], *, workdir: Path, embedder: Any = None,
                tokenizer: Any = None, k_active: int = 8, k_history: int = 8, rag_k: int = 16,
                budget: int = 4000, tables: Sequence[str] = ("admissions", "poe", "pharmacy", "labevents"),
                progress: Any = None) -> dict[str, Any]:
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
    try:
        services = {name: QueryService(states=run.deps.states, vectors=run.deps.vectors, embedder=embedder,
                                       tokenizer=tokenizer, gate=StoreGate(), projection=run.deps.projection)
                    for name, run in (("stam", stam), ("append-only", append))}
        chunk_cache: dict[str, tuple[list[tuple[RecordEntry, str]], np.ndarray, list[int]]] = {}
        rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for q in questions:
            as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
            gold = set(q.evidence)
            for name, service, run, mode, ka, kh in (
                    ("stam", services["stam"], stam, GateMode.AUTO, k_active, k_history),
                    ("stam-both", services["stam"], stam, GateMode.BOTH, k_active, k_history),
                    ("append-only", services["append-only"], append, GateMode.ACTIVE, k_active + k_history, 0)):
                req = QueryRequest(request_id=q.question_id, patient_id=q.patient_id, question=q.question,
                                   k_active=ka, k_history=kh, gate=mode, as_of=as_of)
                pkt = service.packet(req, run.events[q.patient_id] if as_of else None)
                served = {i.source_entry_id for i in pkt.items}
                history = sum(i.store is Store.HISTORY for i in pkt.items)
                rows[name].append(_row(q, served, gold, pkt.tokens, history=history))
            if q.patient_id not in chunk_cache:
                chunks = _chunks(stam, q.patient_id)
                vecs = embedder.embed([t for _, t in chunks]) if chunks else np.zeros((0, embedder.dim))
                chunk_cache[q.patient_id] = (chunks, vecs, tokenizer.count_many([t for _, t in chunks]))
            chunks, vecs, counts = chunk_cache[q.patient_id]
            visible = [i for i, (e, _) in enumerate(chunks)
                       if as_of is None or (_when(e) is not None and _when(e) <= as_of)]  # type: ignore[operator]
            qv = embedder.embed([q.question])[0]
            ranked = sorted(visible, key=lambda i: -float(vecs[i] @ qv))[:rag_k]
            rows["flat-rag"].append(_row(q, {chunks[i][0].entry_id for i in ranked}, gold,
                                         sum(counts[i] for i in ranked)))
            kept, used = [], 0
            for i in reversed(visible):  # newest first; the oldest are what the budget drops
                if used + counts[i] > budget:
                    break
                kept.append(i)
                used += counts[i]
            rows["full-context"].append(_row(q, {chunks[i][0].entry_id for i in kept}, gold, used,
                                             truncated=len(kept) < len(visible)))
    finally:
        stam.close()
        append.close()
    return {"questions": len(questions), "patients": len(subjects), "budget": budget, "rag_k": rag_k,
            "k_active": k_active, "k_history": k_history,
            "systems": {s: _summary(r) for s, r in rows.items()},
            "paired_vs_stam": {s: _paired(rows["stam"], rows[s]) for s in SYSTEMS if s != "stam"}}


def _row(q: Question, served: set[str], gold: set[str], tokens: int, **extra: Any) -> dict[str, Any]:
    hit = len(gold & served)
    return {"question_id": q.question_id, "qtype": q.qtype, "recall": hit / len(gold) if gold else 1.0,
            "all": hit == len(gold), "tokens": tokens, **extra}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_type[r["qtype"]].append(r)

    def agg(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"n": len(rs), "evidence_recall": round(statistics.fmean(r["recall"] for r in rs), 4),
                "all_evidence": round(statistics.fmean(r["all"] for r in rs), 4),
                "tokens_mean": round(statistics.fmean(r["tokens"] for r in rs), 1),
                "tokens_median": statistics.median(r["tokens"] for r in rs)}

    out = agg(rows)
    out["type_macro_recall"] = round(statistics.fmean(agg(v)["evidence_recall"] for v in by_type.values()), 4)
    out["by_type"] = {t: agg(v) for t, v in sorted(by_type.items())}
    if rows and "truncated" in rows[0]:
        out["truncated"] = sum(r["truncated"] for r in rows)
    if rows and "history" in rows[0]:
        out["served_history"] = round(statistics.fmean(r["history"] > 0 for r in rows), 4)
    return out


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    return {"mcnemar_all_evidence": mcnemar_exact([r["all"] for r in a], [r["all"] for r in b]),
            "bootstrap_recall": paired_bootstrap([r["recall"] for r in a], [r["recall"] for r in b], n_resamples=2000),
            "sign_flip_recall": sign_flip_permutation([r["recall"] for r in a], [r["recall"] for r in b],
                                                      n_permutations=2000)}
