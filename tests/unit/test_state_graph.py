from datetime import UTC, datetime

from schemas import AtomicMemory, Category, Reason, Relation, RelationType, Store
from stam.state import PatientState


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

    from stam.stores.base import VectorRow
    from stam.stores.projection import VectorProjection

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
