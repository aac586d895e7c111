"""Evidence-level QA evaluation on MIMIC-QA: what each system would put in front of a reader.

For each question (``stam_lab.eval.mimic_qa``), each system builds its context for the patient at the question's
clinical time (``as_of``, as a user would ask it), counted with the same tokenizer; reported per system:
gold-evidence recall (share of the question's supporting rows in the context), questions with all their
evidence served, served tokens (mean, median), by question type, and paired comparisons against STAM (exact
McNemar on "all evidence served", paired bootstrap CI and sign-flip test on evidence recall). Patients are
replayed with every MIMIC-IV table by default (the distractors a real record has). Systems:

- ``stam``: the read path (``QueryService.packet``: the patient's timeline viewed at ``as_of``, concept threads
  ranked and filled by the question's intent, computed facts, the store gate, thread rendering).
- ``stam-both``: the same with HISTORY always served (the gate forced open).
- ``append-only``: the classic accumulating memory: every memory stays current and nothing is linked; cosine
  top-k (k = STAM's two budgets together) over the memories recorded by the question's time, one dated line
  each. Its memories are STAM's own (the same extraction), so only the state differs.
- ``append-only+threads``: STAM's read path over that append-only state (an ablation: threads, intents and
  computed facts without the state transitions).
- ``flat-rag``: each entry is one chunk (the text of its memories); semantic top-k over the patient's chunks
  up to the question's time.
- ``full-context``: every entry up to the question's time in time order, oldest dropped first to the token
  budget.
- on request (``systems``), rendering controls: ``stam-no-facts`` (no computed facts) and ``stam-neutral``
  (``labels=false``: no store words).

Also counted for STAM's packets: items served as current that the rows say were superseded by then (a lab result
with a later result of the same item at or before the packet's time; a pharmacy order whose stop is at or before
it), from the published entries, never from STAM's state.

With a reader (any OpenAI-compatible endpoint, or a packaged GGUF model in process), each system's answers are
scored by token F1 and exact match against the rows' answer, with the same paired tests (McNemar on EM,
bootstrap and sign-flip on F1). Context matching (the paper's appendix C.5): ``match=<system>`` runs STAM once
more with a token budget equal to that system's median context and reports the ratio of the medians (matched
within 0.8-1.25).
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from schemas import AtomicMemory, RecordEntry, Store, StoredMemory
from schemas.query import GateMode, QueryRequest
from stam.deletion.sweep import orders, scan
from stam.llm.prompt import ids as prompt_ids
from stam.llm.prompt import prompt
from stam.read.reader import SYSTEM
from stam.read.store_gate import StoreGate
from stam.read.tokens import load_tokenizer
from stam.sources.mimic import TABLES
from stam_lab.eval.mimic_qa import Question
from stam_lab.eval.paired import mcnemar_exact, paired_bootstrap, sign_flip_permutation
from stam_lab.eval.qa import exact_match, token_f1
from stam_lab.eval.state_eval import Replayed, replay_mimic

SYSTEMS = ("stam", "stam-both", "append-only", "append-only+threads", "flat-rag", "full-context")
ABLATIONS = ("stam-no-facts", "stam-neutral")
"""Rendering controls, run on request: STAM without computed facts; STAM's neutral rendering (labels=false)."""


def _when(e: RecordEntry) -> datetime | None:
    return e.effective_at or e.recorded_at


def _chunks(run: Replayed, pid: str) -> list[tuple[RecordEntry, str]]:
    """Per entry, the text of its memories (the same surface every system reads)."""
    texts: dict[str, list[str]] = defaultdict(list)
    for ev in run.events[pid]:
        if ev.memory is not None:
            texts[ev.entry_id].append(ev.memory.text)
    return [(e, "\n".join(texts[e.entry_id])) for e in run.entries[pid] if texts.get(e.entry_id)]


SHORT_ANSWER = " Reply with the answer only: a value with its unit, a medication name, a number, or yes or no; no sentence."
READER_SYSTEM = prompt("answer-short", 1, "{answer}" + SHORT_ANSWER, SYSTEM + SHORT_ANSWER).text
"""The reader's prompt in an evaluation: the answer prompt, asking for the answer alone (scored by matching)."""
MATCH_K = 200
"""Threads and per-thread history of a context-matched STAM run: the token budget, not k, decides the size."""


def _line(e: RecordEntry, text: str) -> str:
    when = _when(e)
    return f"- [{when.date().isoformat() if when else '?'}] " + text.replace("\n", "; ")


