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
from stam.metrics import FREE_TEXT
from stam.patient_state import PatientState


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
    """Routes each judgement to the right reasoner: codes to the coded reasoner, free text to a model.

    - An entry with codes and no text: coded only. Free text with no codes: the model extracts.
    - A coded entry that also carries text (a report's presented form, a note-like result): the coded
      reasoner extracts the coded facts and the model extracts the text, with the coded facts given to it
      as context.
    - Link and update are routed per memory: a memory with a code goes to the coded reasoner, one the model
      extracted goes to the model (which links and updates it in one call).

    With no model configured, free text is kept verbatim as one memory by the coded reasoner (notes are
    not decomposed); ``decomposes_text`` says which is the case, and the workers log it at start.
    """

    name = "router"

    def __init__(self, coded: Reasoner, text: Reasoner | None = None) -> None:
        self.coded = coded
        self.text = text

    @property
    def decomposes_text(self) -> bool:
        return self.text is not None

    def _model_memory(self, memory: AtomicMemory) -> bool:
        return self.text is not None and memory.concept is None

    def extract(self, entry: RecordEntry) -> list[AtomicMemory]:
        result = self.extract_many([entry])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def extract_many(self, entries: Sequence[RecordEntry]) -> list[list[AtomicMemory] | BaseException]:
        """Memories of each entry, or the error of that entry; the model calls of the batch run together."""
        out: list[list[AtomicMemory] | BaseException] = []
        pending: list[tuple[int, RecordEntry, list[str], int]] = []
        for i, entry in enumerate(entries):
            has_text = bool(entry.text and entry.text.strip())
            try:
                if self.text is None or not has_text:
                    out.append(self.coded.extract(entry))
                    if has_text:
                        FREE_TEXT.labels(handling="verbatim").inc()
                    continue
                FREE_TEXT.labels(handling="decomposed").inc()
                coded = ([m for m in self.coded.extract(entry) if m.concept is not None] if entry.codes else [])
            except Exception as exc:  # this entry's fault only
                out.append(exc)
                continue
            out.append(coded)
            pending.append((i, entry, [m.text for m in coded], len(coded)))
        if pending:
            assert self.text is not None
            many = getattr(self.text, "extract_many", None)
            if many is not None:
                results = many([p[1] for p in pending], [p[2] for p in pending], [p[3] for p in pending])
            else:
                results = [self.text.extract(p[1]) for p in pending]
            for (i, _entry, _ctx, _start), res in zip(pending, results, strict=True):
                prior = out[i]  # the coded facts: only entries whose coded part succeeded are pending
                assert not isinstance(prior, BaseException)
                out[i] = res if isinstance(res, BaseException) else [*prior, *res]
        return out

    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        # The coded reasoner links by concept and by the entry's references (which hold for every memory
        # of the entry); the model links its memories in the update call.
        return self.coded.link(entry, memories, state)

    def update(self, entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate]) -> UpdateDecision:
        return self.update_many(entry, [(memory, candidates)])[0]

    def update_many(self, entry: RecordEntry,
                    items: Sequence[tuple[AtomicMemory, Sequence[Candidate]]]) -> list[UpdateDecision]:
        """Decisions for the new memories of one entry, in order; the model's calls run together."""
        decisions: list[UpdateDecision | None] = [None] * len(items)
        model_items: list[int] = []
        for i, (memory, cands) in enumerate(items):
            if self._model_memory(memory):
                model_items.append(i)
            else:
                decisions[i] = self.coded.update(entry, memory, cands)
        if model_items:
            assert self.text is not None
            many = getattr(self.text, "update_many", None)
            chosen = [items[i] for i in model_items]
            got = many(entry, chosen) if many is not None else [self.text.update(entry, m, c) for m, c in chosen]
            for i, d in zip(model_items, got, strict=True):
                decisions[i] = d
        return [d for d in decisions if d is not None]

    def semantic_floor(self, memory: AtomicMemory) -> float:
        """The least cosine at which an impact candidate found by meaning alone can change the update decision about
        ``memory``, as the reasoner it goes to declares it (``semantic_floor``); minus infinity, every such
        candidate counts, for a reasoner that does not say. The update stage keeps the impact work of an earlier
        stage when the only memories added since are below it (:mod:`stam.stages.reads`)."""
        reasoner = self.text if self._model_memory(memory) else self.coded
        floor = getattr(reasoner, "semantic_floor", None)
        return float(floor(memory)) if callable(floor) else float("-inf")

    def links_at_update(self, memory: AtomicMemory) -> bool:
        """Whether this memory's relations come with its update decision (impact then takes its graph hop
        from the memory's best semantic neighbours)."""
        return self._model_memory(memory)
