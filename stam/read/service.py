"""The query service: one question about one patient -> an evidence packet (and an answer).

The read path serves what the write path knows (section 3.3 of the method, and the state it maintains):

1. **The patient's timeline** (:mod:`stam.read.timeline`): every memory of the patient with its clinical times,
   its store, why it ended and what replaced it, read from the record store in one round trip and kept per
   process while the patient's state version is unchanged; vectors of coded memories come from the shared
   concept-embedding cache (every value of a concept shares its concept's vector), the others from the vector
   store. Only the requested patient's records and vectors are read; every served item is checked to belong to
   the patient (a breach raises).
2. **What the question asks of time** (:mod:`stam.read.intent`): current, previous, first, highest/lowest,
   count, change, history, orders started/stopped most recently, is X active, what X was changed into; and the
   times it names, resolved against the patient's clinical clock.
3. **The state at the question's time**: ``as_of`` (or a time the question names) is a view of the timeline at
   that clinical time, the same rules as a replay of the transition log; ``as_of_version`` replays the log to a
   position in the patient's stream. A ``visibility`` boundary leaves out evidence the query may not see.
4. **The store gate** (:mod:`stam.read.store_gate`) decides whether HISTORY is served.
5. **Threads, not memories** (:mod:`stam.read.select`): concept threads ranked by the question, each filled by
   the intent; computed facts where the question names a concept.
6. **Rendering** (:mod:`stam.read.render`): one compact block per thread, within ``token_budget``.
7. **Record gaps**: entries of the patient that were dead-lettered and not applied (``stam deadletters``) are
   listed in the packet (``gaps``) and one line under the header tells the reader the record is incomplete.

:meth:`QueryService.answer` builds the packet (embedding, Redis and Milvus round trips: blocking calls) on a
small thread pool of the service, so the caller's event loop keeps serving while a query works. A query that
fails is answered, never raised: ``ok=false`` with an ``error_kind`` (see :mod:`stam.read.failures`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import numpy as np

from schemas import Store, StoredMemory, TransitionEvent
from schemas.query import (
    ComputedFact,
    EvidenceItem,
    EvidencePacket,
    GateDecision,
    QueryAnswer,
    QueryRequest,
    RecordGap,
    Visibility,
)
from stam.backends.base import StateStore, VectorStore
from stam.cache import VersionedCache
from stam.deadletters import gap_line
from stam.embedding import Embedder
from stam.errors import IsolationBreach, QueryError, UnsupportedQuery
from stam.read.aggregate import select
from stam.read.asof import state_at_version
from stam.read.encounters import Stay, resolve
from stam.read.failures import classify, failed_answer
from stam.read.intent import Intent, parse
from stam.read.reader import Reader
from stam.read.render import header, render_block, render_packet
from stam.read.store_gate import StoreGate
from stam.read.threads import Pick, ThreadIndex
from stam.read.timeline import Timeline, View, collector_paused, from_epoch
from stam.read.tokens import Tokenizer

__all__ = ["NO_READER", "IsolationBreach", "QueryError", "QueryService", "UnsupportedQuery", "classify",
           "failed_answer"]

NO_READER = "no reader model configured: evidence packet only (set STAM_READER_URL to get answers)"
SPAN_CHARS = 240
DEFAULT_CACHE_MEMORIES = 500_000


class TimelineCache(VersionedCache[tuple[Timeline, ThreadIndex]]):
    """Per-patient timelines (with their vectors and thread index) of one process, least recently used out
    first once they hold more than ``max_memories`` memories. A timeline is valid for one state version."""

    def __init__(self, max_memories: int = DEFAULT_CACHE_MEMORIES) -> None:
        super().__init__(max_memories, version_of=lambda item: item[0].version, weigh=lambda item: len(item[0]))
        self.loads = 0
        self.hits = 0

    def get(self, patient_id: str, version: int, erasures: int = 0) -> tuple[Timeline, ThreadIndex] | None:
        got = super().get(patient_id, version, erasures)
        if got is not None:
            self.hits += 1
        return got

    def put(self, patient_id: str, value: tuple[Timeline, ThreadIndex], erasures: int = 0) -> None:
        super().put(patient_id, value, erasures)
        self.loads += 1

    def memories(self) -> int:
        return self.weight()


class QueryService:
    def __init__(self, *, states: StateStore, vectors: VectorStore, embedder: Embedder, tokenizer: Tokenizer,
                 gate: StoreGate, reader: Reader | None = None,
                 transitions: Callable[[str], Awaitable[list[TransitionEvent]]] | None = None,
                 cache: TimelineCache | None = None, threads: int = 2) -> None:
        """``threads``: packets built at once, off the caller's event loop (a bounded pool of this service)."""
        self.states = states
        self.vectors = vectors
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.gate = gate
        self.reader = reader
        self.transitions = transitions
        self.cache = cache or TimelineCache()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stam-query")

    def close(self) -> None:
        """Stop the service's threads (after the packets being built are done)."""
        self._pool.shutdown(wait=True)

    # --- the patient's timeline ------------------------------------------------------------------------

    def timeline(self, patient_id: str) -> tuple[Timeline, ThreadIndex]:
        """The live timeline (cached while the patient's state version is unchanged)."""
        both = getattr(self.states, "version_and_erasures", None)  # adapters that only answer version(): no count
        version, erasures = both(patient_id) if both is not None else (self.states.version(patient_id), 0)
        got = self.cache.get(patient_id, version, erasures)
        if got is not None:
            return got
        with collector_paused():
            tl = Timeline.read(self.states, patient_id)
            self._attach_vectors(tl)
            idx = ThreadIndex.build(tl)
        self.cache.put(patient_id, (tl, idx), erasures)
        return tl, idx

    def _attach_vectors(self, tl: Timeline) -> None:
        keys = list(dict.fromkeys(tl.embed_keys))
        concept = [k for k in keys if k.startswith("c:")]
        own = [k for k in keys if k.startswith("m:")]
        rows: dict[str, np.ndarray] = {}
        if concept:
            # The concept texts' vectors: the shared concept cache the write path filled (or the model).
            for k, v in zip(concept, self.embedder.embed_concepts([k[2:] for k in concept]), strict=True):
                rows[k] = v
        if own:
            found = self.vectors.fetch_ids(tl.patient_id, [k[2:] for k in own])
            missing = [k for k in own if k[2:] not in found]
            for k in own:
                if k[2:] in found:
                    rows[k] = found[k[2:]]
            if missing:  # a vector not yet in the vector store (a write in flight): the same model embeds it
                texts = self._texts(tl.patient_id, [k[2:] for k in missing])
                for k, v in zip(missing, self.embedder.embed([texts[k[2:]] for k in missing]), strict=True):
                    rows[k] = v
        dim = self.embedder.dim
        tl.attach_vectors(keys, np.vstack([rows[k] for k in keys]) if keys else np.zeros((0, dim), np.float32))

    def _texts(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, str]:
        recs = self.states.memories(patient_id, memory_ids)
        return {m: (r.memory.embed_text or r.memory.text) for m, r in recs.items()}

    def _past_version(self, req: QueryRequest, events: Sequence[TransitionEvent]) -> tuple[Timeline, ThreadIndex]:
        assert req.as_of_version is not None
        state = state_at_version(req.patient_id, events, req.as_of_version)
        tl = Timeline.from_stored(req.patient_id, state.version, state.memories.values())
        self._attach_vectors(tl)
        return tl, ThreadIndex.build(tl)

    # --- the packet -------------------------------------------------------------------------------------

    def packet(self, req: QueryRequest, events: Sequence[TransitionEvent] | None = None) -> EvidencePacket:
        if req.as_of_version is not None:
            if events is None:
                raise UnsupportedQuery("as_of_version needs the transition log; none is configured for this service")
            tl, idx = self._past_version(req, events)
        else:
            tl, idx = self.timeline(req.patient_id)
        gaps = tuple(self.states.gaps(req.patient_id))  # one HGETALL: dead-lettered entries not applied
        gap = gap_line(gaps)
        if len(tl) == 0:
            raise QueryError(f"no memory for patient {req.patient_id!r}" + (f" ({gap})" if gap else ""))
        intent, at, view, stay = read_plan(tl, idx, req.question, req.as_of, req.visibility)
        top = header(req.as_of, req.as_of_version, at) + (f"\n({gap})" if gap else "")
        if stay is not None:
            over = stay.ended and (at is None or stay.end <= at.timestamp())
            top += f"\n({stay.label('latest admission' if over else 'current admission')})"
        if not view.present.any():  # nothing recorded yet at that time (or nothing visible): an empty packet
            return self._empty(req, tl, at, intent.describe(), top, gaps)
        qv = self.embedder.embed([req.question])[0]
        scores = tl.scores(qv)
        active = view.present & ~view.history
        hist = view.present & view.history
        s_a = float(scores[active].max()) if active.any() else None
        s_h = float(scores[hist].max()) if hist.any() else None
        decision: GateDecision = self.gate.decide(req.question, req.gate, s_a, s_h, intent)
        sel = select(tl, idx, view, scores, req.question, intent, serve_history=decision.serve_history,
                     k_threads=req.k_active, k_history=req.k_history, joint=req.ranking == "joint", stay=stay)
        begins = from_epoch(stay.start) if stay is not None else None
        blocks = self._blocks(tl, view, sel.picks, scores, req, begins)
        facts = [ComputedFact(kind=f.kind, text=f.text, memory_ids=f.memory_ids) for f in sel.facts] if req.facts \
            else []
        rendered, kept, kept_facts, dropped = render_packet(req, blocks, facts, self.tokenizer, top=top,
                                                            stay_start=begins)
        return EvidencePacket(patient_id=req.patient_id, question=req.question, state_version=tl.version,
                              as_of=req.as_of, as_of_version=req.as_of_version, at=at, intent=intent.describe(),
                              gate=decision, facts=tuple(kept_facts), items=tuple(kept), dropped=dropped,
                              rendered=rendered, tokens=self.tokenizer.count(rendered), tokenizer=self.tokenizer.name,
                              token_budget=req.token_budget, gaps=gaps)

    def _empty(self, req: QueryRequest, tl: Timeline, at: datetime | None, intent: str, top: str,
               gaps: tuple[RecordGap, ...] = ()) -> EvidencePacket:
        rendered = f"{top}\n(nothing recorded {'by then' if at is not None else 'that this query may see'})"
        decision = self.gate.decide(req.question, req.gate, None, None)
        return EvidencePacket(patient_id=req.patient_id, question=req.question, state_version=tl.version,
                              as_of=req.as_of, as_of_version=req.as_of_version, at=at, intent=intent, gate=decision,
                              items=(), rendered=rendered, tokens=self.tokenizer.count(rendered),
                              tokenizer=self.tokenizer.name, token_budget=req.token_budget, gaps=gaps)

    def _blocks(self, tl: Timeline, view: View, picks: Sequence[Pick], scores: np.ndarray,
                req: QueryRequest, stay_start: datetime | None = None) -> list[list[EvidenceItem]]:
        """Evidence items per thread (newest first), from the records of the served memories and their
        successors (only those are read)."""
        ids = [tl.ids[i] for p in picks for i in p.members]
        succ = [tl.ids[int(tl.succ[i])] for p in picks for i in p.members if view.history[i] and tl.succ[i] >= 0]
        records = self.states.memories(req.patient_id, list(dict.fromkeys(ids + succ)))
        blocks: list[list[EvidenceItem]] = []
        for p in picks:
            items: list[EvidenceItem] = []
            for i in p.members:
                s = records.get(tl.ids[i])
                if s is None:
                    continue  # the record moved on since the timeline was read; served next time
                items.append(self._item(tl, view, i, s, p, scores, records, req))
            if items:
                blocks.append(items)
        counts = self.tokenizer.count_many([render_block([i], labels=req.labels, stay_start=stay_start)
                                            for b in blocks for i in b])
        it = iter(counts)
        return [[i.model_copy(update={"tokens": next(it)}) for i in b] for b in blocks]

    def _item(self, tl: Timeline, view: View, i: int, s: StoredMemory, pick: Pick, scores: np.ndarray,
              records: dict[str, StoredMemory], req: QueryRequest) -> EvidenceItem:
        m = s.memory
        if m.patient_id != req.patient_id:
            raise IsolationBreach(f"memory {m.memory_id} of another patient reached a query; not served")
        in_history = bool(view.history[i])
        succ_rec = None
        if in_history and tl.succ[i] >= 0:
            succ_rec = records.get(tl.ids[int(tl.succ[i])])
        span = None
        if req.spans:
            text = self.states.source_text(req.patient_id, m.entry_id)
            if text:
                a, b = (m.span.start, m.span.end) if m.span else (0, len(text))
                lo, hi = max(0, a - SPAN_CHARS), min(len(text), b + SPAN_CHARS)
                span = ("..." if lo else "") + text[lo:hi].strip() + ("..." if hi < len(text) else "")
        value = None
        if m.value is not None:
            value = f"{m.value:g} {m.unit}".strip() if m.unit else f"{m.value:g}"
        elif m.value_text and m.category.value in ("observation", "other"):
            value = f"{m.value_text} {m.unit}".strip() if m.unit else m.value_text
        ended = from_epoch(float(tl.t_ended[i])) if in_history and np.isfinite(tl.t_ended[i]) else None
        return EvidenceItem(
            rank=1, memory_id=m.memory_id, store=Store.HISTORY if in_history else Store.ACTIVE,
            score=round(float(scores[i]), 6), category=m.category, text=m.text, status=m.status,
            effective_start=m.effective_start, effective_end=m.effective_end, recorded_at=m.recorded_at,
            reason=s.reason if in_history else None, archived_at=s.archived_at if in_history else None,
            successor_id=s.successor_id if in_history else None,
            successor_text=_short(succ_rec) if succ_rec is not None else None,
            source_entry_id=m.entry_id, source_ref=m.source_ref, span_text=span, tokens=0,
            role=pick.roles.get(i), concept=m.concept.display if m.concept else None, value=value,
            dosage=m.dosage, ended_at=ended, encounter=m.encounter_id)

    # --- answering -------------------------------------------------------------------------------------

    async def answer(self, req: QueryRequest) -> QueryAnswer:
        """The answer to ``req``; never raises: a failure is an answer with ``ok=false`` and its error kind."""
        started = time.perf_counter()
        try:
            events = None
            if req.as_of_version is not None:
                if self.transitions is None:
                    raise UnsupportedQuery("as_of_version needs the transition log; none is configured for this "
                                           "service")
                events = await self.transitions(req.patient_id)
            packet = await asyncio.get_running_loop().run_in_executor(self._pool, self.packet, req, events)
        except Exception as exc:
            return failed_answer(req, exc, started)
        text = reader = None
        note = None
        if req.answer and self.reader is not None:
            try:
                text = await self.reader.answer(req.question, packet.rendered)
                reader = self.reader.name
            except Exception as exc:  # the packet is still the answer's evidence; say why there is no text
                note = f"reader {self.reader.name} failed: {type(exc).__name__}: {exc}"[:500]
        elif req.answer:
            note = NO_READER
        return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=True, packet=packet,
                           answer=text, reader=reader, note=note, answered_at=datetime.now(UTC),
                           latency_ms=_ms(started))


def read_plan(tl: Timeline, idx: ThreadIndex, question: str, as_of: datetime | None,
              visibility: Visibility | None) -> tuple[Intent, datetime | None, View, Stay | None]:
    """What the question asks and of which state: its intent (times resolved against the patient's clinical clock,
    ``as_of`` or the latest time in the record), the clinical time to read the state at (``as_of``, or an earlier
    time the question names), the view there, and the encounter current then. A scope the question names ("this
    admission", "at hour N of the stay", "at discharge") is resolved against that encounter, and may move the time
    the state is read at."""
    intent = parse(question, as_of or tl.latest_time())
    at = as_of
    if intent.at is not None and (at is None or intent.at < at):
        at = intent.at
    view = tl.view(at, visibility)
    stay = idx.encounters.at(tl, view) if len(idx.encounters) else None
    if stay is not None and intent.scope is not None:
        intent = resolve(intent, stay)
        if intent.at is not None and (at is None or intent.at < at):
            at = intent.at
            view = tl.view(at, visibility)
    return intent, at, view, stay


def _short(s: StoredMemory) -> str:
    m = s.memory
    if m.concept is not None and m.concept.display:
        return f"{m.concept.display} {m.dosage}" if m.dosage else m.concept.display
    return m.text


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
