"""A patient's timeline: every memory's life in clinical time, and the state at any point of it.

The read path's model of one patient. It is built from the patient's memory records (what the transition log
describes: each memory, where it is now, why, and what replaced it) and answers, in array operations:

- **the state at a clinical time** ``T`` (``as_of``): which memories existed then and which store each was in;
- **the state within a visibility boundary** (evidence a query may not see is left out, and a memory whose end
  came from invisible evidence is current again);
- **concept threads**: memories of one concept over time (same code, versions of one source resource, or joined
  by successor links), so a hit on any value brings the concept's values in clinical order.

Point in time, the rules (the same as a replay of the transition log filtered to ``clinical_time <= T``, see
:func:`stam.read.asof.state_at_time`; a test checks both agree on every MIMIC-IV demo patient):

- A memory *exists* at ``T`` when its evidence is clinically no later than ``T``: a fact that was current
  when it arrived from its start (an admission from admission, not discharge), a fact that arrived already
  ended (added straight to HISTORY: a stop, a resolved condition) from its end; a memory with no time always
  exists. A fact that arrived already ended also exists inside its own interval, ACTIVE there, unless it ended
  an earlier version of the same source resource (a pharmacy stop: the start stands for the order), and, when its
  lifecycle ends with its encounter, no later than the encounter's end (a pharmacy stop recorded after the
  discharge is not current between the discharge and the stop).
- A memory archived by later evidence is in HISTORY at ``T`` when that evidence is clinically no later than
  ``T``, visible, and its successor (if it names one) exists at ``T``; otherwise it is ACTIVE.
- A memory added straight to HISTORY (a late-arriving older value, a stopped order) is in HISTORY at ``T``
  unless its successor does not exist yet at ``T``: then it was the current fact.

Memory records never change content; only their placement does, so the record store (Redis) plus these rules
give any past state without re-reading the log. Times are seconds since the epoch (float64), ``-inf`` for none.
"""

from __future__ import annotations

import gc
import operator
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from threading import Lock
from typing import Any

import numpy as np
import orjson

from schemas import Lifecycle, Store, StoredMemory
from schemas.query import Visibility
from stam.backends.rows import row_of
from stam.errors import IsolationBreach

ACTIVE, ARCHIVED, PLACED = 0, 1, 2
"""Memory kinds: never archived; archived by later evidence; added straight to HISTORY."""
NO_SUCCESSOR, UNKNOWN_SUCCESSOR = -1, -2

_NEG = -np.inf


def epoch(t: datetime | None) -> float:
    return t.timestamp() if t is not None else _NEG


def from_epoch(x: float) -> datetime | None:
    return datetime.fromtimestamp(x, UTC) if np.isfinite(x) else None


def resource_type(source_ref: str | None) -> str:
    """``MedicationRequest/poe-1`` -> ``MedicationRequest`` ("" when there is none)."""
    return source_ref.split("/", 1)[0] if source_ref else ""


