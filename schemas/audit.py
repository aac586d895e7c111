"""Audit records (topic ``stam.audit.v1``, kept forever). They carry no patient data."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.wire import AwareDatetime, NonEmptyStr, SchemaVersion, WireModel


class ErasureVerification(WireModel):
    """The independent scan run after an erasure (``stam.erase.scan``): residuals per place, 0 everywhere
    verified."""

    verified: bool = Field(description="True iff every place was scanned and holds no residual")
    residuals: dict[str, int] = Field(description="Places (redis, milvus_query, milvus_files, topics, files) "
                                      "-> items still holding the patient id or a sample text")
    not_covered: tuple[str, ...] = Field(default=(), description="Places that could not be scanned, and why")
    samples: int = Field(ge=0, description="Sample texts of the patient searched for besides the id (the texts "
                         "themselves are not recorded)")


class ErasureReceipt(WireModel):
    """Proof that a patient was erased, without the patient: no id, no pseudonym, no text.

    The ``request_id`` is the caller's reference (e.g. the ticket of the erasure request); the mapping from it to
    the patient is kept where the request was made, not here."""

    schema_version: SchemaVersion = 1
    kind: Literal["erasure"] = "erasure"
    receipt_id: NonEmptyStr
    request_id: NonEmptyStr
    requested_at: AwareDatetime
    completed_at: AwareDatetime
    removed: dict[str, int] = Field(description="Counts removed per store: redis_keys, memories, source_texts, "
                                    "outboxes, milvus_vectors, file_lines, files_redacted, data_key_shredded")
    steps: dict[str, str] = Field(description="What each step did (e.g. how the Milvus bytes were purged, which "
                                  "Redis persistence files were rewritten), or why it was not covered")
    verification: ErasureVerification
    software_version: NonEmptyStr
