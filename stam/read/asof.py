"""Point in time: a patient's ACTIVE and HISTORY as they were, reconstructed from the transition log.

Two ways to name the past:

- ``as_of_version=V``: the state right after the patient's V-th applied entry (a position in the
  patient's stream): the transitions with ``state_version <= V``, replayed in log order.
- ``as_of=T`` (clinical time): the state the record describes at clinical time T, knowing what the log
  knows now: the transitions whose evidence is clinically no later than T (``clinical_time <= T``;
  transitions without a clinical time are kept), replayed in log order. An archival whose successor is
  clinically later than T did not hold at T and is dropped: a value superseded at T+1 is still ACTIVE at T,
  and a late-arriving older fact (added straight to HISTORY as ``prior-state``) is ACTIVE at its own time
  when the fact that followed it is after T. A fact that arrived already ended (a condition published with
  its abatement, added straight to HISTORY at that time) is ACTIVE at the T inside its validity interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from schemas import Store, TransitionEvent, TransitionKind
from stam.config import Settings
from stam.rebuild import replay
from stam.state import PatientState


def state_at_version(patient_id: str, events: Iterable[TransitionEvent], version: int) -> PatientState:
    state = replay(patient_id, (e for e in events if e.state_version <= version))
    state.version = min(state.version, version)
    return state


def _open_at(e: TransitionEvent, as_of: datetime, covered: set[str]) -> bool:
    """A fact that arrived already ended (added straight to HISTORY at its end time, e.g. a condition with its
    abatement) whose validity interval contains ``as_of``: it held then. Not when it ended an earlier version
    of the same source resource (``covered``: the stop of an order that was ACTIVE since its start): that
    version stands for it."""
    m = e.memory
    return (e.kind is TransitionKind.ADDED and e.to_store is Store.HISTORY and m is not None
            and e.memory_id not in covered and m.effective_start is not None and e.clinical_time is not None
            and m.effective_start <= as_of < e.clinical_time)


def state_at_time(patient_id: str, events: Sequence[TransitionEvent], as_of: datetime) -> PatientState:
    mine = [e for e in events if e.patient_id == patient_id]
    source = {e.memory_id: e.memory.source_ref for e in mine if e.memory is not None and e.memory.source_ref}
    covered = {e.evidence_id for e in mine if e.kind is TransitionKind.ARCHIVED and e.evidence_id
               and source.get(e.memory_id) is not None and source.get(e.memory_id) == source.get(e.evidence_id)}
    kept = [e if e.clinical_time is None or e.clinical_time <= as_of else
            e.model_copy(update={"to_store": Store.ACTIVE, "reason": None, "successor_id": None})
            for e in mine if e.clinical_time is None or e.clinical_time <= as_of or _open_at(e, as_of, covered)]
    present = {e.memory_id for e in kept if e.kind is TransitionKind.ADDED}
    out: list[TransitionEvent] = []
    for e in kept:
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


async def read_patient_transitions(settings: Settings, patient_id: str) -> list[TransitionEvent]:
    """Every transition of one patient, read from its partition of the transitions topic."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.partitioner import DefaultPartitioner

    from topology import topics as t
    from topology.admin import bootstrap

    topic = t.TRANSITIONS.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap(settings), enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or [])
        if not parts:
            await consumer.topics()
            parts = sorted(consumer.partitions_for_topic(topic) or [])
        key = patient_id.encode()
        tp = TopicPartition(topic, DefaultPartitioner()(key, parts, parts))
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        events: list[TransitionEvent] = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                events.extend(TransitionEvent.model_validate_json(r.value) for r in records if r.key == key)
        return events
    finally:
        await consumer.stop()
