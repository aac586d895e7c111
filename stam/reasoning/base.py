"""The one interface behind the method's three judgements: extract, link, update.

The coded reasoner (``stam.reasoning.coded``) answers them exactly from codes, statuses, times and
references; a language-model reasoner answers them for free text behind the same interface. Reasoners
are pure: they read the state they are given and return judgements; stages apply them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from schemas import AtomicMemory, ImpactCandidate, RecordEntry, Relation, StoredMemory, UpdateDecision
from stam.state import PatientState


@dataclass(frozen=True)
class Candidate:
    """An impact candidate with the memory it points at."""

    stored: StoredMemory
    impact: ImpactCandidate


@runtime_checkable
class Reasoner(Protocol):
    name: str

    def extract(self, entry: RecordEntry) -> list[AtomicMemory]:
        """Atomic memories of one entry, ids derived from the entry id and position."""
        ...

    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        """Typed relations from the new memories to ACTIVE memories (and among the new ones)."""
        ...

    def update(self, entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate]) -> UpdateDecision:
        """Where the new memory goes, and which ACTIVE candidates stop holding (with reason, successor)."""
        ...


class Router:
    """Picks the reasoner for an entry: coded entries to the coded reasoner, free text to a model.

    With no model configured, free-text entries are handled by the coded reasoner, which keeps the text
    verbatim as one memory (it does not decompose notes) and says so through ``decomposes_text``.
    """

    def __init__(self, coded: Reasoner, text: Reasoner | None = None) -> None:
        self.coded = coded
        self.text = text

    def for_entry(self, entry: RecordEntry) -> Reasoner:
        if entry.codes or self.text is None:
            return self.coded
        return self.text

    @property
    def decomposes_text(self) -> bool:
        return self.text is not None
