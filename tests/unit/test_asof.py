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
