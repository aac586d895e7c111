"""Record entries: what users publish on the entries topic."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from schemas.limits import MAX_ENTRY_BYTES, MAX_TEXT_CHARS, EntryId, PatientId
from schemas.vocabulary import Lifecycle
from schemas.wire import AwareDatetime, Coding, NonEmptyStr, SchemaVersion, WireModel


class Reference(WireModel):
    """A typed pointer from an entry to another source resource (e.g. a reasonReference).

    ``role`` names the source field (``reason``, ``addresses``, ``encounter-reason``, ``based-on``,
    ``part-of``, ``has-member``); the coded linker maps roles to relation types.
    """

    role: NonEmptyStr
    target: NonEmptyStr = Field(description="Source reference, e.g. 'Condition/1234'")


class Quantity(WireModel):
    value: float | None = None
    unit: str | None = None
    text: str | None = Field(default=None, description="Non-numeric value (coded or string result)")


class RecordEntry(WireModel):
    """One record entry of one patient.

    Two clocks are kept apart: ``effective_at``/``effective_end`` say when the fact was clinically true;
    ``recorded_at`` says when the source recorded it. Update order follows arrival on the topic; validity
    follows clinical time.

    Limits (``schemas.limits``): at most 256 KiB serialized, ``text`` at most 100,000 characters, ids
    printable ASCII (``patient_id`` up to 128 characters, ``entry_id`` and ``source_ref`` up to 256).
    """

    schema_version: SchemaVersion = 1
    patient_id: PatientId
    entry_id: EntryId = Field(description="Deterministic id: same source content, same id. Printable ASCII, "
                              "1-256 characters, no leading/trailing space")
    source: NonEmptyStr = Field(description="Source system/format, e.g. 'fhir-r4'")
    source_ref: EntryId | None = Field(
        default=None, description="Identity of the source resource, e.g. 'MedicationRequest/abc'. Printable "
        "ASCII, 1-256 characters"
    )
    resource_type: NonEmptyStr | None = None
    effective_at: AwareDatetime | None = None
    effective_end: AwareDatetime | None = None
    recorded_at: AwareDatetime | None = None
    status: str | None = Field(default=None, description="Source status (active, stopped, resolved...)")
    codes: tuple[Coding, ...] = ()
    text: str | None = Field(default=None, max_length=MAX_TEXT_CHARS,
                             description=f"Free text, at most {MAX_TEXT_CHARS:,} characters")
    value: Quantity | None = None
    components: tuple[tuple[Coding, Quantity], ...] = ()
    dosage: str | None = None
    references: tuple[Reference, ...] = ()
    encounter: EntryId | None = Field(
        default=None, description="The encounter the entry belongs to, as its source reference ('Encounter/<id>': "
        "MIMIC hadm_id, FHIR encounter/context, HL7 v2 PV1-19). Printable ASCII, 1-256 characters")
    lifecycle: Lifecycle | None = Field(
        default=None, description="How the entry's facts stop being current, where the source knows better than "
        "the default of its resource type (schemas.vocabulary.LIFECYCLE_BY_RESOURCE): MIMIC's inpatient orders end "
        "with their admission, a pharmacy order is current inside its start/stop interval")
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_content(self) -> RecordEntry:
        if not self.codes and not (self.text and self.text.strip()):
            raise ValueError("an entry needs codes or text")
        if self.effective_at and self.effective_end and self.effective_end < self.effective_at:
            raise ValueError("effective_end is before effective_at")
        size = len(self.__pydantic_serializer__.to_json(self))
        if size > MAX_ENTRY_BYTES:
            raise ValueError(f"entry is {size:,} bytes serialized; the limit is {MAX_ENTRY_BYTES:,}")
        return self
