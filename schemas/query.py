"""Read path contracts: a query about one patient, and the evidence packet (and answer) it gets back.

Queries travel on ``stam.queries.v1`` (key = patient id) or arrive over HTTP; answers go to
``stam.answers.v1`` keyed by patient id and correlated by ``request_id``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from schemas.common import AwareDatetime, Category, NonEmptyStr, Reason, SchemaVersion, Store, WireModel

ErrorKind = Literal["not_found", "invalid", "unavailable", "internal"]
"""Why a query was not answered (``QueryAnswer.error_kind``); HTTP maps them to 404, 400, 503, 500."""


class GateMode(StrEnum):
    """How HISTORY is served: decided by the store gate, never, or always."""

    AUTO = "auto"
    ACTIVE = "active"
    BOTH = "both"


class QueryRequest(WireModel):
    """A question about one patient. Every field but ``patient_id`` and ``question`` has a default."""

    schema_version: SchemaVersion = 1
    request_id: NonEmptyStr
    patient_id: NonEmptyStr = Field(description="Required: a query reads exactly one patient's memory")
    question: str = Field(min_length=1, max_length=4000)
    k_active: int = Field(default=8, ge=1, le=200, description="Retrieval budget in ACTIVE")
    k_history: int = Field(default=8, ge=0, le=200, description="Retrieval budget in HISTORY")
    ranking: Literal["separate", "joint"] = Field(
        default="separate", description="separate: each store ranked within its budget, ACTIVE first; "
        "joint: one ranking over both stores with budget k_active + k_history")
    labels: bool = Field(default=True, description="Render Current/Historical labels (else neutral bullets)")
    spans: bool = Field(default=False, description="Render the source text around each memory")
    token_budget: int | None = Field(default=None, ge=1, description="Fill the packet by rank up to this")
    gate: GateMode = GateMode.AUTO
    as_of: AwareDatetime | None = Field(default=None, description="Answer against the state at this clinical "
                                        "time, reconstructed from the transition log")
    as_of_version: int | None = Field(default=None, ge=0, description="... or at this patient state version "
                                      "(a position in the patient's stream)")
    answer: bool = Field(default=True, description="Ask the reader model for an answer when one is configured")

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
    tokens: int = Field(ge=0, description="Tokens of this item's rendered line")


class EvidencePacket(WireModel):
    schema_version: SchemaVersion = 1
    patient_id: NonEmptyStr
    question: str
    state_version: int = Field(ge=0, description="Patient state version the packet was read from")
    as_of: AwareDatetime | None = None
    as_of_version: int | None = None
    gate: GateDecision
    items: tuple[EvidenceItem, ...]
    dropped: int = Field(default=0, ge=0, description="Retrieved items left out by the token budget")
    rendered: str = Field(description="The text given to a reader")
    tokens: int = Field(ge=0, description="Tokens of ``rendered``")
    tokenizer: str = Field(description="Tokenizer that counted the tokens")
    token_budget: int | None = None


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
