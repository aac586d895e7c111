"""``state_at_time`` over hand-written transition logs: facts that arrive already ended."""

from datetime import UTC, datetime

from schemas import AtomicMemory, Category, Reason, Relation, RelationType, Store, TransitionEvent, TransitionKind
from stam.read.asof import state_at_time


def t(year: int) -> datetime:
    return datetime(year, 1, 1, tzinfo=UTC)


def mem(mid: str, entry: str, start: datetime, end: datetime | None = None, ref: str | None = None) -> AtomicMemory:
    return AtomicMemory(memory_id=mid, patient_id="p", entry_id=entry, position=0, category=Category.CONDITION,
                        text=mid, effective_start=start, effective_end=end, source_ref=ref)


def added(m: AtomicMemory, version: int, store: Store = Store.ACTIVE, reason: Reason | None = None,
          relations: tuple[Relation, ...] = ()) -> TransitionEvent:
    return TransitionEvent(transition_id=f"t-{m.memory_id}", patient_id="p", entry_id=m.entry_id, sequence=0,
                           kind=TransitionKind.ADDED, memory_id=m.memory_id, from_store=None, to_store=store,
                           reason=reason, clinical_time=m.effective_end or m.effective_start, recorded_at=t(2030),
                           state_version=version, memory=m, relations=relations)


def active(events: list[TransitionEvent], when: datetime) -> set[str]:
    return {i for i, s in state_at_time("p", events, when).memories.items() if s.store is Store.ACTIVE}


def test_a_fact_published_with_its_end_is_active_inside_its_interval_only() -> None:
    sinusitis = mem("sinusitis", "e1", t(2010), t(2012))
    events = [added(sinusitis, 1, Store.HISTORY, Reason.RESOLVED)]
    assert active(events, t(2009)) == set()
    assert active(events, t(2011)) == {"sinusitis"}
    state = state_at_time("p", events, t(2012))
    assert state.memories["sinusitis"].store is Store.HISTORY and state.memories["sinusitis"].reason is Reason.RESOLVED


def test_the_stop_of_an_order_active_since_its_start_does_not_duplicate_it() -> None:
    start = mem("start", "e1", t(2010), ref="pharmacy/1")
    stop = mem("stop", "e2", t(2010), t(2012), ref="pharmacy/1")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="start", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.STOPPED, successor_id="stop", evidence_id="stop",
                               clinical_time=t(2012), recorded_at=t(2030), state_version=2)
    rel = Relation(source_id="stop", target_id="start", type=RelationType.RESTATEMENT)
    events = [added(start, 1), added(stop, 2, Store.HISTORY, Reason.STOPPED, (rel,)), archived]
    assert active(events, t(2011)) == {"start"}  # the start stands for the order until it stopped
    assert active(events, t(2013)) == set()


def test_relations_to_memories_clinically_after_the_time_are_left_out() -> None:
    later = mem("later", "e1", t(2015))  # arrived first, clinically later
    early = mem("early", "e2", t(2010), t(2012))
    rel = Relation(source_id="early", target_id="later", type=RelationType.SAME_CONDITION_THREAD)
    events = [added(later, 1), added(early, 2, Store.HISTORY, Reason.RESOLVED, (rel,))]
    state = state_at_time("p", events, t(2011))
    assert set(state.memories) == {"early"} and state.relations() == []
    assert {r.target_id for r in state_at_time("p", events, t(2016)).relations()} == {"later"}


def test_an_ended_fact_that_archived_another_resource_of_its_concept_held_beside_it() -> None:
    chronic = mem("chronic", "e1", t(2009), ref="Condition/a")
    episode = mem("episode", "e2", t(2010), t(2012), ref="Condition/b")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="chronic", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.RESOLVED, evidence_id="episode",
                               clinical_time=t(2012), recorded_at=t(2030), state_version=2)
    events = [added(chronic, 1), added(episode, 2, Store.HISTORY, Reason.RESOLVED), archived]
    assert active(events, t(2011)) == {"chronic", "episode"}
    assert active(events, t(2013)) == set()


# --- the read path's timeline computes the same states, and a visibility boundary ------------------------------

def timeline_active(events: list[TransitionEvent], when: datetime | None, **vis: object) -> set[str]:
    from schemas.query import Visibility
    from stam.read.timeline import Timeline
    from stam.rebuild import replay

    final = replay("p", events)
    tl = Timeline.from_stored("p", final.version, final.memories.values())
    view = tl.view(when, Visibility(**vis) if vis else None)  # type: ignore[arg-type]
    return {tl.ids[i] for i in range(len(tl)) if view.present[i] and not view.history[i]}


