"""Point in time: a patient's ACTIVE and HISTORY as they were, reconstructed from the transition log.

Two ways to name the past:

- ``as_of_version=V``: the state right after the patient's V-th applied entry (a position in the
  patient's stream): the transitions with ``state_version <= V``, replayed in log order.
- ``as_of=T`` (clinical time): the state the record describes at clinical time T, knowing what the log
  knows now. Each memory's evidence has a clinical time: a fact that was current when it arrived holds from
  its start (``effective_start``; an admission is current from admission, not from discharge); a fact that
  arrived already ended (added straight to HISTORY: a stop, a resolved condition, a late-arriving older value)
  is evidence of its end (``effective_end``, else its start). The transitions whose evidence is clinically no
  later than T are replayed in log order (an archival's evidence is the memory that caused it; transitions
  without a clinical time are kept). An archival whose successor is clinically later than T did not hold at T
  and is dropped: a value superseded at T+1 is still ACTIVE at T, and a late-arriving older fact is ACTIVE at
  its own time when the fact that followed it is after T. A fact that arrived already ended is ACTIVE at the T
  inside its validity interval, unless it ended an earlier version of the same source resource (a pharmacy
  stop: the start stands for the order). An archival of a memory that did not exist yet at T (an explicit
  reference can end an order whose own start is later than the order that ended it) is left out.

An archival by the lifecycle (reasons ``encounter-ended`` and ``expired``) happens at its own clinical time (the
encounter's end, the interval's end: the transition's ``clinical_time``), not its evidence's. An ending that a later
``restored`` transition cancelled (a cancelled discharge) never happened, at any time.

A memory the deletion gate deleted (a ``deleted`` transition) is absent from every point in time, before its
deletion too: deletion forgets, it does not end a fact. Past states are computed as if it had never been
recorded: a memory whose successor it was is followed by its successor instead (the link the update stage
re-pointed), an archival it caused ended its memory at an unknown time (which the successor rule then decides,
as the timeline does for evidence gone from the record), and its relations go. So at a T between a deleted
value and the next one, the value before it is the current one at T. The gate keeps the value before the
current one, so the present is never affected.

This replay is the reference; the read path computes the same states from the patient's timeline
(:mod:`stam.read.timeline`) without re-reading the log, and a test checks both agree on real patients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from schemas import LIFECYCLE_REASONS, AtomicMemory, Store, TransitionEvent, TransitionKind
from stam.config import Settings
from stam.crypto import sealer_for
from stam.errors import Erased
from stam.patient_state import PatientState, is_encounter_record, lifecycle_of
from stam.rebuild import replay
from stam.transport import kafka_consumer
from topology import topics as t


def state_at_version(patient_id: str, events: Iterable[TransitionEvent], version: int) -> PatientState:
    # A deletion is forgetting, not a change of state at a time: a deleted memory is absent at every version.
    state = replay(patient_id, (e for e in events if e.state_version <= version or e.kind is TransitionKind.DELETED))
    state.version = min(state.version, version)
    return state


def evidence_time(memory: AtomicMemory, placed_in_history: bool) -> datetime | None:
    """The clinical time a memory is evidence at: its end when it arrived already ended, else its start."""
    if placed_in_history:
        return memory.effective_end or memory.effective_start
    return memory.effective_start or memory.effective_end


def _open_at(e: TransitionEvent, as_of: datetime, covered: set[str], when: datetime | None,
             encounter_ends: dict[str, datetime]) -> bool:
    """A fact that arrived already ended (added straight to HISTORY at its end time, e.g. a condition with its
    abatement) whose validity interval contains ``as_of``: it held then. Not when it ended an earlier version
    of the same source resource (``covered``: the stop of an order that was ACTIVE since its start): that
    version stands for it; and not after its encounter ended when its lifecycle ends with the encounter
    (``encounter_ends``: a pharmacy stop recorded after the discharge)."""
    m = e.memory
    if not (e.kind is TransitionKind.ADDED and e.to_store is Store.HISTORY and m is not None
            and e.memory_id not in covered and m.effective_start is not None and when is not None
            and m.effective_start <= as_of < when):
        return False
    end = encounter_ends.get(m.encounter_id or "")
    return end is None or as_of < end or not lifecycle_of(m).ends_with_encounter


def encounter_ends(events: Sequence[TransitionEvent]) -> dict[str, datetime]:
    """Each encounter's end as a record of its own says it (the earliest such end: a discharge)."""
    out: dict[str, datetime] = {}
    for e in events:
        m = e.memory
        if e.kind is TransitionKind.ADDED and m is not None and is_encounter_record(m) and m.effective_end:
            enc = m.encounter_id or ""
            out[enc] = min(m.effective_end, out.get(enc, m.effective_end))
    return out


def forget_deleted(events: Sequence[TransitionEvent]) -> list[TransitionEvent]:
    """The events as if the deleted memories had never been recorded (see the module's notes)."""
    deleted = {e.memory_id: e.successor_id for e in events if e.kind is TransitionKind.DELETED}
    if not deleted:
        return list(events)

    def follow(memory_id: str | None) -> str | None:
        seen: set[str] = set()
        while memory_id in deleted and memory_id not in seen:
            seen.add(memory_id)
            memory_id = deleted[memory_id]
        return memory_id

    out = []
    for e in events:
        if e.memory_id in deleted:
            continue
        change: dict[str, Any] = {}
        if e.successor_id in deleted:
            change["successor_id"] = follow(e.successor_id)
        if e.evidence_id in deleted:
            change |= {"evidence_id": None, "clinical_time": None}
        if any(r.source_id in deleted or r.target_id in deleted for r in e.relations):
            change["relations"] = tuple(r for r in e.relations if r.source_id not in deleted
                                        and r.target_id not in deleted)
        out.append(e.model_copy(update=change) if change else e)
    return out


