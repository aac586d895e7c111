"""One least-recently-used cache for every in-process cache of STAM (embeddings, patient states, vector
projections, timelines, model replies).

A cache here is only ever a copy: whoever holds one checks it against the store's version before trusting
it (see the callers), so forgetting is always safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from threading import RLock
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")


class LRU(Generic[K, V]):
    """A bounded, thread-safe map that forgets the least recently used entries first.

    The bound is on the total weight of the values: ``weigh(value)`` (1 each by default, so a count). With
    ``keep_last``, the most recently used entry is kept even when it alone is over the bound (a patient larger
    than the cache is still served from it until another one is used). ``max_weight <= 0`` without
    ``keep_last`` caches nothing. A value that grows in place is weighed again at the next :meth:`put` or
    :meth:`shrink`."""

    def __init__(self, max_weight: int, *, weigh: Callable[[V], int] | None = None, keep_last: bool = False) -> None:
        self._data: OrderedDict[K, V] = OrderedDict()
        self._max = max_weight
        self._weigh = weigh
        self._keep_last = keep_last
        self._lock = RLock()

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if self._max <= 0 and not self._keep_last:
                return
            self._data[key] = value
            self._data.move_to_end(key)
            self.shrink()

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def shrink(self) -> None:
        """Forget least recently used entries until the cache is within its bound."""
        with self._lock:
            floor = 1 if self._keep_last else 0
            if self._weigh is None:
                while len(self._data) > max(self._max, floor):
                    self._data.popitem(last=False)
                return
            total = sum(self._weigh(v) for v in self._data.values())
            while total > self._max and len(self._data) > floor:
                _, dropped = self._data.popitem(last=False)
                total -= self._weigh(dropped)

    def weight(self) -> int:
        with self._lock:
            return len(self._data) if self._weigh is None else sum(self._weigh(v) for v in self._data.values())

    def keys(self) -> list[K]:
        """The keys, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._data)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class VersionedCache(Generic[T]):
    """Per-patient values (a patient's timeline, with or without its index and vectors) valid for one state version
    (``version_of(value)``), least recently used out first beyond ``max_weight`` (``weigh``), the last one kept.
    When the store's erasure count moves, every value held is dropped: an erased patient is never served from here,
    even one re-created since up to the same version; and a value read before the count moved is not kept."""

    def __init__(self, max_weight: int, *, version_of: Callable[[T], int], weigh: Callable[[T], int]) -> None:
        self._items: LRU[str, T] = LRU(max_weight, weigh=weigh, keep_last=True)
        self._version_of = version_of
        self._lock = RLock()
        self._erasures = 0

    def get(self, patient_id: str, version: int, erasures: int = 0) -> T | None:
        """``erasures``: the store's erasure count, read with ``version``."""
        with self._lock:
            if erasures != self._erasures:
                self._items.clear()
                self._erasures = erasures
            got = self._items.get(patient_id)
            return got if got is not None and self._version_of(got) == version else None

    def put(self, patient_id: str, value: T, erasures: int = 0) -> None:
        """``erasures``: the count read with the version the value was built from."""
        with self._lock:
            if erasures == self._erasures:
                self._items.put(patient_id, value)

    def forget(self, patient_id: str) -> None:
        with self._lock:
            self._items.pop(patient_id)

    def weight(self) -> int:
        return self._items.weight()
