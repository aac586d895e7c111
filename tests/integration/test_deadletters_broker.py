"""Gaps are visible, and dead letters can be handled: on the real stack (Tansu, redis-server, Milvus Lite server)
with the Faust workers in their own process and a real Synthea patient.

Bad entries of the patient are dead-lettered by the default worker's one stage (fused); the patient's ``stam
state`` (text and JSON) and an ``ask`` packet carry the record gap; ``stam deadletters list/show`` show them; a
corrected payload replayed with ``--value-file`` is applied and closes its gap; a dismissal closes one with its reason
kept; the original bytes of a malformed entry and a publisher's bad file are refused for replay."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from schemas import DeadLetter
from stam.backends.redis_state import RedisStateStore
from stam.cli import main as stam
from stam.deadletters import gap_of, letter_id
from stam.transport import kafka_producer, redis_client
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import _publish
from topology import topics as t

pytestmark = pytest.mark.integration

GOOD = 12


@pytest.fixture()
def cli_env(stack_settings: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    s = stack_settings
    for name, value in (("HOME", str(s.home)), ("BROKER_URL", s.broker_url), ("REDIS_URL", s.redis_url),
                        ("MILVUS_URI", s.milvus_uri), ("PARTITIONS", str(s.partitions))):
        monkeypatch.setenv(f"STAM_{name}", value)
    return s


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = stam(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def _send_raw(settings: Any, key: bytes, values: list[bytes]) -> None:
    producer = kafka_producer(settings)
    await producer.start()
    try:
        for v in values:
            await producer.send_and_wait(t.ENTRIES.name(settings.topic_prefix), key=key, value=v)
    finally:
        await producer.stop()


async def _send_letter(settings: Any, letter: DeadLetter) -> tuple[int, int]:
    producer = kafka_producer(settings)
    await producer.start()
    try:
        md = await producer.send_and_wait(t.DEAD_LETTERS.name(settings.topic_prefix), key=SMALL_PATIENT.encode(),
                                          value=letter.model_dump_json().encode())
        return md.partition, md.offset
    finally:
        await producer.stop()


def _wait(check: Any, timeout: float, what: str, worker: Any, home: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        assert worker.poll() is None, (home / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: " + (home / "worker.log").read_text()[-2000:])


def _broken(e: Any) -> bytes:
    """An entry that fails the schema (no codes, no text)."""
    return json.dumps({**json.loads(e.model_dump_json()), "codes": [], "text": None}).encode()


def _send_bad_entries(capsys: pytest.CaptureFixture[str], s: Any, entries: list[Any], states: RedisStateStore,
                      worker: Any, tmp_path: Path) -> None:
    """The good entries, three bad ones of the patient, a lonely malformed one and a publisher's bad file: four gaps
    and a dead letter of no known patient."""
    good, fixed_a, dropped = entries[:GOOD], entries[GOOD], entries[GOOD + 2]
    # A: an entry that fails the schema (no codes, no text); B: bytes that are not JSON at all, keyed by the
    # patient; C: another entry that fails the schema, to be dismissed.
    asyncio.run(_publish(s, good))
    asyncio.run(_send_raw(s, SMALL_PATIENT.encode(), [_broken(fixed_a), b"\x00not json", _broken(dropped)]))
    # A patient whose only entry is malformed: no state, but a gap.
    lonely = json.loads(_broken(fixed_a)) | {"patient_id": "gap-only-patient"}
    asyncio.run(_send_raw(s, b"gap-only-patient", [json.dumps(lonely).encode()]))
    asyncio.run(_publish(s, [entries[GOOD + 3]]))  # a good entry after them: the stream went on
    _wait(lambda: states.version(SMALL_PATIENT) == GOOD + 1 and len(states.gaps(SMALL_PATIENT)) == 3
          and len(states.gaps("gap-only-patient")) == 1, 240, "the good entries applied and four gaps", worker, s.home)
    code, _, err = run(capsys, "state", "--patient", "gap-only-patient")
    assert code == 1 and "no state for patient gap-only-patient (record gap: 1 entry not applied (fused, " \
        "ValidationError), since " in err

    # A publisher's bad file: a dead letter of no known patient.
    bad_file = tmp_path / "bundle.json"
    bad_file.write_text('{"resourceType": "Bundle", "entry": [{"resource": {"resourceType": "Condition"')
    assert run(capsys, "publish", "--quiet", str(bad_file))[0] == 2


def _check_the_gaps_are_visible(capsys: pytest.CaptureFixture[str], fixed_a: Any, dropped: Any) -> None:
    # stam state: the gap line, each gap, and the JSON export's "gaps".
    code, out, _ = run(capsys, "state", "--patient", SMALL_PATIENT)
    assert code == 0
    assert "record gap: 3 entries not applied (fused, ValidationError), since " in out.splitlines()[0]
    assert f"entry {fixed_a.entry_id}: fused, ValidationError" in out
    assert f"entry {dropped.entry_id}: fused, ValidationError" in out and "entry (unknown id)" in out
    code, out, _ = run(capsys, "state", "--patient", SMALL_PATIENT, "--json")
    exported = json.loads(out)
    assert sorted(g["entry_id"] or "" for g in exported["gaps"]) == sorted(["", fixed_a.entry_id, dropped.entry_id])

    # ask: the packet lists the gaps and its text says the record is incomplete.
    code, out, _ = run(capsys, "ask", "--patient", SMALL_PATIENT, "--json", "What are the current conditions?")
    answer = json.loads(out)
    assert code == 0 and answer["ok"], out[-500:]
    packet = answer["packet"]
    assert len(packet["gaps"]) == 3
    assert "record gap: 3 entries not applied (fused, ValidationError)" in packet["rendered"].splitlines()[1]


def _list_and_show(capsys: pytest.CaptureFixture[str], fixed_a: Any, dropped: Any) -> tuple[str, str, str, str]:
    """The ids of dead letters A, B and C, and of the publisher's."""
    # list: table and JSON, filters; show: the decoded value.
    code, out, _ = run(capsys, "deadletters", "list", "--json")
    listed = json.loads(out)
    by_entry = {x["entry_id"]: x for x in listed if x["patient_id"] == SMALL_PATIENT}
    assert {x["status"] for x in listed if x["patient_id"] == SMALL_PATIENT} == {"open"}
    publisher = [x for x in listed if x["stage"] == "publish:fhir-r4"]
    assert publisher and publisher[-1]["status"] == "no gap (patient unknown)" and publisher[-1]["patient_id"] is None
    id_a, id_b, id_c = by_entry[fixed_a.entry_id]["id"], by_entry[None]["id"], by_entry[dropped.entry_id]["id"]
    code, out, _ = run(capsys, "deadletters", "list", "--patient", SMALL_PATIENT, "--stage", "fused")
    rows = [line.split()[0] for line in out.splitlines()[1:]]  # a header, then one line per dead letter
    assert code == 0 and sorted(rows) == sorted([id_a, id_b, id_c])
    assert "(unknown: no gap)" not in out
    code, out, _ = run(capsys, "deadletters", "list")
    assert len(out.splitlines()) == len(listed) + 1
    assert "(unknown: no gap)" in out and "no gap (patient unknown)" in out
    code, out, _ = run(capsys, "deadletters", "show", id_a)
    shown = json.loads(out)
    assert shown["value"]["entry_id"] == fixed_a.entry_id and shown["value"]["codes"] == []
    assert shown["source"].startswith("stam.entries.v1/") and "needs codes or text" in shown["error"]
    return id_a, id_b, id_c, publisher[-1]["id"]


