"""Shared building blocks of the wire contracts.

Every payload that crosses a topic or is stored carries ``schema_version``. Models are frozen and
reject unknown fields so a producer that drifts from the contract fails loudly at the consumer edge
(and the message goes to the dead-letter topic) instead of being half-read.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

WIRE_VERSION = 1
"""Version of every wire schema in this package. Bump on any incompatible change."""

SchemaVersion = Literal[1]


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must carry a timezone offset (naive times are ambiguous)")
    return value


AwareDatetime = Annotated[datetime, AfterValidator(_aware)]
NonEmptyStr = Annotated[str, Field(min_length=1, max_length=512)]


class WireModel(BaseModel):
    """Base of every wire contract: frozen, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)


class Coding(WireModel):
    """One code from a terminology (RxNorm, SNOMED CT, LOINC, ICD-9/10, ...)."""

    system: str = Field(min_length=1, description="Code system URI, e.g. http://loinc.org")
    code: str = Field(min_length=1)
    display: str | None = None


class CodeSystem(StrEnum):
    """Canonical URIs of the code systems the coded reasoner understands."""

    RXNORM = "http://www.nlm.nih.gov/research/umls/rxnorm"
    SNOMED = "http://snomed.info/sct"
    LOINC = "http://loinc.org"
    ICD10 = "http://hl7.org/fhir/sid/icd-10-cm"
    ICD9 = "http://hl7.org/fhir/sid/icd-9-cm"
    CVX = "http://hl7.org/fhir/sid/cvx"


class Category(StrEnum):
    """Clinical category of an atomic memory."""

    CONDITION = "condition"
    MEDICATION = "medication"
    OBSERVATION = "observation"
    PROCEDURE = "procedure"
    IMMUNIZATION = "immunization"
    ENCOUNTER = "encounter"
    ALLERGY = "allergy"
    CAREPLAN = "careplan"
    REPORT = "report"
    ORDER = "order"
    NOTE = "note"
    OTHER = "other"


class Store(StrEnum):
    """The two memory stores of the method."""

    ACTIVE = "active"
    HISTORY = "history"
