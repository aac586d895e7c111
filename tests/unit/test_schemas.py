from datetime import datetime

import pytest
from pydantic import ValidationError

from schemas import Coding, RecordEntry, TransitionEvent

CODE = Coding(system="http://loinc.org", code="8302-2", display="Body Height")


def test_entry_requires_codes_or_text() -> None:
    with pytest.raises(ValidationError, match="codes or text"):
        RecordEntry(patient_id="p", entry_id="e", source="x")


def test_entry_rejects_naive_times_and_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        RecordEntry(patient_id="p", entry_id="e", source="x", codes=(CODE,),
                    effective_at=datetime(2020, 1, 1))
    with pytest.raises(ValidationError, match="extra"):
        RecordEntry.model_validate({"patient_id": "p", "entry_id": "e", "source": "x",
                                    "codes": [CODE.model_dump()], "surprise": 1})


def test_entry_rejects_other_wire_versions() -> None:
    with pytest.raises(ValidationError):
        RecordEntry.model_validate({"schema_version": 2, "patient_id": "p", "entry_id": "e",
                                    "source": "x", "text": "hi"})


def test_entry_roundtrips_json() -> None:
    e = RecordEntry(patient_id="p", entry_id="e", source="x", codes=(CODE,),
                    effective_at=datetime.fromisoformat("2020-01-01T00:00:00+00:00"))
    assert RecordEntry.model_validate_json(e.model_dump_json()) == e


def test_transition_schema_documents_public_fields() -> None:
    props = TransitionEvent.model_json_schema()["properties"]
    for name in ("transition_id", "patient_id", "entry_id", "kind", "memory_id", "from_store", "to_store",
                 "reason", "successor_id", "clinical_time", "recorded_at", "state_version"):
        assert name in props


def test_published_json_schemas_are_current() -> None:
    from schemas.__main__ import CONTRACTS, OUT, render
    from schemas.wire import WIRE_VERSION

    for name, model in CONTRACTS.items():
        path = OUT / f"{name}.v{WIRE_VERSION}.json"
        assert path.read_text() == render(model), f"run `python -m schemas` to refresh {path.name}"


def test_a_deletion_order_needs_one_verdict_per_distinct_memory() -> None:
    from datetime import UTC

    from schemas import DeletionOrder, DeletionVerdict

    v = DeletionVerdict(score=0.9, tau=0.8, alpha=0.01, calibration_id="gate-1")
    at = datetime(2026, 1, 1, tzinfo=UTC)
    DeletionOrder(order_id="o", patient_id="p", memory_ids=("a", "b"), verdicts=(v, v), ordered_at=at)
    for ids, verdicts in ((("a", "b"), (v,)), (("a", "a"), (v, v)), ((), ())):
        with pytest.raises(ValidationError):
            DeletionOrder(order_id="o", patient_id="p", memory_ids=ids, verdicts=verdicts, ordered_at=at)
    with pytest.raises(ValidationError):  # a score is a probability
        DeletionVerdict(score=1.5, tau=0.8, alpha=0.01, calibration_id="gate-1")
