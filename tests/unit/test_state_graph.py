from datetime import UTC, datetime

import orjson

from schemas import AtomicMemory, Category, Reason, Relation, RelationType, Store
from stam.patient_state import PatientState


def mem(i: int) -> AtomicMemory:
    return AtomicMemory(memory_id=f"m{i}", patient_id="p", entry_id=f"e{i}", position=0,
                        category=Category.OBSERVATION, text=f"fact {i}")


def test_no_new_relation_to_history_but_existing_relations_survive() -> None:
    s = PatientState("p")
    for i in range(3):
        s.add(mem(i), Store.ACTIVE)
    assert s.relate(Relation(source_id="m0", target_id="m1", type=RelationType.TREATMENT_FOR))
    s.archive("m1", reason=Reason.SUPERSEDED, successor_id="m2", evidence_id="m2", entry_id="e2",
              at=datetime(2020, 1, 1, tzinfo=UTC))
    assert not s.relate(Relation(source_id="m2", target_id="m1", type=RelationType.RESTATEMENT))
    assert [(n, t) for n, t, _ in s.neighbours("m1")] == [("m0", RelationType.TREATMENT_FOR)]


def test_snapshot_roundtrip_keeps_graph() -> None:
    s = PatientState("p")
    for i in range(3):
        s.add(mem(i), Store.ACTIVE)
    s.relate(Relation(source_id="m2", target_id="m0", type=RelationType.MONITORING_FOR, weight=0.8))
    restored = PatientState.restore("p", 1, s.graph_snapshot(),
                                    [v.model_dump_json().encode() for v in s.memories.values()])
    assert restored.relations() == s.relations()
    assert restored.counts() == s.counts()


def test_projection_evicts_least_recent_patients_beyond_its_vector_budget() -> None:
    import numpy as np

    from stam.backends.base import VectorRow
    from stam.backends.projection import VectorProjection

    class Empty:  # backing store with nothing in it: a unit test of the projection alone
        def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
            return []

    proj = VectorProjection(Empty(), max_vectors=5)  # type: ignore[arg-type]
    rows = [VectorRow(f"m{i}", np.ones(4, dtype=np.float32)) for i in range(3)]
    for pid in ("a", "b"):
        proj.nearest(pid, 0, np.ones((1, 4), dtype=np.float32), 1)
        proj.committed(pid, 0, 1, rows)
    assert set(proj._patients.keys()) == {"b"}
    hits = proj.nearest("b", 1, np.ones((1, 4), dtype=np.float32), 2)[0]
    assert [h.score for h in hits] == [1.0, 1.0]

def test_deleting_a_history_memory_drops_its_vertex_relations_and_relinks_its_chain() -> None:
    """m0 -> m1 -> m2 -> m3 (successor chain; m3 ACTIVE), m1 related to m4. Deleting m1 re-points m0 to m2."""
    s = PatientState("p")
    for i in range(5):
        s.add(mem(i), Store.ACTIVE)
    assert s.relate(Relation(source_id="m1", target_id="m4", type=RelationType.RESTATEMENT))
    assert s.relate(Relation(source_id="m0", target_id="m2", type=RelationType.RESTATEMENT))
    at = datetime(2020, 1, 1, tzinfo=UTC)
    for i in range(3):
        s.archive(f"m{i}", reason=Reason.SUPERSEDED, successor_id=f"m{i + 1}", evidence_id=f"m{i + 1}",
                  entry_id=f"e{i + 1}", at=at)
    try:
        s.delete("m3")
        raise AssertionError("an ACTIVE memory was deleted")
    except ValueError:
        pass
    relinked = s.delete("m1")
    assert [(x.memory.memory_id, x.successor_id) for x in relinked] == [("m0", "m2")]
    assert s.get("m0").successor_id == "m2"  # type: ignore[union-attr]
    assert s.get("m1") is None and "m1" not in s.graph.vs["name"]
    assert s.by_source("m1") == [] and s.counts() == {"active": 2, "history": 2, "relations": 1}
    assert [(r.source_id, r.target_id) for r in s.relations()] == [("m0", "m2")]
    assert s.neighbours("m4") == []
    restored = PatientState.restore("p", 1, s.graph_snapshot(),
                                    [v.model_dump_json().encode() for v in s.memories.values()])
    assert restored.relations() == s.relations()


def _random_state(seed: int, n: int = 60) -> PatientState:
    """A state built by random adds, relations, archives and deletions (every kind of graph change)."""
    import random

    rng = random.Random(seed)
    s = PatientState("p")
    at = datetime(2020, 1, 1, tzinfo=UTC)
    for i in range(n):
        s.add(mem(i), Store.ACTIVE)
        for _ in range(rng.randrange(3)):
            j = rng.randrange(i + 1)
            s.relate(Relation(source_id=f"m{i}", target_id=f"m{j}", type=rng.choice(list(RelationType)),
                              weight=round(rng.random(), 3)))
        if i and rng.random() < 0.4:
            j = rng.randrange(i)
            if s.get(f"m{j}") is not None and s.get(f"m{j}").store is Store.ACTIVE:  # type: ignore[union-attr]
                s.archive(f"m{j}", reason=Reason.SUPERSEDED, successor_id=f"m{i}", evidence_id=f"m{i}",
                          entry_id=f"e{i}", at=at)
        if i > 5 and rng.random() < 0.1:
            history = [m for m, v in s.memories.items() if v.store is Store.HISTORY]
            if history:
                s.delete(rng.choice(history))
    return s


def _igraph_view(s: PatientState) -> tuple[list[str], list[tuple[str, str, str, float]]]:
    g = s.graph
    names = g.vs["name"]
    return names, [(names[e.source], names[e.target], e["type"], e["weight"]) for e in g.es]


