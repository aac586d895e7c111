"""Every source through the real broker and the worker process: HL7 v2 samples, a MIMIC-IV demo patient
(read back with ``stam state --json``), and all 1,215 notes of the Synthea bulk set."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Any

import pytest

from stam.publish import publish_paths
from stam.transport import kafka_consumer
from tests.conftest import DATA
from tests.integration.broker import _dead_letters, collect_outputs, opened

pytestmark = pytest.mark.integration
HL7 = DATA / "hl7v2-samples"
MIMIC = DATA / "mimic-iv-demo-2.2"
NOTES = DATA / "synthea-bulk-10p" / "DocumentReference.000.ndjson"


def _need(path: Any) -> None:
    if not path.exists():
        pytest.skip(f"shared data not found at {path} (set STAM_SHARED_DATA)")


def test_hl7_samples_map_or_are_dead_lettered_with_their_bytes(stack_settings: Any, worker: Any) -> None:
    _need(HL7)
    from stam.sources.hl7v2 import load_hl7

    expected = load_hl7([HL7])
    summary = asyncio.run(publish_paths(stack_settings, [HL7]))
    assert summary.sent == len(expected.entries) and summary.dead_lettered == len(expected.bad) > 0
    detail = summary.sources["hl7v2"]["message_types"]
    assert sum(v["messages"] for v in detail.values()) == len(list(HL7.glob("*.hl7")))

    letters = [d for d in asyncio.run(_dead_letters(stack_settings)) if d["stage"] == "publish:hl7v2"]
    assert len(letters) == len(expected.bad)
    files = [f.read_bytes() for f in HL7.glob("*.hl7")]
    for d in letters:  # the original message bytes, and a reason naming the message type
        raw = base64.b64decode(d["value"]).strip()
        assert raw and any(raw in f for f in files), raw[:80]
        assert re.search(r"\b[A-Z]{3}\^[A-Z0-9]{2,3}\b", d["error"]), d["error"]

    ids = {e.entry_id for e in expected.entries}
    transitions, _ = asyncio.run(collect_outputs(stack_settings, ids, timeout=300))
    assert ids <= {x["entry_id"] for x in transitions}
    # LAB-ORU-1 (preliminary 40.1) then LAB-ORU-2 (final 39.7) of the same OBX: the final value supersedes.
    prelim = next(e for e in expected.entries if e.source_ref == "Observation/82503246-20570-8"
                  and e.status == "preliminary")
    archived = [x for x in transitions if x["kind"] == "archived" and x["reason"] == "superseded"
                and x["patient_id"] == prelim.patient_id]
    assert archived and all(x["successor_id"] for x in archived)


def test_mimic_patient_through_the_broker_and_stam_state(stack_settings: Any, worker: Any, monkeypatch: Any,
                                                        capsys: Any) -> None:
    _need(MIMIC)
    from stam.cli import main
    from stam.sources.mimic import load_mimic, poe_check

    patient = "10019917"
    expected = load_mimic(MIMIC, subjects=[patient])
    summary = asyncio.run(publish_paths(stack_settings, [MIMIC], subjects=[patient]))
    assert summary.sent == len(expected.entries) and summary.dead_lettered == 0
    assert summary.sources["mimic-iv"]["tables"]["poe"] == {"rows": 53, "entries": 53, "bad": 0, "folded": 0}
    ids = {e.entry_id for e in expected.entries}
    transitions, _ = asyncio.run(collect_outputs(stack_settings, ids, timeout=300))
    assert ids <= {x["entry_id"] for x in transitions}

    s = stack_settings
    for name, value in (("HOME", str(s.home)), ("BROKER_URL", s.broker_url), ("REDIS_URL", s.redis_url),
                        ("MILVUS_URI", s.milvus_uri), ("PARTITIONS", str(s.partitions))):
        monkeypatch.setenv(f"STAM_{name}", value)
    capsys.readouterr()
    assert main(["state", "--patient", patient, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    report = poe_check(lambda _sid: state, MIMIC, {patient})
    assert report["counts"].get("change_wrong", 0) == report["counts"].get("dc_wrong", 0) == 0, report
    assert report["counts"]["change_ok"] >= 6 and report["counts"]["dc_ok"] >= 6
    # The changed diet order 10019917-8 is in HISTORY, superseded by the Change order 10019917-27.
    mems = {m["memory_id"]: m for m in state["active"] + state["history"]}
    (old,) = [m for m in state["history"] if m["source_ref"] == "ServiceRequest/poe-10019917-8"]
    assert old["reason"] == "superseded"
    assert mems[old["successor_id"]]["source_entry_id"] == "mimic-iv:poe:10019917-27"


def test_an_hl7_visit_through_the_broker_ends_with_its_discharge_and_a_cancelled_discharge_reinstates_it(
        stack_settings: Any, worker: Any, tmp_path: Any) -> None:
    """A01, a lab order, an inpatient pharmacy order, a dose given, A03, A13, as an integration engine sends them
    (files in that order: the publisher keeps a patient's order on its partition)."""
    from benchmarks import hl7_visit
    from stam.sources.hl7v2 import load_hl7

    for n, make in enumerate(hl7_visit.VISIT_MESSAGES):
        (tmp_path / f"{n:02d}-{make.__name__}.hl7").write_bytes(make())
    expected = load_hl7([tmp_path])
    summary = asyncio.run(publish_paths(stack_settings, [tmp_path]))
    assert summary.sent == len(expected.entries) == len(hl7_visit.VISIT_MESSAGES) and summary.dead_lettered == 0
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in expected.entries}, timeout=300))
    entry = {e.entry_id: e for e in expected.entries}
    by_message = {entry[x["entry_id"]].attributes["hl7_control_id"]: [] for x in transitions if x["entry_id"] in entry}
    for x in transitions:
        if x["entry_id"] in entry:
            by_message[entry[x["entry_id"]].attributes["hl7_control_id"]].append(x)
    added = {x["memory_id"]: x for xs in by_message.values() for x in xs if x["kind"] == "added"}
    order = next(x for x in by_message["LC-ORM"] if x["kind"] == "added")["memory_id"]
    drug = next(x for x in by_message["LC-RDE"] if x["kind"] == "added")["memory_id"]
    dose = next(x for x in by_message["LC-RAS"] if x["kind"] == "added")
    assert added[order]["to_store"] == added[drug]["to_store"] == "active"
    assert dose["to_store"] == "history" and dose["reason"] == "event"
    record = next(x for x in by_message["LC-A03"] if x["kind"] == "added")
    assert record["to_store"] == "history" and record["reason"] == "encounter-ended"
    ended = {x["memory_id"]: x for x in by_message["LC-A03"] if x["kind"] == "archived"}
    for mid in (order, drug):
        assert ended[mid]["reason"] == "encounter-ended" and ended[mid]["evidence_id"] == record["memory_id"]
        assert ended[mid]["clinical_time"].startswith("2030-01-09T11:30:00")
    restored = {x["memory_id"]: x for x in by_message["LC-A13"] if x["kind"] == "restored"}
    assert set(restored) == {order, drug}
    assert all(x["from_store"] == "history" and x["to_store"] == "active" for x in restored.values())


