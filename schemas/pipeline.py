"""Payloads between the write-path stages, the transition event and the dead letter."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from schemas.entry import RecordEntry
from schemas.memory import AtomicMemory, Relation
from schemas.vocabulary import Reason, RelationType
from schemas.wire import AwareDatetime, NonEmptyStr, SchemaVersion, Store, WireModel


class ExtractedEntry(WireModel):
    """extract -> link: the entry and its atomic memories."""

    schema_version: SchemaVersion = 1
    entry: RecordEntry
    memories: tuple[AtomicMemory, ...]


class LinkedEntry(WireModel):
    """link -> impact: relations to ACTIVE memories, and the patient state version they were read at."""

    schema_version: SchemaVersion = 1
    entry: RecordEntry
    memories: tuple[AtomicMemory, ...]
    relations: tuple[Relation, ...]
    state_version: int = Field(ge=0)
    deferred: bool = Field(
        default=False,
        description="Linking and impact retrieval are left to the update stage, done there on the state the entry "
        "is applied to: the one-hop write path's entries, and those of a link stage before issue 38, which deferred "
        "an entry while an earlier one of its patient was in flight",
    )


class Channel(StrEnum):
    SEMANTIC = "semantic"
    GRAPH = "graph"
    CODE = "code"
    """Exact concept identity (same code system and code): found before any search by meaning."""


class ImpactCandidate(WireModel):
    """A prior memory whose validity the new evidence may affect."""

    memory_id: NonEmptyStr
    store: Store
    channels: tuple[Channel, ...]
    score: float = Field(description="Cosine similarity (semantic) or strongest relation weight (graph)")
    relation: RelationType | None = None


class SemanticRead(WireModel):
    """What impact retrieval's semantic channel read for one new memory: its top-B prior memories by cosine, best
    first. The update stage merges the memories added since into it instead of searching again."""

    memory_ids: tuple[NonEmptyStr, ...]
    scores: tuple[float, ...]

    @model_validator(mode="after")
    def _paired(self) -> SemanticRead:
        if len(self.memory_ids) != len(self.scores):
            raise ValueError("memory_ids and scores must pair up")
        return self


class ImpactedEntry(WireModel):
    """impact -> update: candidates per new memory (keyed by the new memory id)."""

    schema_version: SchemaVersion = 1
    entry: RecordEntry
    memories: tuple[AtomicMemory, ...]
    relations: tuple[Relation, ...]
    candidates: dict[str, tuple[ImpactCandidate, ...]]
    state_version: int = Field(ge=0)
    deferred: bool = Field(default=False, description="See LinkedEntry.deferred")
    semantic: dict[str, SemanticRead] | None = Field(
        default=None,
        description="Per new memory, the semantic channel's hits at state_version (None: not recorded). With the "
        "candidates and the relations, what link and impact read: the update stage redoes their work only when "
        "something they read changed since state_version",
    )


class Archive(WireModel):
    """Move one ACTIVE memory to HISTORY."""

    memory_id: NonEmptyStr
    reason: Reason
    successor_id: str | None = None


class UpdateDecision(WireModel):
    """The updater's judgement for one new memory over its impact candidates."""

    memory_id: NonEmptyStr
    placement: Store
    placement_reason: Reason | None = Field(
        default=None, description="Why a new memory goes straight to HISTORY"
    )
    successor_id: str | None = Field(default=None, description="For a new memory placed in HISTORY")
    archive: tuple[Archive, ...] = ()
    delete_proposals: tuple[str, ...] = Field(
        default=(), description="HISTORY memories proposed for deletion; recorded, never executed here"
    )
    relations: tuple[Relation, ...] = Field(
        default=(), description="Relations decided together with the update (a language-model reasoner links "
        "and updates a new memory in one call); applied before the memory's ADDED transition is emitted"
    )
    rationale: str | None = None


class RefusedArchive(WireModel):
    """An archival the reasoner proposed that the source-identity rule refused (stam/integrity.py): the fact
    stays where it was."""

    memory_id: NonEmptyStr
    reason: Reason = Field(description="The archival reason that was proposed")
    why: str = Field(description="Why it was refused (source systems involved, never patient data)")


class TransitionKind(StrEnum):
    ADDED = "added"
    """A new memory entered a store (ACTIVE, or HISTORY directly when it describes a prior state)."""
    ARCHIVED = "archived"
    """An ACTIVE memory moved to HISTORY."""
    DELETE_PROPOSED = "delete_proposed"
    """The updater proposed deleting a HISTORY memory. Recorded only; the deletion gate decides."""
    DELETED = "deleted"
    """The deletion gate deleted a HISTORY memory: every projection forgets it (``gate`` says why)."""
    RESTORED = "restored"
    """A HISTORY memory is ACTIVE again because what ended it was cancelled (a cancelled discharge: HL7 A13, a FHIR
    Encounter set back to in-progress). ``evidence_id`` is the memory that cancelled it; a point in time reads the
    ending as never having happened."""


