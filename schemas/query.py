"""Read path contracts: a query about one patient, and the evidence packet (and answer) it gets back.

Queries travel on ``stam.queries.v1`` (key = patient id) or arrive over HTTP; answers go to
``stam.answers.v1`` keyed by patient id and correlated by ``request_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from schemas.vocabulary import Reason
from schemas.wire import AwareDatetime, Category, NonEmptyStr, SchemaVersion, Store, WireModel

ErrorKind = Literal["not_found", "invalid", "unavailable", "internal"]
"""Why a query was not answered (``QueryAnswer.error_kind``); HTTP maps them to 404, 400, 503, 500."""


class GateMode(StrEnum):
    """How HISTORY is served: decided by the store gate, never, or always."""

    AUTO = "auto"
    ACTIVE = "active"
    BOTH = "both"


class Visibility(WireModel):
    """Which evidence a query may see (the method's evidence visibility): e.g. notes withheld by policy.

    A memory is visible when its source entry, category and source resource type pass every filter given
    (an include list, when given, must contain it; an exclude list must not). Retrieval sees only visible
    memories, and stores follow the same boundary: a memory whose end came from evidence that is not visible
    (its successor, or what archived it) is served as current.
    """

    entry_ids: tuple[NonEmptyStr, ...] | None = Field(default=None, description="Only these source entries")
    exclude_entry_ids: tuple[NonEmptyStr, ...] = Field(default=(), description="Never these source entries")
    categories: tuple[Category, ...] | None = Field(default=None, description="Only these memory categories")
    exclude_categories: tuple[Category, ...] = Field(default=(), description="Never these categories")
    source_types: tuple[NonEmptyStr, ...] | None = Field(
        default=None, description="Only memories from these source resource types (e.g. Observation)")
    exclude_source_types: tuple[NonEmptyStr, ...] = Field(
        default=(), description="Never memories from these source resource types (e.g. DocumentReference)")

    def predicate(self) -> Callable[[str, str, str], bool]:
        """``allows(entry_id, category, resource_type)``, with the lists turned into sets once."""
        only_e = set(self.entry_ids) if self.entry_ids is not None else None
        not_e = set(self.exclude_entry_ids)
        only_c = {c.value for c in self.categories} if self.categories is not None else None
        not_c = {c.value for c in self.exclude_categories}
        only_s = set(self.source_types) if self.source_types is not None else None
        not_s = set(self.exclude_source_types)

        def allows(entry_id: str, category: str, resource: str) -> bool:
            return ((only_e is None or entry_id in only_e) and entry_id not in not_e
                    and (only_c is None or category in only_c) and category not in not_c
                    and (only_s is None or resource in only_s) and resource not in not_s)

        return allows


class QueryRequest(WireModel):
    """A question about one patient. Every field but ``patient_id`` and ``question`` has a default."""

    schema_version: SchemaVersion = 1
    request_id: NonEmptyStr
    patient_id: NonEmptyStr = Field(description="Required: a query reads exactly one patient's memory")
    question: str = Field(min_length=1, max_length=4000)
    k_active: int = Field(default=8, ge=1, le=200, description="Concept threads served (each with its current "
                          "memory when it has one)")
    k_history: int = Field(default=8, ge=0, le=200, description="Earlier (HISTORY) memories served per thread "
                           "beyond what the question's intent needs, when HISTORY is served")
    ranking: Literal["separate", "joint"] = Field(
        default="separate", description="separate: threads with a current memory first, then threads that "
        "only hold HISTORY (a stopped drug); joint: one ranking over all threads")
    labels: bool = Field(default=True, description="Render Current/Historical labels (else neutral bullets)")
    spans: bool = Field(default=False, description="Render the source text around each memory")
    token_budget: int | None = Field(default=None, ge=1, description="Fill the packet by rank up to this")
    gate: GateMode = GateMode.AUTO
    as_of: AwareDatetime | None = Field(default=None, description="Answer against the state at this clinical "
                                        "time, reconstructed from the transition log")
    as_of_version: int | None = Field(default=None, ge=0, description="... or at this patient state version "
                                      "(a position in the patient's stream)")
    answer: bool = Field(default=True, description="Ask the reader model for an answer when one is configured")
    visibility: Visibility | None = Field(default=None, description="Which evidence the query may see; None: all")
    facts: bool = Field(default=True, description="Put statements computed from the state in the packet (the "
                        "most recent value, the previous one, a count...) where the question names a concept")

    @model_validator(mode="after")
    def _one_past_point(self) -> QueryRequest:
        if self.as_of is not None and self.as_of_version is not None:
            raise ValueError("give as_of or as_of_version, not both")
        return self


class GateDecision(WireModel):
    mode: GateMode
    serve_history: bool
    reason: str = Field(description="Why: a history cue in the question, the similarity margin, the mode")
    s_active: float | None = Field(default=None, description="Best query-memory cosine in ACTIVE")
    s_history: float | None = Field(default=None, description="Best query-memory cosine in HISTORY")
    threshold: float = Field(description="HISTORY is served when s_history - s_active exceeds this")
    cue: str | None = Field(default=None, description="The history cue found in the question, if any")


class EvidenceItem(WireModel):
    rank: int = Field(ge=1)
    memory_id: NonEmptyStr
    store: Store
    score: float
    category: Category
    text: str
    status: str | None = None
    effective_start: AwareDatetime | None = None
    effective_end: AwareDatetime | None = None
    recorded_at: AwareDatetime | None = None
    reason: Reason | None = Field(default=None, description="Why it is in HISTORY")
    archived_at: AwareDatetime | None = None
    successor_id: str | None = None
    successor_text: str | None = Field(default=None, description="What replaced it, when known")
    source_entry_id: NonEmptyStr
    source_ref: str | None = None
    span_text: str | None = Field(default=None, description="Source text around the memory (spans=true)")
    tokens: int = Field(ge=0, description="Tokens of this item's share of the rendered text")
    thread: int = Field(default=0, ge=0, description="The concept thread (rendered block) the item belongs to, "
                        "0 = the first block")
    role: str | None = Field(default=None, description="Why it is served: current, latest, previous, first, "
                             "highest, lowest, window (a value in the asked period), order, earlier (context)")
    concept: str | None = Field(default=None, description="The concept's name (coded memories)")
    value: str | None = Field(default=None, description="The value with its unit, as rendered")
    dosage: str | None = None
    ended_at: AwareDatetime | None = Field(default=None, description="Clinical time of the evidence that ended "
                                           "it (HISTORY items)")
    encounter: str | None = Field(default=None, description="The encounter the memory belongs to ('Encounter/<id>'), "
                                  "None for none")


class ComputedFact(WireModel):
    """A short statement computed from the state (the most recent value, the previous one, a count...), with
    the memories it came from. Only made when the question names a concept of the record (or a category of
    orders) and asks something of time the state can compute; never a guess."""

    kind: str = Field(description="The question's intent it answers (current, previous, first, count...)")
    text: str
    memory_ids: tuple[NonEmptyStr, ...]


class RecordGap(WireModel):
    """An entry of the patient that was dead-lettered and not (yet) applied: the record is incomplete until it
    is replayed and applied, or dismissed (``stam deadletters``). Kept next to the patient's state."""

    entry_id: str | None = Field(default=None, description="The entry's id; None when the payload did not say")
    stage: NonEmptyStr = Field(description="The stage that dead-lettered it (extract, link, impact, update)")
    error_type: NonEmptyStr = Field(description="The error's class name, e.g. ValidationError")
    error: str = Field(default="", max_length=300, description="The error message (its start)")
    dead_letter: NonEmptyStr = Field(description="Id of the dead letter: partition:offset on the dead-letter topic")
    source: str | None = Field(default=None, description="Where the message was: topic/partition/offset")
    failed_at: AwareDatetime = Field(description="When it was first dead-lettered")
    replayed_at: AwareDatetime | None = Field(default=None, description="When it was last replayed (not yet "
                                              "applied)")


class EvidencePacket(WireModel):
    schema_version: SchemaVersion = 1
    patient_id: NonEmptyStr
    question: str
    state_version: int = Field(ge=0, description="Patient state version the packet was read from")
    as_of: AwareDatetime | None = None
    as_of_version: int | None = None
    at: AwareDatetime | None = Field(default=None, description="Clinical time of the state served: as_of, or a "
                                     "time the question names (the earlier of the two); None: now")
    intent: str = Field(default="current", description="What the question asks of time, as understood (e.g. "
                        "'previous', 'count from 2148-01-01 00:00')")
    gate: GateDecision
    facts: tuple[ComputedFact, ...] = Field(default=(), description="Statements computed from the state")
    items: tuple[EvidenceItem, ...]
    dropped: int = Field(default=0, ge=0, description="Retrieved items left out by the token budget")
    rendered: str = Field(description="The text given to a reader")
    tokens: int = Field(ge=0, description="Tokens of ``rendered``")
    tokenizer: str = Field(description="Tokenizer that counted the tokens")
    token_budget: int | None = None
    gaps: tuple[RecordGap, ...] = Field(default=(), description="Dead-lettered entries of the patient not applied: "
                                        "the record served is incomplete (one line in ``rendered`` says so)")


class QueryAnswer(WireModel):
    schema_version: SchemaVersion = 1
    request_id: NonEmptyStr
    patient_id: NonEmptyStr
    ok: bool
    packet: EvidencePacket | None = None
    answer: str | None = None
    reader: str | None = Field(default=None, description="Model that wrote the answer; None: packet only")
    note: str | None = Field(default=None, description="E.g. 'no reader configured: packet only'")
    error: str | None = Field(default=None, description="Why the query was not answered (ok=false): a message "
                              "for people, never a traceback")
    error_kind: ErrorKind | None = Field(
        default=None, description="Set when ok=false. not_found: nothing to answer from (unknown patient, no "
        "memory at that point in time); invalid: the query cannot be answered as asked (e.g. as_of where no "
        "transition log is configured); unavailable: a store or service (Redis, Milvus, the broker) could not be "
        "reached, retry later; internal: a bug in the service, logged with the request id")
    answered_at: AwareDatetime
    latency_ms: float = Field(ge=0)
