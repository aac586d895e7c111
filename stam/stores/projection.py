"""A worker-local projection of each warm patient's vectors, for impact retrieval.

Milvus stays the store of the vectors. Impact retrieval runs once per entry on the write path, and a
filtered Milvus Lite search costs tens of milliseconds (hundreds before segments are sealed), which caps
a worker far below the throughput goal. The projection holds the patient's ACTIVE and HISTORY vectors as
one matrix and answers the same exact cosine top-k a FLAT Milvus index gives.

Coherence: the projection is tagged with the patient state version it reflects. The update stage, the
only writer, advances it after each commit; any other version (another worker wrote, a rebalance, a
restart) makes the next read reload the patient from Milvus.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class VectorProjection:
    def __init__(self, backing: VectorStore, *, max_vectors: int = 250_000) -> None:
        self._backing = backing
        # Weighed by vectors held; the most recent patient stays even when it alone is over the bound.
        self._patients: LRU[str, _Patient] = LRU(max_vectors, weigh=lambda p: len(p.ids), keep_last=True)
        self._lock = Lock()
        self.reloads = 0

    def _get(self, patient_id: str, version: int) -> _Patient:
        with self._lock:
            p = self._patients.get(patient_id)
            if p is not None and p.version == version:
                return p
        p = _Patient(version=version)
        if version > 0:
            self.reloads += 1
            p.put(self._backing.fetch(patient_id, Store.ACTIVE) + self._backing.fetch(patient_id, Store.HISTORY))
        self._patients.put(patient_id, p)
        return p

    def search(self, patient_id: str, version: int, queries: np.ndarray, limit: int,
               exclude: set[str] | None = None) -> list[list[Hit]]:
        """Top-``limit`` over ACTIVE and HISTORY together, by cosine, for each query vector."""
        p = self._get(patient_id, version)
        if not p.ids or len(queries) == 0:
            return [[] for _ in range(len(queries))]
        q = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
        scores = q.astype(np.float32) @ p.matrix.T
        out: list[list[Hit]] = []
        want = min(limit + len(exclude or ()), len(p.ids))
        for row in scores:
            top = np.argpartition(-row, want - 1)[:want] if want < len(row) else np.arange(len(row))
            top = top[np.argsort(-row[top], kind="stable")]
            hits = [Hit(p.ids[i], p.stores[i], float(row[i])) for i in top
                    if not exclude or p.ids[i] not in exclude]
            out.append(hits[:limit])
        return out

    def scores(self, patient_id: str, version: int, query: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Cosine of one query vector with every vector of the patient (both stores): (memory ids, scores)."""
        p = self._get(patient_id, version)
        if not p.ids:
            return [], np.zeros(0, dtype=np.float32)
        q = query.reshape(-1) / max(float(np.linalg.norm(query)), 1e-12)
        return list(p.ids), p.matrix @ q.astype(np.float32)

    def top_by_store(self, patient_id: str, version: int, query: np.ndarray, limit: int) -> dict[Store, list[Hit]]:
        """Top-``limit`` of ACTIVE and of HISTORY separately, by cosine with one query vector."""
        p = self._get(patient_id, version)
        out: dict[Store, list[Hit]] = {Store.ACTIVE: [], Store.HISTORY: []}
        if not p.ids:
            return out
        q = query.reshape(-1) / max(float(np.linalg.norm(query)), 1e-12)
        scores = p.matrix @ q.astype(np.float32)
        history = np.fromiter((s is Store.HISTORY for s in p.stores), dtype=bool, count=len(p.stores))
        for store, mask in ((Store.ACTIVE, ~history), (Store.HISTORY, history)):
            idx = np.flatnonzero(mask)
            if idx.size == 0:
                continue
            sub = scores[idx]
            want = min(limit, idx.size)
            top = np.argpartition(-sub, want - 1)[:want] if want < idx.size else np.arange(idx.size)
            top = top[np.argsort(-sub[top], kind="stable")]
            out[store] = [Hit(p.ids[idx[i]], store, float(sub[i])) for i in top]
        return out

    def prime(self, patient_id: str, version: int, rows: Sequence[VectorRow]) -> None:
        """Hold ``rows`` as the patient's vectors at ``version`` (a process that already has them, e.g. from
        the write it just made or a log it follows, need not fetch them from Milvus)."""
        p = _Patient(version=version)
        p.put(rows)
        self._patients.put(patient_id, p)

    def advance(self, patient_id: str, from_version: int, to_version: int, rows: Sequence[VectorRow]) -> None:
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