_gc_lock = Lock()
_gc_paused = 0
_gc_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a timeline is built: reading a patient allocates ~10 objects
    per memory, which triggers full collections over every timeline the process keeps (0.35 s at a 20,000-memory
    patient, measured; 0.06 s without; the rows' decoding of the same patient alone took 0.18-0.33 s with it and
    0.11-0.13 s without). Nothing built here forms cycles; threads building at once share the pause."""
    global _gc_paused, _gc_was_enabled
    with _gc_lock:
        if _gc_paused == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused -= 1
            if _gc_paused == 0 and _gc_was_enabled:
                gc.enable()


@dataclass
class View:
    """The state of a timeline at one point: which memories exist and which store each is in."""

    present: np.ndarray
    """bool per memory: it exists at this point (and is visible)."""
    history: np.ndarray
    """bool per memory: in HISTORY at this point (only meaningful where ``present``)."""
    at: float
    """The clinical time of the view (``inf`` for now)."""

    def store(self, i: int) -> Store:
        return Store.HISTORY if self.history[i] else Store.ACTIVE


@dataclass
class Timeline:
    patient_id: str
    version: int
    ids: tuple[str, ...]
    entry_ids: tuple[str, ...]
    category: tuple[str, ...]
    source: tuple[str | None, ...]
    """The memory's source resource (``MedicationRequest/poe-1``): an order's versions share it."""
    resource: tuple[str, ...]
    """Resource type of the memory's source (``Observation``, ``MedicationRequest``...)."""
    concept: tuple[str | None, ...]
    display: tuple[str, ...]
    """The concept's name (coded memories), else the memory text."""
    unit: tuple[str | None, ...]
    dosage: tuple[str | None, ...]
    value: np.ndarray
    """Numeric value (``nan`` when none)."""
    t_start: np.ndarray
    t_end: np.ndarray
    """``effective_end`` (``-inf`` when none)."""
    t_add: np.ndarray
    """Clinical time the memory is evidence at: a current fact's start, an ended fact's end."""
    kind: np.ndarray
    t_ended: np.ndarray
    """Clinical time it ended (ARCHIVED: its evidence's, or the lifecycle's own ``ended_at``; PLACED: its own end)."""
    succ: np.ndarray
    evid: np.ndarray
    covered: np.ndarray
    reason: tuple[str | None, ...]
    thread: np.ndarray
    """Thread id per memory (concept threads, see :func:`threads`)."""
    embed_keys: tuple[str, ...]
    """What the memory's vector is: ``c:<concept embedding text>`` (shared by every value of a coded concept)
    or ``m:<memory id>`` (a free-text memory's own vector)."""
    index: dict[str, int] = field(default_factory=dict)
    encounter: tuple[str | None, ...] = ()
    """The encounter each memory belongs to (``Encounter/<hadm_id>``), None for none."""
    value_text: tuple[str | None, ...] = ()
    """A value that is not a number (a sex, a care unit, an organism), its first characters."""
    enc_end: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per memory whose lifecycle ends with its encounter: when the encounter ended, by its own record (``inf``:
    no end recorded, or a memory that does not end with its encounter)."""
    enc_end_rec: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    """The record that says so (-1: none)."""
    vectors: np.ndarray | None = None
    """Distinct unit vectors (rows); ``vec_row[i]`` is memory i's row. Filled by :meth:`attach_vectors`."""
    vec_row: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    # --- building ---------------------------------------------------------------------------------------------

    @classmethod
    def from_records(cls, patient_id: str, version: int, raw: Sequence[bytes]) -> Timeline:
        """From stored memory records as JSON (the Redis hash values); parsed without full validation, for speed:
        they were validated when written."""
        recs: list[dict[str, Any]] = orjson.loads(b"[" + b",".join(raw) + b"]") if raw else []
        return cls.from_rows(patient_id, version, [row_of(r) for r in recs])

    @classmethod
    def from_stored(cls, patient_id: str, version: int, stored: Iterable[StoredMemory]) -> Timeline:
        return cls.from_rows(patient_id, version, [row_of(s.model_dump(mode="json")) for s in stored])

    @classmethod
    def read(cls, states: Any, patient_id: str) -> Timeline:
        """The patient's timeline from a state store (:class:`~stam.backends.base.StateStore`): its timeline rows, or
        its records where a store keeps no rows. No vectors: :meth:`attach_vectors` adds them."""
        with collector_paused():
            got_rows = states.timeline_rows(patient_id)
            if got_rows is not None:
                return cls.from_rows(patient_id, *got_rows)
            return cls.from_records(patient_id, *states.records(patient_id))

    @classmethod
    def from_rows(cls, patient_id: str, version: int, rows_in: Sequence[Sequence[Any]]) -> Timeline:
        """From timeline rows (:mod:`stam.backends.rows`, what the state store keeps beside each record). Column
        by column (a patient of 20,000 memories is read at a first query: it must be quick)."""
        n = len(rows_in)
        if n == 0:
            return cls._empty(patient_id, version)
        (mids, pids, entries, positions_in, categories, sources, concepts, displays, units, dosages, values, starts,
         ends, in_hists, evidences, successors, reasons_in, embed_keys_in, ended_ats, encounters,
         value_texts, lifecycles) = zip(*rows_in, strict=True)
        if any(p != patient_id for p in pids):
            other = next(m for m, p in zip(mids, pids, strict=True) if p != patient_id)
            raise IsolationBreach(f"memory {other} of another patient in this patient's records")
        t_start_in = _times(starts)
        # Clinical order (start, then memory id): the order every thread and view relies on.
        take = np.lexsort((np.array(mids), t_start_in)).tolist()

        # Columns are tuples: the garbage collector stops tracking a tuple of strings, so the timelines a query
        # process keeps cost its full collections nothing (lists of them cost ~0.6 s per million memories).
        pick = operator.itemgetter(*take) if n > 1 else (lambda values: (values[0],))

        def col(values_in: Sequence[Any]) -> tuple[Any, ...]:
            return pick(values_in)

        def interned(values_in: Sequence[Any]) -> tuple[Any, ...]:
            table = {v: sys.intern(v) for v in set(values_in) if v is not None}
            return tuple(map(table.get, pick(values_in)))

        ids = col(mids)
        index = dict(zip(ids, range(n), strict=True))
        source: tuple[str | None, ...] = col(sources)
        resource_of = {s: sys.intern(resource_type(s)) for s in set(sources)}
        resource = tuple([resource_of[s] for s in source])
        concept: tuple[str | None, ...] = interned(concepts)
        t_start = t_start_in[take]
        t_end = _times(col(ends))
        hist = np.array(col(in_hists), dtype=bool)
        evidence = col(evidences)
        has_evidence = np.array([e is not None for e in evidence], dtype=bool)
        ended_at = _times(col(ended_ats))
        has_end = np.isfinite(ended_at)  # the lifecycle ended it at a time of its own (encounter's, interval's end)
        placed = hist & ~has_evidence & ~has_end
        # Evidence time (see stam.read.asof.evidence_time): an ended fact's end, a current fact's start.
        t_add = np.where(placed, np.where(np.isfinite(t_end), t_end, t_start),
                         np.where(np.isfinite(t_start), t_start, t_end))
        value = np.array(col(values), dtype=np.float64)  # None: nan
        kind = np.zeros(n, dtype=np.int8)
        kind[placed] = PLACED
        archived = hist & (has_evidence | has_end)
        kind[archived] = ARCHIVED
        succ = _successors(col(successors), hist, index)
        evid = np.full(n, NO_SUCCESSOR, dtype=np.int32)
        arch = np.flatnonzero(archived)
        evid[arch] = [index.get(evidence[i], NO_SUCCESSOR) for i in arch.tolist()]
        t_ended = np.full(n, np.inf)
        t_ended[placed] = t_add[placed]
        known = archived & (evid >= 0)
        t_ended[known] = t_add[evid[known]]
        t_ended[archived & (evid < 0)] = _NEG  # its evidence is gone from the record: ended at an unknown time
        t_ended[has_end] = ended_at[has_end]
        covered = _covered(source, known, evid)
        reason = tuple([reasons_in[i] if h else None for i, h in zip(take, hist.tolist(), strict=True)])
        # Versions of one source resource join a thread position by position (a panel's components are
        # different concepts of one resource and stay apart).
        positions = [f"{sources[i]}#{positions_in[i]}" if sources[i] else None for i in take]
        encounter: tuple[str | None, ...] = interned(encounters)
        category: tuple[str, ...] = interned(categories)
        enc_end, enc_end_rec = _encounter_ends(category, encounter, source, t_end, lifecycles, col)
        return cls(patient_id=patient_id, version=version, ids=ids, entry_ids=col(entries),
                   category=category, source=source, resource=resource, concept=concept,
                   display=interned(displays), unit=interned(units), dosage=interned(dosages), value=value,
                   t_start=t_start, t_end=t_end, t_add=t_add, kind=kind, t_ended=t_ended, succ=succ, evid=evid,
                   covered=covered, reason=reason, thread=threads(concept, positions, succ),
                   embed_keys=col(embed_keys_in), index=index, encounter=encounter,
                   value_text=col(value_texts), enc_end=enc_end, enc_end_rec=enc_end_rec)

    @classmethod
    def _empty(cls, patient_id: str, version: int) -> Timeline:
        f = np.zeros(0, dtype=np.float64)
        i32 = np.zeros(0, dtype=np.int32)
        return cls(patient_id=patient_id, version=version, ids=(), entry_ids=(), category=(), source=(), resource=(),
                   concept=(), display=(), unit=(), dosage=(), value=f, t_start=f, t_end=f, t_add=f,
                   kind=np.zeros(0, dtype=np.int8), t_ended=f, succ=i32, evid=i32, covered=np.zeros(0, dtype=bool),
                   reason=(), thread=i32, embed_keys=(), index={}, encounter=(), value_text=(), enc_end=f,
                   enc_end_rec=i32)

    def attach_vectors(self, keys: Sequence[str], matrix: np.ndarray) -> None:
        """Distinct vectors by embed key (rows of ``matrix``, in the order of ``keys``); normalised here."""
        row = {k: i for i, k in enumerate(keys)}
        norms = np.linalg.norm(matrix, axis=1, keepdims=True) if len(matrix) else np.zeros((0, 1))
        self.vectors = (matrix / np.maximum(norms, 1e-12)).astype(np.float32)
        self.vec_row = np.fromiter((row[k] for k in self.embed_keys), dtype=np.int32, count=len(self.ids))

    def scores(self, query: np.ndarray) -> np.ndarray:
        """Cosine of the query with every memory (memories sharing a vector share the score)."""
        if self.vectors is None or self.vec_row is None:
            raise RuntimeError("timeline has no vectors attached")
        if len(self.ids) == 0:
            return np.zeros(0, dtype=np.float32)
        q = query.reshape(-1) / max(float(np.linalg.norm(query)), 1e-12)
        out: np.ndarray = (self.vectors @ q.astype(np.float32))[self.vec_row]
        return out

    # --- views ------------------------------------------------------------------------------------------------

    def visible_mask(self, visibility: Visibility | None) -> np.ndarray:
        n = len(self.ids)
        if visibility is None:
            return np.ones(n, dtype=bool)
        allows = visibility.predicate()
        return np.fromiter((allows(self.entry_ids[i], self.category[i], self.resource[i]) for i in range(n)),
                           dtype=bool, count=n)

    def view(self, at: datetime | None = None, visibility: Visibility | None = None) -> View:
        """The state at clinical time ``at`` (None: now, what the record holds) within ``visibility``."""
        vis = self.visible_mask(visibility)
        n = len(self.ids)
        if at is None and visibility is None:
            return View(present=np.ones(n, dtype=bool), history=self.kind != ACTIVE, at=np.inf)
        t = np.inf if at is None else at.timestamp()
        placed = self.kind == PLACED
        open_ = placed & ~self.covered & np.isfinite(self.t_start) & np.isfinite(self.t_add) & \
            (self.t_start <= t) & (t < self.t_add)
        # ... and no later than its encounter, once the record of the encounter's end exists (and is visible).
        closed = self.enc_end <= t
        if closed.any():
            rec = self.enc_end_rec[closed]
            closed[closed] = vis[rec]
            open_ &= ~closed
        present = ((self.t_add <= t) | open_) & vis
        succ_ok = np.ones(n, dtype=bool)  # no successor, or the successor exists in this view
        has = self.succ != NO_SUCCESSOR
        known = self.succ >= 0
        succ_ok[has] = False
        succ_ok[known] = present[self.succ[known]]
        evid_ok = np.ones(n, dtype=bool)
        has_evid = self.evid >= 0
        evid_ok[has_evid] = vis[self.evid[has_evid]]
        archived = (self.kind == ARCHIVED) & (self.t_ended <= t) & evid_ok & succ_ok
        ended_placed = placed & ~open_ & succ_ok
        return View(present=present, history=present & (archived | ended_placed), at=t)

    def latest_time(self) -> datetime | None:
        """The patient's clinical clock: the latest clinical time in the record."""
        finite = self.t_add[np.isfinite(self.t_add)]
        return from_epoch(float(finite.max())) if finite.size else None

    def members(self, thread: int) -> np.ndarray:
        return np.flatnonzero(self.thread == thread)


