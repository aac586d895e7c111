"""Wire contracts (pydantic v2) for everything that crosses a STAM topic or is stored.

Topic payloads only; the memory model's behaviour lives in the ``stam`` package.
"""

from schemas.audit import ErasureReceipt, ErasureVerification
from schemas.entry import Quantity, RecordEntry, Reference
from schemas.memory import AtomicMemory, Relation, Span, StoredMemory
from schemas.pipeline import (
    Archive,
    Channel,
    DeadLetter,
    DeletionOrder,
    DeletionVerdict,
    ExtractedEntry,
    ImpactCandidate,
    ImpactedEntry,
    LinkedEntry,
    RefusedArchive,
    SemanticRead,
    TransitionEvent,
    TransitionKind,
    UpdateDecision,
)
from schemas.query import EvidenceItem, EvidencePacket, GateDecision, GateMode, QueryAnswer, QueryRequest
from schemas.vocabulary import (
    DIRECTED_RELATIONS,
    ENDING_ROLES,
    LIFECYCLE_BY_CATEGORY,
    LIFECYCLE_BY_RESOURCE,
    LIFECYCLE_REASONS,
    RELATION_WEIGHT,
    Lifecycle,
    Reason,
    ReferenceRole,
    RelationType,
)
from schemas.wire import (
    WIRE_VERSION,
    Category,
    CodeSystem,
    Coding,
    Store,
)

__all__ = [
    "DIRECTED_RELATIONS",
    "ENDING_ROLES",
    "LIFECYCLE_BY_CATEGORY",
    "LIFECYCLE_BY_RESOURCE",
    "LIFECYCLE_REASONS",
    "RELATION_WEIGHT",
    "WIRE_VERSION",
    "Archive",
    "AtomicMemory",
    "Category",
    "Channel",
    "CodeSystem",
    "Coding",
    "DeadLetter",
    "DeletionOrder",
    "DeletionVerdict",
    "ErasureReceipt",
    "ErasureVerification",
    "EvidenceItem",
    "EvidencePacket",
    "ExtractedEntry",
    "GateDecision",
    "GateMode",
    "ImpactCandidate",
    "ImpactedEntry",
    "Lifecycle",
    "LinkedEntry",
    "Quantity",
    "QueryAnswer",
    "QueryRequest",
    "Reason",
    "RecordEntry",
    "Reference",
    "ReferenceRole",
    "RefusedArchive",
    "Relation",
    "RelationType",
    "SemanticRead",
    "Span",
    "Store",
    "StoredMemory",
    "TransitionEvent",
    "TransitionKind",
    "UpdateDecision",
]
