"""A memory and the transition that moved it, as the FHIR resources a subscriber expects (R4B or R5).

Identity. A memory that came from a FHIR resource (an entry of the ``fhir-r4`` source) keeps that resource's
identity: its ``source_ref`` ``MedicationRequest/abc`` is ``MedicationRequest/abc`` here. A memory from HL7 v2 or
MIMIC-IV gets a stable derived id (a uuid5 of its memory id), so no medical record number or MIMIC subject id ever
appears in a URL; its patient is ``Patient/<uuid5 of the patient id>`` for the same reason. Only a FHIR source's
own Patient id (already a FHIR identity) is used as it is.

The state. The ended version carries what ended it: a MedicationRequest ``stopped`` (``completed``,
``cancelled``...) with its ``statusReason`` from the transition's reason, a Condition ``resolved`` with its
``abatementDateTime``, an Encounter ``finished`` (R5: ``completed``) with the end of its period. Every ended
resource is tagged with the reason (``meta.tag``, :data:`REASON_SYSTEM`). The new version (the successor) points
back at it where FHIR has a place for that (``MedicationRequest.priorPrescription``, ``ServiceRequest.replaces``).

Provenance. One per transition: its target the resources the transition concerns, ``occurred`` the clinical time,
``recorded`` when STAM applied it, and the evidence entry as its ``source`` entity.

Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from schemas import Category, Reason, StoredMemory, TransitionEvent

Version = Literal["R4B", "R5"]

STAM_FHIR = "https://stam.dev/fhir"
"""Base of the canonical URLs STAM defines (topics, code systems, identifier systems)."""
REASON_SYSTEM = f"{STAM_FHIR}/CodeSystem/transition-reason"
CATEGORY_SYSTEM = f"{STAM_FHIR}/CodeSystem/memory-category"
ENTRY_SYSTEM = f"{STAM_FHIR}/sid/entry"
"""Identifier system of an evidence entry (the value is a uuid5 of STAM's entry id, never the id itself)."""
NAMESPACE = uuid.UUID("5d1f1c2e-7b8a-4c1e-9f3a-2f7e0a9c6b41")
"""The uuid5 namespace of every id STAM derives for FHIR."""
FHIR_SOURCES = ("fhir-r4:",)
"""Entry id prefixes of the sources whose resources keep their identity."""
FHIR_ID = re.compile(r"^[A-Za-z0-9\-.]{1,64}$")

CONDITION_CLINICAL = "http://terminology.hl7.org/CodeSystem/condition-clinical"
ALLERGY_CLINICAL = "http://terminology.hl7.org/CodeSystem/allergyintolerance-clinical"
CONDITION_VERIFICATION = "http://terminology.hl7.org/CodeSystem/condition-ver-status"
DATA_OPERATION = "http://terminology.hl7.org/CodeSystem/v3-DataOperation"
NULL_FLAVOR = "http://terminology.hl7.org/CodeSystem/v3-NullFlavor"

BY_CATEGORY = {
    Category.MEDICATION: "MedicationRequest", Category.CONDITION: "Condition", Category.ENCOUNTER: "Encounter",
    Category.OBSERVATION: "Observation", Category.REPORT: "DiagnosticReport", Category.ALLERGY: "AllergyIntolerance",
    Category.CAREPLAN: "CarePlan", Category.ORDER: "ServiceRequest", Category.PROCEDURE: "Procedure",
}
"""The resource type of a memory whose source resource type is not one STAM renders."""


def derived_id(*parts: str) -> str:
    return str(uuid.uuid5(NAMESPACE, "|".join(parts)))


def from_fhir(memory_entry_id: str) -> bool:
    return memory_entry_id.startswith(FHIR_SOURCES)


def patient_id_for(patient_id: str, fhir: bool) -> str:
    """The FHIR id of a patient: its own where it came from a FHIR source, else a uuid5 of STAM's patient id."""
    return patient_id if fhir and FHIR_ID.match(patient_id) else derived_id("Patient", patient_id)


@dataclass(frozen=True)
class Ref:
    type: str
    id: str

    @property
    def relative(self) -> str:
        return f"{self.type}/{self.id}"


def identity(memory: Any) -> Ref:
    """The resource type and id a memory is rendered as (see the module's docstring)."""
    rtype, _, rid = (memory.source_ref or "").partition("/")
    if rtype not in RENDERERS:
        rtype = BY_CATEGORY.get(memory.category, "Basic")
        rid = ""
    if from_fhir(memory.entry_id) and rid and FHIR_ID.match(rid):
        return Ref(rtype, rid)
    return Ref(rtype, derived_id("memory", memory.memory_id))


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _code(memory: Any) -> dict[str, Any]:
    cc: dict[str, Any] = {"text": memory.text}
    if memory.concept is not None:
        coding = {"system": memory.concept.system, "code": memory.concept.code}
        if memory.concept.display:
            coding["display"] = memory.concept.display
        cc["coding"] = [coding]
    return cc


def reason_concept(reason: Reason) -> dict[str, Any]:
    return {"coding": [{"system": REASON_SYSTEM, "code": reason.value, "display": reason.description}],
            "text": reason.description}


@dataclass(frozen=True)
class Rendering:
    """What a renderer needs beyond the memory: the reason it ended (None: current), when, what replaced it."""

    version: Version
    patient: str
    ended: Reason | None = None
    ended_at: datetime | None = None
    prior: Ref | None = None
    """The version this one replaces (the successor's pointer back)."""


def _med_status(ended: Reason | None, status: str | None) -> str:
    if ended is None:
        return status if status in ("active", "on-hold", "draft") else "active"
    return {Reason.COMPLETED: "completed", Reason.CANCELLED: "cancelled",
            Reason.ENTERED_IN_ERROR: "entered-in-error"}.get(ended, "stopped")


def _request_status(ended: Reason | None) -> str:
    if ended is None:
        return "active"
    return {Reason.COMPLETED: "completed", Reason.ENTERED_IN_ERROR: "entered-in-error"}.get(ended, "revoked")


def _medication_request(m: Any, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {"status": _med_status(r.ended, m.status), "intent": "order",
                           "subject": {"reference": r.patient}}
    if r.version == "R5":
        out["medication"] = {"concept": _code(m)}
    else:
        out["medicationCodeableConcept"] = _code(m)
    if r.ended is not None:
        out["statusReason"] = reason_concept(r.ended)
    if m.effective_start or m.recorded_at:
        out["authoredOn"] = _time(m.effective_start or m.recorded_at)
    if m.dosage:
        out["dosageInstruction"] = [{"text": m.dosage}]
    if r.prior is not None:
        out["priorPrescription"] = {"reference": r.prior.relative}
    return out


def _condition(m: Any, r: Rendering) -> dict[str, Any]:
    if r.ended is Reason.RESOLVED:
        clinical = "resolved"
    elif r.ended is not None:
        clinical = "inactive"
    else:
        clinical = m.status if m.status in ("active", "recurrence", "relapse", "remission") else "active"
    out: dict[str, Any] = {"clinicalStatus": {"coding": [{"system": CONDITION_CLINICAL, "code": clinical}]},
                           "code": _code(m), "subject": {"reference": r.patient}}
    if r.ended is Reason.ENTERED_IN_ERROR:
        out["verificationStatus"] = {"coding": [{"system": CONDITION_VERIFICATION, "code": "entered-in-error"}]}
        del out["clinicalStatus"]  # con-5: no clinical status for a condition entered in error
    if m.effective_start:
        out["onsetDateTime"] = _time(m.effective_start)
    abated = (m.effective_end or r.ended_at) if r.ended is not None else m.effective_end
    if abated is not None and "clinicalStatus" in out:
        out["abatementDateTime"] = _time(abated)
        if clinical == "active":  # con-4: an abated condition is not active
            out["clinicalStatus"]["coding"][0]["code"] = "resolved"
    if m.recorded_at:
        out["recordedDate"] = _time(m.recorded_at)
    return out


def _encounter(m: Any, r: Rendering) -> dict[str, Any]:
    end = m.effective_end or (r.ended_at if r.ended is not None else None)
    finished = r.ended is not None or m.status in ("finished", "completed")
    out: dict[str, Any] = {"subject": {"reference": r.patient}, "type": [_code(m)]}
    period = {k: v for k, v in (("start", _time(m.effective_start)), ("end", _time(end) if finished else None)) if v}
    if r.version == "R5":
        out["status"] = "completed" if finished else "in-progress"
        if period:
            out["actualPeriod"] = period
    else:
        out["status"] = "finished" if finished else "in-progress"
        out["class"] = {"system": NULL_FLAVOR, "code": "UNK", "display": "unknown"}  # 1..1 in R4B; STAM keeps none
        if period:
            out["period"] = period
    return out


def _observation(m: Any, r: Rendering) -> dict[str, Any]:
    out = _report(m, r)  # the same status, code, subject and times; an observation adds its value
    if m.value is not None:
        q: dict[str, Any] = {"value": m.value}
        if m.unit:
            q["unit"] = m.unit
        out["valueQuantity"] = q
    elif m.value_text:
        out["valueString"] = m.value_text
    return out


def _report(m: Any, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "entered-in-error" if r.ended is Reason.ENTERED_IN_ERROR else "final",
                           "code": _code(m), "subject": {"reference": r.patient}}
    if m.effective_start:
        out["effectiveDateTime"] = _time(m.effective_start)
    if m.recorded_at:
        out["issued"] = _time(m.recorded_at)
    return out


def _allergy(m: Any, r: Rendering) -> dict[str, Any]:
    clinical = "resolved" if r.ended is Reason.RESOLVED else "inactive" if r.ended is not None else "active"
    out: dict[str, Any] = {"clinicalStatus": {"coding": [{"system": ALLERGY_CLINICAL, "code": clinical}]},
                           "code": _code(m), "patient": {"reference": r.patient}}
    if m.effective_start:
        out["onsetDateTime"] = _time(m.effective_start)
    return out


def _careplan(m: Any, r: Rendering) -> dict[str, Any]:
    out = {"status": _request_status(r.ended), "intent": "plan", "subject": {"reference": r.patient},
           "description": m.text}
    if r.version == "R4B":
        out["category"] = [_code(m)]
    return out


def _service_request(m: Any, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {"status": _request_status(r.ended), "intent": "order", "subject": {"reference": r.patient},
                           "code": {"concept": _code(m)} if r.version == "R5" else _code(m)}
    if m.effective_start:
        out["authoredOn"] = _time(m.effective_start)
    if r.prior is not None:
        out["replaces"] = [{"reference": r.prior.relative}]
    return out


def _procedure(m: Any, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "entered-in-error" if r.ended is Reason.ENTERED_IN_ERROR else "completed",
                           "code": _code(m), "subject": {"reference": r.patient}}
    if m.effective_start:
        out["occurrenceDateTime" if r.version == "R5" else "performedDateTime"] = _time(m.effective_start)
    return out


def _basic(m: Any, r: Rendering) -> dict[str, Any]:
    code = {"coding": [{"system": CATEGORY_SYSTEM, "code": m.category.value}], "text": m.text}
    out: dict[str, Any] = {"code": code, "subject": {"reference": r.patient}}
    when = m.effective_start or m.recorded_at
    if when is not None:
        out["created"] = when.date().isoformat() if r.version == "R4B" else _time(when)
    return out


RENDERERS = {
    "MedicationRequest": _medication_request, "Condition": _condition, "Encounter": _encounter,
    "Observation": _observation, "DiagnosticReport": _report, "AllergyIntolerance": _allergy, "CarePlan": _careplan,
    "ServiceRequest": _service_request, "Procedure": _procedure, "Basic": _basic,
}


def render(stored: StoredMemory, version: Version, *, ended: Reason | None, ended_at: datetime | None = None,
           prior: Ref | None = None) -> dict[str, Any]:
    """The memory as a FHIR resource of ``version``; ``ended``: the reason it left ACTIVE (None: it is current)."""
    m = stored.memory
    ref = identity(m)
    patient = f"Patient/{patient_id_for(m.patient_id, from_fhir(m.entry_id))}"
    body = RENDERERS[ref.type](m, Rendering(version, patient, ended, ended_at, prior))
    out: dict[str, Any] = {"resourceType": ref.type, "id": ref.id}
    if ended is not None:
        out["meta"] = {"tag": [{"system": REASON_SYSTEM, "code": ended.value}]}
    out.update(body)
    return out


def provenance(transition: TransitionEvent, version: Version, targets: list[Ref], evidence: Ref | None) -> dict[str, Any]:
    """The Provenance of one transition: its targets, the clinical time (``occurred``), the recorded time and the
    evidence entry as the ``source`` entity."""
    what: dict[str, Any] = {"identifier": {"system": ENTRY_SYSTEM, "value": derived_id("entry", transition.entry_id)}}
    if evidence is not None:
        what["reference"] = evidence.relative
    activity: dict[str, Any] = {"coding": [{"system": DATA_OPERATION, "code": "UPDATE", "display": "revise"}]}
    if transition.reason is not None:
        activity["text"] = f"{transition.kind.value}: {transition.reason.value}"
    out: dict[str, Any] = {
        "resourceType": "Provenance", "id": derived_id("provenance", transition.transition_id),
        "target": [{"reference": t.relative} for t in targets],
        "recorded": _time(transition.recorded_at),
        "activity": activity,
        "agent": [{"who": {"display": "STAM"}}],
        "entity": [{"role": "source", "what": what}],
    }
    if transition.clinical_time is not None:
        out["occurredDateTime"] = _time(transition.clinical_time)
    return out


@dataclass(frozen=True)
class EventResources:
    """The resources of one notification event: the focus (the fact that ended, in its ended state), the
    additional context (its successor, the Provenance), in that order."""

    focus: dict[str, Any]
    context: list[dict[str, Any]]

    @property
    def all(self) -> list[dict[str, Any]]:
        return [self.focus, *self.context]


def event_resources(transition: TransitionEvent, memories: dict[str, StoredMemory], version: Version) -> EventResources:
    """The resources a transition concerns (``memories``: the stored memories it names, by id)."""
    ended = memories[transition.memory_id]
    ended_at = transition.clinical_time or ended.ended_at
    focus_ref = identity(ended.memory)
    focus = render(ended, version, ended=transition.reason, ended_at=ended_at)
    context: list[dict[str, Any]] = []
    targets = [focus_ref]
    evidence: Ref | None = None
    successor = memories.get(transition.successor_id or "")
    if successor is not None:
        ref = identity(successor.memory)
        evidence = ref
        if ref != focus_ref:  # a new version of another resource (a renewed order, a newer lab value)
            context.append(render(successor, version, ended=None, prior=focus_ref))
            targets.append(ref)
    source = memories.get(transition.evidence_id or "")
    if source is not None:
        evidence = identity(source.memory)
    if evidence is None and transition.memory is not None:  # added straight to HISTORY: its own entry says so
        evidence = focus_ref
    context.append(provenance(transition, version, targets, evidence))
    return EventResources(focus, context)