def _check_replay_refusals(capsys: pytest.CaptureFixture[str], id_a: str, id_publisher: str, id_c: str) -> None:
    # Replay refusals: one line, exit 2, nothing sent.
    code, _, err = run(capsys, "deadletters", "replay", id_a)
    assert code == 2 and "fail the RecordEntry schema" in err and "--value-file" in err and err.count("\n") == 1
    code, _, err = run(capsys, "deadletters", "replay", id_publisher)
    assert code == 2 and "publisher's bad input" in err and "stam publish" in err
    code, _, err = run(capsys, "deadletters", "dismiss", id_c)
    assert code == 2 and "--reason" in err
    code, _, err = run(capsys, "deadletters", "show", "99:99999")
    assert code == 2 and "no dead letter 99:99999" in err


def _replay_corrected_and_dismiss(capsys: pytest.CaptureFixture[str], tmp_path: Path, fixed_a: Any, fixed_b: Any,
                                  id_a: str, id_b: str, id_c: str) -> None:
    # Replay corrected payloads: A (the entry as it should have been) and B (its bytes were not even JSON).
    (tmp_path / "a.json").write_text(fixed_a.model_dump_json())
    (tmp_path / "b.json").write_text(fixed_b.model_dump_json())
    code, out, _ = run(capsys, "deadletters", "replay", id_a, "--value-file", str(tmp_path / "a.json"), "--by", "ops")
    assert code == 0 and json.loads(out)["corrected"] is True
    code, out, _ = run(capsys, "deadletters", "replay", id_b, "--value-file", str(tmp_path / "b.json"))
    assert code == 0
    # Dismiss C with a reason.
    code, out, _ = run(capsys, "deadletters", "dismiss", id_c, "--reason", "test entry, never clinical",
                       "--by", "ops")
    assert code == 0 and json.loads(out)["gap_closed"] is True


