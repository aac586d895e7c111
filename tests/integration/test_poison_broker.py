"""Poison messages are the message's fault, never the stream's (issue 13, reproductions 1, 2, 3 and 7), through
the real stack: Tansu, redis-server, the Milvus Lite server and ``stam worker --stages all`` in its own process."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from benchmarks.hostile import expected, hostile_files, hostile_inputs, hostile_key
from schemas import RecordEntry
from schemas.limits import DEAD_LETTER_EXCERPT_BYTES
from stam.backends.redis_state import RedisStateStore
from stam.transport import kafka_consumer, kafka_producer, redis_client
from tests.conftest import SMALL_BUNDLE, SMALL_PATIENT
from tests.integration.broker import opened
from tests.integration.conftest import _stam_process
from topology import topics as t

pytestmark = pytest.mark.integration


class _Worker:
    """``stam worker --stages all`` in its own process; restartable (reproduction 3 is about a worker's start). The
    four stages, not the default fused path: the reproductions are theirs (the extract stage's output over the
    broker's limit, dead letters of stage ``extract``)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.starts = 0
        self._cm: Any = None
        self.proc: Any = None

    def start(self) -> None:
        self.starts += 1
        self._cm = _stam_process(self.settings, "worker --stages all", f"worker-{self.starts}.log")
        self.proc = self._cm.__enter__()

    def stop(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        return (self.settings.home / f"worker-{self.starts}.log").read_text(errors="replace")[-tail:]


@pytest.fixture(scope="module")
def poison_worker(stack_settings: Any) -> Iterator[_Worker]:
    w = _Worker(stack_settings)
    w.start()
    yield w
    w.stop()


async def _send_raw(settings: Any, items: list[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
    """Publish (key, value) pairs in order on the entries topic; returns their (partition, offset)."""
    producer = kafka_producer(settings, acks="all")
    await producer.start()
    try:
        metas = [await producer.send_and_wait(t.ENTRIES.name(settings.topic_prefix), key=k, value=v)
                 for k, v in items]
    finally:
        await producer.stop()
    return [(m.partition, m.offset) for m in metas]


async def _read(settings: Any, done: Any, timeout: float) -> tuple[list[dict], list[dict]]:
    """Transitions and dead letters from offset 0, until ``done(transitions, letters)`` or the timeout."""
    consumer = kafka_consumer(settings, t.TRANSITIONS.name(settings.topic_prefix),
                              t.DEAD_LETTERS.name(settings.topic_prefix), auto_offset_reset="earliest", group_id=None,
                              fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    transitions: list[dict] = []
    letters: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for tp, recs in (await consumer.getmany(timeout_ms=500)).items():
                target = letters if tp.topic.endswith("deadletter.v1") else transitions
                target.extend(json.loads(opened(settings, r.value)) for r in recs)
            if done(transitions, letters):
                break
    finally:
        await consumer.stop()
    return transitions, letters


def _letter_entry_id(letter: dict) -> str | None:
    if letter.get("truncated"):
        return None
    try:
        d = json.loads(base64.b64decode(letter["value"]))
    except (ValueError, RecursionError):
        return None
    if isinstance(d, dict):
        inner = d.get("entry") if isinstance(d.get("entry"), dict) else d
        return inner.get("entry_id") if isinstance(inner.get("entry_id"), str) else None
    return None


def _good_entries(n: int, tag: str) -> list[RecordEntry]:
    from stam.sources.fhir_r4 import load_bundle

    return [e.model_copy(update={"entry_id": f"{e.entry_id}:{tag}"}) for e in load_bundle(SMALL_BUNDLE).entries[:n]]


def test_oversized_entry_and_long_patient_id_are_dead_lettered_and_the_stream_goes_on(
        stack_settings: Any, poison_worker: _Worker) -> None:
    """Reproductions 1 and 2: a 700 KB entry stopped extraction (the output could not be sent); a 300-character
    patient id stalled updates for every patient (Milvus's VARCHAR(256), retried as an outage)."""
    s = stack_settings
    rng_entry = json.loads(RecordEntry(patient_id=SMALL_PATIENT, entry_id="huge-1", source="test",
                                       text="x").model_dump_json())
    rng_entry["codes"] = [{"system": "http://snomed.info/sct", "code": "38341003", "display": "d" * 700_000}]
    huge = json.dumps(rng_entry).encode()
    long_id = json.loads(RecordEntry(patient_id="p", entry_id="long-1", source="test", text="x").model_dump_json())
    long_id["patient_id"] = "p" * 300
    long_raw = json.dumps(long_id).encode()
    good = _good_entries(30, "repro12")
    items = [(SMALL_PATIENT.encode(), huge), (b"p" * 300, long_raw)]
    items += [(e.patient_id.encode(), e.model_dump_json().encode()) for e in good]
    offsets = asyncio.run(_send_raw(s, items))
    want = {e.entry_id for e in good}

    def where(dl: list[dict]) -> dict[tuple[int, int], dict]:
        return {(d["partition"], d["offset"]): d for d in dl if d.get("stage") == "extract"}

    transitions, letters = asyncio.run(_read(
        s, lambda tr, dl: want <= {x["entry_id"] for x in tr} and set(offsets[:2]) <= set(where(dl)), 600))
    assert poison_worker.alive(), poison_worker.log()
    assert want <= {x["entry_id"] for x in transitions}
    mine = where(letters)
    big = mine[offsets[0]]
    assert big["truncated"] and big["value_bytes"] == len(huge) and big["topic"] == "stam.entries.v1"
    assert big["value_sha256"] == hashlib.sha256(huge).hexdigest() and "limit is 262,144" in big["error"]
    assert mine[offsets[1]]["error_type"] == "ValidationError" and "128" in mine[offsets[1]]["error"]
    assert base64.b64decode(mine[offsets[1]]["value"]) == long_raw


def test_hostile_inputs_are_applied_or_dead_lettered_and_good_entries_all_applied(
        stack_settings: Any, poison_worker: _Worker) -> None:
    s = stack_settings
    hostile = hostile_inputs(int(os.environ.get("STAM_HOSTILE_N", "300")), seed=13)
    good = _good_entries(132, "hostile")
    items: list[tuple[bytes, bytes]] = []
    gi = iter(good)
    for i, (kind, raw) in enumerate(hostile):
        items.append((hostile_key(kind, raw), raw))
        if i % 8 == 7:
            e = next(gi, None)
            if e is not None:
                items.append((e.patient_id.encode(), e.model_dump_json().encode()))
    items += [(e.patient_id.encode(), e.model_dump_json().encode()) for e in gi]
    started = time.monotonic()
    asyncio.run(_send_raw(s, items))
    digests = {hashlib.sha256(raw).hexdigest() for _, raw in hostile}
    want_applied = {json.loads(raw)["entry_id"] for kind, raw in hostile if expected(kind) == "applied"}
    want_good = {e.entry_id for e in good}

    def accounted(tr: list[dict], dl: list[dict]) -> bool:
        applied = {x["entry_id"] for x in tr}
        lettered = {d.get("value_sha256") for d in dl} | {_letter_entry_id(d) for d in dl}
        return want_good <= applied and want_applied <= applied and all(
            h in lettered for k, raw in hostile if expected(k) == "dead_letter"
            for h in [hashlib.sha256(raw).hexdigest()])

    transitions, letters = asyncio.run(_read(s, accounted, 900))
    elapsed = time.monotonic() - started
    assert poison_worker.alive(), poison_worker.log()
    applied = {x["entry_id"] for x in transitions}
    lettered = {d.get("value_sha256") for d in letters}
    missing = [(k, raw[:80]) for k, raw in hostile
               if (expected(k) == "applied" and json.loads(raw)["entry_id"] not in applied)
               or (expected(k) == "dead_letter" and hashlib.sha256(raw).hexdigest() not in lettered)]
    assert not missing, missing[:10]
    assert want_good <= applied
    ours = [d for d in letters if d.get("value_sha256") in digests]
    assert all(d["error"] and d["error_type"] for d in ours)
    assert "a bug, not the message's fault" not in poison_worker.log(tail=10**9)  # no input took the bug path
    print(json.dumps({"hostile": len(hostile), "good": len(good), "dead_lettered": len(ours),
                      "applied_hostile": len(want_applied), "seconds_until_all_applied": round(elapsed, 1),
                      "worker_alive": poison_worker.alive()}))


def test_outbox_like_and_glob_patient_ids_survive_a_worker_restart(
        stack_settings: Any, poison_worker: _Worker) -> None:
    """Reproduction 3: ``stam:{x:outbox:y}:mem`` matched the start-up outbox scan; GET raised WRONGTYPE on every
    start, and ``erase_patient('[a-z]*')`` deleted other patients' keys."""
    s = stack_settings
    ids = ["r:outbox:y", "[r-z]*", "rbc", "{r}"]
    first = [RecordEntry(patient_id=p, entry_id=f"outbox-{i}", source="test", text=f"note {i}") for i, p in enumerate(ids)]
    asyncio.run(_send_raw(s, [(e.patient_id.encode(), e.model_dump_json().encode()) for e in first]))
    asyncio.run(_read(s, lambda tr, dl: {e.entry_id for e in first} <= {x["entry_id"] for x in tr}, 300))
    poison_worker.stop()
    poison_worker.start()
    after = RecordEntry(patient_id="r:outbox:y", entry_id="outbox-after-restart", source="test", text="later")
    asyncio.run(_send_raw(s, [(after.patient_id.encode(), after.model_dump_json().encode())]))
    transitions, _ = asyncio.run(_read(s, lambda tr, dl: after.entry_id in {x["entry_id"] for x in tr}, 300))
    assert after.entry_id in {x["entry_id"] for x in transitions}, poison_worker.log()
    assert poison_worker.alive(), poison_worker.log()
    time.sleep(2)
    assert "republish_pending failed" not in poison_worker.log(tail=10**9)  # the start-up scan went through
    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    assert states.load("r:outbox:y").version == 2
    assert states.version("rbc") == 1 and states.version("{r}") == 1 and states.version("[r-z]*") == 1
    states.erase_patient("[r-z]*")
    assert states.version("[r-z]*") == 0
    assert states.version("rbc") == 1 and states.version("r:outbox:y") == 2 and states.version("{r}") == 1


def test_publisher_dead_letters_malformed_files_and_publishes_the_rest(stack_settings: Any, tmp_path: Path) -> None:
    """Reproduction 7: non-UTF-8, deep nesting, arrays, ``"entry": null``, one bad NDJSON line, an invalid bundle
    over the dead-letter limit... each is dead-lettered with its reason; the publisher goes on."""
    from stam.publish import publish_paths

    files = hostile_files(tmp_path / "bad", int(os.environ.get("STAM_HOSTILE_FILES", "15")), seed=7)
    shutil.copy(SMALL_BUNDLE, tmp_path / "bad" / "zz-good.json")
    paths = [str(p) for _, p in files] + [str(tmp_path / "bad" / "zz-good.json")]
    summary = asyncio.run(publish_paths(stack_settings, paths))
    good = len(_good_entries(1000, "x"))
    ndjson_good = sum(3 if k == "ndjson_one_bad_line" else 2 if k == "ndjson_deep_line" else 0 for k, _ in files)
    assert summary.sent == good + ndjson_good, summary.as_dict()
    # one letter per bad file (the NDJSON files: per bad line; the HL7 file: per message)
    assert summary.dead_lettered == len(files), summary.as_dict()

    def ours(dl: list[dict]) -> list[dict]:
        return [d for d in dl if str(d.get("source_file") or "").startswith(str(tmp_path))]

    new = ours(asyncio.run(_read(stack_settings, lambda tr, dl: len(ours(dl)) >= len(files), 30))[1])
    assert len(new) == len(files)
    assert all(d["error"] and d["error_type"] and d["stage"].startswith("publish:") for d in new)
    print(json.dumps({"hostile_files": len(files), "dead_lettered": len(new), "sent": summary.sent,
                      "publish_seconds": round(summary.seconds, 1)}))
    by_file = {Path(d["source_file"]).name: d for d in new}
    large = next(p for k, p in files if k == "large_invalid_bundle")
    big = by_file[large.name]
    assert big["truncated"] and big["value_bytes"] == large.stat().st_size
    assert big["value_sha256"] == hashlib.sha256(large.read_bytes()).hexdigest()
    assert len(base64.b64decode(big["value"])) == DEAD_LETTER_EXCERPT_BYTES
    line = next(p for k, p in files if k == "ndjson_one_bad_line")
    assert by_file[line.name]["source_line"] == 2 and by_file[line.name]["source_byte_offset"] > 0
    assert base64.b64decode(by_file[line.name]["value"]).startswith(b'{"resourceType": "Condition", "id": "bad"')


def test_publisher_refuses_an_entry_that_breaks_a_limit_after_it_was_built(stack_settings: Any) -> None:
    """An entry copied with an updated field skips validation (pydantic's model_copy): the publisher checks
    what it sends against the schema's limits and dead-letters the entry instead of sending it."""
    from stam.publish import Publisher, PublishSummary

    ok = RecordEntry(patient_id="pub-limit", entry_id="pub-limit-1", source="test", text="note")
    bad = ok.model_copy(update={"patient_id": "p" * 300, "entry_id": "pub-limit-2"})

    async def run() -> PublishSummary:
        summary = PublishSummary()
        async with Publisher(stack_settings) as pub:
            await pub.send_entries([bad, ok], summary)
        return summary

    summary = asyncio.run(run())
    assert (summary.sent, summary.dead_lettered) == (1, 1)

    def ours(dl: list[dict]) -> list[dict]:
        return [d for d in dl if d["stage"] == "publish:test"]

    letters = ours(asyncio.run(_read(stack_settings, lambda tr, dl: bool(ours(dl)), 30))[1])
    assert [(d["stage"], d["error_type"]) for d in letters] == [("publish:test", "ValidationError")]
    assert json.loads(base64.b64decode(letters[0]["value"]))["entry_id"] == "pub-limit-2"


async def _entries_on_the_topic(settings: Any) -> int:
    """The entries topic's end offsets, summed over its partitions: it grows when anything arrives there."""
    consumer = kafka_consumer(settings, group_id=None)
    await consumer.start()
    try:
        topic = t.ENTRIES.name(settings.topic_prefix)
        await consumer.topics()  # the cluster's metadata, with the topic's partitions
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        assert parts, topic
        return sum((await consumer.end_offsets(parts)).values())
    finally:
        await consumer.stop()


def test_ctrl_c_during_publish_says_what_was_sent_and_that_rerunning_is_safe(stack_settings: Any) -> None:
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    s = stack_settings
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, PYTHONPATH=str(REPO),
               HF_HUB_OFFLINE="1")
    before = asyncio.run(_entries_on_the_topic(s))
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "publish", "--quiet", "--rate", "10",
                             str(SMALL_BUNDLE)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # Interrupted mid-stream: once its first entries are on the broker (at 10/s the 132 take 13 s), however long
    # its start took on a busy machine.
    deadline = time.monotonic() + 240
    while asyncio.run(_entries_on_the_topic(s)) == before:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted after" in lines[0] and "re-running the same command is safe" in lines[0]
    sent = int(lines[0].split("interrupted after ")[1].split()[0])
    assert 0 < sent < 132 and out == ""


def test_a_stage_output_over_the_broker_limit_dead_letters_its_input_and_the_stream_goes_on(
        stack_settings: Any, poison_worker: _Worker) -> None:
    """Reproduction 1, the stage side: an entry within every limit (242 KB, 1,200 observation components)
    whose extracted payload (one memory per component) is 1.1 MB: the extract agent failed with
    ProducerSendError(MessageSizeTooLargeError), was restarted and consumed nothing more."""
    from schemas import Coding, Quantity

    s = stack_settings
    comps = tuple((Coding(system="http://loinc.org", code=f"c{i}", display="c" * 100 + str(i)),
                   Quantity(value=float(i), unit="mg")) for i in range(1200))
    wide = RecordEntry(patient_id=SMALL_PATIENT, entry_id="wide-panel-1", source="test", resource_type="Observation",
                       codes=(Coding(system="http://loinc.org", code="panel", display="panel"),), components=comps)
    raw = wide.model_dump_json().encode()
    good = _good_entries(20, "after-wide")
    items = [(SMALL_PATIENT.encode(), raw)] + [(e.patient_id.encode(), e.model_dump_json().encode()) for e in good]
    asyncio.run(_send_raw(s, items))
    want = {e.entry_id for e in good}
    digest = hashlib.sha256(raw).hexdigest()
    transitions, letters = asyncio.run(_read(
        s, lambda tr, dl: want <= {x["entry_id"] for x in tr} and any(d.get("value_sha256") == digest for d in dl),
        600))
    assert poison_worker.alive(), poison_worker.log()
    assert want <= {x["entry_id"] for x in transitions}
    letter = next(d for d in letters if d.get("value_sha256") == digest)
    assert (letter["stage"], letter["error_type"]) == ("extract", "MessageTooLarge")
    assert "broker's message limit" in letter["error"] and letter["value_bytes"] == len(raw)
    assert "wide-panel-1" not in {x["entry_id"] for x in transitions}
