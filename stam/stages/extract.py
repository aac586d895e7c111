"""The extract stage: the atomic memories of an entry, checked to be its own and scoped to its encounter."""

from __future__ import annotations

from collections.abc import Sequence

from schemas import AtomicMemory, ExtractedEntry, RecordEntry
from stam.errors import ReasoningError
from stam.integrity import stamp
from stam.stages.deps import Deps


def extract_stage(entry: RecordEntry, deps: Deps) -> ExtractedEntry:
    """Atomic memories of one entry (coded entries exactly; free text by the model when configured)."""
    return _checked(entry, deps.router.extract(entry))


def extract_signed_batch(items: Sequence[tuple[RecordEntry, str | None]], deps: Deps) -> list[ExtractedEntry]:
    """:func:`extract_batch` over entries whose source identity the worker verified (``None``: unsigned); every
    memory carries its entry's verified source system (``AtomicMemory.source_system``)."""
    out = extract_batch([entry for entry, _ in items], deps)
    return [x.model_copy(update={"memories": stamp(x.memories, source)})
            for x, (_, source) in zip(out, items, strict=True)]


def _checked(entry: RecordEntry, memories: Sequence[AtomicMemory]) -> ExtractedEntry:
    for m in memories:
        if m.patient_id != entry.patient_id or m.entry_id != entry.entry_id:
            raise ReasoningError("extracted memory does not belong to its entry")
    return ExtractedEntry(entry=entry, memories=tuple(_scoped(entry, m) for m in memories))


def _scoped(entry: RecordEntry, memory: AtomicMemory) -> AtomicMemory:
    """The memory with its entry's encounter (a fact the language model read in a note belongs to the note's
    encounter; the coded reasoner sets it, and the lifecycle of the entry's own facts, itself)."""
    if memory.encounter_id is None and entry.encounter is not None:
        return memory.model_copy(update={"encounter_id": entry.encounter})
    return memory



def extract_batch(entries: Sequence[RecordEntry], deps: Deps) -> list[ExtractedEntry]:
    """:func:`extract_stage` for each entry; the model calls of the batch are in flight together. An
    entry that fails raises, and the worker re-runs the batch one entry at a time (model replies are
    cached, so the others do not pay twice)."""
    out = []
    for entry, result in zip(entries, deps.router.extract_many(entries), strict=True):
        if isinstance(result, BaseException):
            raise result
        out.append(_checked(entry, result))
    return out
