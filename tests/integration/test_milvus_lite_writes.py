"""Milvus Lite's insert replaces the row of a key it already holds: ``MilvusVectorStore.place`` writes with insert
there (Lite's upsert waits out every segment seal: ``stam.backends.milvus``). Checked on the installed Milvus Lite,
with the key's earlier row in the open MemTable, in a sealed segment, in two segments, and after a delete, so that a
Lite release that kept both rows fails here instead of serving a memory twice or in both stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from schemas import Store
from stam.backends.base import VectorRow
from stam.backends.milvus import MilvusVectorStore

DIM = 8


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


def _ids(store: MilvusVectorStore, patient: str, which: Store) -> list[str]:
    return sorted(r.memory_id for r in store.fetch(patient, which))


def test_lite_place_replaces_the_row_of_a_key_it_holds(tmp_path: Path) -> None:
    vs = MilvusVectorStore(str(tmp_path / "milvus.db"), dim=DIM, prefix="lw")
    try:
        assert vs.lite, "a Milvus Lite file is Milvus Lite"
        p = "patient-1"
        vs.place(p, [VectorRow("a", _vec(1), Store.ACTIVE), VectorRow("b", _vec(2), Store.ACTIVE)])
        vs.place(p, [VectorRow("a", _vec(3), Store.HISTORY)])  # both rows of "a" in the MemTable
        assert _ids(vs, p, Store.ACTIVE) == ["b"] and _ids(vs, p, Store.HISTORY) == ["a"]
        assert np.allclose(vs.fetch_ids(p, ["a"])["a"], _vec(3))

        vs.flush()
        vs.place(p, [VectorRow("a", _vec(4), Store.ACTIVE)])  # the earlier row sealed, the new one not
        assert _ids(vs, p, Store.ACTIVE) == ["a", "b"] and _ids(vs, p, Store.HISTORY) == []
        vs.flush()  # each row in its own segment
        assert (vs.count(p, Store.ACTIVE), vs.count(p, Store.HISTORY)) == (2, 0)
        hits = vs.search(p, Store.ACTIVE, _vec(4)[None, :], limit=5)[0]
        assert [h.memory_id for h in hits].count("a") == 1 and hits[0].memory_id == "a"
        assert np.allclose(vs.fetch_ids(p, ["a"])["a"], _vec(4))

        vs.delete(p, ["a"])
        assert _ids(vs, p, Store.ACTIVE) == ["b"] and _ids(vs, p, Store.HISTORY) == []
        vs.place(p, [VectorRow("a", _vec(5), Store.HISTORY)])
        vs.flush()
        assert _ids(vs, p, Store.ACTIVE) == ["b"] and _ids(vs, p, Store.HISTORY) == ["a"]
        assert vs.count(p, Store.HISTORY) == 1
    finally:
        vs.close()


def test_a_write_made_during_a_flush_is_sealed_by_the_next_round(tmp_path: Path) -> None:
    """The seal timer runs beside the stage thread: ``flush`` clears the written mark before it seals, so a write
    that lands while it runs marks the store again instead of being forgotten."""
    vs = MilvusVectorStore(str(tmp_path / "milvus.db"), dim=DIM, prefix="lw")
    try:
        vs.place("p", [VectorRow("a", _vec(1), Store.ACTIVE)])
        calls: list[str] = []
        real_flush = vs._client.flush

        def flush_with_a_write_in_between(name: str) -> None:
            calls.append(name)
            if len(calls) == 1:
                vs.place("p", [VectorRow("b", _vec(2), Store.ACTIVE)])  # lands while the first seal runs
            real_flush(name)

        vs._client.flush = flush_with_a_write_in_between  # type: ignore[method-assign]
        vs.flush_own_writes()
        vs.flush_own_writes()  # "b" came after the first seal began: sealed now
        vs.flush_own_writes()  # nothing written since: no call
        assert calls == ["lw_memories", "lw_memories"]
    finally:
        vs.close()
