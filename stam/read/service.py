"""The query service: one question about one patient -> an evidence packet (and an answer).

Retrieval is store-aware (section 3.3 of the method): ACTIVE and HISTORY are ranked separately, each
within its own budget (``k_active``, ``k_history``), or jointly when asked. Similarities are exact cosines
between the question and every vector *of the requested patient*: the patient's vectors are the only ones
the search can see (a per-patient projection loaded from Milvus by patient partition key, or a Milvus search
filtered by patient), and every item is checked to belong to the patient before it is served.

Live queries read the state from Redis. ``as_of`` / ``as_of_version`` queries replay the patient's
transitions (the record) to the requested point and rank against that state (see :mod:`stam.read.asof`).

:meth:`QueryService.answer` builds the packet (embedding, Redis and Milvus round trips: blocking calls) on a
small thread pool of the service, so the caller's event loop keeps serving while a query works. A query that
fails is answered, never raised: ``ok=false`` with an ``error_kind`` (see :func:`classify`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
import numpy as np
import redis
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from pymilvus.exceptions import ConnectError, MilvusException, MilvusUnavailableException

from schemas import Store, TransitionEvent
from schemas.query import ErrorKind, EvidenceItem, EvidencePacket, GateDecision, QueryAnswer, QueryRequest
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
MILVUS_CONNECT_FAILED = 2  # pymilvus Status.CONNECT_FAILED; also the server's "service unavailable" code

log = logging.getLogger("stam.query")


class QueryError(StamError):
    """A query that cannot be answered as asked (unknown patient, no transition log for as_of...)."""


class UnsupportedQuery(QueryError):
    """A query this service cannot answer as asked (as_of where no transition log is configured)."""


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
                 transitions: Callable[[str], Awaitable[list[TransitionEvent]]] | None = None,
                 threads: int = 2) -> None:
        """``threads``: packets built at once, off the caller's event loop (a bounded pool of this service)."""
        self.states = states
        self.vectors = vectors
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.gate = gate
        self.projection = projection
        self.reader = reader
        self.transitions = transitions
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stam-query")

    def close(self) -> None:
        """Stop the service's threads (after the packets being built are done)."""
        self._pool.shutdown(wait=True)

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

    def _live_ranked(self, patient_id: str, version: int, qv: np.ndarray, limit: int) -> dict[Store, list[_Scored]]:
        """Live state: rank with the store flags the vectors carry (the projection's, or Milvus's field)."""
        if self.projection is not None:
            found = self.projection.top_by_store(patient_id, version, qv, limit)
        else:  # a Milvus search filtered by patient and store
            found = {store: self.vectors.search(patient_id, store, qv.reshape(1, -1), limit)[0]
                     for store in (Store.ACTIVE, Store.HISTORY)}
        return {store: [_Scored(h.memory_id, store, h.score) for h in hits] for store, hits in found.items()}

    def packet(self, req: QueryRequest, events: Sequence[TransitionEvent] | None = None) -> EvidencePacket:
        past = req.as_of is not None or req.as_of_version is not None
        version = self.states.version(req.patient_id)
        state: PatientState | None = None
        if past:
            if events is None:
                raise QueryError("as_of needs the transition log; none is configured for this service")
            state = (state_at_version(req.patient_id, events, req.as_of_version) if req.as_of_version is not None
                     else state_at_time(req.patient_id, events, req.as_of))  # type: ignore[arg-type]
            if not state.memories:
                raise QueryError(f"no memory for patient {req.patient_id!r} at that point")
        elif version == 0:
            raise QueryError(f"no memory for patient {req.patient_id!r}")
        qv = self.embedder.embed([req.question])[0]
        budget = max(req.k_active, req.k_history, req.k_active + req.k_history if req.ranking == "joint" else 0)
        ranked = (self._scores(req.patient_id, version, qv, state, budget) if state is not None
                  else self._live_ranked(req.patient_id, version, qv, budget))
        s_a = ranked[Store.ACTIVE][0].score if ranked[Store.ACTIVE] else None
        s_h = ranked[Store.HISTORY][0].score if ranked[Store.HISTORY] else None
        decision: GateDecision = self.gate.decide(req.question, req.gate, s_a, s_h)
        if req.ranking == "joint":
            pool = ranked[Store.ACTIVE] + (ranked[Store.HISTORY] if decision.serve_history else [])
            chosen = sorted(pool, key=lambda x: -x.score)[: req.k_active + req.k_history]
        else:
            chosen = ranked[Store.ACTIVE][: req.k_active] + (
                ranked[Store.HISTORY][: req.k_history] if decision.serve_history else [])
        items = self._items(chosen, state, req)
        rendered, kept, dropped = render_packet(req, items, self.tokenizer, as_of=req.as_of,
                                                as_of_version=req.as_of_version)
        return EvidencePacket(patient_id=req.patient_id, question=req.question,
                              state_version=state.version if state is not None else version,
                              as_of=req.as_of, as_of_version=req.as_of_version, gate=decision, items=tuple(kept),
                              dropped=dropped, rendered=rendered, tokens=self.tokenizer.count(rendered),
                              tokenizer=self.tokenizer.name, token_budget=req.token_budget)

    def _items(self, chosen: Sequence[_Scored], state: PatientState | None, req: QueryRequest) -> list[EvidenceItem]:
        """Evidence items of the chosen memories: records from the past state, or fetched from the store
        (only the chosen memories and their successors are read)."""
        if state is not None:
            records = {c.memory_id: s for c in chosen if (s := state.get(c.memory_id)) is not None}
            succ_ids = [r.successor_id for r in records.values() if r.successor_id]
            successors = {i: s for i in succ_ids if (s := state.get(i)) is not None}
        else:
            records = self.states.memories(req.patient_id, [c.memory_id for c in chosen])
            succ_ids = [r.successor_id for r in records.values() if r.successor_id and r.successor_id not in records]
            successors = {**records, **self.states.memories(req.patient_id, succ_ids)}
        items: list[EvidenceItem] = []
        for c in chosen:
            s = records.get(c.memory_id)
            if s is None:
                continue  # the vector moved ahead of the record (a write in flight); served next time
            m = s.memory
            if m.patient_id != req.patient_id:
                raise IsolationBreach(f"memory {m.memory_id} of another patient reached a query; not served")
            succ = successors.get(s.successor_id) if s.successor_id else None
            span = None
            if req.spans:
                text = self.states.source_text(req.patient_id, m.entry_id)
                if text:
                    a, b = (m.span.start, m.span.end) if m.span else (0, len(text))
                    lo, hi = max(0, a - SPAN_CHARS), min(len(text), b + SPAN_CHARS)
                    span = ("..." if lo else "") + text[lo:hi].strip() + ("..." if hi < len(text) else "")
            items.append(EvidenceItem(
                rank=len(items) + 1, memory_id=m.memory_id, store=s.store, score=round(c.score, 6),
                category=m.category, text=m.text, status=m.status, effective_start=m.effective_start,
                effective_end=m.effective_end, recorded_at=m.recorded_at, reason=s.reason, archived_at=s.archived_at,
                successor_id=s.successor_id, successor_text=succ.memory.text if succ else None,
                source_entry_id=m.entry_id, source_ref=m.source_ref, span_text=span, tokens=0))
        counts = self.tokenizer.count_many([render_item(i, labels=req.labels) for i in items])
        return [i.model_copy(update={"tokens": n}) for i, n in zip(items, counts, strict=True)]

    # --- answering -------------------------------------------------------------------------------------

    async def answer(self, req: QueryRequest) -> QueryAnswer:
        """The answer to ``req``; never raises: a failure is an answer with ``ok=false`` and its error kind."""
        started = time.perf_counter()
        try:
            events = None
            if req.as_of is not None or req.as_of_version is not None:
                if self.transitions is None:
                    raise UnsupportedQuery("as_of needs the transition log; none is configured for this service")
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


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