def test_the_timeline_agrees_with_the_log_replay_on_every_case_above() -> None:
    start = mem("start", "e1", t(2010), ref="pharmacy/1")
    stop = mem("stop", "e2", t(2010), t(2012), ref="pharmacy/1")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="start", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.STOPPED, successor_id="stop", evidence_id="stop",
                               clinical_time=t(2012), recorded_at=t(2030), state_version=2)
    cases = [[added(mem("sinusitis", "e1", t(2010), t(2012)), 1, Store.HISTORY, Reason.RESOLVED)],
             [added(start, 1), added(stop, 2, Store.HISTORY, Reason.STOPPED), archived]]
    for events in cases:
        for year in (2009, 2010, 2011, 2012, 2013):
            assert timeline_active(events, t(year)) == active(events, t(year)), year


def test_a_rate_superseded_before_its_own_end_exists_from_its_start() -> None:
    # MIMIC-IV subject 10040025: an ICU infusion rate charted for 2148-01-28 14:00 to 01-30 16:00 was superseded by
    # the next rate at 01-28 15:00. The log replay took the infusion's end as the time it appeared, kept the
    # archival (15:00 <= T) without the memory, and raised KeyError('m-...') for T = 01-28 20:06.
    water = mem("water-1", "e1", datetime(2148, 1, 28, 14, tzinfo=UTC), datetime(2148, 1, 30, 16, tzinfo=UTC))
    rate = mem("water-2", "e2", datetime(2148, 1, 28, 15, tzinfo=UTC), datetime(2148, 1, 28, 15, 15, tzinfo=UTC))
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="water-1", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.SUPERSEDED, successor_id="water-2",
                               evidence_id="water-2", clinical_time=rate.effective_end, recorded_at=t(2030),
                               state_version=2)
    events = [added(water, 1), added(rate, 2), archived]
    when = datetime(2148, 1, 28, 20, 6, tzinfo=UTC)
    assert active(events, when) == {"water-2"} == timeline_active(events, when)
    assert active(events, datetime(2148, 1, 28, 14, 30, tzinfo=UTC)) == {"water-1"}


def test_an_archival_of_a_memory_that_does_not_exist_yet_is_left_out() -> None:
    # An explicit reference can end an order whatever its time: a change at 2011 names an order that starts 2012.
    order = mem("order", "e1", t(2012), ref="poe/1")
    change = mem("change", "e2", t(2011), ref="poe/2")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="order", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.SUPERSEDED, successor_id="change",
                               evidence_id="change", clinical_time=t(2011), recorded_at=t(2030), state_version=2)
    events = [added(order, 1), added(change, 2), archived]
    half = datetime(2011, 7, 1, tzinfo=UTC)
    assert active(events, half) == {"change"} == timeline_active(events, half)
    assert active(events, t(2013)) == {"change"} == timeline_active(events, t(2013))


def test_an_interval_fact_that_was_current_holds_from_its_start() -> None:
    first = mem("adm1", "e1", t(2010), t(2011), ref="Encounter/1")
    second = mem("adm2", "e2", t(2014), t(2015), ref="Encounter/2")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="adm1", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.SUPERSEDED, successor_id="adm2",
                               evidence_id="adm2", clinical_time=t(2015), recorded_at=t(2030), state_version=2)
    events = [added(first, 1), added(second, 2), archived]
    during = datetime(2014, 6, 1, tzinfo=UTC)  # inside the second admission, before its discharge
    assert active(events, during) == {"adm2"} == timeline_active(events, during)
    assert active(events, t(2012)) == {"adm1"} == timeline_active(events, t(2012))


def test_evidence_outside_the_visibility_boundary_is_left_out_and_what_it_ended_is_current() -> None:
    old = mem("old", "e1", t(2010), ref="Observation/1")
    new = mem("new", "e2", t(2011), ref="Observation/2")
    archived = TransitionEvent(transition_id="t-arch", patient_id="p", entry_id="e2", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id="old", from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.SUPERSEDED, successor_id="new",
                               evidence_id="new", clinical_time=t(2011), recorded_at=t(2030), state_version=2)
    events = [added(old, 1), added(new, 2), archived]
    assert timeline_active(events, None) == {"new"}
    assert timeline_active(events, None, exclude_entry_ids=("e2",)) == {"old"}
    assert timeline_active(events, None, entry_ids=("e1",)) == {"old"}
    assert timeline_active(events, None, exclude_categories=("condition",)) == set()
    assert timeline_active(events, None, exclude_source_types=("Observation",)) == set()
    assert timeline_active(events, t(2010), exclude_entry_ids=("e2",)) == {"old"}


