"""The link stage: typed relations from an entry's new memories to the patient's ACTIVE memories, computed at
the state version it read (the update stage checks what they read: :mod:`stam.stages.reads`)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas import AtomicMemory, ExtractedEntry, LinkedEntry, RecordEntry, Relation
from stam.patient_state import PatientState
from stam.stages.deps import Deps


def link_relations(entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState,
                   deps: Deps) -> list[Relation]:
    """The relations the router links ``memories`` by to ``state`` (the update stage looks them up again when
    something they read changed)."""
    return deps.router.link(entry, memories, state)


def link_batch(items: Sequence[ExtractedEntry], deps: Deps) -> list[LinkedEntry]:
    """:func:`link_stage` for each item, reading every patient's state version in one round trip."""
    with deps.states.pinned_versions({x.entry.patient_id for x in items}):
        return [link_stage(x, deps) for x in items]


def link_stage(x: ExtractedEntry, deps: Deps) -> LinkedEntry:
    """Typed relations from the new memories to the patient's ACTIVE memories."""
    state = deps.states.load(x.entry.patient_id)
    relations = link_relations(x.entry, x.memories, state, deps)
    return LinkedEntry(entry=x.entry, memories=x.memories, relations=tuple(relations),
                       state_version=state.version)
