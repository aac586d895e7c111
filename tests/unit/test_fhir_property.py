"""Property-based: malformed FHIR never crashes a parser; every line is an entry, skipped, or a dead letter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stam.errors import SourceError
from stam.sources.fhir_ndjson import load_ndjson
from stam.sources.fhir_r4 import entries_from_bundle

SEED = {"resourceType": "MedicationRequest", "id": "m1", "status": "active", "intent": "order",
        "subject": {"reference": "Patient/p1"}, "authoredOn": "2020-01-01",
        "medicationCodeableConcept": {"coding": [{"system": "http://www.nlm.nih.gov/research/umls/rxnorm",
                                                  "code": "860975", "display": "metformin"}]},
        "dosageInstruction": [{"doseAndRate": [{"doseQuantity": {"value": 1}}]}]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3),
    max_leaves=10,
)


@st.composite
def mutated_resources(draw: Any) -> dict[str, Any]:
    resource = json.loads(json.dumps(SEED))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*SEED.keys(), "extra", "resourceType"]))
        if draw(st.booleans()):
            resource.pop(key, None)
        else:
            resource[key] = draw(json_values)
    return resource


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(mutated_resources().map(lambda r: json.dumps(r).encode()),
                                st.binary(max_size=60)), min_size=1, max_size=5))
def test_ndjson_lines_never_crash(tmp_path: Path, lines: list[bytes]) -> None:
    lines = [line.replace(b"\n", b" ") for line in lines]
    f = tmp_path / "MedicationRequest.000.ndjson"
    f.write_bytes(b"\n".join(lines) + b"\n")
    result = load_ndjson([f])
    accounted = len(result.entries) + sum(result.skipped.values()) + len(result.bad)
    assert accounted == sum(1 for line in lines if line.strip())
    for bad in result.bad:
        assert bad.raw in lines


@settings(max_examples=100, deadline=None)
@given(resource=mutated_resources())
def test_bundles_either_parse_or_raise_source_error(resource: dict[str, Any]) -> None:
    bundle = {"resourceType": "Bundle", "type": "collection", "entry": [{"resource": resource}]}
    try:
        result = entries_from_bundle(bundle)
    except SourceError as exc:
        assert str(exc)  # refused with a reason
        return
    assert len(result.entries) + sum(result.skipped.values()) == 1
