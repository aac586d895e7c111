"""Which memories the deletion gate may even score.

Two sources, as in the paper: every archived (HISTORY) memory (the sweep), and the updater's DELETE proposals
(``delete_proposed`` transitions). Never an ACTIVE memory. Beyond the paper, some HISTORY memories are kept
whatever their score, because the record and the read path rely on them (decided here, documented in the
README's deletion section):

- ``before-current``: its successor is ACTIVE. It is the value before the latest (the previous dose, the last
  result before this one), the history question readers ask most, and the memory that explains the current one.
- ``thread-start``: it starts a successor chain that continues (nothing points to it as successor, it has a
  successor). Deleting it would move the apparent start of the thread (when a medication was first ordered,
  the first value of a series) to a later memory.
- ``related``: a relation joins it to an ACTIVE memory (the graph hop of impact retrieval follows it, and the
  relation is part of why the ACTIVE memory is understood).
- ``coded-never-forget``: its codes say it is never forgotten (:func:`stam.deletion.labels.code_label`: a
  diagnosis, an allergy, a procedure, an immunization, a coded laboratory result). The codes are a rule, not
  only a training label: the head generalises from the types it was trained on and can score an unlabelled lab
  type of a new patient as safe. A rule that only holds memories back can only lower the gate's loss, so the
  calibrated guarantee still holds for what the gate deletes.

A memory whose successor link another memory needs is not kept for that alone: when a memory in the middle of a
chain is deleted, its predecessor's successor link is re-pointed to its successor (``relink``), so the chain
stays whole and ``as_of`` reads stay coherent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from schemas import Store, StoredMemory
from stam.deletion.labels import Endurance, code_label
from stam.patient_state import PatientState


class Keep(StrEnum):
    ACTIVE = "active"
    BEFORE_CURRENT = "before-current"
    THREAD_START = "thread-start"
    RELATED = "related"
    CODED = "coded-never-forget"


class Source(StrEnum):
    SWEEP = "sweep"
    PROPOSAL = "proposal"


@dataclass(frozen=True)
class Candidate:
    stored: StoredMemory
    sources: frozenset[Source]


@dataclass(frozen=True)
class Selection:
    candidates: list[Candidate]
    kept: dict[str, Keep]
    """Memory id -> why a HISTORY memory (or a proposed ACTIVE one) may not be deleted."""


def select(state: PatientState, proposals: Iterable[str] = (), *, sweep: bool = True) -> Selection:
    """The candidates of one patient's state: the HISTORY sweep (when ``sweep``) and the proposed memory ids,
    less the memories kept by the rules above."""
    proposed = set(proposals)
    predecessors = {s.successor_id for s in state.memories.values() if s.successor_id}
    related_to_active: set[str] = set()
    for r in state.relations():
        a, b = state.get(r.source_id), state.get(r.target_id)
        if a is not None and b is not None:
            if a.store is Store.ACTIVE:
                related_to_active.add(b.memory.memory_id)
            if b.store is Store.ACTIVE:
                related_to_active.add(a.memory.memory_id)
    kept: dict[str, Keep] = {}
    out: list[Candidate] = []
    for mid, s in state.memories.items():
        sources = frozenset({Source.SWEEP} if sweep and s.store is Store.HISTORY else set()) | (
            {Source.PROPOSAL} if mid in proposed else set())
        if not sources:
            continue
        why = _keep(s, state, predecessors, related_to_active)
        if why is not None:
            kept[mid] = why
        else:
            out.append(Candidate(s, frozenset(sources)))
    return Selection(out, kept)


def _keep(s: StoredMemory, state: PatientState, predecessors: set[str], related: set[str]) -> Keep | None:
    if s.store is Store.ACTIVE:
        return Keep.ACTIVE
    successor = state.get(s.successor_id) if s.successor_id else None
    if successor is not None and successor.store is Store.ACTIVE:
        return Keep.BEFORE_CURRENT
    if successor is not None and s.memory.memory_id not in predecessors:
        return Keep.THREAD_START
    if s.memory.memory_id in related:
        return Keep.RELATED
    if code_label(s.memory) is Endurance.NEVER_FORGET:
        return Keep.CODED
    return None


def keep_now(state: PatientState, memory_id: str) -> Keep | None:
    """Why one memory must be kept in ``state`` as it is now (``None``: it may be deleted). The update stage asks
    this again when it applies a deletion order: the state may have moved since the sweep scored it, and
    deleting one memory of a chain can make its predecessor the start of the thread."""
    s = state.get(memory_id)
    if s is None:
        return None
    predecessors = {x.successor_id for x in state.memories.values() if x.successor_id == memory_id}
    related = {memory_id} if any(
        (other := state.get(n)) is not None and other.store is Store.ACTIVE
        for n, _, _ in state.neighbours(memory_id)) else set()
    return _keep(s, state, predecessors, related)


def relink(state: PatientState, memory_id: str) -> list[tuple[str, str | None]]:
    """The successor links to re-point when ``memory_id`` is deleted: ``(predecessor id, new successor id)`` for
    each memory whose successor it was (its own successor, or ``None`` where it had none)."""
    gone = state.get(memory_id)
    new = gone.successor_id if gone is not None else None
    return [(mid, new) for mid, s in state.memories.items() if s.successor_id == memory_id]