def test_bulk_notes_of_12_patients_become_note_memories_of_their_patient(stack_settings: Any, worker: Any,
                                                                         tmp_path: Any) -> None:
    """The bulk export's notes, interleaved across 12 of its 13 patients, through the broker and the worker: the
    first 8 of each patient's notes (96), in the file's order. The rest (1,119 notes) are left out for the suite's
    time only (each note costs the worker about 0.2 s of CPU on 2 cores); the mapping of all 1,215 is checked
    without the broker in tests/unit/test_fhir_ndjson.py, and one patient's notes become memories whole in
    tests/integration/test_stages_real_stores.py."""
    _need(NOTES)
    from collections import Counter

    from stam.sources.fhir_r4 import parse_time

    lines = NOTES.read_text().splitlines()
    per_patient = Counter(json.loads(line)["subject"]["reference"] for line in lines)
    largest = max(per_patient, key=per_patient.__getitem__)
    taken: Counter[str] = Counter()
    keep = []
    for line in lines:
        ref = json.loads(line)["subject"]["reference"]
        if ref != largest and taken[ref] < 8:
            taken[ref] += 1
            keep.append(line)
    notes = tmp_path / "DocumentReference.000.ndjson"
    notes.write_text("\n".join(keep) + "\n")
    raw = [json.loads(line) for line in keep]
    summary = asyncio.run(publish_paths(stack_settings, [notes]))
    assert summary.sent == len(raw) == 96 and len({r["subject"]["reference"] for r in raw}) == 12
    assert summary.dead_lettered == 0
    by_ref = {f"DocumentReference/{r['id']}": r for r in raw}
    want = set(by_ref)
    added: dict[str, Any] = {}
    transitions, _ = asyncio.run(_collect_until_refs(stack_settings, want, timeout=600))
    for x in transitions:
        m = x.get("memory") or {}
        if x["kind"] == "added" and m.get("source_ref") in want:
            added[m["source_ref"]] = x
    assert set(added) == want
    for ref, x in added.items():
        r = by_ref[ref]
        m = x["memory"]
        assert x["patient_id"] == r["subject"]["reference"].removeprefix("Patient/")
        assert m["category"] == "note" and m["text"] == base64.b64decode(
            r["content"][0]["attachment"]["data"]).decode().strip()
        assert parse_time(m["effective_start"]) == parse_time(r["context"]["period"]["start"])


async def _collect_until_refs(settings: Any, refs: set[str], timeout: float) -> tuple[list[dict], list[dict]]:
    """Transitions until an 'added' event was seen for every source_ref in ``refs``."""
    import time

    from topology import topics as t

    consumer = kafka_consumer(settings, t.TRANSITIONS.name(settings.topic_prefix), auto_offset_reset="earliest",
                              group_id=None)
    await consumer.start()
    out: list[dict] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not refs <= seen:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    x = json.loads(opened(settings, r.value))
                    out.append(x)
                    if x["kind"] == "added" and (x.get("memory") or {}).get("source_ref") in refs:
                        seen.add(x["memory"]["source_ref"])
    finally:
        await consumer.stop()
    return out, []
