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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from schemas import Store, StoredMemory
from schemas.query import Visibility
from stam.errors import IsolationBreach

ACTIVE, ARCHIVED, PLACED = 0, 1, 2
"""Memory kinds: never archived; archived by later evidence; added straight to HISTORY."""
NO_SUCCESSOR, UNKNOWN_SUCCESSOR = -1, -2

_NEG = -np.inf


def epoch(t: datetime | None) -> float:
    return t.timestamp() if t is not None else _NEG


def _epoch_iso(value: str | None) -> float:
    if not value:
        return _NEG
    return datetime.fromisoformat(value).timestamp()


def from_epoch(x: float) -> datetime | None:
    return datetime.fromtimestamp(x, UTC) if np.isfinite(x) else None


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
    def from_records(cls, patient_id: str, version: int, raw: Iterable[bytes | str]) -> Timeline:
        """From stored memory records as JSON (the Redis hash values); parsed without full validation, for speed:
        they were validated when written."""
        return cls._build(patient_id, version, [orjson.loads(r) for r in raw])

    @classmethod
    def from_stored(cls, patient_id: str, version: int, stored: Iterable[StoredMemory]) -> Timeline:
        return cls._build(patient_id, version, [s.model_dump(mode="json") for s in stored])

    @classmethod
    def _build(cls, patient_id: str, version: int, recs: list[dict[str, Any]]) -> Timeline:
        recs.sort(key=lambda r: (_epoch_iso(r["memory"].get("effective_start")), r["memory"]["memory_id"]))
        n = len(recs)
        ids = [r["memory"]["memory_id"] for r in recs]
        index = {m: i for i, m in enumerate(ids)}
        mems = [r["memory"] for r in recs]
        for m in mems:
            if m["patient_id"] != patient_id:
                raise IsolationBreach(f"memory {m['memory_id']} of another patient in this patient's records")
        t_start = np.fromiter((_epoch_iso(m.get("effective_start")) for m in mems), dtype=np.float64, count=n)
        t_end = np.fromiter((_epoch_iso(m.get("effective_end")) for m in mems), dtype=np.float64, count=n)
        placed_h = np.fromiter((r["store"] == Store.HISTORY.value and r.get("evidence_id") is None for r in recs),
                               dtype=bool, count=n)
        # Evidence time (see stam.read.asof.evidence_time): an ended fact's end, a current fact's start.
        t_add = np.where(placed_h, np.where(np.isfinite(t_end), t_end, t_start),
                         np.where(np.isfinite(t_start), t_start, t_end))
        value = np.fromiter((np.nan if m.get("value") is None else float(m["value"]) for m in mems),
                            dtype=np.float64, count=n)
        kind = np.zeros(n, dtype=np.int8)
        succ = np.full(n, NO_SUCCESSOR, dtype=np.int32)
        evid = np.full(n, NO_SUCCESSOR, dtype=np.int32)
        t_ended = np.full(n, np.inf)
        reason: list[str | None] = [None] * n
        source = [m.get("source_ref") for m in mems]
        covered = np.zeros(n, dtype=bool)
        for i, r in enumerate(recs):
            if r["store"] != Store.HISTORY.value:
                continue
            reason[i] = r.get("reason")
            s = r.get("successor_id")
            if s:
                succ[i] = index.get(s, UNKNOWN_SUCCESSOR)
            e = r.get("evidence_id")
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
        concept = [f"{m['concept']['system']}|{m['concept']['code']}" if m.get("concept") else None for m in mems]
        display = [((m.get("concept") or {}).get("display") or m["text"]) for m in mems]
        embed_keys = [f"c:{m['embed_text']}" if m.get("concept") and m.get("embed_text") else f"m:{m['memory_id']}"
                      for m in mems]
        tl = cls(patient_id=patient_id, version=version, ids=ids, entry_ids=[m["entry_id"] for m in mems],
                 category=[m["category"] for m in mems], source=source, resource=[resource_type(s) for s in source],
                 concept=concept, display=display, unit=[m.get("unit") for m in mems],
                 dosage=[m.get("dosage") for m in mems], value=value, t_start=t_start, t_end=t_end,
                 t_add=t_add, kind=kind, t_ended=t_ended, succ=succ, evid=evid, covered=covered, reason=reason,
                 thread=np.zeros(n, dtype=np.int32), embed_keys=embed_keys, index=index)
        # Versions of one source resource join a thread position by position (a panel's components are
        # different concepts of one resource and stay apart).
        tl.thread = threads(concept, [f"{src}#{m['position']}" if src else None for src, m in zip(source, mems,
                                                                                                  strict=True)], succ)
        return tl

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