def _replay_the_same_bytes(capsys: pytest.CaptureFixture[str], s: Any, states: RedisStateStore, same: Any) -> str:
    """D's id."""
    # D: a dead letter whose bytes were fine (the fault was outside the message, e.g. a bug since fixed), as a
    # stage writes it, with its gap recorded as the worker records it: replay sends the same bytes again.
    letter = DeadLetter(stage="extract", topic=t.ENTRIES.name(s.topic_prefix), partition=0, offset=0,
                        key=base64.b64encode(SMALL_PATIENT.encode()).decode(),
                        value=base64.b64encode(same.model_dump_json().encode()).decode(),
                        error_type="ReasoningError", error="a reasoner bug, since fixed", failed_at=datetime.now(UTC))
    part, off = asyncio.run(_send_letter(s, letter))
    id_d = letter_id(part, off)
    states.record_gap(*gap_of(letter, id_d))  # type: ignore[misc]
    code, out, _ = run(capsys, "deadletters", "replay", id_d)
    assert code == 0 and json.loads(out)["corrected"] is False
    return id_d


def _check_every_gap_closed(capsys: pytest.CaptureFixture[str], states: RedisStateStore, entries: list[Any],
                            ids: tuple[str, str, str, str]) -> None:
    fixed_a, fixed_b, dropped, same = entries[GOOD], entries[GOOD + 1], entries[GOOD + 2], entries[GOOD + 4]
    id_a, id_b, id_c, id_d = ids
    state = states.load(SMALL_PATIENT)
    assert {fixed_a.entry_id, fixed_b.entry_id, same.entry_id} <= {m.memory.entry_id for m in state.memories.values()}
    assert dropped.entry_id not in {m.memory.entry_id for m in state.memories.values()}

    code, out, _ = run(capsys, "state", "--patient", SMALL_PATIENT)
    assert "record gap" not in out
    code, out, _ = run(capsys, "ask", "--patient", SMALL_PATIENT, "--json", "What are the current conditions?")
    packet = json.loads(out)["packet"]
    assert packet["gaps"] == [] and "record gap" not in packet["rendered"]

    code, out, _ = run(capsys, "deadletters", "list", "--json", "--patient", SMALL_PATIENT)
    status = {x["id"]: x for x in json.loads(out)}
    assert [status[i]["status"] for i in (id_a, id_b, id_c, id_d)] == ["applied", "applied", "dismissed", "applied"]
    assert status[id_c]["handled"]["reason"] == "test entry, never clinical"
    assert status[id_c]["handled"]["by"] == "ops" and status[id_a]["handled"]["by"] == "ops"
    code, out, _ = run(capsys, "deadletters", "list", "--status", "open", "--patient", SMALL_PATIENT)
    assert out.strip() == "no dead letters matching the filters"


def test_gaps_are_visible_and_dead_letters_handled(cli_env: Any, worker: Any, small_bundle: Any,
                                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    s = cli_env
    entries = small_bundle.entries
    fixed_a, fixed_b, dropped = entries[GOOD], entries[GOOD + 1], entries[GOOD + 2]
    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    _send_bad_entries(capsys, s, entries, states, worker, tmp_path)
    _check_the_gaps_are_visible(capsys, fixed_a, dropped)
    id_a, id_b, id_c, id_publisher = _list_and_show(capsys, fixed_a, dropped)
    _check_replay_refusals(capsys, id_a, id_publisher, id_c)
    _replay_corrected_and_dismiss(capsys, tmp_path, fixed_a, fixed_b, id_a, id_b, id_c)
    id_d = _replay_the_same_bytes(capsys, s, states, entries[GOOD + 4])
    _wait(lambda: states.version(SMALL_PATIENT) == GOOD + 4 and not states.gaps(SMALL_PATIENT),
          240, "the replayed entries applied and their gaps closed", worker, s.home)
    _check_every_gap_closed(capsys, states, entries, (id_a, id_b, id_c, id_d))
