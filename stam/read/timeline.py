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
  an earlier version of the same source resource (a pharmacy stop: the start stands for the order).
- A memory archived by later evidence is in HISTORY at ``T`` when that evidence is clinically no later than
  ``T``, visible, and its successor (if it names one) exists at ``T``; otherwise it is ACTIVE.
- A memory added straight to HISTORY (a late-arriving older value, a stopped order) is in HISTORY at ``T``
  unless its successor does not exist yet at ``T``: then it was the current fact.

Memory records never change content; only their placement does, so the record store (Redis) plus these rules
give any past state without re-reading the log. Times are seconds since the epoch (float64), ``-inf`` for none.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from schemas import Store, StoredMemory
from schemas.query import Visibility
from stam.errors import IsolationBreach
from stam.stores.rows import row_of

ACTIVE, ARCHIVED, PLACED = 0, 1, 2
"""Memory kinds: never archived; archived by later evidence; added straight to HISTORY."""
NO_SUCCESSOR, UNKNOWN_SUCCESSOR = -1, -2

_NEG = -np.inf


def epoch(t: datetime | None) -> float:
    return t.timestamp() if t is not None else _NEG


def from_epoch(x: float) -> datetime | None:
    return datetime.fromtimestamp(x, UTC) if np.isfinite(x) else None


def _intern(text: str | None) -> Any:
    return sys.intern(text) if text is not None else None


def resource_type(source_ref: str | None) -> str:
    """``MedicationRequest/poe-1`` -> ``MedicationRequest`` ("" when there is none)."""
    return source_ref.split("/", 1)[0] if source_ref else ""


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
    ids: list[str]
    entry_ids: list[str]
    category: list[str]
    source: list[str | None]
    """The memory's source resource (``MedicationRequest/poe-1``): an order's versions share it."""
    resource: list[str]
    """Resource type of the memory's source (``Observation``, ``MedicationRequest``...)."""
    concept: list[str | None]
    display: list[str]
    """The concept's name (coded memories), else the memory text."""
    unit: list[str | None]
    dosage: list[str | None]
    value: np.ndarray
    """Numeric value (``nan`` when none)."""
    t_start: np.ndarray
    t_end: np.ndarray
    """``effective_end`` (``-inf`` when none)."""
    t_add: np.ndarray
    """Clinical time the memory is evidence at: a current fact's start, an ended fact's end."""
    kind: np.ndarray
    t_ended: np.ndarray
    """Clinical time of the evidence that ended it (ARCHIVED: its evidence's; PLACED: its own)."""
    succ: np.ndarray
    evid: np.ndarray
    covered: np.ndarray
    reason: list[str | None]
    thread: np.ndarray
    """Thread id per memory (concept threads, see :func:`threads`)."""
    embed_keys: list[str]
    """What the memory's vector is: ``c:<concept embedding text>`` (shared by every value of a coded concept)
    or ``m:<memory id>`` (a free-text memory's own vector)."""
    index: dict[str, int] = field(default_factory=dict)
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
    def from_rows(cls, patient_id: str, version: int, rows_in: Sequence[Sequence[Any]]) -> Timeline:
        """From timeline rows (:mod:`stam.stores.rows`, what the state store keeps beside each record)."""
        neg = _NEG
        rows = []
        for (mid, pid, entry, position, category_, src, concept_, display_, unit_, dosage_, value_, start, end,
             in_hist, evidence_, successor_, reason_, embed_key) in rows_in:  # one pass: every field it keeps
            if pid != patient_id:
                raise IsolationBreach(f"memory {mid} of another patient in this patient's records")
            rows.append((neg if start is None else start, mid, neg if end is None else end, in_hist, evidence_,
                         successor_, reason_, entry, _intern(category_), src, _intern(resource_type(src)),
                         _intern(concept_), _intern(display_), _intern(unit_), _intern(dosage_), value_, embed_key,
                         f"{src}#{position}" if src else None))
        rows.sort(key=lambda x: (x[0], x[1]))
        n = len(rows)
        cols = list(zip(*rows, strict=True)) if rows else [()] * 18
        (starts_l, ids_t, ends_l, in_hist, evidence, successor, reasons, entry_ids, category, source_t, resource,
         concept_t, display, unit, dosage, values, embed_keys, positions) = cols
        ids = list(ids_t)
        index = {m: i for i, m in enumerate(ids)}
        source: list[str | None] = list(source_t)
        concept: list[str | None] = list(concept_t)
        t_start = np.fromiter(starts_l, dtype=np.float64, count=n)
        t_end = np.fromiter(ends_l, dtype=np.float64, count=n)
        hist = np.fromiter(in_hist, dtype=bool, count=n)
        placed_h = hist & np.fromiter((e is None for e in evidence), dtype=bool, count=n)
        # Evidence time (see stam.read.asof.evidence_time): an ended fact's end, a current fact's start.
        t_add = np.where(placed_h, np.where(np.isfinite(t_end), t_end, t_start),
                         np.where(np.isfinite(t_start), t_start, t_end))
        value = np.fromiter((np.nan if v is None else float(v) for v in values), dtype=np.float64, count=n)
        kind = np.zeros(n, dtype=np.int8)
        succ = np.full(n, NO_SUCCESSOR, dtype=np.int32)
        evid = np.full(n, NO_SUCCESSOR, dtype=np.int32)
        t_ended = np.full(n, np.inf)
        reason: list[str | None] = [None] * n
        covered = np.zeros(n, dtype=bool)
        for i in np.flatnonzero(hist).tolist():
            reason[i] = reasons[i]
            if successor[i]:
                succ[i] = index.get(successor[i], UNKNOWN_SUCCESSOR)
            e = evidence[i]
            if e is None:
                kind[i] = PLACED
                t_ended[i] = t_add[i]
                continue
            kind[i] = ARCHIVED
            j = index.get(e)
            if j is None:
                t_ended[i] = _NEG  # its evidence is gone from the record: ended at an unknown time, always
                continue
            evid[i] = j
            t_ended[i] = t_add[j]
            if source[i] is not None and source[i] == source[j]:
                covered[j] = True
        # Versions of one source resource join a thread position by position (a panel's components are
        # different concepts of one resource and stay apart).
        return cls(patient_id=patient_id, version=version, ids=ids, entry_ids=list(entry_ids),
                   category=list(category), source=source, resource=list(resource), concept=concept,
                   display=list(display), unit=list(unit), dosage=list(dosage), value=value, t_start=t_start,
                   t_end=t_end, t_add=t_add, kind=kind, t_ended=t_ended, succ=succ, evid=evid, covered=covered,
                   reason=reason, thread=threads(concept, list(positions), succ), embed_keys=list(embed_keys),
                   index=index)

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


def threads(concept: Sequence[str | None], source: Sequence[str | None], succ: np.ndarray) -> np.ndarray:
    """Concept threads: memories joined when they share a code, are versions of one coded source resource
    (``source``: the resource and the memory's position in it), or one replaced the other (successor links).
    Free-text memories have no code, so only their successor links join them. Returns a thread id per memory (the
    smallest index of its thread)."""
    n = len(concept)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    first: dict[str, int] = {}
    for i in range(n):
        keys = [f"c:{concept[i]}"] if concept[i] else []
        if concept[i] and source[i]:
            keys.append(f"s:{source[i]}")
        for k in keys:
            j = first.setdefault(k, i)
            if j != i:
                union(i, j)
    for m in np.flatnonzero(succ >= 0):
        union(int(m), int(succ[m]))
    return np.fromiter((find(i) for i in range(n)), dtype=np.int32, count=n)


_WORD = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())
