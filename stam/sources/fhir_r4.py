"""FHIR R4 bundles -> record entries.

The bundle is validated with ``fhir.resources.R4B`` (the 8.x default is R5, which rejects R4 data), then
each clinical resource becomes one :class:`RecordEntry`. References inside the bundle (``urn:uuid:...``)
are resolved to ``ResourceType/id`` so entries stay meaningful once they travel alone on a topic. A
resource recorded during an encounter carries that encounter's reason codes (role ``encounter-reason``).

Entry ids hash the resource's canonical JSON: the same resource content gives the same id (replays are
no-ops), a new version of the resource gives a new id (a state change).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import Coding, Lifecycle, Quantity, RecordEntry, Reference, ReferenceRole
from stam.errors import SourceError
from stam.ids import digest
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult, folder_has

SOURCE = "fhir-r4"

# What fhir.resources (and our mapping of a validated resource) can raise on a malformed input besides
# pydantic's ValidationError; the sources turn all of them into SourceError.
LIBRARY_FAULTS: tuple[type[Exception], ...] = (TypeError, KeyError, ValueError, AttributeError, IndexError)

def parse_time(value: str | None) -> datetime | None:
    """FHIR dateTime/date/instant -> aware datetime (dates and zoneless times are taken as UTC)."""
    if not value:
        return None
    try:
        if len(value) <= 10:
            parts = [int(p) for p in value.split("-")] + [1, 1]
            return datetime.combine(date(parts[0], parts[1], parts[2]), datetime.min.time(), UTC)
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise SourceError(f"bad FHIR date/time {value!r}") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _codings(concept: dict[str, Any] | None) -> list[Coding]:
    if not concept:
        return []
    out = [Coding(system=c["system"], code=c["code"], display=c.get("display") or concept.get("text"))
           for c in concept.get("coding", []) if c.get("system") and c.get("code")]
    return out


def first_codings(concepts: list[dict[str, Any]] | None) -> list[Coding]:
    """The codings of the first CodeableConcept in ``concepts`` that has any."""
    for concept in concepts or []:
        found = _codings(concept)
        if found:
            return found
    return []


def status_code(concept: dict[str, Any] | None) -> str | None:
    """The first code of a status CodeableConcept (clinicalStatus, verificationStatus); None without one."""
    for c in (concept or {}).get("coding", []):
        if c.get("code"):
            return str(c["code"])
    return None


def _attachments_text(attachments: list[dict[str, Any]]) -> str | None:
    """The text of text/* attachments (base64 ``data``), joined; other content types are not read."""
    parts = []
    for a in attachments:
        if not str(a.get("contentType", "text/plain")).startswith("text/") or not a.get("data"):
            continue
        try:
            parts.append(base64.b64decode(a["data"], validate=True).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise SourceError(f"attachment is not base64 UTF-8 text: {exc}") from exc
    text = "\n\n".join(p.strip() for p in parts if p.strip())
    return text or None


def _quantity(r: dict[str, Any]) -> Quantity | None:
    if "valueQuantity" in r:
        q = r["valueQuantity"]
        return Quantity(value=q.get("value"), unit=q.get("unit") or q.get("code"))
    if "valueCodeableConcept" in r:
        cc = r["valueCodeableConcept"]
        text = cc.get("text") or next((c.get("display") for c in cc.get("coding", []) if c.get("display")), None)
        return Quantity(text=text)
    for key in ("valueString", "valueBoolean", "valueInteger", "valueDateTime"):
        if key in r:
            if key == "valueInteger":
                return Quantity(value=float(r[key]))
            return Quantity(text=str(r[key]))
    return None


def _dosage(r: dict[str, Any]) -> str | None:
    parts = []
    for d in r.get("dosageInstruction", []):
        if d.get("text"):
            parts.append(d["text"])
            continue
        bits = []
        for dr in d.get("doseAndRate", []):
            dq = dr.get("doseQuantity")
            if dq and dq.get("value") is not None:
                bits.append(f"{dq['value']:g} {dq.get('unit', '')}".strip())
        rep = d.get("timing", {}).get("repeat", {})
        if rep.get("frequency") and rep.get("period"):
            bits.append(f"{rep['frequency']}x per {rep['period']:g}{rep.get('periodUnit', '')}")
        if d.get("asNeededBoolean"):
            bits.append("as needed")
        if bits:
            parts.append(" ".join(bits))
    return "; ".join(parts) or None


@dataclass
class BundleResult(SourceResult):
    """Entries of one bundle (a bundle that cannot be read raises instead: nothing in ``bad``)."""

    patient_id: str | None = None


def validate_bundle(raw: dict[str, Any]) -> None:
    # deferred: fhir.resources' models are slow to import (kept off `stam --help`)
    from fhir.resources.R4B.bundle import Bundle

    try:
        Bundle.model_validate(raw)
    except ValidationError as exc:
        raise SourceError(f"FHIR R4 bundle failed validation: {exc.error_count()} errors; first: "
                          f"{exc.errors()[0]['loc']} {exc.errors()[0]['msg']}") from exc
    except LIBRARY_FAULTS as exc:  # fhir.resources raises these on some malformed shapes
        raise SourceError(f"FHIR R4 bundle failed validation: {type(exc).__name__}: {exc}") from exc


def _canonical_ref(ref: str | None, urls: dict[str, str]) -> str | None:
    if not ref:
        return None
    return urls.get(ref, ref)


def entries_from_bundle(raw: dict[str, Any], *, validate: bool = True) -> BundleResult:
    """Record entries of a FHIR R4 bundle, in clinical-time order (stable for equal times)."""
    if raw.get("resourceType") != "Bundle":
        raise SourceError("not a FHIR Bundle (resourceType is not 'Bundle')")
    if validate:
        validate_bundle(raw)
    resources = [e.get("resource") or {} for e in raw.get("entry", [])]
    urls: dict[str, str] = {}
    for e, r in zip(raw.get("entry", []), resources, strict=True):
        if r.get("resourceType") and r.get("id"):
            canonical = f"{r['resourceType']}/{r['id']}"
            urls[canonical] = canonical
            if e.get("fullUrl"):
                urls[e["fullUrl"]] = canonical
    patients = [r["id"] for r in resources if r.get("resourceType") == "Patient" and r.get("id")]
    encounter_reasons: dict[str, list[Coding]] = {}
    for r in resources:
        if r.get("resourceType") == "Encounter" and r.get("id"):
            encounter_reasons[f"Encounter/{r['id']}"] = first_codings(r.get("reasonCode"))
    result = BundleResult(patient_id=patients[0] if len(patients) == 1 else None)
    for r in resources:
        rtype = r.get("resourceType", "?")
        if rtype not in CLINICAL_TYPES:
            result.skipped[rtype] = result.skipped.get(rtype, 0) + 1
            continue
        subject = _canonical_ref((r.get("subject") or r.get("patient") or {}).get("reference"), urls)
        pid = subject.split("/", 1)[1] if subject and subject.startswith("Patient/") else result.patient_id
        if not pid:
            raise SourceError(f"{rtype}/{r.get('id')} names no patient")
        try:
            entry = resource_to_entry(r, pid, urls, encounter_reasons)
        except LIBRARY_FAULTS as exc:
            raise SourceError(f"{rtype}/{r.get('id')} cannot be mapped: {type(exc).__name__}: {exc}") from exc
        if entry is None:
            result.skipped[rtype] = result.skipped.get(rtype, 0) + 1
        else:
            result.entries.append(entry)
    sort_clinically(result.entries)
    return result


_EPOCH = datetime(1, 1, 1, tzinfo=UTC)


def sort_clinically(entries: list[RecordEntry]) -> None:
    """Order entries by clinical time (recorded time when there is none), stable for equal times."""
    entries.sort(key=lambda e: e.effective_at or e.recorded_at or _EPOCH)


@dataclass
class _Mapped:
    """What a resource handler reads off one resource; :func:`resource_to_entry` makes the entry of it."""

    urls: dict[str, str]
    codes: list[Coding] = field(default_factory=list)
    start: datetime | None = None
    end: datetime | None = None
    recorded: datetime | None = None
    status: str | None = None
    value: Quantity | None = None
    components: list[tuple[Coding, Quantity]] = field(default_factory=list)
    dosage: str | None = None
    text: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    refs: list[Reference] = field(default_factory=list)
    lifecycle: Lifecycle | None = None

    def add_refs(self, role: ReferenceRole, items: list[dict[str, Any]] | None) -> None:
        for item in items or []:
            target = _canonical_ref(item.get("reference"), self.urls)
            if target:
                self.refs.append(Reference(role=role, target=target))


def _condition(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    m.start, m.end = parse_time(r.get("onsetDateTime")), parse_time(r.get("abatementDateTime"))
    m.recorded = parse_time(r.get("recordedDate"))
    m.status = status_code(r.get("clinicalStatus"))
    if status_code(r.get("verificationStatus")) in ("entered-in-error", "refuted"):
        m.status = status_code(r.get("verificationStatus"))


def _medication(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("medicationCodeableConcept"))
    m.start = parse_time(r.get("authoredOn") or r.get("effectiveDateTime")
                         or (r.get("effectivePeriod") or {}).get("start"))
    validity = ((r.get("dispenseRequest") or {}).get("validityPeriod") or {}).get("end")
    m.end = parse_time((r.get("effectivePeriod") or {}).get("end") or validity)
    categories = {c.code for c in first_codings(r.get("category"))}
    if m.end is not None and r["resourceType"] != "MedicationAdministration":
        m.lifecycle = Lifecycle.INTERVAL  # current inside its effective or validity period
    elif "inpatient" in categories:
        m.lifecycle = Lifecycle.ENCOUNTER  # an inpatient order ends with its stay
    m.recorded = parse_time(r.get("authoredOn") or r.get("dateAsserted"))
    m.dosage = _dosage(r)
    m.add_refs(ReferenceRole.REASON, r.get("reasonReference"))
    m.add_refs(ReferenceRole.REPLACES, [r["priorPrescription"]] if r.get("priorPrescription") else [])


def _observation(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    m.start = parse_time(r.get("effectiveDateTime") or (r.get("effectivePeriod") or {}).get("start"))
    m.recorded = parse_time(r.get("issued"))
    m.value = _quantity(r)
    for comp in r.get("component", []):
        cc = _codings(comp.get("code"))
        q = _quantity(comp)
        if cc and q:
            m.components.append((cc[0], q))
    m.add_refs(ReferenceRole.HAS_MEMBER, r.get("hasMember"))


def _procedure(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    period = r.get("performedPeriod") or {}
    m.start = parse_time(r.get("performedDateTime") or period.get("start"))
    m.end = parse_time(period.get("end"))
    m.add_refs(ReferenceRole.REASON, r.get("reasonReference"))


def _immunization(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("vaccineCode"))
    m.start = parse_time(r.get("occurrenceDateTime"))
    m.recorded = parse_time(r.get("recorded"))


def _encounter(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = first_codings(r.get("type"))
    period = r.get("period") or {}
    m.start, m.end = parse_time(period.get("start")), parse_time(period.get("end"))
    klass = r.get("class") or {}
    if klass.get("code"):
        m.attributes["class"] = klass["code"]
    m.refs.extend(Reference(role=ReferenceRole.REASON, target=f"concept:{c.system}|{c.code}")
                  for c in first_codings(r.get("reasonCode")))
    m.add_refs(ReferenceRole.REASON, r.get("reasonReference"))


def _allergy(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    m.start = parse_time(r.get("onsetDateTime") or r.get("recordedDate"))
    m.recorded = parse_time(r.get("recordedDate"))
    m.status = status_code(r.get("clinicalStatus"))
    if status_code(r.get("verificationStatus")) in ("entered-in-error", "refuted"):
        m.status = status_code(r.get("verificationStatus"))


def _care_plan(r: dict[str, Any], m: _Mapped) -> None:
    # Synthea puts the generic "assess-plan" category first; the specific plan code follows it.
    categories = r.get("category") or []
    m.codes = first_codings(categories[1:] if len(categories) > 1 else categories)
    period = r.get("period") or {}
    m.start, m.end = parse_time(period.get("start")), parse_time(period.get("end"))
    m.add_refs(ReferenceRole.ADDRESSES, r.get("addresses"))


def _diagnostic_report(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    m.start = parse_time(r.get("effectiveDateTime") or (r.get("effectivePeriod") or {}).get("start"))
    m.recorded = parse_time(r.get("issued"))
    m.add_refs(ReferenceRole.HAS_MEMBER, r.get("result"))
    m.text = _attachments_text(r.get("presentedForm") or [])


def _service_request(r: dict[str, Any], m: _Mapped) -> None:
    m.codes = _codings(r.get("code"))
    m.start = parse_time(r.get("occurrenceDateTime") or (r.get("occurrencePeriod") or {}).get("start")
                         or r.get("authoredOn"))
    m.recorded = parse_time(r.get("authoredOn"))
    m.add_refs(ReferenceRole.REASON, r.get("reasonReference"))
    m.add_refs(ReferenceRole.REPLACES, r.get("replaces"))


def _document_reference(r: dict[str, Any], m: _Mapped) -> None:
    # A clinical note: its text is the entry (for the extractor); the document type is metadata, not a
    # clinical concept of the patient, so it is not sent as a code.
    m.text = _attachments_text([c.get("attachment") or {} for c in r.get("content", [])])
    context = r.get("context") or {}
    m.start = parse_time((context.get("period") or {}).get("start") or r.get("date"))
    m.recorded = parse_time(r.get("date"))
    doc_type = _codings(r.get("type"))
    if doc_type:
        m.attributes["document_type"] = doc_type[0].display or doc_type[0].code


HANDLERS: dict[str, Callable[[dict[str, Any], _Mapped], None]] = {
    "Condition": _condition,
    "MedicationRequest": _medication, "MedicationStatement": _medication, "MedicationAdministration": _medication,
    "Observation": _observation,
    "Procedure": _procedure,
    "Immunization": _immunization,
    "Encounter": _encounter,
    "AllergyIntolerance": _allergy,
    "CarePlan": _care_plan,
    "DiagnosticReport": _diagnostic_report,
    "ServiceRequest": _service_request,
    "DocumentReference": _document_reference,
}
"""Resource type -> the handler that reads its codes, times, status, value and references. A resource type
with no handler is no clinical entry (counted as skipped); to map a new one, add its handler here."""

CLINICAL_TYPES = frozenset(HANDLERS)


def resource_to_entry(r: dict[str, Any], patient_id: str, urls: dict[str, str] | None = None,
                      encounter_reasons: dict[str, list[Coding]] | None = None) -> RecordEntry | None:
    """One FHIR R4 resource -> one record entry (None when it carries no clinical concept)."""
    rtype = r["resourceType"]
    m = _Mapped(urls or {}, status=r.get("status"))
    handler = HANDLERS.get(rtype)
    if handler is not None:
        handler(r, m)
    if not m.codes and not m.text:
        return None
    context = r.get("context")
    encounter_ref = (r.get("encounter") or (context if isinstance(context, dict) and "reference" in context
                                            else {})).get("reference")
    if encounter_ref is None and isinstance(context, dict) and context.get("encounter"):
        encounter_ref = context["encounter"][0].get("reference")
    encounter = _canonical_ref(encounter_ref, m.urls)
    source_ref = f"{rtype}/{r['id']}" if r.get("id") else None
    if encounter and encounter_reasons:
        m.refs.extend(Reference(role=ReferenceRole.ENCOUNTER_REASON, target=f"concept:{c.system}|{c.code}")
                      for c in encounter_reasons.get(encounter, []))
    recorded = m.recorded or parse_time((r.get("meta") or {}).get("lastUpdated")) or m.start
    if rtype == "Encounter" and source_ref:
        encounter = source_ref  # an encounter's own record belongs to itself
    content = json.dumps(r, sort_keys=True, separators=(",", ":"))
    return RecordEntry(
        patient_id=patient_id, entry_id=f"{SOURCE}:{source_ref or rtype}:{digest(content, size=8)}",
        source=SOURCE, source_ref=source_ref, resource_type=rtype, effective_at=m.start,
        effective_end=m.end, recorded_at=recorded, status=m.status, codes=tuple(m.codes), value=m.value,
        components=tuple(m.components), dosage=m.dosage, references=tuple(m.refs), text=m.text,
        encounter=encounter if encounter and len(encounter) <= 256 else None, lifecycle=m.lifecycle,
        attributes=m.attributes,
    )


_BUNDLE_FAULTS: tuple[type[Exception], ...] = (RecursionError, *LIBRARY_FAULTS)


def load_bundle(path: str | Path, *, validate: bool = True) -> BundleResult:
    """Entries of one bundle file. Any malformed content (not UTF-8, not JSON, nested past the parser's
    depth, an array or scalar where the Bundle object belongs, a resource that cannot be mapped or whose
    entry breaks a limit) raises :class:`SourceError`, never another exception."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SourceError(f"cannot read FHIR bundle {path}: {exc}") from exc
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SourceError(f"not a JSON FHIR bundle: {type(exc).__name__}: {str(exc)[:300]}") from exc
    if not isinstance(raw, dict):
        raise SourceError(f"not a FHIR Bundle (a JSON {type(raw).__name__}, not an object)")
    try:
        return entries_from_bundle(raw, validate=validate)
    except _BUNDLE_FAULTS as exc:
        raise SourceError(f"malformed FHIR bundle: {type(exc).__name__}: {str(exc)[:300]}") from exc


def iter_bundle_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(x for x in p.glob("*.json"))
        else:
            yield p


def load_bundles(paths: Iterable[str | Path]) -> Iterator[SourceResult]:
    """One result per bundle file; a file that is no readable bundle is one bad input with its bytes and the
    reason, and the next file goes on."""
    for path in iter_bundle_files(paths):
        try:
            result: SourceResult = load_bundle(path)
        except SourceError as exc:
            raw = Path(path).read_bytes() if Path(path).is_file() else b""
            result = SourceResult(bad=[BadInput(Path(path).name, raw, type(exc).__name__, str(exc), file=str(path),
                                                byte_offset=0)])
        yield result


def _detects(path: Path, head: bytes) -> bool:
    return folder_has(path, "*.json") if path.is_dir() else path.suffix == ".json"


def _load(paths: list[Path], options: LoadOptions) -> Iterator[SourceResult]:
    return load_bundles(paths)


FORMAT = SourceFormat(name="fhir-bundle", detects=_detects, load=_load, label="a FHIR JSON bundle",
                      suffixes=(".json",), signatures=(b"{", b"["), source=SOURCE)
"""FHIR R4 bundles: ``.json`` files, or folders of them; also what no other format claims (``base.FALLBACK``)."""
