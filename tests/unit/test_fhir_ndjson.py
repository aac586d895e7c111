"""Bulk-export NDJSON on the real Synthea set: every note arrives as free text with its patient and time."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from stam.sources.fhir_ndjson import load_ndjson
from stam.sources.fhir_r4 import parse_time
from tests.conftest import DATA

BULK = DATA / "synthea-bulk-10p"


@pytest.fixture(scope="module")
def bulk():  # type: ignore[no-untyped-def]
    if not BULK.is_dir():
        pytest.skip(f"shared data folder not found at {BULK}")
    return load_ndjson([BULK])


def test_all_1215_notes_arrive_as_free_text_with_patient_and_time(bulk) -> None:  # type: ignore[no-untyped-def]
    raw = [json.loads(line) for line in (BULK / "DocumentReference.000.ndjson").read_text().splitlines()]
    assert len(raw) == 1215
    notes = {e.source_ref: e for e in bulk.entries if e.resource_type == "DocumentReference"}
    assert len(notes) == 1215
    for r in raw:
        e = notes[f"DocumentReference/{r['id']}"]
        assert e.codes == () and e.text
        assert e.patient_id == r["subject"]["reference"].removeprefix("Patient/")
        assert e.effective_at == parse_time(r["context"]["period"]["start"])
        assert e.recorded_at == parse_time(r["date"])
        assert e.text == base64.b64decode(r["content"][0]["attachment"]["data"]).decode().strip()


def test_bulk_set_counts(bulk) -> None:  # type: ignore[no-untyped-def]
    kinds = {}
    for e in bulk.entries:
        kinds[e.resource_type] = kinds.get(e.resource_type, 0) + 1
    assert kinds == {"Procedure": 2056, "MedicationRequest": 1745, "Encounter": 1215, "DocumentReference": 1215,
                     "Condition": 555, "Immunization": 161, "AllergyIntolerance": 11}
    assert bulk.bad == []
    times = [e.effective_at for e in bulk.entries if e.effective_at]
    assert times == sorted(times)


def test_bad_lines_are_kept_whole_and_the_file_goes_on(tmp_path: Path) -> None:
    good = {"resourceType": "Condition", "id": "c1", "subject": {"reference": "Patient/p1"},
            "code": {"coding": [{"system": "http://snomed.info/sct", "code": "38341003", "display": "Hypertension"}]},
            "onsetDateTime": "2020-01-01"}
    invalid = dict(good, id="c2", onsetDateTime="not a date")
    lines = [json.dumps(good).encode(), b'{"resourceType": "Condition", "id": ', json.dumps(invalid).encode(),
             json.dumps(dict(good, id="c3")).encode()]
    f = tmp_path / "Condition.000.ndjson"
    f.write_bytes(b"\n".join(lines) + b"\n")
    result = load_ndjson([f])
    assert [e.source_ref for e in result.entries] == ["Condition/c1", "Condition/c3"]
    assert [(b.source, b.raw) for b in result.bad] == [("Condition.000.ndjson:2", lines[1]),
                                                       ("Condition.000.ndjson:3", lines[2])]
    assert "not JSON" in result.bad[0].error and "failed validation" in result.bad[1].error
