"""The lifecycle of facts: when something current stops being current without an entry that says so about it.

Each kind of fact (``schemas.vocabulary.Lifecycle``, declared per resource type and category beside the rest of the
vocabulary) has its own way of ending, and the update stage applies it after the reasoner's judgements of an entry,
in the same commit and on the same transition log:

- **events** (a dose given, a procedure done, a billing code) are history from the start: a new one is placed in
  HISTORY with reason ``event`` whatever a reasoner said;
- **encounter-scoped facts** (inpatient orders, diet, ADT, care units, the encounter's own records) end no later
  than their encounter. An encounter ends when one of its own records arrives saying it ended (a discharge: an
  end time or a finished status); that record is placed in HISTORY (reason ``encounter-ended``), and every ACTIVE
  fact of the encounter is archived with the same reason, the record as evidence and the encounter's end as the
  clinical time it stopped holding;
- **time-bounded facts** (a pharmacy order's start/stop, an ICU input's interval, a validity period) are archived
  with reason ``expired`` once the patient's clinical clock passes their end, at that end;
- **a cancelled end** (a record of an ended encounter that says it is open again: HL7 A13, a FHIR Encounter back to
  in-progress) reinstates what the encounter's end archived, each by a ``restored`` transition;
- **states** and **measurements** keep the reasoner's rules (current until an entry ends them; the latest value).

The patient's clinical clock (:attr:`stam.patient_state.PatientState.clock`) is the latest clinical time any memory of the
patient is evidence at (a current fact's start, an ended fact's end; the same notion point-in-time reads use). It
moves only forward and only with the record: no wall clock takes part, so a replay of the same entries decides the
same endings. Where the record gives no end (an order without an encounter, an interval without an end time), the
fact stays current and is rendered "no end recorded"; nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from schemas import AtomicMemory, Reason, Store
from stam.patient_state import PatientState, is_encounter_record, lifecycle_of

ENDED_STATUSES = frozenset({"finished", "discharged", "completed"})
"""Statuses with which an encounter's own record says the encounter is over (FHIR ``finished``, HL7 A03)."""


@dataclass(frozen=True)
class Ending:
    """One ACTIVE fact the lifecycle ends: why, when (clinical time) and on whose evidence (None: its own end)."""

    memory_id: str
    reason: Reason
    ended_at: datetime
    evidence_id: str | None


def reports_end(memory: AtomicMemory) -> bool:
    """An encounter's own record that says the encounter is over."""
    return is_encounter_record(memory) and (
        memory.effective_end is not None or (memory.status or "").lower() in ENDED_STATUSES)


def placement(memory: AtomicMemory) -> Reason | None:
    """Why a new memory goes straight to HISTORY whatever its reasoner said (None: the reasoner decides)."""
    if not lifecycle_of(memory).current:
        return Reason.EVENT
    if reports_end(memory):
        return Reason.ENCOUNTER_ENDED
    return None


def reopened(state: PatientState, memories: Sequence[AtomicMemory], ended_before: dict[str, bool]) -> list[
        tuple[str, str]]:
    """(memory id, evidence id) of the memories to reinstate: an encounter that had ended (``ended_before``, read
    before the entry was applied) has an ACTIVE record of its own again (its discharge was cancelled)."""
    out: list[tuple[str, str]] = []
    for m in memories:
        enc = m.encounter_id
        stored = state.get(m.memory_id)
        if (enc is None or not ended_before.get(enc) or not is_encounter_record(m) or stored is None
                or stored.store is not Store.ACTIVE or state.encounter_end(enc) is not None):
            continue
        out.extend((s.memory.memory_id, m.memory_id) for s in state.ended_with(enc))
        ended_before[enc] = False
    return out


def ended_encounters(state: PatientState, memories: Sequence[AtomicMemory]) -> dict[str, bool]:
    """For the encounters of ``memories``: whether each had ended before they are applied."""
    return {m.encounter_id: state.encounter_end(m.encounter_id) is not None
            for m in memories if m.encounter_id is not None}


def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def endings(state: PatientState) -> list[Ending]:
    """The ACTIVE facts whose encounter or interval is over on the patient's clinical clock, each with the earlier of
    its two ends. Cost: the encounters that still have ACTIVE facts and the ACTIVE facts with an end time, not the
    patient's history."""
    clock = state.clock
    found: dict[str, Ending] = {}
    for enc in state.encounters_with_scoped():
        end = state.encounter_end(enc)
        if end is None or end[0] > clock:
            continue
        record = state.memories[end[1]].memory
        when = record.effective_end or record.effective_start or _time(end[0])
        for s in state.scoped_to(enc):
            found[s.memory.memory_id] = Ending(s.memory.memory_id, Reason.ENCOUNTER_ENDED, when, end[1])
    for mid, end_ts in state.expiring():
        if end_ts > clock:
            continue
        own = state.memories[mid].memory.effective_end
        assert own is not None  # only facts with an end time are indexed as expiring
        other = found.get(mid)
        if other is None or own < other.ended_at:
            found[mid] = Ending(mid, Reason.EXPIRED, own, None)
    return sorted(found.values(), key=lambda e: (e.ended_at, e.memory_id))
