"""Rebuild the stores from the transition log.

The transitions topic is the record of state; Redis (state, relation graph) and Milvus (vectors) are
projections of it. :func:`replay` folds a patient's transition events, in log order, into a
:class:`PatientState`; :func:`rebuild` writes that state and its vectors to empty stores. Events are
de-duplicated by ``transition_id``, so a log with redelivered events rebuilds the same state. A ``deleted``
transition (the deletion gate) removes its memory, its relations and its vector, and re-points the successor
links that named it, as the update stage did. A ``restored`` transition (a cancelled discharge) puts a HISTORY memory
back in ACTIVE.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas import LIFECYCLE_REASONS, Store, TransitionEvent, TransitionKind
from stam.backends.base import Commit, VectorRow
from stam.embedding import memory_vectors
from stam.patient_state import PatientState
from stam.stages import Deps


def replay(patient_id: str, events: Iterable[TransitionEvent]) -> PatientState:
    """The state a patient's transitions describe (events of other patients are ignored)."""
    state = PatientState(patient_id)
    seen: set[str] = set()
    for ev in events:
        if ev.patient_id != patient_id or ev.transition_id in seen:
            continue
        seen.add(ev.transition_id)
        if ev.kind is TransitionKind.ADDED:
            if ev.memory is None:
                raise ValueError(f"transition {ev.transition_id} adds a memory but does not carry it")
            # Relations are recorded on the memory they start from, when they were made (both ends ACTIVE
            # then); they are restored as made, before the memory's own placement.
            state.add(ev.memory, Store.ACTIVE)
            for r in ev.relations:
                state.restore_relation(r)
            if ev.to_store is Store.HISTORY and ev.reason is not None:
                state.archive(ev.memory_id, reason=ev.reason, successor_id=ev.successor_id, evidence_id=None,
                              entry_id=ev.entry_id, at=ev.recorded_at)
        elif ev.kind is TransitionKind.ARCHIVED and ev.reason is not None:
            state.archive(ev.memory_id, reason=ev.reason, successor_id=ev.successor_id,
                          evidence_id=ev.evidence_id, entry_id=ev.entry_id, at=ev.recorded_at,
                          ended_at=ev.clinical_time if ev.reason in LIFECYCLE_REASONS else None)
        elif ev.kind is TransitionKind.RESTORED and ev.memory_id in state.memories:
            state.reinstate(ev.memory_id)
        elif ev.kind is TransitionKind.DELETED and ev.memory_id in state.memories:
            # Forgotten for good: a point-in-time replay (stam.read.asof) may meet it while it was still ACTIVE.
            state.delete(ev.memory_id, any_store=True)
        state.version = max(state.version, ev.state_version)
    return state


def rebuild(patient_id: str, events: Iterable[TransitionEvent], deps: Deps) -> PatientState:
    """Replay a patient's log into the stores (which must not hold this patient yet)."""
    state = replay(patient_id, events)
    stored = list(state.memories.values())
    vectors = memory_vectors([s.memory for s in stored], deps.embedder)
    deps.vectors.place(patient_id, [VectorRow(s.memory.memory_id, v, s.store) for s, v in
                                    zip(stored, vectors, strict=True)])
    deps.states.commit_many([Commit(patient_id=patient_id, expected_version=0, state=state, changed=stored,
                                    outboxes={})])
    return state
