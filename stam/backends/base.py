"""Store interfaces. Every call is scoped by patient id: there is no method that spans patients."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas import Store, StoredMemory
from schemas.query import RecordGap
from stam.patient_state import PatientState


@dataclass(frozen=True)
class VectorRow:
    memory_id: str
    vector: np.ndarray
    store: Store = Store.ACTIVE


@dataclass(frozen=True)
class Hit:
    memory_id: str
    store: Store
    score: float


class VectorStore(ABC):
    """ACTIVE and HISTORY vectors. Implementations keep one collection per store."""

    @abstractmethod
    def place(self, patient_id: str, rows: Sequence[VectorRow]) -> None:
        """Put each vector in the store its row names and remove it from the other store.

        Idempotent and convergent: applying the same rows again, or the rows of a later attempt, leaves
        each memory's vector in exactly the store the last write named.
        """

    @abstractmethod
    def search(self, patient_id: str, store: Store, vectors: np.ndarray, limit: int) -> list[list[Hit]]:
        """Top-``limit`` by cosine for each query vector, within one patient and one store."""

    @abstractmethod
    def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
        """Every vector of one patient in one store."""

    def fetch_ids(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The vectors of some memories of one patient (missing ones are left out)."""
        wanted = set(memory_ids)
        return {r.memory_id: r.vector for store in (Store.ACTIVE, Store.HISTORY) for r in self.fetch(patient_id, store)
                if r.memory_id in wanted}

    def count(self, patient_id: str, store: Store) -> int:
        """How many vectors one patient has in one store."""
        return len(self.fetch(patient_id, store))

    @abstractmethod
    def delete(self, patient_id: str, memory_ids: Sequence[str]) -> int:
        """Remove some memories' vectors of one patient (the deletion gate). Idempotent; returns how many went."""

    @abstractmethod
    def erase_patient(self, patient_id: str) -> int: ...

    def flush(self) -> None:  # noqa: B027 - optional hook, a no-op where writes are visible at once
        """Make recent writes cheap to search (Milvus seals growing segments)."""

    def flush_own_writes(self) -> None:
        """:meth:`flush` when this client has written since its last flush, else nothing (a worker's periodic
        seal: an idle worker makes no call)."""
        self.flush()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection."""

    def nearest(self, patient_id: str, version: int, vectors: np.ndarray, limit: int,
                exclude: Iterable[str] = ()) -> list[list[Hit]]:
        """Top-``limit`` over ACTIVE and HISTORY together, by cosine, for each query vector, leaving out
        ``exclude``: impact retrieval's semantic channel.

        ``version`` is the patient's state version the caller read (0: the patient has nothing yet). A store
        that keeps vectors near the worker (:class:`stam.backends.projection.VectorProjection`) answers from
        them while they are at that version; this default searches each store and merges."""
        if version == 0 or len(vectors) == 0:
            return [[] for _ in range(len(vectors))]
        skip = set(exclude)
        per_store = [self.search(patient_id, s, vectors, limit + len(skip)) for s in (Store.ACTIVE, Store.HISTORY)]
        merged = []
        for i in range(len(vectors)):
            hits = [h for store_hits in per_store for h in store_hits[i] if h.memory_id not in skip]
            hits.sort(key=lambda h: -h.score)
            merged.append(hits[:limit])
        return merged

    def similarities(self, patient_id: str, version: int, vectors: np.ndarray,
                     memory_ids: Sequence[str]) -> np.ndarray | None:
        """Cosine of each query vector with each of ``memory_ids`` at the patient's state ``version`` (a row per
        vector), as :meth:`nearest` scores them; None when the store cannot say without a search. The update
        stage uses it to merge the memories added since into a semantic channel read earlier
        (:mod:`stam.stages.reads`); this default says None, so that stage searches again."""
        return None

    def committed(self, patient_id: str, from_version: int, to_version: int,  # noqa: B027 - optional hook
                  rows: Sequence[VectorRow]) -> None:
        """The update stage applied ``rows`` for a patient, moving its state from ``from_version`` to
        ``to_version`` (before they are placed). A store that keeps vectors near the worker follows the write;
        this default keeps nothing."""

    def forget(self, patient_id: str) -> None:  # noqa: B027 - optional hook
        """Drop whatever is kept near the worker for one patient (a failed commit, a rebuild)."""


@dataclass(frozen=True)
class Commit:
    """What applied entries change for one patient, written atomically with a version check."""

    patient_id: str
    expected_version: int
    state: PatientState
    """The new state; its ``version`` is the version to store."""
    changed: Sequence[StoredMemory]
    outboxes: dict[str, bytes]
    """Serialised transition events per entry id, kept until delivered (transactional outbox)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Text of the applied entries that carry text, by entry id (source spans at read time)."""
    deleted: Sequence[str] = ()
    """Memory ids the deletion gate deleted: their records go."""
    dropped_sources: Sequence[str] = ()
    """Entry ids whose text goes with them (no memory left cites the entry)."""


class StateStore(ABC):
    """Per-patient state (memories + igraph relation graph) with optimistic versioning."""

    @abstractmethod
    def version(self, patient_id: str) -> int: ...

    def version_and_erasures(self, patient_id: str) -> tuple[int, int]:
        """The patient's state version and the store's erasure count (``stam erase`` increments it), read together:
        a cache keyed by version alone could take a patient erased and re-created up to the same version for the
        one it held. A store without erasures answers 0 for the count."""
        return self.version(patient_id), 0

    @abstractmethod
    def load(self, patient_id: str) -> PatientState: ...

    @contextmanager
    def pinned_versions(self, patient_ids: Iterable[str]) -> Iterator[None]:
        """Within the block, answer version look-ups of these patients from one bulk read.

        Only for read-only stage batches that run without yielding to other coroutines; writers still
        check versions at commit. The default does nothing."""
        yield

    @abstractmethod
    def commit_many(self, commits: Sequence[Commit]) -> None:
        """Write all or nothing, iff every patient's stored version still equals its ``expected_version``;
        raise ConcurrentUpdate otherwise."""

    @abstractmethod
    def pending_outbox(self, patient_id: str, entry_id: str) -> bytes | None: ...

    @abstractmethod
    def pending_outboxes(self) -> list[tuple[str, str, bytes]]:
        """(patient id, entry id, outbox) of every entry whose transitions are not confirmed delivered."""

    @abstractmethod
    def clear_outbox(self, patient_id: str, entry_id: str) -> None: ...

    def clear_outboxes(self, delivered: Sequence[tuple[str, str]]) -> None:
        """:meth:`clear_outbox` for many (patient id, entry id) pairs (a store may do it in one round trip)."""
        for patient_id, entry_id in delivered:
            self.clear_outbox(patient_id, entry_id)

    @abstractmethod
    def patients(self) -> list[str]: ...

    def memories(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, StoredMemory]:
        """Stored records of some memories of one patient (the read path fetches only what it serves)."""
        state = self.load(patient_id)
        return {m: s for m in memory_ids if (s := state.get(m)) is not None}

    def timeline_rows(self, patient_id: str) -> tuple[int, list[list[Any]]] | None:
        """The patient's version and the timeline row of every memory (:mod:`stam.backends.rows`), read together;
        None when the store keeps no rows for this patient (then :meth:`records` serves)."""
        return None

    def records(self, patient_id: str) -> tuple[int, list[bytes]]:
        """The patient's version and every memory record as JSON, read together (the read path's timeline)."""
        state = self.load(patient_id)
        return state.version, [s.model_dump_json().encode() for s in state.memories.values()]

    def source_text(self, patient_id: str, entry_id: str) -> str | None:
        """The text of an applied entry (kept for entries that carry text); None when not kept."""
        return None

    @abstractmethod
    def erase_patient(self, patient_id: str) -> int: ...

    def gaps(self, patient_id: str) -> list[RecordGap]:
        """The patient's record gaps: dead-lettered entries not applied (see :class:`RecordGap`)."""
        return []

    def record_gap(self, patient_id: str, gap: RecordGap) -> None:
        """Record that an entry of the patient was dead-lettered; a store without gaps refuses."""
        raise NotImplementedError(f"{type(self).__name__} keeps no record gaps")

    def clear_gap(self, patient_id: str, entry_id: str) -> None:  # noqa: B027 - a store without gaps has none
        """Close the gap of an entry that is applied."""

    def marks(self) -> tuple[str | None, int]:
        """Durability marks (epoch, write counter); a store without them answers (None, 0)."""
        return None, 0

    def seen_marks(self) -> tuple[str | None, int]:
        """The highest marks this process wrote or checked."""
        return None, 0

    def expect_marks(self, epoch: str | None, wseq: int) -> None:  # noqa: B027 - optional, see RedisStateStore
        """Refuse later commits on a store whose marks are behind these."""

    def ensure_marks(self, at_least: int = 0) -> tuple[str | None, int]:
        """Give the store an epoch and a write counter of at least ``at_least``."""
        return self.marks()
