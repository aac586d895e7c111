"""Verified erasure (issue 13, repro 9) on the real stack: three Synthea patients through a real worker, one
erased with ``stam erase``; the independent scan finds neither its id nor sample texts of it in Redis, Milvus
(query and the bytes of its data dir), or any file under STAM_HOME; the other two patients' exports are unchanged
byte for byte; a running query worker answers for the erased patient as for an unknown one; rebuild refuses.

Topics: every value STAM writes for a patient is sealed under its data key (``stam.crypto``); erasure shreds the
key, and the scan (raw bytes, and every envelope that still opens) finds nothing of the patient on any topic."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from stam.backends.redis_state import RedisStateStore
from stam.export import export_state
from stam.transport import kafka_consumer, redis_client
from tests.conftest import BUNDLES, REPO, SMALL_BUNDLE, SMALL_PATIENT, need_data
from tests.integration.broker import _publish
from tests.integration.test_query_outages import _http

pytestmark = [pytest.mark.integration, pytest.mark.durable_broker]  # the disk is scanned for the patient's bytes

OTHER_BUNDLES = ["22bbe238-220e-495c-8abc-0ce3aa28a605.json", "ecc5586f-45d1-4fb2-bb4c-3fce1b7b4456.json"]
QUESTION = "What is the body height?"


def _cli(s: Any, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "stam.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _export(client: redis.Redis, pid: str) -> bytes:
    state = RedisStateStore(client).load(pid)
    return json.dumps(export_state(state), indent=2).encode()


def _audit(settings: Any) -> list[dict[str, Any]]:
    from topology import topics as t

    async def read() -> list[dict[str, Any]]:
        consumer = kafka_consumer(settings, t.AUDIT.name(settings.topic_prefix), auto_offset_reset="earliest",
                                  group_id=None)
        await consumer.start()
        try:
            got = await consumer.getmany(timeout_ms=3000)
            return [json.loads(r.value) for recs in got.values() for r in recs]
        finally:
            await consumer.stop()

    return asyncio.run(read())


@pytest.fixture(scope="module")
def erased(stack_settings: Any, worker: Any, query_worker: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    """Three patients applied by the worker, exported, warm in the query worker; then one erased by the CLI."""
    need_data()
    from stam.read.calibrate import labelled_set
    from stam.sources.fhir_r4 import load_bundle

    s = stack_settings
    bundles = [load_bundle(SMALL_BUNDLE)] + [load_bundle(BUNDLES / b) for b in OTHER_BUNDLES]
    patients = [b.entries[0].patient_id for b in bundles]
    assert patients[0] == SMALL_PATIENT and len(set(patients)) == 3
    entries = [e for b in bundles for e in b.entries]
    asyncio.run(_publish(s, entries))
    client = redis_client(s)
    states = RedisStateStore(client)
    want = {p: sum(1 for e in entries if e.patient_id == p) for p in patients}
    deadline = time.monotonic() + 600
    while {p: states.version(p) for p in patients} != want:
        assert time.monotonic() < deadline and worker.poll() is None, (
            {p: states.version(p) for p in patients}, want, (s.home / "worker.log").read_text()[-3000:])
        time.sleep(2)
    # The worker's 5 s Milvus flush timer seals the last segment.
    time.sleep(6)
    target, others = patients[1], [patients[0], patients[2]]
    before = {p: _export(client, p) for p in patients}

    # A calibration set in STAM_HOME, and the gate's set outside it (named by the gate file).
    items = labelled_set(states, patients, per_patient=4)
    assert {i["patient_id"] for i in items} == set(patients)
    (s.home / "calibration").mkdir(exist_ok=True)
    home_set = s.home / "calibration" / "set.jsonl"
    home_set.write_text("".join(json.dumps(i) + "\n" for i in items))
    outside = tmp_path_factory.mktemp("gate") / "gate-set.jsonl"
    outside.write_text("".join(json.dumps(i) + "\n" for i in items))
    (s.home / "gate.json").write_text(json.dumps({"threshold": 0.219, "source": str(outside)}))

    # The query worker has the patient's timeline warm before the erasure.
    port = query_worker.web_port
    end = time.monotonic() + 300
    while True:
        try:
            status, _, body = _http(port, {"patient_id": target, "question": QUESTION})
            break
        except OSError:
            assert time.monotonic() < end and query_worker.poll() is None
            time.sleep(1)
    assert status == 200 and body["ok"], body

    # The id is not in any log under STAM_HOME (nothing logs patient ids at INFO), before the erasure redacts.
    dry = _cli(s, "erase", "--patient", target, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["counts"]["log_files"] == 0, plan
    assert plan["counts"]["memories"] > 100 and plan["counts"]["milvus_vectors"] == plan["counts"]["memories"]
    assert plan["counts"]["file_lines"] == 2 * sum(1 for i in items if i["patient_id"] == target)
    assert RedisStateStore(client).version(target) == want[target], "a dry run changes nothing"

    from stam.erase import pick_samples

    samples = pick_samples(s, target, client=client)
    assert len(samples) >= 3, samples
    # Before: the id is in Milvus's files (a sealed segment) and the samples in Redis.
    from stam.erase import scan

    pre = scan(s, target, samples, client=client)
    assert pre["residuals"]["redis"] > 0 and pre["residuals"]["milvus_files"] > 0 and pre["residuals"]["files"] > 0

    started = time.perf_counter()
    run = _cli(s, "erase", "--patient", target, "--request-id", "REQ-erasure-test", "--sample-text", *samples,
               "--json")
    seconds = time.perf_counter() - started
    assert run.returncode in (0, 1), run.stderr
    out = json.loads(run.stdout)
    return {"settings": s, "client": client, "target": target, "others": others, "before": before,
            "samples": samples, "out": out, "rc": run.returncode, "stderr": run.stderr, "seconds": seconds,
            "home_set": home_set, "outside_set": outside, "items": items, "port": port}


def test_scan_finds_nothing_in_redis_milvus_and_files(erased: dict[str, Any]) -> None:
    from stam.erase import scan

    s, target = erased["settings"], erased["target"]
    found = scan(s, target, erased["samples"], client=erased["client"])
    print(json.dumps({"erase_seconds": round(erased["seconds"], 2), "residuals": found["residuals"],
                      "where": found["where"]}))
    for place in ("redis", "milvus_query", "milvus_files", "redis_files", "files"):
        assert found["residuals"][place] == 0, (place, found["where"][place])
    assert found["samples"] == len(erased["samples"]) >= 3
    # The receipt's verification is the same scan.
    assert erased["out"]["scan"]["residuals"] == found["residuals"]


def test_topics_hold_nothing_readable_of_the_patient(erased: dict[str, Any]) -> None:
    found = erased["out"]["scan"]
    assert found["residuals"]["topics"] == 0, found["where"]["topics"]
    assert found["residuals"]["broker_files"] == 0, found["where"]["broker_files"]
    assert "raw bytes and every envelope that opens" in found["where"]["topics"][-1]
    steps = erased["out"]["receipt"]["steps"]
    assert steps["topics"].startswith("data key shredded") and erased["out"]["receipt"]["removed"]["data_key_shredded"] == 1
    assert found["verified"] and erased["rc"] == 0, found


def test_the_other_patients_messages_still_open(erased: dict[str, Any]) -> None:
    """Shredding one patient's key leaves every other patient's messages readable: their transition log is whole."""
    from stam.recovery import read_log

    logged = asyncio.run(read_log(erased["settings"]))
    assert erased["target"] not in logged
    for pid in erased["others"]:
        assert max(e.state_version for e in logged[pid]) == RedisStateStore(erased["client"]).version(pid)


def test_receipt_on_the_audit_topic_without_patient_data(erased: dict[str, Any]) -> None:
    out, target = erased["out"], erased["target"]
    assert out["published"] is True
    receipt = out["receipt"]
    assert receipt["request_id"] == "REQ-erasure-test" and receipt["software_version"]
    removed = receipt["removed"]
    assert removed["memories"] > 100 and removed["milvus_vectors"] == removed["memories"]
    assert removed["redis_keys"] >= 4 and removed["patients_set"] == 1
    assert removed["file_lines"] == 2 * sum(1 for i in erased["items"] if i["patient_id"] == target)
    assert "Milvus Lite" in receipt["steps"]["milvus"] and "BGSAVE" in receipt["steps"]["redis_files"]
    on_topic = [r for r in _audit(erased["settings"]) if r["receipt_id"] == receipt["receipt_id"]]
    assert on_topic == [receipt]
    text = json.dumps(receipt)
    assert target not in text and target.split("-")[0] not in text
    assert not any(sample in text for sample in erased["samples"])


def test_other_patients_exports_unchanged_byte_for_byte(erased: dict[str, Any]) -> None:
    client = erased["client"]
    for pid in erased["others"]:
        assert _export(client, pid) == erased["before"][pid]
    assert RedisStateStore(client).patients() == sorted(erased["others"])
    # The calibration sets keep the other patients' lines.
    for path in (erased["home_set"], erased["outside_set"]):
        kept = [json.loads(line) for line in path.read_text().splitlines()]
        assert kept == [i for i in erased["items"] if i["patient_id"] != erased["target"]]


def test_query_worker_answers_like_an_unknown_patient(erased: dict[str, Any]) -> None:
    port, target = erased["port"], erased["target"]
    status, _, body = _http(port, {"patient_id": target, "question": QUESTION})
    unknown_status, _, unknown = _http(port, {"patient_id": "no-such-patient-000", "question": QUESTION})
    assert (status, body["ok"], body["error_kind"]) == (unknown_status, unknown["ok"], unknown["error_kind"]) \
        == (404, False, "not_found")
    assert body["error"].replace(target, "X") == unknown["error"].replace("no-such-patient-000", "X")
    # Another patient is still served.
    status, _, body = _http(port, {"patient_id": erased["others"][0], "question": QUESTION})
    assert status == 200 and body["ok"]


def test_rebuild_refuses_an_erased_patient(erased: dict[str, Any]) -> None:
    s, target = erased["settings"], erased["target"]
    run = _cli(s, "rebuild", "--patient", target)
    assert run.returncode == 1 and "erased" in run.stderr and target not in run.stderr
    assert RedisStateStore(erased["client"]).version(target) == 0
    verify = _cli(s, "erase", "--verify", "--patient", target, "--sample-text", *erased["samples"])
    body = json.loads(verify.stdout)
    # After the queries above too: the query worker's log does not hold the id.
    assert body["residuals"]["redis"] == body["residuals"]["milvus_files"] == body["residuals"]["files"] == 0, body


def test_erase_with_the_append_only_file_on(erased: dict[str, Any]) -> None:
    """Redis with an append-only file (the durable stack's setting): the AOF is rewritten, so it does not keep
    the deleted keys. The second erasure leaves the last patient's export unchanged."""
    from stam.erase import erase, pick_samples, scan

    s, client = erased["settings"], erased["client"]
    target, last = erased["others"]
    client.config_set("appendonly", "yes")
    deadline = time.monotonic() + 60
    while int(client.info("persistence")["aof_rewrite_in_progress"]) or not any(
            "appendonly" in p.name for p in Path(s.home).rglob("*")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    client.set("erasure-test-marker", "x")  # the AOF now also has writes appended since its rewrite
    samples = pick_samples(s, target, client=client)
    aof_files = [p for p in Path(s.home).rglob("*") if p.is_file() and "appendonly" in p.name]
    assert any(target.encode() in p.read_bytes() for p in aof_files), "the AOF holds the patient before"
    result = erase(s, target, request_id="REQ-aof", samples=samples, client=client)
    assert "BGREWRITEAOF" in result["receipt"]["steps"]["redis_files"]
    aof_files = [p for p in Path(s.home).rglob("*") if p.is_file() and "appendonly" in p.name]
    assert aof_files and not any(target.encode() in p.read_bytes() for p in aof_files)
    found = scan(s, target, samples, client=client)
    for place in ("redis", "milvus_query", "milvus_files", "redis_files", "files"):
        assert found["residuals"][place] == 0, (place, found["where"][place])
    assert _export(client, last) == erased["before"][last]
    client.delete("erasure-test-marker")


def test_recovery_from_the_log_does_not_bring_erased_patients_back(erased: dict[str, Any]) -> None:
    """After a store loss the worker rebuilds every patient whose state is behind the transition log; an erased
    patient is behind the log by design and must stay erased. Both erased patients' transitions are still on the
    topic, sealed under shredded keys (unreadable); the live patient, made to lose its state, is rebuilt."""
    from stam.compose import build_deps
    from stam.recovery import read_log, recover

    s, client = erased["settings"], erased["client"]
    gone = [erased["target"], erased["others"][0]]  # the second was erased by the AOF test
    live = erased["others"][1]
    logged = asyncio.run(read_log(s))
    assert not set(gone) & set(logged), "their transitions are sealed under shredded keys"
    version = RedisStateStore(client).version(live)
    deps = build_deps(s)
    try:
        deps.states.erase_patient(live)  # a loss: the live patient is now behind the log
        deps.vectors.erase_patient(live)
        report = recover(s, deps)
    finally:
        deps.vectors.close()
    assert report.rebuilt == 1
    assert RedisStateStore(client).version(live) == version
    for pid in gone:
        assert RedisStateStore(client).version(pid) == 0
    assert RedisStateStore(client).patients() == [live]
