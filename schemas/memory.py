"""Atomic memories and typed relations."""

from __future__ import annotations

from pydantic import Field

from schemas.vocabulary import DIRECTED_RELATIONS, Lifecycle, Reason, RelationType
from schemas.wire import (
    AwareDatetime,
    Category,
    Coding,
    NonEmptyStr,
    SchemaVersion,
    Store,
    WireModel,
)


class Span(WireModel):
    """Character offsets of the memory in its entry's text (free-text entries)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)


class AtomicMemory(WireModel):
    """One person-specific clinical assertion extracted from one entry.

    ``memory_id`` derives from the entry id and the memory's position in it, so replaying an entry
    yields the same ids. ``concept_key`` is the identity the coded reasoner compares on
    (``system|code``); free-text memories without a code have none.
    """

    schema_version: SchemaVersion = 1
    memory_id: NonEmptyStr
    patient_id: NonEmptyStr
    entry_id: NonEmptyStr
    position: int = Field(ge=0)
    category: Category
    text: str = Field(min_length=1, description="Canonical statement, what gets embedded and served")
    concept: Coding | None = None
    status: str | None = None
    value: float | None = None
    value_text: str | None = None
    unit: str | None = None
    dosage: str | None = None
    effective_start: AwareDatetime | None = None
    effective_end: AwareDatetime | None = None
    recorded_at: AwareDatetime | None = None
    source_ref: str | None = None
    source_system: str | None = Field(
        default=None, description="Verified source system of the entry (its signature checked by the extract "
        "stage, see stam/integrity.py); None: unsigned. Never taken from the entry's free-text `source`")
    span: Span | None = None
    encounter_id: str | None = Field(
        default=None, description="The encounter the memory belongs to (its entry's ``encounter``)")
    lifecycle: Lifecycle | None = Field(
        default=None, description="How the fact stops being current (None: the default of its category, "
        "schemas.vocabulary.LIFECYCLE_BY_CATEGORY)")
    embed_text: str | None = Field(
        default=None,
        description="Text used for the embedding when it differs from `text` (values excluded, so a "
        "repeated concept reuses one vector)",
    )

    @property
    def concept_key(self) -> str | None:
        return f"{self.concept.system}|{self.concept.code}" if self.concept else None


class Relation(WireModel):
    """A typed edge between two memories. Directed types read source -> target
    (``treatment_for``: drug -> condition; ``monitoring_for``: lab -> condition; ``causal``: cause -> effect).
    """

    source_id: NonEmptyStr
    target_id: NonEmptyStr
    type: RelationType
    weight: float = Field(default=1.0, ge=0.0, le=1.0)

    @property
    def directed(self) -> bool:
        return self.type in DIRECTED_RELATIONS


class StoredMemory(WireModel):
    """A memory as it sits in a store: the memory plus where it is and why."""

    memory: AtomicMemory
    store: Store
    reason: Reason | None = None
    successor_id: str | None = None
    evidence_id: str | None = Field(default=None, description="Memory whose arrival moved this one")
    archived_by_entry: str | None = None
    archived_at: AwareDatetime | None = Field(default=None, description="Recorded (arrival) time")
    ended_at: AwareDatetime | None = Field(
        default=None, description="Clinical time the fact stopped holding, where it is its own and not its evidence's "
        "(reasons encounter-ended and expired: the encounter's end, the interval's end)")