def test_snapshot_plus_change_log_restores_the_same_graph_as_a_full_snapshot() -> None:
    """The state store keeps a snapshot and a log of later changes; any split of the changes into the two
    restores the graph a full snapshot does: vertices, edges, their order, and every neighbourhood."""
    for seed in range(5):
        s = _random_state(seed)
        ops = list(s.graph_ops)
        records = [v.model_dump_json().encode() for v in s.memories.values()]
        full = PatientState.restore("p", 1, s.graph_snapshot(), records)
        assert _igraph_view(full) == _igraph_view(s)
        for cut in (0, len(ops) // 3, len(ops) - 1):
            head = PatientState("p")
            for op in ops[:cut]:
                head._apply_op(op)
            logged = [orjson.dumps(op) for op in ops[cut:]]
            again = PatientState.restore("p", 1, head.graph_snapshot() if cut else None, records, logged)
            assert _igraph_view(again) == _igraph_view(s)
            assert again.relations() == s.relations() and again.graph_log == len(logged)
            for m in s.memories:
                assert again.neighbours(m) == s.neighbours(m)


def test_neighbours_match_igraph_and_a_copy_leaves_its_original_alone() -> None:
    s = _random_state(7)
    g = s.graph
    names = g.vs["name"]
    for v in g.vs:
        want = [(names[e.target if e.source == v.index else e.source], RelationType(e["type"]), e["weight"])
                for e in g.es[g.incident(v.index, mode="all")]]
        assert sorted(s.neighbours(v["name"]), key=str) == sorted(want, key=str)
    before = (_igraph_view(s), s.counts(), [s.neighbours(n) for n in names])
    c = s.copy()
    target = next(m for m, v in s.memories.items() if v.store is Store.ACTIVE)
    for i in range(100, 110):
        c.add(mem(i), Store.ACTIVE)
        assert c.relate(Relation(source_id=f"m{i}", target_id=target, type=RelationType.RESTATEMENT))
    history = [m for m, v in c.memories.items() if v.store is Store.HISTORY]
    for m in history[:3]:
        c.delete(m)
    assert (_igraph_view(s), s.counts(), [s.neighbours(n) for n in names]) == before
    assert [op[0] for op in c.graph_ops] == ["v", "e"] * 10 + ["x"] * 3
    assert s.graph.vcount() == len(s.memories) and c.graph.vcount() == len(s.memories) + 7


def test_projection_answers_the_exact_top_k_with_shared_vectors() -> None:
    """Memories of one concept share a vector; the projection stores it once and still answers the exact
    top-k (scores and members) a scan of every memory's vector gives."""
    import numpy as np

    from stam.backends.base import VectorRow
    from stam.backends.projection import VectorProjection

    class Empty:
        def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
            return []

    rng = np.random.default_rng(3)
    concepts = rng.normal(size=(30, 8)).astype(np.float32)
    proj = VectorProjection(Empty())  # type: ignore[arg-type]
    proj.nearest("p", 0, concepts[:1], 1)
    every: list[tuple[str, np.ndarray]] = []
    version = 0
    for batch in range(20):
        rows = []
        for i in range(25):
            vec = concepts[rng.integers(30)] if rng.random() < 0.8 else rng.normal(size=8).astype(np.float32)
            rows.append(VectorRow(f"m{batch}-{i}", vec, Store.ACTIVE if i % 3 else Store.HISTORY))
            every.append((f"m{batch}-{i}", vec))
        proj.committed("p", version, version + 1, rows)
        version += 1
    matrix = np.stack([v / np.linalg.norm(v) for _, v in every])
    queries = np.vstack([concepts[:3], rng.normal(size=(3, 8)).astype(np.float32)])
    skip = {every[0][0], every[5][0]}
    for q, hits in zip(queries, proj.nearest("p", version, queries, 48, exclude=skip), strict=True):
        scores = matrix @ (q / np.linalg.norm(q))
        want = sorted(((float(s), every[i][0]) for i, s in enumerate(scores) if every[i][0] not in skip),
                      key=lambda x: -x[0])[:48]
        assert len(hits) == 48
        assert np.allclose([h.score for h in hits], [w[0] for w in want], atol=1e-5)
        cut = want[-1][0]  # members tied at the cut may differ; everything above it must be the same
        assert {h.memory_id for h in hits if h.score > cut + 1e-5} == {w[1] for w in want if w[0] > cut + 1e-5}
    assert proj._patients.get("p").used < 150  # type: ignore[union-attr]  # 500 memories, 30 concepts + ~100 free


def test_projection_still_fills_the_top_k_when_a_memory_leaves_its_vector() -> None:
    """A memory whose vector changed leaves its old row empty; that row can score best and hold nobody."""
    import numpy as np

    from stam.backends.base import VectorRow
    from stam.backends.projection import VectorProjection

    class Empty:
        def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
            return []

    proj = VectorProjection(Empty())  # type: ignore[arg-type]
    e = np.eye(4, dtype=np.float32)
    proj.nearest("p", 0, e[:1], 1)
    proj.committed("p", 0, 1, [VectorRow("a", e[0]), VectorRow("b", e[1]), VectorRow("c", e[2])])
    proj.committed("p", 1, 2, [VectorRow("a", e[3])])  # a's row (e0) is now empty
    hits = proj.nearest("p", 2, e[:1] + 0.1 * e[1:2], 2)[0]
    assert len(hits) == 2 and hits[0].memory_id == "b"  # without counting the empty row: only b
    assert [h.memory_id for h in proj.nearest("p", 2, e[3:4], 1)[0]] == ["a"]