# --- failures ----------------------------------------------------------------------------------------

_OUTAGE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                            errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETUNREACH, errno.ENETDOWN})
_GRPC_OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _client_of(exc: BaseException) -> str | None:
    if isinstance(exc, redis.exceptions.RedisError):
        return "Redis"
    if isinstance(exc, MilvusException | grpc.RpcError):  # Milvus is the query path's only gRPC service
        return "Milvus"
    if isinstance(exc, KafkaError):
        return "Kafka"
    return None


def _is_outage(exc: BaseException) -> bool:
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        # A refused login is a misconfiguration, not an outage.
        return not isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError)
    if isinstance(exc, MilvusException):
        # Client side: connecting failed (code 2), or the retries ran out on an UNAVAILABLE/DEADLINE_EXCEEDED
        # gRPC status (then the status is the code); server side: code 2 is "service unavailable".
        return (isinstance(exc, ConnectError | MilvusUnavailableException) or exc.code == MILVUS_CONNECT_FAILED
                or exc.code in _GRPC_OUTAGE)
    if isinstance(exc, grpc.RpcError):  # statuses pymilvus does not retry are raised bare
        return callable(getattr(exc, "code", None)) and exc.code() in _GRPC_OUTAGE
    if isinstance(exc, KafkaError):
        return isinstance(exc, KafkaConnectionError | KafkaTimeoutError) or bool(exc.retriable)
    return isinstance(exc, ConnectionError | TimeoutError | socket.gaierror) or (
        isinstance(exc, OSError) and exc.errno in _OUTAGE_ERRNOS)


def unavailable_store(exc: BaseException) -> str | None:
    """The store or service whose outage ``exc`` is ("Redis", "Milvus", "Kafka"; "Store" for a bare network
    error), or None when ``exc`` is not an outage. Causes are followed, as clients wrap what they caught."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        if _is_outage(seen):
            return _client_of(exc) or _client_of(seen) or "Store"
        seen = seen.__cause__
    return None


def classify(exc: BaseException) -> tuple[ErrorKind, str]:
    """``(error_kind, message)`` of a failed query. The message is one line and carries no traceback; an
    ``internal`` error's message does not carry the exception's text either (it is logged)."""
    if isinstance(exc, UnsupportedQuery):
        return "invalid", str(exc)
    if isinstance(exc, QueryError):
        return "not_found", str(exc)
    store = unavailable_store(exc)
    if store is not None:
        detail = exc.message if isinstance(exc, MilvusException) else str(exc)
        detail = " ".join(detail.split()) or type(exc).__name__
        return "unavailable", f"{store} unavailable: {detail}"[:500]
    return "internal", f"internal error ({type(exc).__name__})"


def failed_answer(req: QueryRequest, exc: BaseException, started: float) -> QueryAnswer:
    """The answer to a query that failed with ``exc``: classified and, when the service is at fault, logged
    with the request id (never the patient id)."""
    kind, message = classify(exc)
    if kind == "unavailable":
        log.warning("query %s not answered: %s", req.request_id, message)
    elif kind == "internal":
        log.error("query %s failed: %s", req.request_id, message, exc_info=exc)
        message += f"; logged with request_id {req.request_id}"
    return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=False, error=message,
                       error_kind=kind, answered_at=datetime.now(UTC), latency_ms=_ms(started))
