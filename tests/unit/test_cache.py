"""The one LRU cache (stam/cache.py)."""

from __future__ import annotations

import threading

from stam.cache import LRU, VersionedCache


def test_least_recently_used_goes_first_and_get_refreshes() -> None:
    c: LRU[str, int] = LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "b" is now the least recently used
    c.put("c", 3)
    assert "b" not in c and c.get("a") == 1 and c.get("c") == 3 and len(c) == 2


def test_weighed_bound_and_keep_last() -> None:
    c: LRU[str, list[int]] = LRU(5, weigh=len, keep_last=True)
    c.put("a", [1, 2, 3])
    c.put("b", [1, 2])
    assert c.weight() == 5
    c.put("c", [1])
    assert "a" not in c and c.weight() == 3
    c.put("huge", list(range(10)))  # alone over the bound: kept, everything else goes
    assert len(c) == 1 and c.get("huge") is not None


def test_a_value_that_grew_is_weighed_again_on_shrink() -> None:
    c: LRU[str, list[int]] = LRU(4, weigh=len, keep_last=True)
    a, b = [1], [1]
    c.put("a", a)
    c.put("b", b)
    b.extend([2, 3, 4])
    c.shrink()
    assert "a" not in c and "b" in c


def test_zero_size_caches_nothing_and_pop_clear() -> None:
    c: LRU[str, int] = LRU(0)
    c.put("a", 1)
    assert len(c) == 0 and c.get("a") is None
    d: LRU[str, int] = LRU(3)
    d.put("a", 1)
    assert d.pop("a") == 1 and d.pop("a") is None
    d.put("b", 2)
    d.clear()
    assert len(d) == 0


def test_threads_never_see_it_over_its_bound() -> None:
    c: LRU[int, int] = LRU(50)
    over = []

    def work(base: int) -> None:
        for i in range(2000):
            c.put(base + i, i)
            c.get(base + i // 2)
            if len(c) > 50:
                over.append(len(c))

    threads = [threading.Thread(target=work, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over and len(c) == 50


def test_a_versioned_cache_serves_one_version_and_forgets_everything_at_an_erasure() -> None:
    c: VersionedCache[tuple[int, list[int]]] = VersionedCache(10, version_of=lambda v: v[0], weigh=lambda v: len(v[1]))
    c.put("a", (3, [1, 2]))
    assert c.get("a", 3) == (3, [1, 2]) and c.get("a", 4) is None  # another version: not this value
    c.put("b", (1, [1]))
    assert c.get("b", 1, erasures=1) is None and c.get("a", 3, erasures=1) is None  # an erasure: all of it forgotten
    c.put("a", (3, [1, 2]), erasures=0)  # read before that erasure: not kept
    assert c.get("a", 3, erasures=1) is None
    c.put("a", (5, [1]), erasures=1)
    assert c.get("a", 5, erasures=1) == (5, [1]) and c.weight() == 1
    c.forget("a")
    assert c.get("a", 5, erasures=1) is None
