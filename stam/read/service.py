"""The query service: one question about one patient -> an evidence packet (and an answer).

Retrieval is store-aware (section 3.3 of the method): ACTIVE and HISTORY are ranked separately, each
within its own budget (``k_active``, ``k_history``), or jointly when asked. Similarities are exact cosines
between the question and every vector *of the requested patient*: the patient's vectors are the only ones
the search can see (a per-patient projection loaded from Milvus by patient partition key, or a Milvus search
filtered by patient), and every item is checked to belong to the patient before it is served.

Live queries read the state from Redis. ``as_of`` / ``as_of_version`` queries replay the patient's
transitions (the record) to the requested point and rank against that state (see :mod:`stam.read.asof`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from schemas import Store, TransitionEvent
from schemas.query import EvidenceItem, EvidencePacket, GateDecision, QueryAnswer, QueryRequest
from stam.embedding import Embedder
from stam.errors import StamError
from stam.read.asof import state_at_time, state_at_version
from stam.read.gate import StoreGate
from stam.read.reader import Reader
from stam.read.render import render_item, render_packet
from stam.read.tokens import Tokenizer
from stam.state import PatientState
from stam.stores.base import StateStore, VectorStore
from stam.stores.projection import VectorProjection

NO_READER = "no reader model configured: evidence packet only (set STAM_READER_URL to get answers)"
SPAN_CHARS = 240


class QueryError(StamError):
    """A query that cannot be answered as asked (unknown patient, no transition log for as_of...)."""


class IsolationBreach(StamError):
    """A retrieved memory belongs to another patient. Never served; raised loudly."""


@dataclass
class _Scored:
    memory_id: str
    store: Store
    score: float


class QueryService:
    def __init__(self, *, states: StateStore, vectors: VectorStore, embedder: Embedder, tokenizer: Tokenizer,
                 gate: StoreGate, projection: VectorProjection | None = None, reader: Reader | None = None,
                 transitions: Callable[[str], Awaitable[list[TransitionEvent]]] | None = None) -> None:
        self.states = states
        self.vectors = vectors
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.gate = gate
        self.projection = projection
        self.reader = reader
        self.transitions = transitions

    # --- retrieval -------------------------------------------------------------------------------------

    def _scores(self, patient_id: str, version: int, qv: np.ndarray, state: PatientState,
                limit: int) -> dict[Store, list[_Scored]]:
        """Per store, the patient's memories by descending cosine (at most ``limit`` each)."""
        out: dict[Store, list[_Scored]] = {Store.ACTIVE: [], Store.HISTORY: []}
        if self.projection is not None:
            ids, scores = self.projection.scores(patient_id, version, qv)
            order = np.argsort(-scores, kind="stable")
            for i in order:
                s = state.get(ids[i])
                if s is None:
                    continue  # a vector whose memory is not in this (past or newer) state
                bucket = out[s.store]
                if len(bucket) < limit:
                    bucket.append(_Scored(ids[i], s.store, float(scores[i])))
                if all(len(b) >= limit for b in out.values()):
                    break
            return out
        for store in (Store.ACTIVE, Store.HISTORY):  # a Milvus search filtered by patient and store
            for hit in self.vectors.search(patient_id, store, qv.reshape(1, -1), limit)[0]:
                s = state.get(hit.memory_id)
                if s is not None and s.store is store:
                    out[store].append(_Scored(hit.memory_id, store, hit.score))
        return out

    def _state(self, req: QueryRequest, events: Sequence[TransitionEvent] | None) -> tuple[PatientState, int]:
        live_version = self.states.version(req.patient_id)
        if req.as_of is None and req.as_of_version is None:
            return self.states.load(req.patient_id), live_version
        if events is None:
            raise QueryError("as_of needs the transition log; none is configured for this service")
        if req.as_of_version is not None:
            return state_at_version(req.patient_id, events, req.as_of_version), live_version
        assert req.as_of is not None
        return state_at_time(req.patient_id, events, req.as_of), live_version

    def packet(self, req: QueryRequest, events: Sequence[TransitionEvent] | None = None) -> EvidencePacket:
        state, live_version = self._state(req, events)
        if state.version == 0 and not state.memories:
            raise QueryError(f"no memory for patient {req.patient_id!r}" + (" at that point" if (
                req.as_of or req.as_of_version is not None) else ""))
        qv = self.embedder.embed([req.question])[0]
        budget = max(req.k_active, req.k_history, req.k_active + req.k_history if req.ranking == "joint" else 0)
        ranked = self._scores(req.patient_id, live_version, qv, state, budget)
        s_a = ranked[Store.ACTIVE][0].score if ranked[Store.ACTIVE] else None
        s_h = ranked[Store.HISTORY][0].score if ranked[Store.HISTORY] else None
        decision: GateDecision = self.gate.decide(req.question, req.gate, s_a, s_h)
        if req.ranking == "joint":
            pool = ranked[Store.ACTIVE] + (ranked[Store.HISTORY] if decision.serve_history else [])
            chosen = sorted(pool, key=lambda x: -x.score)[: req.k_active + req.k_history]
        else:
            chosen = ranked[Store.ACTIVE][: req.k_active] + (
                ranked[Store.HISTORY][: req.k_history] if decision.serve_history else [])
        items = [self._item(rank, c, state, req) for rank, c in enumerate(chosen, start=1)]
        rendered, kept, dropped = render_packet(req, items, self.tokenizer, as_of=req.as_of,
                                                as_of_version=req.as_of_version)
        return EvidencePacket(patient_id=req.patient_id, question=req.question, state_version=state.version,
                              as_of=req.as_of, as_of_version=req.as_of_version, gate=decision, items=tuple(kept),
                              dropped=dropped, rendered=rendered, tokens=self.tokenizer.count(rendered),
                              tokenizer=self.tokenizer.name, token_budget=req.token_budget)

    def _item(self, rank: int, c: _Scored, state: PatientState, req: QueryRequest) -> EvidenceItem:
        s = state.get(c.memory_id)
        assert s is not None
        m = s.memory
        if m.patient_id != req.patient_id:
            raise IsolationBreach(f"memory {m.memory_id} of another patient reached a query; not served")
        succ = state.get(s.successor_id) if s.successor_id else None
        span = None
        if req.spans:
            text = self.states.source_text(req.patient_id, m.entry_id)
            if text:
                a, b = (m.span.start, m.span.end) if m.span else (0, len(text))
                lo, hi = max(0, a - SPAN_CHARS), min(len(text), b + SPAN_CHARS)
                span = ("..." if lo else "") + text[lo:hi].strip() + ("..." if hi < len(text) else "")
        item = EvidenceItem(
            rank=rank, memory_id=m.memory_id, store=s.store, score=round(c.score, 6), category=m.category,
            text=m.text, status=m.status, effective_start=m.effective_start, effective_end=m.effective_end,
            recorded_at=m.recorded_at, reason=s.reason, archived_at=s.archived_at, successor_id=s.successor_id,
            successor_text=succ.memory.text if succ else None, source_entry_id=m.entry_id, source_ref=m.source_ref,
            span_text=span, tokens=0)
        return item.model_copy(update={"tokens": self.tokenizer.count(render_item(item, labels=req.labels))})

    # --- answering -------------------------------------------------------------------------------------

    async def answer(self, req: QueryRequest) -> QueryAnswer:
        started = time.perf_counter()
        try:
            events = None
            if req.as_of is not None or req.as_of_version is not None:
                if self.transitions is None:
                    raise QueryError("as_of needs the transition log; none is configured for this service")
                events = await self.transitions(req.patient_id)
            packet = self.packet(req, events)
        except StamError as exc:
            return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=False, error=str(exc),
                               answered_at=datetime.now(UTC), latency_ms=_ms(started))
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


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)