def test_a_deleted_memory_is_absent_at_every_time_and_its_chain_reads_as_if_it_never_was() -> None:
    """Values a (2010) -> b (2012) -> c (2014, current); the gate deleted b."""
    a, b, c = mem("a", "e1", t(2010)), mem("b", "e2", t(2012)), mem("c", "e3", t(2014))

    def archived(m: str, by: str, when: int, version: int) -> TransitionEvent:
        return TransitionEvent(transition_id=f"t-arch-{m}", patient_id="p", entry_id=f"e-{by}", sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id=m, from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=Reason.SUPERSEDED, successor_id=by, evidence_id=by,
                               clinical_time=t(when), recorded_at=t(2030), state_version=version)

    deleted = TransitionEvent(transition_id="t-del-b", patient_id="p", entry_id="del-1", sequence=0,
                              kind=TransitionKind.DELETED, memory_id="b", from_store=Store.HISTORY, to_store=None,
                              reason=Reason.SUPERSEDED, successor_id="c", recorded_at=t(2030), state_version=4)
    events = [added(a, 1), added(b, 2), archived("a", "b", 2012, 2), added(c, 3), archived("b", "c", 2014, 3)]
    assert [active(events, t(y)) for y in (2011, 2013, 2015)] == [{"a"}, {"b"}, {"c"}]
    events.append(deleted)
    # Between b and c, b was the current value; with b forgotten, a is (as if b had never been recorded).
    assert [active(events, t(y)) for y in (2011, 2013, 2015)] == [{"a"}, {"a"}, {"c"}]
    now = state_at_time("p", events, t(2015))
    assert set(now.memories) == {"a", "c"} and now.memories["a"].successor_id == "c"
    for year in (2009, 2011, 2013, 2015):  # the read path's timeline over the live rows agrees
        assert timeline_active(events, t(year)) == active(events, t(year)), year


def test_a_stop_recorded_after_the_discharge_is_not_current_after_the_discharge() -> None:
    """A pharmacy stop written after the admission ended (its stop time later than the discharge) arrives already
    ended; inside its own interval it held, but an inpatient order holds no longer than its admission: between the
    discharge and the stop it is not current, in the log replay and in the timeline alike."""
    from schemas import Lifecycle

    admit, dc, stop_at = datetime(2182, 1, 7, tzinfo=UTC), datetime(2182, 1, 10, 16, tzinfo=UTC), \
        datetime(2182, 1, 10, 21, tzinfo=UTC)
    start_time = datetime(2182, 1, 10, tzinfo=UTC)

    def encounter_mem(mid: str, end: datetime | None) -> AtomicMemory:
        return AtomicMemory(memory_id=mid, patient_id="p", entry_id=mid, position=0, category=Category.ENCOUNTER,
                            text=mid, effective_start=admit, effective_end=end, source_ref="Encounter/1",
                            encounter_id="Encounter/1", lifecycle=Lifecycle.ENCOUNTER)

    def order_mem(mid: str, end: datetime | None) -> AtomicMemory:
        return AtomicMemory(memory_id=mid, patient_id="p", entry_id=mid, position=0, category=Category.MEDICATION,
                            text=mid, effective_start=start_time, effective_end=end, source_ref="pharmacy/1",
                            encounter_id="Encounter/1", lifecycle=Lifecycle.INTERVAL)

    admission, discharge = encounter_mem("admission", None), encounter_mem("discharge", dc)
    start, stop = order_mem("start", None), order_mem("stop", stop_at)

    def archive(mid: str, evidence: str, reason: Reason, version: int) -> TransitionEvent:
        return TransitionEvent(transition_id=f"t-arch-{mid}", patient_id="p", entry_id=evidence, sequence=1,
                               kind=TransitionKind.ARCHIVED, memory_id=mid, from_store=Store.ACTIVE,
                               to_store=Store.HISTORY, reason=reason, evidence_id=evidence, clinical_time=dc,
                               recorded_at=t(2030), state_version=version)

    events = [added(admission, 1), added(start, 2), added(discharge, 3, Store.HISTORY, Reason.ENCOUNTER_ENDED),
              archive("admission", "discharge", Reason.SUPERSEDED, 3),
              archive("start", "discharge", Reason.ENCOUNTER_ENDED, 3),
              added(stop, 4, Store.HISTORY, Reason.STOPPED)]
    half = datetime(2182, 1, 10, 12, tzinfo=UTC)
    after_dc, after_stop = datetime(2182, 1, 10, 18, tzinfo=UTC), datetime(2182, 1, 11, tzinfo=UTC)
    assert "start" in active(events, half)
    assert active(events, after_dc) == set() and active(events, after_stop) == set()
    for when in (half, after_dc, after_stop):
        assert timeline_active(events, when) == active(events, when), when
    # Without the discharge the stop's interval stands: it held until its own end.
    before = [e for e in events if "discharge" not in (e.memory_id, e.evidence_id)]
    assert "stop" in active(before, after_dc) and timeline_active(before, after_dc) == active(before, after_dc)
