"""A worker-local projection of each warm patient's vectors, for impact retrieval.

Milvus stays the store of the vectors. Impact retrieval runs once per entry on the write path, and a
filtered Milvus Lite search costs tens of milliseconds (hundreds before segments are sealed), which caps
a worker far below the throughput goal. The projection holds the patient's ACTIVE and HISTORY vectors, each
distinct vector once, and answers the same exact cosine top-k a FLAT Milvus index gives.

It is a :class:`VectorStore` decorator: it wraps the backing store (Milvus), passes every call through, and
answers :meth:`~VectorStore.nearest` (impact retrieval) from memory. The write path sees one ``VectorStore``;
whether a projection sits in front of Milvus is the composition root's choice (``STAM_IMPACT_SEARCH``).

Coherence: the projection is tagged with the patient state version it reflects. The update stage, the
only writer, advances it after each commit; any other version (another worker wrote, a rebalance, a
restart) makes the next read reload the patient from Milvus.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from threading import Lock

import numpy as np

from schemas import Store
from stam.backends.base import Hit, VectorRow, VectorStore
from stam.cache import LRU


@dataclass
class _Patient:
    """One patient's vectors, each distinct vector once.

    Memories of one coded concept share one vector (they embed the concept's name), so a patient with 18,000
    lab values has a few hundred distinct vectors: a search scores the distinct vectors and expands the best
    ones into their memories, and its cost follows the patient's vocabulary, not the length of the record.
    Rows are appended into a matrix grown by doubling, so a commit does not copy the patient's vectors."""

    version: int
    ids: list[str] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    """Memory id -> position in ``ids``."""
    group: list[int] = field(default_factory=list)
    """Position -> row of its vector in ``matrix``."""
    members: list[list[int]] = field(default_factory=list)
    """Row -> positions of the memories with that vector, in the order they came."""
    rows: dict[bytes, int] = field(default_factory=dict)
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    used: int = 0
    """Rows of ``matrix`` in use (the rest is room to grow)."""
    emptied: set[int] = field(default_factory=set)
    """Rows left without a memory (their memories' vectors changed)."""

    def _row(self, vec: np.ndarray) -> int:
        key = vec.tobytes()
        row = self.rows.get(key)
        if row is not None:
            return row
        if self.used == len(self.matrix):
            grown = np.zeros((max(16, 2 * len(self.matrix)), vec.shape[0]), dtype=np.float32)
            if self.used:
                grown[: self.used] = self.matrix[: self.used]
            self.matrix = grown
        row = self.rows[key] = self.used
        self.matrix[row] = vec
        self.members.append([])
        self.used += 1
        return row

    def put(self, rows: Sequence[VectorRow]) -> None:
        for r in rows:
            vec = (r.vector / (np.linalg.norm(r.vector) or 1.0)).astype(np.float32)
            row = self._row(vec)
            pos = self.index.get(r.memory_id)
            if pos is not None:
                self.stores[pos] = r.store
                if self.group[pos] != row:  # the memory's vector changed: it moves to its new row
                    old = self.members[self.group[pos]]
                    old.remove(pos)
                    if not old:
                        self.emptied.add(self.group[pos])
                    self.emptied.discard(row)
                    self.members[row].append(pos)
                    self.group[pos] = row
                continue
            pos = self.index[r.memory_id] = len(self.ids)
            self.ids.append(r.memory_id)
            self.stores.append(r.store)
            self.group.append(row)
            self.emptied.discard(row)
            self.members[row].append(pos)


class VectorProjection(VectorStore):
    """``backing`` with each warm patient's vectors held in memory for :meth:`nearest`."""

    def __init__(self, backing: VectorStore, *, max_vectors: int = 250_000) -> None:
        self.backing = backing
        # Weighed by vectors held; the most recent patient stays even when it alone is over the bound.
        self._patients: LRU[str, _Patient] = LRU(max_vectors, weigh=lambda p: len(p.ids), keep_last=True)
        self._lock = Lock()
        self.reloads = 0

    # --- passed through to the backing store -------------------------------------------------------------

    def place(self, patient_id: str, rows: Sequence[VectorRow]) -> None:
        self.backing.place(patient_id, rows)  # the projection already follows the write (committed)

    def search(self, patient_id: str, store: Store, vectors: np.ndarray, limit: int) -> list[list[Hit]]:
        return self.backing.search(patient_id, store, vectors, limit)

    def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
        return self.backing.fetch(patient_id, store)

    def fetch_ids(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, np.ndarray]:
        return self.backing.fetch_ids(patient_id, memory_ids)

    def count(self, patient_id: str, store: Store) -> int:
        return self.backing.count(patient_id, store)

    def delete(self, patient_id: str, memory_ids: Sequence[str]) -> int:
        self.forget(patient_id)  # reloaded at the next version
        return self.backing.delete(patient_id, memory_ids)

    def erase_patient(self, patient_id: str) -> int:
        self.forget(patient_id)
        return self.backing.erase_patient(patient_id)

    def flush(self) -> None:
        self.backing.flush()

    def flush_own_writes(self) -> None:
        self.backing.flush_own_writes()

    def close(self) -> None:
        self.backing.close()

    # --- answered from memory ----------------------------------------------------------------------------

    def _get(self, patient_id: str, version: int) -> _Patient:
        with self._lock:
            p = self._patients.get(patient_id)
            if p is not None and p.version == version:
                return p
        p = _Patient(version=version)
        if version > 0:
            self.reloads += 1
            p.put(self.backing.fetch(patient_id, Store.ACTIVE) + self.backing.fetch(patient_id, Store.HISTORY))
        self._patients.put(patient_id, p)
        return p

    def nearest(self, patient_id: str, version: int, vectors: np.ndarray, limit: int,
                exclude: Iterable[str] = ()) -> list[list[Hit]]:
        """Exact cosine top-``limit`` over ACTIVE and HISTORY together, as a FLAT Milvus index gives (memories
        with the same score in the order they came)."""
        p = self._get(patient_id, version)
        if not p.ids or len(vectors) == 0 or limit <= 0:
            return [[] for _ in range(len(vectors))]
        skip = set(exclude)
        q = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        scores = q.astype(np.float32) @ p.matrix[: p.used].T
        # Every row but the emptied ones holds a memory, so the best limit + |skip| + |emptied| rows hold enough hits.
        want = min(limit + len(skip) + len(p.emptied), p.used)
        out: list[list[Hit]] = []
        for row in scores:
            top = np.argpartition(-row, want - 1)[:want] if want < len(row) else np.arange(len(row))
            hits: list[Hit] = []
            for u in top[np.argsort(-row[top], kind="stable")]:
                score = float(row[u])
                for pos in p.members[u]:
                    if p.ids[pos] not in skip:
                        hits.append(Hit(p.ids[pos], p.stores[pos], score))
                        if len(hits) == limit:
                            break
                if len(hits) >= limit:
                    break
            out.append(hits)
        return out

    def similarities(self, patient_id: str, version: int, vectors: np.ndarray,
                     memory_ids: Sequence[str]) -> np.ndarray | None:
        """The cosines :meth:`nearest` would score ``memory_ids`` by; None when one of them is not held."""
        p = self._get(patient_id, version)
        rows = [p.group[pos] for pos in (p.index.get(mid) for mid in memory_ids) if pos is not None]
        if len(rows) != len(memory_ids):
            return None
        q = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.asarray(q.astype(np.float32) @ p.matrix[rows].T)

    def committed(self, patient_id: str, from_version: int, to_version: int, rows: Sequence[VectorRow]) -> None:
        """Apply a committed write. If the projection is not at ``from_version`` it is dropped instead."""
        with self._lock:
            p = self._patients.get(patient_id)
            if p is None or p.version != from_version:
                self._patients.pop(patient_id)
                return
            p.put(rows)
            p.version = to_version
            self._patients.shrink()

    def forget(self, patient_id: str) -> None:
        self._patients.pop(patient_id)