def forget_cancelled(events: Sequence[TransitionEvent]) -> list[TransitionEvent]:
    """The events as if an ending that was later cancelled (a ``restored`` transition: a cancelled discharge) had
    never happened: the restore and the archival it reversed both go. What the log knows now is that the fact did
    not end then (the timeline, built from the memory records, sees the same)."""
    if not any(e.kind is TransitionKind.RESTORED for e in events):
        return list(events)
    drop: set[int] = set()
    last_archival: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.kind is TransitionKind.ARCHIVED:
            last_archival[e.memory_id] = i
        elif e.kind is TransitionKind.RESTORED:
            drop.add(i)
            j = last_archival.pop(e.memory_id, None)
            if j is not None:
                drop.add(j)
    return [e for i, e in enumerate(events) if i not in drop]


def state_at_time(patient_id: str, events: Sequence[TransitionEvent], as_of: datetime) -> PatientState:
    mine = forget_cancelled(forget_deleted([e for e in events if e.patient_id == patient_id]))
    source = {e.memory_id: e.memory.source_ref for e in mine if e.memory is not None and e.memory.source_ref}
    covered = {e.evidence_id for e in mine if e.kind is TransitionKind.ARCHIVED and e.evidence_id
               and source.get(e.memory_id) is not None and source.get(e.memory_id) == source.get(e.evidence_id)}
    # Each memory's evidence time, from its ADDED event; an archival happens at its evidence's time.
    times = {e.memory_id: evidence_time(e.memory, e.to_store is Store.HISTORY) for e in mine
             if e.kind is TransitionKind.ADDED and e.memory is not None}

    def when(e: TransitionEvent) -> datetime | None:
        if e.kind is TransitionKind.ADDED:
            return times.get(e.memory_id)
        if e.kind is TransitionKind.ARCHIVED and e.reason in LIFECYCLE_REASONS:
            return e.clinical_time  # the encounter's or the interval's own end, not its evidence's time
        return times.get(e.evidence_id, e.clinical_time) if e.evidence_id else e.clinical_time

    closed = {k: v for k, v in encounter_ends(mine).items() if v <= as_of}
    kept = []
    for e in mine:
        t = when(e)
        if t is None or t <= as_of:
            kept.append(e)
        elif _open_at(e, as_of, covered, t, closed):
            kept.append(e.model_copy(update={"to_store": Store.ACTIVE, "reason": None, "successor_id": None}))
    present = {e.memory_id for e in kept if e.kind is TransitionKind.ADDED}
    out: list[TransitionEvent] = []
    for e in kept:
        if e.kind is not TransitionKind.ADDED and e.memory_id not in present:
            # An explicit reference (a POE Change or D/C) can end an order whose own start is clinically later
            # than the order that ended it: at a T between the two, the order did not exist yet.
            continue
        ends = e.kind is TransitionKind.ARCHIVED or (e.kind is TransitionKind.ADDED and e.to_store is Store.HISTORY)
        if ends and e.successor_id and e.successor_id not in present:
            if e.kind is TransitionKind.ARCHIVED:
                continue  # what replaced it came later than T
            e = e.model_copy(update={"to_store": Store.ACTIVE, "reason": None, "successor_id": None})
        if any(r.source_id not in present or r.target_id not in present for r in e.relations):
            # a relation made on arrival to a memory that is clinically later than T: not part of that state
            e = e.model_copy(update={"relations": tuple(r for r in e.relations
                                                        if r.source_id in present and r.target_id in present)})
        out.append(e)
    return replay(patient_id, out)


async def read_patient_transitions(settings: Settings, patient_id: str, sealer: Any = None) -> list[TransitionEvent]:
    """Every transition of one patient, read from its partition of the transitions topic (keyed by the patient's
    pseudonym, sealed for it: ``stam.crypto``). An erased patient has none."""
    # deferred: aiokafka is slow to import; topology.admin only on this path
    from aiokafka import TopicPartition
    from aiokafka.partitioner import DefaultPartitioner

    from topology.admin import read_to_end

    sealer = sealer or sealer_for(settings)
    topic = t.TRANSITIONS.name(settings.topic_prefix)
    consumer = kafka_consumer(settings, enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or [])
        if not parts:
            await consumer.topics()
            parts = sorted(consumer.partitions_for_topic(topic) or [])
        key = sealer.message_key(patient_id)
        tp = TopicPartition(topic, DefaultPartitioner()(key, parts, parts))
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        events: list[TransitionEvent] = []
        async for r in read_to_end(consumer, [tp]):
            if r.key == key:
                try:
                    plain = sealer.open(r.value)  # the key is read once, then cached
                except Erased:
                    continue
                events.append(TransitionEvent.model_validate_json(plain))
        return events
    finally:
        await consumer.stop()