def _times(values: Sequence[float | None]) -> np.ndarray:
    """Seconds since the epoch, ``-inf`` for none."""
    out = np.array(values, dtype=np.float64)  # None: nan
    out[np.isnan(out)] = _NEG
    return out


def _successors(successor: Sequence[str | None], hist: np.ndarray, index: dict[str, int]) -> np.ndarray:
    """Per memory (clinical order), the index of the memory that replaced it: ``NO_SUCCESSOR`` when it is not in
    HISTORY or names none, ``UNKNOWN_SUCCESSOR`` when it names one that is not in the record."""
    succ = np.full(len(successor), NO_SUCCESSOR, dtype=np.int32)
    for i in np.flatnonzero(hist).tolist():
        if name := successor[i]:
            succ[i] = index.get(name, UNKNOWN_SUCCESSOR)
    return succ


def _covered(source: Sequence[str | None], known: np.ndarray, evid: np.ndarray) -> np.ndarray:
    """Per memory, whether an archived version of its own source resource names it as evidence."""
    # An archived version whose evidence is a later version of the same source resource (a pharmacy stop of
    # its start) covers that evidence: the stop does not stand for the order inside its own interval.
    src_code: dict[str | None, int] = {s: k for k, s in enumerate(set(source)) if s is not None}
    codes = np.array([src_code.get(s, -1) for s in source], dtype=np.int64)
    same = known.copy()
    same[known] = (codes[known] >= 0) & (codes[known] == codes[evid[known]])
    covered = np.zeros(len(source), dtype=bool)
    covered[evid[same]] = True
    return covered