def _render_entries(chunks: Sequence[tuple[RecordEntry, str]], idx: Sequence[int], header: str) -> str:
    return "\n".join([header, *(_line(*chunks[i]) for i in idx)] if idx else [header, "(no entry retrieved)"])


class AppendOnlyStates:
    """A patient's records as an append-only memory keeps them: the same memories, every one current, none
    ended or replaced (an evaluation adapter over a STAM replay's state store)."""

    def __init__(self, states: Any) -> None:
        self._states = states

    @staticmethod
    def _flat(s: StoredMemory) -> StoredMemory:
        return s.model_copy(update={"store": Store.ACTIVE, "reason": None, "successor_id": None, "evidence_id": None,
                                    "archived_by_entry": None, "archived_at": None})

    def version(self, patient_id: str) -> int:
        return int(self._states.version(patient_id))

    def timeline_rows(self, patient_id: str) -> None:
        return None  # the records, flattened, are what it reads

    def records(self, patient_id: str) -> tuple[int, list[bytes]]:
        version, raw = self._states.records(patient_id)
        return version, [self._flat(StoredMemory.model_validate_json(r)).model_dump_json().encode() for r in raw]

    def memories(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, StoredMemory]:
        return {k: self._flat(v) for k, v in self._states.memories(patient_id, memory_ids).items()}

    def source_text(self, patient_id: str, entry_id: str) -> str | None:
        return self._states.source_text(patient_id, entry_id)  # type: ignore[no-any-return]

    def gaps(self, patient_id: str) -> list[Any]:
        return list(self._states.gaps(patient_id))


@dataclass
class _Memories:
    """One patient's memories for the append-only baseline: (memory, evidence time, vector)."""

    memories: list[AtomicMemory]
    times: np.ndarray
    vectors: np.ndarray


def _current_errors(pkt: Any, series: dict[str, list[tuple[datetime, str]]], item_of: dict[str, str],
                    stops: dict[str, datetime]) -> int:
    """Items a packet serves as current that the rows say were replaced by the packet's time."""
    at = pkt.at
    n = 0
    for i in pkt.items:
        if i.store is not Store.ACTIVE:
            continue
        item = item_of.get(i.source_entry_id)
        if item is not None and i.effective_start is not None:
            later = [t for t, e in series[item] if t > i.effective_start and (at is None or t <= at)]
            n += bool(later)
        stop = stops.get(i.source_entry_id)
        n += stop is not None and (at is None or stop <= at)
    return n


def evaluate_qa(root: Path, questions: Sequence[Question], *, workdir: Path, embedder: Any = None,
                tokenizer: Any = None, k_active: int = 8, k_history: int = 8, rag_k: int = 16,
                budget: int = 4000, tables: Sequence[str] | None = None, progress: Any = None, reader: Any = None,
                match: str | None = None, keep_rows: bool = False, answer_progress: Any = None,
                keep_replay: bool = False, systems: Sequence[str] | None = None,
                deletion_gate: Any = None) -> dict[str, Any]:
    """Contexts of every system for every question; with ``reader``, its answers scored by token F1 / EM;
    with ``match`` (a comparator system), STAM again at a token budget equal to that system's median.
    ``keep_replay``: keep the replay in ``workdir`` and reuse one kept there (see ``replay_mimic``). ``systems``:
    which systems to run (default :data:`SYSTEMS`; ``stam`` always runs, the others are compared with it).
    ``deletion_gate`` (a :class:`stam.deletion.gate.Gate`): after every system has read, the gate's sweep is applied
    to the replay by the update stage's own deletion (:func:`stam.stages.delete_batch`), and STAM reads again as
    ``stam+deletion`` (paired with ``stam``); the report says what was deleted (``deletion``)."""
    # deferred: stam.embedding pulls in redis
    from stam.embedding import Embedder

    embedder = embedder or Embedder()
    tokenizer = tokenizer or load_tokenizer("all-MiniLM-L6-v2")
    tables = tuple(tables) if tables is not None else TABLES
    subjects = sorted({q.patient_id for q in questions})
    stam = replay_mimic(root, subjects=subjects, tables=tables, variant="stam", workdir=workdir / "stam",
                        embedder=embedder, progress=progress, keep=keep_replay)
    chosen = list(dict.fromkeys(["stam", *(systems or SYSTEMS)]))
    unknown = set(chosen) - set(SYSTEMS) - set(ABLATIONS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS + ABLATIONS)}")
    systems = chosen
    matching: dict[str, Any] | None = None
    deletion: dict[str, Any] | None = None
    try:
        run = _Run(stam, embedder, tokenizer, workdir=workdir, keep_replay=keep_replay, rag_k=rag_k, budget=budget)
        rows: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for q in questions:
            for name in systems:
                if name.startswith("stam") or name == "append-only+threads":
                    mode = GateMode.BOTH if name == "stam-both" else GateMode.AUTO
                    rows[name].append(run.read(name, q, mode, k_active, k_history))
            run.baselines(q, rows, k_active + k_history)
            if progress is not None and hasattr(progress, "question") and "full-context" in rows:
                progress.question()
        if match is not None:
            matching = run.matching(match, questions, rows)
            systems.append(f"stam@{match}")
        if deletion_gate is not None:
            deletion = _delete(stam, deletion_gate, subjects, embedder)
            run.services["stam"] = run.service()
            rows["stam+deletion"] = [run.read("stam", q, GateMode.AUTO, k_active, k_history) for q in questions]
            systems.append("stam+deletion")
    finally:
        stam.close()
    if reader is not None:
        _answer(reader, questions, rows, answer_progress)
    report: dict[str, Any] = {
        "questions": len(questions), "patients": len(subjects), "tables": list(tables), "budget": budget,
        "rag_k": rag_k, "k_active": k_active, "k_history": k_history, "reader": getattr(reader, "name", None),
        "prompts": prompt_ids("answer-short"),
        "stale_current_items": {s: sum(r.get("stale", 0) for r in rows[s]) for s in systems if s.startswith("stam")},
        "systems": {s: _summary(rows[s]) for s in systems},
        "paired_vs_stam": {s: _paired(rows["stam"], rows[s]) for s in systems if s != "stam"}}
    if matching is not None:
        report["matching"] = matching
    if deletion is not None:
        report["deletion"] = deletion
    if reader is not None and hasattr(reader, "usage"):
        report["reader_usage"] = usage_of(reader)
    if keep_rows:
        report["rows"] = {s: [{k: v for k, v in r.items() if k != "context"} for r in rows[s]] for s in systems}
    return report


