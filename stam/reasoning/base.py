"""The one interface behind the method's three judgements: extract, link, update.

The coded reasoner (``stam.reasoning.coded``) answers them exactly from codes, statuses, times and
references; a language-model reasoner answers them for free text behind the same interface. Reasoners
are pure: they read the state they are given and return judgements; stages apply them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from schemas import (
    AtomicMemory,
    Channel,
    ImpactCandidate,
    RecordEntry,
    Relation,
    RelationType,
    Store,
    StoredMemory,
    UpdateDecision,
)
from stam.state import PatientState


class Impact(NamedTuple):
    """An impact candidate inside a worker (the wire form is ``schemas.ImpactCandidate``)."""

    memory_id: str
    store: Store
    channels: tuple[Channel, ...]
    score: float
    relation: RelationType | None

    @classmethod
    def from_wire(cls, c: ImpactCandidate) -> Impact:
        return cls(c.memory_id, c.store, c.channels, c.score, c.relation)

    def to_wire(self) -> ImpactCandidate:
        # model_construct: built here from typed state; validating again would only cost time.
        return ImpactCandidate.model_construct(memory_id=self.memory_id, store=self.store,
                                               channels=self.channels, score=self.score,
                                               relation=self.relation)


@dataclass(frozen=True)
class Candidate:
    """An impact candidate with the memory it points at."""

    stored: StoredMemory
    impact: Impact


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