def _encounter_ends(category: Sequence[str], encounter: Sequence[str | None], source: Sequence[str | None],
                    t_end: np.ndarray, lifecycles: Sequence[str | None],
                    col: Callable[[Sequence[Any]], tuple[Any, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Per memory (clinical order), its encounter's end and the record that says so (``inf``, -1 when none or its
    lifecycle does not end with its encounter). ``lifecycles`` are in row order; ``col`` puts them in clinical
    order."""
    # An open interval ends no later than its encounter (a pharmacy stop recorded after the discharge): each
    # memory's encounter end, from the encounter's own record that says it ended (a discharge).
    n = len(category)
    closing: dict[str, tuple[float, int]] = {}
    for i in [i for i, c in enumerate(category) if c == "encounter"]:
        enc = encounter[i]
        if enc is not None and source[i] == enc and np.isfinite(t_end[i]) \
                and (enc not in closing or t_end[i] < closing[enc][0]):
            closing[enc] = (float(t_end[i]), i)
    ends_with = {v: Lifecycle(v).ends_with_encounter for v in set(lifecycles) if v}
    enc_end = np.full(n, np.inf)
    enc_end_rec = np.full(n, -1, dtype=np.int32)
    if closing:
        lifecycle = col(lifecycles)
        for i, enc in enumerate(encounter):
            if enc is not None and enc in closing and ends_with.get(lifecycle[i], False):
                enc_end[i], enc_end_rec[i] = closing[enc]
    return enc_end, enc_end_rec


def threads(concept: Sequence[str | None], source: Sequence[str | None], succ: np.ndarray) -> np.ndarray:
    """Concept threads: memories joined when they share a code, are versions of one coded source resource
    (``source``: the resource and the memory's position in it), or one replaced the other (successor links).
    Free-text memories have no code, so only their successor links join them. Returns a thread id per memory (the
    smallest index of its thread)."""
    n = len(concept)
    first_c: dict[str, int] = {}
    first_s: dict[str, int] = {}
    a: list[int] = []
    b: list[int] = []
    for i, (c, s) in enumerate(zip(concept, source, strict=True)):
        if c:
            j = first_c.setdefault(c, i)
            if j != i:
                a.append(i)
                b.append(j)
            if s:
                j = first_s.setdefault(s, i)
                if j != i:
                    a.append(i)
                    b.append(j)
    linked = np.flatnonzero(succ >= 0)
    u = np.concatenate([np.array(a, dtype=np.int64), linked]).astype(np.int64)
    v = np.concatenate([np.array(b, dtype=np.int64), succ[linked].astype(np.int64)])
    # Connected components by minimum-label propagation with pointer jumping: each round every edge pulls both
    # ends to the smaller label and every label to its own label's label; stable when no label changes.
    label = np.arange(n, dtype=np.int64)
    while len(u):
        low = np.minimum(label[u], label[v])
        new = label.copy()
        np.minimum.at(new, u, low)
        np.minimum.at(new, v, low)
        np.minimum.at(new, label, new)  # a root takes the smallest label any of its members reached
        new = new[new]
        if np.array_equal(new, label):
            break
        label = new
    return label.astype(np.int32)


_WORD = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())