class _Run:
    """One QA run's systems over one replay: STAM's read path (and append-only+threads on the same stores), the
    append-only, flat-RAG and full-context baselines, and the record's truth that stale current items are
    counted against (each lab item's results in time order, each pharmacy order's stop)."""

    def __init__(self, stam: Replayed, embedder: Any, tokenizer: Any, *, workdir: Path, keep_replay: bool,
                 rag_k: int, budget: int) -> None:
        self.stam, self.embedder, self.tokenizer = stam, embedder, tokenizer
        self.workdir, self.keep_replay, self.rag_k, self.budget = workdir, keep_replay, rag_k, budget
        self.gate = StoreGate()
        self.services = {"stam": self.service(), "append-only+threads": self.service(
            AppendOnlyStates(stam.deps.states))}
        self.series: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
        self.item_of: dict[str, str] = {}
        self.stops: dict[str, datetime] = {}
        for es in stam.entries.values():
            for e in es:
                if e.entry_id.startswith("mimic-iv:labevents:") and e.codes and e.effective_at is not None:
                    key = f"{e.patient_id}|{e.codes[0].code}"
                    self.series[key].append((e.effective_at, e.entry_id))
                    self.item_of[e.entry_id] = key
                elif e.entry_id.startswith("mimic-iv:pharmacy:") and e.entry_id.endswith(":stop") and \
                        e.effective_end is not None:
                    self.stops[e.entry_id.removesuffix(":stop") + ":start"] = e.effective_end
        for v in self.series.values():
            v.sort()
        self.memories: dict[str, _Memories] = {}
        self.chunks: dict[str, tuple[list[tuple[RecordEntry, str]], np.ndarray, list[int]]] = {}

    def service(self, states: AppendOnlyStates | None = None) -> Any:
        """A query service on the replay's stores (``states``: append-only's view of them)."""
        # deferred: stam.compose pulls in pymilvus, redis, cryptography
        from stam.compose import local_query_service

        if states is None:
            return local_query_service(self.stam.deps, embedder=self.embedder, tokenizer=self.tokenizer,
                                       gate=self.gate)
        return local_query_service(self.stam.deps, states=states,  # type: ignore[arg-type]
                                   embedder=self.embedder, tokenizer=self.tokenizer, gate=self.gate)

    def read(self, name: str, q: Question, mode: GateMode, ka: int, kh: int,
             token_budget: int | None = None) -> dict[str, Any]:
        """The read path's packet for ``q`` as system ``name`` (a STAM variant or append-only+threads)."""
        service = self.services["append-only+threads" if name == "append-only+threads" else "stam"]
        as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
        req = QueryRequest(request_id=q.question_id, patient_id=q.patient_id, question=q.question,
                           k_active=ka, k_history=kh, gate=mode, as_of=as_of, token_budget=token_budget,
                           facts=name != "stam-no-facts", labels=name != "stam-neutral")
        pkt = service.packet(req)
        return _row(q, {i.source_entry_id for i in pkt.items}, pkt.tokens, pkt.rendered,
                    history=sum(i.store is Store.HISTORY for i in pkt.items), facts=len(pkt.facts),
                    intent=pkt.intent, stale=_current_errors(pkt, self.series, self.item_of, self.stops)
                    if name.startswith("stam") else 0)

    def baselines(self, q: Question, rows: dict[str, list[dict[str, Any]]], k: int) -> None:
        """The append-only, flat-RAG and full-context rows of ``q`` (those of the systems in ``rows``)."""
        as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
        qv = self.embedder.embed([q.question])[0]
        if "append-only" in rows:
            if q.patient_id not in self.memories:
                self.memories[q.patient_id] = _append_only_memories(self.stam, q.patient_id, self.embedder)
            rows["append-only"].append(_append_only(q, self.memories[q.patient_id], qv, as_of, k, self.tokenizer))
        if "flat-rag" not in rows and "full-context" not in rows:
            return
        chunks, vecs, counts = self.patient_chunks(q.patient_id)
        visible = [i for i, (e, _) in enumerate(chunks)
                   if as_of is None or (_when(e) is not None and _when(e) <= as_of)]  # type: ignore[operator]
        ranked = sorted(visible, key=lambda i: -float(vecs[i] @ qv))[:self.rag_k]
        text = _render_entries(chunks, ranked, "Patient record entries (most relevant first):")
        if "flat-rag" in rows:
            rows["flat-rag"].append(_row(q, {chunks[i][0].entry_id for i in ranked}, self.tokenizer.count(text), text))
        if "full-context" not in rows:
            return
        kept: list[int] = []
        used = self.tokenizer.count("Patient record entries (oldest first):")
        for i in reversed(visible):  # newest first; the oldest are what the budget drops
            if used + counts[i] > self.budget:
                break
            kept.append(i)
            used += counts[i]
        text = _render_entries(chunks, kept[::-1], "Patient record entries (oldest first):")
        rows["full-context"].append(_row(q, {chunks[i][0].entry_id for i in kept}, self.tokenizer.count(text), text,
                                         truncated=len(kept) < len(visible)))

    def patient_chunks(self, pid: str) -> tuple[list[tuple[RecordEntry, str]], np.ndarray, list[int]]:
        """The patient's record entries as text chunks, their vectors and token counts (computed once)."""
        if pid not in self.chunks:
            chunks = _chunks(self.stam, pid)
            vecs = _chunk_vectors(self.embedder, [t for _, t in chunks],
                                  self.workdir / "stam" / "chunk-vectors" / f"{pid}.npy" if self.keep_replay
                                  else None)
            self.chunks[pid] = (chunks, vecs, self.tokenizer.count_many([_line(*c) for c in chunks]))
        return self.chunks[pid]

    def matching(self, match: str, questions: Sequence[Question],
                 rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """STAM again at a token budget equal to ``match``'s median (rows ``stam@<match>``), and how close it came."""
        if match not in rows or match.startswith("stam") or match == "append-only+threads":
            raise ValueError(f"match against one of append-only, flat-rag, full-context, not {match!r}")
        target = int(statistics.median(r["tokens"] for r in rows[match]))
        name = f"stam@{match}"
        rows[name] = [self.read("stam", q, GateMode.AUTO, MATCH_K, MATCH_K, token_budget=target) for q in questions]
        median = statistics.median(r["tokens"] for r in rows[name])
        return {"comparator": match, "target_tokens": target, "stam_median_tokens": median,
                "ratio": round(median / target, 3) if target else None,
                "matched": bool(target) and 0.8 <= median / target <= 1.25}


def usage_of(reader: Any) -> dict[str, Any]:
    """A reader's token accounting as a dict: the in-process reader keeps a dict, the endpoint reader
    (``--reader-url``) the client's :class:`stam.llm.client.Usage`."""
    usage = reader.usage
    return usage.as_dict() if hasattr(usage, "as_dict") else dict(usage)


def _delete(run: Replayed, gate: Any, subjects: Sequence[str], embedder: Any) -> dict[str, Any]:
    """Sweep the replayed patients with ``gate`` and apply the orders as the update stage does."""
    # deferred: stam.stages pulls in redis
    from stam.stages import delete_batch

    before = {p: run.deps.states.load(p) for p in subjects}
    swept = list(scan(run.deps.states, embedder.embed, gate, subjects))
    todo = [o for x in swept for o in orders(x, gate)]
    results = delete_batch(todo, run.deps) if todo else []
    gone = [t for r in results for t in r.transitions]
    by_category: dict[str, int] = defaultdict(int)
    by_system: dict[str, int] = defaultdict(int)
    kept: dict[str, int] = defaultdict(int)
    for x in swept:
        for why, n in x.kept.items():
            kept[why] += n
    for t in gone:
        m = before[t.patient_id].memories[t.memory_id].memory
        by_category[m.category.value] += 1
        by_system[m.concept.system.rsplit("/", 1)[-1] if m.concept is not None else "uncoded"] += 1
    memories = sum(len(s.memories) for s in before.values())
    history = sum(s.counts()["history"] for s in before.values())
    return {"gate": gate.spec.as_dict(), "memories_before": memories, "history_before": history,
            "candidates": sum(x.candidates for x in swept), "ordered": sum(len(x.chosen) for x in swept),
            "deleted": len(gone), "deleted_share": round(len(gone) / memories, 6) if memories else 0.0,
            "deleted_share_of_history": round(len(gone) / history, 6) if history else 0.0,
            "deleted_by_category": dict(sorted(by_category.items())),
            "deleted_by_code_system": dict(sorted(by_system.items())),
            "kept_by_rule": dict(sorted(kept.items())),
            "skipped": sum(len(r.skipped) for r in results)}


def _chunk_vectors(embedder: Any, texts: list[str], path: Path | None) -> np.ndarray:
    """Flat RAG's chunk embeddings; kept beside a kept replay (a patient with every table has thousands of entries,
    minutes to embed here), and used again only for the same texts."""
    if not texts:
        return np.zeros((0, embedder.dim), dtype=np.float32)
    digest = hashlib.sha256("\x1e".join([embedder.model_name, *texts]).encode()).hexdigest()[:16]
    if path is not None:
        cached = path.with_name(f"{path.stem}-{digest}.npy")
        if cached.is_file():
            loaded: np.ndarray = np.load(cached)
            return loaded
    vecs: np.ndarray = embedder.embed(texts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(cached, vecs)
    return vecs


def _append_only_memories(run: Replayed, pid: str, embedder: Any) -> _Memories:
    # deferred: stam.embedding, stam.read.asof pull in redis, cryptography
    from stam.embedding import memory_vectors
    from stam.read.asof import evidence_time

    mems = [e.memory for e in run.events[pid] if e.memory is not None]
    times = np.array([(t.timestamp() if (t := evidence_time(m, False)) else -np.inf) for m in mems])
    vecs = memory_vectors(mems, run.deps.embedder) if mems else np.zeros((0, embedder.dim), dtype=np.float32)
    return _Memories(mems, times, vecs)


def _append_only(q: Question, mem: _Memories, qv: np.ndarray, as_of: datetime | None, k: int,
                 tokenizer: Any) -> dict[str, Any]:
    """Cosine top-k over the memories recorded by ``as_of``, one dated line each, best first."""
    visible = np.flatnonzero(mem.times <= (as_of.timestamp() if as_of else np.inf))
    scores = mem.vectors[visible] @ qv if visible.size else np.zeros(0)
    top = visible[np.argsort(-scores, kind="stable")[:k]]
    lines = ["Patient record memories (most relevant first):"]
    for i in top:
        m = mem.memories[int(i)]
        lines.append(f"- [{m.effective_start.date().isoformat() if m.effective_start else '?'}] {m.text}")
    if not top.size:
        lines.append("(no memory retrieved)")
    text = "\n".join(lines)
    return _row(q, {mem.memories[int(i)].entry_id for i in top}, tokenizer.count(text), text)


def _answer(reader: Any, questions: Sequence[Question], rows: dict[str, list[dict[str, Any]]],
            progress: Any) -> None:
    """The reader's answer to each (question, context) once (systems that serve the same context share it)."""
    cache: dict[tuple[str, str], str] = {}
    done = 0
    for rs in rows.values():
        for q, r in zip(questions, rs, strict=True):
            key = (q.question, r["context"])
            if key not in cache:
                cache[key] = (reader.answer_sync(q.question, r["context"]) if hasattr(reader, "answer_sync")
                              else asyncio.run(reader.answer(q.question, r["context"])))
            r["prediction"] = cache[key]
            r["f1"] = token_f1(r["prediction"], q.golds)
            r["em"] = exact_match(r["prediction"], q.golds)
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
