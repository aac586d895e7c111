"""FHIR R4 bulk-export NDJSON (one file per resource type, one resource per line) -> record entries.

Every line is validated on its own with ``fhir.resources.R4B``; a line that is not JSON or not a valid
resource becomes a :class:`BadInput` with its original bytes and the reason (the publisher dead-letters
it), and the rest of the file goes on. Encounters are read first so resources recorded during an
encounter carry its reason codes, as in bundles.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import Coding
from stam.errors import SourceError
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult, folder_has
from stam.sources.fhir_r4 import (
    CLINICAL_TYPES,
    LIBRARY_FAULTS,
    first_codings,
    resource_to_entry,
    sort_clinically,
)


@dataclass
class NdjsonResult(SourceResult):
    """Entries of NDJSON files; ``skipped`` by resource type, ``bad`` one per line that is not a resource."""


ENTRY_FAULTS: tuple[type[Exception], ...] = (SourceError, ValidationError, RecursionError, *LIBRARY_FAULTS)


def ndjson_files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        # In a folder, log.ndjson is the bulk-data export's status log, not clinical data.
        out.extend(sorted(f for f in p.glob("*.ndjson") if f.name != "log.ndjson") if p.is_dir() else [p])
    # Encounters first: other resources look up their encounter's reason.
    return sorted(out, key=lambda f: (not f.name.startswith("Encounter"), f.name))


def _validate(line: bytes) -> dict[str, Any]:
    # deferred: fhir.resources' models are slow to import (kept off `stam --help`)
    from fhir.resources.R4B import get_fhir_model_class

    try:
        resource = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser's depth
        raise SourceError(f"not JSON: {type(exc).__name__}: {str(exc)[:300]}") from exc
    if not isinstance(resource, dict) or not isinstance(resource.get("resourceType"), str):
        raise SourceError("not a FHIR resource (no resourceType)")
    try:
        model = get_fhir_model_class(resource["resourceType"])
    except KeyError as exc:
        raise SourceError(f"unknown FHIR R4 resource type {resource['resourceType']!r}") from exc
    try:
        model.model_validate(resource)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SourceError(f"FHIR R4 {resource['resourceType']} failed validation: {exc.error_count()} errors; "
                          f"first: {first['loc']} {first['msg']}") from exc
    except LIBRARY_FAULTS as exc:
        raise SourceError(f"FHIR R4 {resource['resourceType']} failed validation: {type(exc).__name__}: {exc}") from exc
    return resource


def load_ndjson(paths: Iterable[str | Path]) -> NdjsonResult:
    """Entries of bulk-export NDJSON files or folders, in clinical-time order (stable)."""
    result = NdjsonResult()
    encounter_reasons: dict[str, list[Coding]] = {}
    for path in ndjson_files(paths):
        with path.open("rb") as fh:
            offset = 0
            for lineno, line in enumerate(fh, start=1):
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                where = f"{path.name}:{lineno}"
                try:
                    resource = _validate(line)
                    rtype = resource["resourceType"]
                    if rtype == "Encounter" and resource.get("id"):
                        encounter_reasons[f"Encounter/{resource['id']}"] = first_codings(resource.get("reasonCode"))
                    if rtype not in CLINICAL_TYPES:
                        result.skipped[rtype] = result.skipped.get(rtype, 0) + 1
                        continue
                    subject = (resource.get("subject") or resource.get("patient") or {}).get("reference", "")
                    if not subject.startswith("Patient/"):
                        raise SourceError(f"{rtype}/{resource.get('id')} names no patient (subject {subject!r})")
                    entry = resource_to_entry(resource, subject.removeprefix("Patient/"), {}, encounter_reasons)
                except ENTRY_FAULTS as exc:
                    result.bad.append(BadInput(where, line.rstrip(b"\n"), type(exc).__name__, str(exc)[:2000],
                                               file=str(path), line=lineno, byte_offset=at))
                    continue
                if entry is None:
                    result.skipped[rtype] = result.skipped.get(rtype, 0) + 1
                else:
                    result.entries.append(entry)
    sort_clinically(result.entries)
    return result


def _detects(path: Path, head: bytes) -> bool:
    return folder_has(path, "*.ndjson") if path.is_dir() else path.suffix == ".ndjson"


def _load(paths: list[Path], options: LoadOptions) -> Iterator[SourceResult]:
    yield load_ndjson(paths)


FORMAT = SourceFormat(name="fhir-ndjson", detects=_detects, load=_load, label="FHIR NDJSON", suffixes=(".ndjson",),
                      signatures=(b"{",))
"""FHIR bulk-export NDJSON: ``.ndjson`` files, or folders holding them."""


def started_at(resource: dict[str, Any]) -> str:
    """The ISO time a resource starts at as written (order authored, onset, period start...), or ''."""
    return str(resource.get("authoredOn") or resource.get("onsetDateTime") or resource.get("recordedDate")
               or resource.get("occurrenceDateTime") or (resource.get("period") or {}).get("start")
               or (resource.get("performedPeriod") or {}).get("start") or "")


def patient_lines(folder: Path, patient_id: str, resource_types: Iterable[str], before: str) -> dict[str, list[str]]:
    """Per resource type, the NDJSON lines of one patient's resources that start before ``before`` (an ISO
    prefix compared as text, as the files write it); for demos, tests and benchmarks that stream a history."""
    out: dict[str, list[str]] = {}
    for rtype in resource_types:
        path = folder / f"{rtype}.000.ndjson"
        if not path.is_file():
            continue
        out[rtype] = [line for line in path.read_text().splitlines()
                      if patient_id in line and (when := started_at(json.loads(line))) and when < before]
    return out

