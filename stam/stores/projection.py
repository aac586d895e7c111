"""A worker-local projection of each warm patient's vectors, for impact retrieval.

Milvus stays the store of the vectors. Impact retrieval runs once per entry on the write path, and a
filtered Milvus Lite search costs tens of milliseconds (hundreds before segments are sealed), which caps
a worker far below the throughput goal. The projection holds the patient's ACTIVE and HISTORY vectors as
one matrix and answers the same exact cosine top-k a FLAT Milvus index gives.

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
from stam.cache import LRU
from stam.stores.base import Hit, VectorRow, VectorStore


@dataclass
class _Patient:
    version: int
    ids: list[str] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    index: dict[str, int] = field(default_factory=dict)

    def put(self, rows: Sequence[VectorRow]) -> None:
        fresh: list[np.ndarray] = []
        for row in rows:
            vec = row.vector / (np.linalg.norm(row.vector) or 1.0)
            pos = self.index.get(row.memory_id)
            if pos is not None:
                self.stores[pos] = row.store
                self.matrix[pos] = vec
                continue
            self.index[row.memory_id] = len(self.ids)
            self.ids.append(row.memory_id)
            self.stores.append(row.store)
            fresh.append(vec)
        if fresh:
            block = np.vstack(fresh).astype(np.float32)
            self.matrix = block if self.matrix.size == 0 else np.vstack([self.matrix, block])


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
        """Exact cosine top-``limit`` over ACTIVE and HISTORY together, as a FLAT Milvus index gives."""
        p = self._get(patient_id, version)
        if not p.ids or len(vectors) == 0:
            return [[] for _ in range(len(vectors))]
        skip = set(exclude)
        q = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        scores = q.astype(np.float32) @ p.matrix.T
        out: list[list[Hit]] = []
        want = min(limit + len(skip), len(p.ids))
        for row in scores:
            top = np.argpartition(-row, want - 1)[:want] if want < len(row) else np.arange(len(row))
            top = top[np.argsort(-row[top], kind="stable")]
            hits = [Hit(p.ids[i], p.stores[i], float(row[i])) for i in top if p.ids[i] not in skip]
            out.append(hits[:limit])
        return out

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