class DeletionVerdict(WireModel):
    """Why the deletion gate deleted a memory: its score, the calibrated threshold and the calibration."""

    score: float = Field(ge=0.0, le=1.0, description="The deletion scorer's safe-to-forget score of the memory")
    tau: float = Field(ge=0.0, le=1.0, description="The calibrated threshold the score reached")
    alpha: float = Field(gt=0.0, lt=1.0, description="The risk level tau was calibrated for")
    calibration_id: NonEmptyStr = Field(description="The calibration (head digest, labels, split) tau came from")
    criterion: NonEmptyStr = Field(default="strict", description="The calibration loss: strict or never-forget-only")


class DeletionOrder(WireModel):
    """Sweep -> update (topic ``stam.deletions.v1``): HISTORY memories of one patient the gate decided to delete.

    Applied by the update stage, the single writer of patient state, in the patient's order. A memory that is
    no longer a candidate when the order is applied (it became needed, or is gone) is skipped, not deleted.
    """

    schema_version: SchemaVersion = 1
    order_id: NonEmptyStr = Field(description="Identifies the order; the deleted transitions' ids derive from it")
    patient_id: NonEmptyStr
    memory_ids: tuple[NonEmptyStr, ...] = Field(min_length=1)
    verdicts: tuple[DeletionVerdict, ...] = Field(description="One per memory id, in the same order")
    ordered_at: AwareDatetime

    @model_validator(mode="after")
    def _one_verdict_per_memory(self) -> DeletionOrder:
        if len(self.verdicts) != len(self.memory_ids):
            raise ValueError(f"{len(self.memory_ids)} memory ids but {len(self.verdicts)} verdicts")
        if len(set(self.memory_ids)) != len(self.memory_ids):
            raise ValueError("a memory id appears twice")
        return self


class TransitionEvent(WireModel):
    """One change of a patient's memory state: the public output of STAM (topic ``stam.transitions.v1``).

    ``transition_id`` is derived from the entry id, the memory and the kind, never from a clock, so a
    replayed entry yields the same ids and consumers can de-duplicate.
    """

    schema_version: SchemaVersion = 1
    transition_id: NonEmptyStr
    patient_id: NonEmptyStr
    entry_id: NonEmptyStr
    sequence: int = Field(ge=0, description="Order of this transition within its entry")
    kind: TransitionKind
    memory_id: NonEmptyStr
    from_store: Store | None
    to_store: Store | None
    reason: Reason | None = None
    successor_id: str | None = None
    evidence_id: str | None = None
    clinical_time: AwareDatetime | None = Field(
        default=None, description="Clinical time of the evidence that caused the transition"
    )
    recorded_at: AwareDatetime = Field(description="When STAM applied it (arrival clock)")
    state_version: int = Field(ge=1, description="Patient state version this transition produced")
    memory: AtomicMemory | None = Field(default=None, description="Full memory for kind=added")
    relations: tuple[Relation, ...] = Field(
        default=(), description="For kind=added: the relations this entry added from this memory, so the "
        "relation graph can be rebuilt from the log")
    refused: tuple[RefusedArchive, ...] = Field(
        default=(), description="For kind=added: archivals this memory's evidence proposed and the source-identity "
        "rule refused (an entry from another source system, or unsigned, cannot retract or amend a fact)")
    gate: DeletionVerdict | None = Field(
        default=None, description="For kind=deleted: the deletion gate's score, threshold and calibration. "
        "``entry_id`` is then the deletion order's id, and memories whose successor was the deleted memory now "
        "have its successor (``successor_id``)")


class DeadLetter(WireModel):
    """A message that could not be processed, with its original bytes (base64) and why.

    An original over ``schemas.limits.DEAD_LETTER_VALUE_BYTES`` (256 KiB) is not copied whole: ``value`` holds
    its first ``DEAD_LETTER_EXCERPT_BYTES`` (64 KiB), ``truncated`` is true, ``value_bytes`` and
    ``value_sha256`` describe the whole, and the pointer to the whole is ``topic``/``partition``/``offset`` (a
    topic message) or ``source_file`` with ``source_line`` or ``source_byte_offset`` (publisher input).
    """

    schema_version: SchemaVersion = 1
    stage: NonEmptyStr
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    key: str | None = Field(default=None, description="Original key, base64 (its first 1 KiB if longer)")
    value: str = Field(description="Original value bytes, base64; an excerpt when truncated")
    error_type: NonEmptyStr
    error: str
    failed_at: AwareDatetime
    truncated: bool = Field(default=False, description="value is an excerpt of the original bytes")
    value_bytes: int | None = Field(default=None, ge=0, description="Size of the original value in bytes")
    value_sha256: str | None = Field(default=None, description="sha256 (hex) of the original value bytes")
    source_file: str | None = Field(default=None, description="Publisher input: the file the bytes came from")
    source_line: int | None = Field(default=None, ge=1, description="Publisher input: line number (NDJSON, 1-based)")
    source_byte_offset: int | None = Field(default=None, ge=0,
                                           description="Publisher input: byte offset of the bytes in the file")
