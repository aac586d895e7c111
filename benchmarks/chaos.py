"""Chaos: a crash loses nothing, one bad message stops nothing (issue 13). Prints JSON.

Sections (``--only`` picks some):

- ``bad_input``: 1,000 malformed or hostile values (``benchmarks/hostile.py``) raw on the entries topic,
  interleaved with a real patient's entries, and 200 malformed files through ``stam publish``: every input
  applied or dead-lettered with a reason, the worker alive throughout, every good entry applied; the time until
  the good entries are applied is reported.
- ``erasure``: three real patients through the stack, ``stam erase`` one; the independent scan
  (``stam.erase.scan``: Redis, Milvus, every topic from offset 0, every file under STAM_HOME) must find neither
  its id nor sample texts, and the other patients' exports must be unchanged byte for byte.
- ``restart``: ``stam demo`` as ``make demo`` runs it, then the ``--as-of`` command it prints, run as printed
  after the demo stopped its stack: it answers from the kept record.
- ``faults``: real Synthea patients streamed through the embedded stack twice, once undisturbed and once while
  the worker is killed with SIGKILL at random moments (restarted at once) and Redis, Milvus and the broker are
  each killed mid-stream and restarted. Every patient's final ``stam state --json`` must equal the undisturbed
  run's (``archived_at``, the arrival clock, left out); transitions delivered twice are counted (consumers
  de-duplicate by ``transition_id``).

Usage: python -m benchmarks.chaos [--bundles 4] [--worker-kills 10] [--seed 13] [--only faults] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stam.transport import kafka_consumer, kafka_producer, redis_client
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
BUNDLES = DATA / "synthea-r4-bundles"


def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the stack and its processes ---------------------------------------------------------------------------

class Stack:
    """The embedded stack of one run, with kill -9 and restart of each process."""

    def __init__(self, home: Path, partitions: int = 4, *, redis_fsync: str | None = None) -> None:
        from stam import stack

        self.home = home
        self.info = stack.up(home, redis_fsync=redis_fsync, partitions=partitions)
        self.settings = stack.settings(self.info, home, web_port=0, session_timeout_s=6.0)
        from topology.admin import ensure_topics

        asyncio.run(ensure_topics(self.settings))

    def env(self, **extra: str) -> dict[str, str]:
        s = self.settings
        return dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
                    STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), STAM_WEB_PORT="0",
                    STAM_SESSION_TIMEOUT_S=str(s.session_timeout_s), **extra)

    def storage_kept(self) -> bool:
        """Whether the broker keeps its topics across a crash (``STAM_BROKER_STORAGE=memory`` does not)."""
        return self.info.broker_storage != "memory"

    def kill(self, name: str) -> None:
        pid = self.info.pids[name]
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and b"zombie" not in Path(f"/proc/{pid}/status").read_bytes().lower():
            time.sleep(0.05)

    def start(self, name: str) -> None:
        """``stam stack up``: restarts the dead process on its port with its data."""
        from stam import stack

        self.info = stack.up(self.home)
        assert name in self.info.restarted, (name, self.info.restarted)

    def down(self) -> None:
        from stam import stack

        stack.down(self.home)


@contextmanager
def _worker(stack: Stack, name: str) -> Iterator[subprocess.Popen[bytes]]:
    with (stack.home / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"], cwd=REPO,
                                env=stack.env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _publish(stack: Stack, paths: list[Path], rate: float | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "stam.cli", "publish", "--quiet", *map(str, paths)]
    if rate:
        cmd += ["--rate", str(rate)]
    with (stack.home / "publish.log").open("ab") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=stack.env(), stdout=log, stderr=subprocess.STDOUT)


# --- progress and results ----------------------------------------------------------------------------------

async def _lag(settings: Any) -> int | None:
    """Messages of the write path's input topics not yet committed by its consumer group (None: unknown)."""
    from aiokafka import TopicPartition

    from topology import topics as t

    names = [spec.name(settings.topic_prefix) for spec in (t.ENTRIES, t.EXTRACTED, t.LINKED, t.IMPACTED)]
    # A consumer of the group that never subscribes: it reads the group's committed offsets, it joins nothing.
    consumer = kafka_consumer(settings, group_id=settings.app_id, enable_auto_commit=False)
    try:
        await consumer.start()
        tps = [TopicPartition(n, p) for n in names for p in range(settings.partitions)]
        ends = await consumer.end_offsets(tps)
        lag = 0
        for tp in tps:
            committed = await consumer.committed(tp)
            lag += max(0, ends[tp] - (committed or 0))
        return lag
    except Exception:  # noqa: BLE001 - the broker is down or the group not formed yet
        return None
    finally:
        await consumer.stop()


def _wait_applied(stack: Stack, deadline_s: float, publisher: subprocess.Popen[bytes] | None = None) -> bool:
    deadline = time.monotonic() + deadline_s
    zero_since: float | None = None
    while time.monotonic() < deadline:
        lag = asyncio.run(_lag(stack.settings))
        publishing = publisher is not None and publisher.poll() is None
        if lag == 0 and not publishing:
            zero_since = zero_since or time.monotonic()
            if time.monotonic() - zero_since > 8:  # committed offsets trail the work by the fsync window
                return True
        else:
            zero_since = None
        time.sleep(1.0)
    return False


def _versions(stack: Stack) -> int:
    """The sum of every patient's state version (entries applied), waiting for Redis to answer."""
    import redis as redis_py

    client = redis_client(stack.settings)
    deadline = time.monotonic() + 30
    while True:
        try:
            keys = list(client.scan_iter(match="stam:{*}:ver"))
            return sum(int(v or 0) for v in client.mget(keys)) if keys else 0
        except redis_py.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            client.close()


def _vectors_agree(stack: Stack) -> dict[str, int]:
    """Memories whose vector is missing from Milvus, or in the other store than Redis says."""
    from schemas import Store
    from stam.compose import build_deps

    deps = build_deps(stack.settings)
    missing = wrong = 0
    for pid in deps.states.patients():
        placed = {m: s.store for m, s in deps.states.load(pid).memories.items()}
        found = {r.memory_id: store for store in (Store.ACTIVE, Store.HISTORY) for r in deps.vectors.fetch(pid, store)}
        missing += len(set(placed) - set(found))
        wrong += sum(1 for m, store in placed.items() if m in found and found[m] is not store)
    return {"vectors_missing": missing, "vectors_in_wrong_store": wrong}


def _states(stack: Stack) -> dict[str, dict[str, Any]]:
    from stam.backends.redis_state import RedisStateStore
    from stam.export import export_state
    from stam.transport import redis_client

    states = RedisStateStore(redis_client(stack.settings), prefix=stack.settings.collection_prefix)
    out = {}
    for pid in states.patients():
        data = export_state(states.load(pid))
        for rec in data["active"] + data["history"]:
            rec.pop("archived_at", None)  # the arrival clock: when this run applied it
        out[pid] = data
    return out


async def _transition_ids(settings: Any) -> tuple[int, int]:
    from stam.recovery import read_log

    logged = await read_log(settings)
    ids = [e.transition_id for events in logged.values() for e in events]
    return len(ids), len(set(ids))


def _run(home: Path, paths: list[Path], *, faults: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    # The worst case for Redis: it keeps no append-only file (from its start, so its restart after kill -9 loads the
    # last RDB snapshot and loses recent writes); the worker must notice and rebuild from the transition log.
    stack = Stack(home, redis_fsync="no" if faults and faults.get("redis_without_aof") else None)
    started = time.monotonic()
    events: list[dict[str, Any]] = []
    try:
        n_worker = 0
        worker_cm = _worker(stack, f"worker-{n_worker}")
        worker = worker_cm.__enter__()
        try:
            if faults is None:
                publisher = _publish(stack, paths, None)
            else:
                publisher = _publish(stack, paths, faults["rate"])
                rng = random.Random(seed)
                span = faults["span_s"]
                plan = sorted([(rng.uniform(5, span), "worker") for _ in range(faults["worker_kills"])]
                              + [(span * 0.3, "redis"), (span * 0.55, "milvus")]
                              + ([(span * 0.8, "broker")] if stack.storage_kept() else []))
                if not stack.storage_kept():
                    events.append({"at": 0, "fault": "broker", "skipped": "the broker keeps topics in memory"})
                t0 = time.monotonic()
                for at, what in plan:
                    time.sleep(max(0.0, t0 + at - time.monotonic()))
                    if what == "worker":
                        worker.send_signal(signal.SIGKILL)
                        worker.wait()
                        worker_cm.__exit__(None, None, None)
                        n_worker += 1
                        worker_cm = _worker(stack, f"worker-{n_worker}")
                        worker = worker_cm.__enter__()
                        events.append({"at": round(at, 1), "fault": "worker kill -9, restarted at once"})
                    else:
                        down_s = {"redis": 2.0, "milvus": 5.0, "broker": 3.0}[what]
                        before = _versions(stack) if what == "redis" else None
                        # A Redis kill before anything was applied tests nothing: wait until there is state to lose.
                        while before == 0 and time.monotonic() < t0 + at + 120:
                            time.sleep(1.0)
                            before = _versions(stack)
                        stack.kill(what)
                        time.sleep(down_s)
                        stack.start(what)
                        events.append({"at": round(at, 1), "fault": f"{what} kill -9, restarted after {down_s}s"})
                        if before is not None:
                            events[-1].update(versions_before=before, versions_after_restart=_versions(stack))
                    _log(events[-1]["fault"])
                    if publisher.poll() not in (None, 0):  # the broker was down too long for it: publish again
                        events.append({"at": round(time.monotonic() - t0, 1), "fault": "publisher failed; re-run"})
                        publisher = _publish(stack, paths, None)
            done = _wait_applied(stack, 1800, publisher)
            if publisher.poll() not in (None, 0) and faults is not None:
                publisher = _publish(stack, paths, None)
                done = _wait_applied(stack, 900, publisher)
        finally:
            worker_cm.__exit__(None, None, None)
        total, unique = asyncio.run(_transition_ids(stack.settings))
        recoveries = sum(log.read_text(errors="replace").count("state store recovered from the transition log")
                         for log in stack.home.glob("worker-*.log"))
        return {"seconds": round(time.monotonic() - started, 1), "applied": done, "states": _states(stack),
                "transitions": total, "duplicate_transitions": total - unique, "faults": events,
                "worker_processes": n_worker + 1, "state_store_recoveries": recoveries, **_vectors_agree(stack)}
    finally:
        stack.down()


def faults_section(bundles: int, worker_kills: int, seed: int, work: Path, *,
                   redis_without_aof: bool = True) -> dict[str, Any]:
    from stam.sources.fhir_r4 import load_bundle

    paths = sorted(BUNDLES.glob("*.json"))[:bundles]
    n_entries = sum(len(load_bundle(p).entries) for p in paths)
    _log(f"undisturbed run: {len(paths)} bundles, {n_entries} entries")
    base = _run(work / "undisturbed", paths, faults=None, seed=seed)
    span = 150.0
    _log(f"run under faults over ~{span:.0f}s")
    hit = _run(work / "faults", paths, faults={"rate": n_entries / span, "span_s": span,
                                               "worker_kills": worker_kills,
                                               "redis_without_aof": redis_without_aof}, seed=seed)
    differing = sorted(p for p in set(base["states"]) | set(hit["states"])
                       if base["states"].get(p) != hit["states"].get(p))
    return {
        "patients": len(base["states"]), "entries": n_entries,
        "undisturbed": {k: v for k, v in base.items() if k != "states"},
        "under_faults": {k: v for k, v in hit.items() if k != "states"},
        "patients_differing": len(differing),
        "memories": sum(len(s["active"]) + len(s["history"]) for s in base["states"].values()),
        "redis_without_aof": redis_without_aof,
        "ok": bool(base["applied"] and hit["applied"] and not differing and base["states"]
                   and hit["vectors_missing"] == 0 and hit["vectors_in_wrong_store"] == 0),
    }


async def _send_raw(settings: Any, items: list[tuple[bytes, bytes]]) -> None:
    from topology import topics as t

    producer = kafka_producer(settings, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(t.ENTRIES.name(settings.topic_prefix), key=k, value=v) for k, v in items]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _dead_letters(settings: Any) -> list[dict[str, Any]]:
    from aiokafka import TopicPartition

    from stam.crypto import sealer_for
    from topology import topics as t
    from topology.admin import read_to_end

    sealer = sealer_for(settings)
    topic = t.DEAD_LETTERS.name(settings.topic_prefix)
    consumer = kafka_consumer(settings, group_id=None, enable_auto_commit=False, fetch_max_bytes=64 * 1024 * 1024,
                              max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        return [json.loads(sealer.open(r.value)) async for r in read_to_end(consumer, tps)]
    finally:
        await consumer.stop()


def bad_input_section(n: int, n_files: int, seed: int, work: Path) -> dict[str, Any]:
    """``n`` malformed or hostile values raw on the entries topic, interleaved with a real patient's entries, and
    ``n_files`` malformed files through ``stam publish``: every input applied or dead-lettered with a reason, the
    worker never restarts, every good entry applied."""
    import base64
    import hashlib

    from benchmarks.hostile import expected, hostile_files, hostile_inputs, hostile_key
    from stam.recovery import read_log
    from stam.sources.fhir_r4 import load_bundle

    stack = Stack(work / "bad-input")
    try:
        hostile = hostile_inputs(n, seed)
        good = load_bundle(sorted(BUNDLES.glob("*.json"))[0]).entries
        items: list[tuple[bytes, bytes]] = []
        good_iter = iter(good)
        for i, (kind, raw) in enumerate(hostile):
            items.append((hostile_key(kind, raw), raw))
            if i % 8 == 7 and (e := next(good_iter, None)) is not None:
                items.append((e.patient_id.encode(), e.model_dump_json().encode()))
        items += [(e.patient_id.encode(), e.model_dump_json().encode()) for e in good_iter]
        files = hostile_files(work / "bad-files", n_files, seed)
        with _worker(stack, "worker") as worker:
            started = time.monotonic()
            asyncio.run(_send_raw(stack.settings, items))
            pub = subprocess.run([sys.executable, "-m", "stam.cli", "publish", "--quiet", *(str(p) for _, p in files)],
                                 cwd=REPO, env=stack.env(), capture_output=True, text=True)
            want_good = {e.entry_id for e in good}
            want_applied = {json.loads(raw)["entry_id"] for kind, raw in hostile if expected(kind) == "applied"}
            want_letters = {hashlib.sha256(raw).hexdigest() for kind, raw in hostile if expected(kind) == "dead_letter"}
            good_at: float | None = None
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                applied = {e.entry_id for evs in asyncio.run(read_log(stack.settings)).values() for e in evs}
                if good_at is None and want_good <= applied:
                    good_at = time.monotonic() - started
                letters = asyncio.run(_dead_letters(stack.settings))
                lettered = {d.get("value_sha256") for d in letters} | {
                    hashlib.sha256(base64.b64decode(d["value"])).hexdigest() for d in letters
                    if not d.get("truncated")}
                if want_good <= applied and want_applied <= applied and want_letters <= lettered:
                    break
                time.sleep(2)
            alive = worker.poll() is None
        log = (stack.home / "worker.log").read_text(errors="replace")
        file_letters = [d for d in letters if str(d.get("stage", "")).startswith("publish")]
        return {
            "hostile_raw_inputs": len(hostile), "good_entries": len(good), "malformed_files": len(files),
            "raw_applied_as_expected": len(want_applied & applied), "raw_expected_applied": len(want_applied),
            "raw_dead_lettered_as_expected": len(want_letters & lettered), "raw_expected_dead_letters": len(want_letters),
            "good_applied": len(want_good & applied),
            "seconds_until_good_entries_applied": round(good_at, 1) if good_at is not None else None,
            "publisher_exit": pub.returncode, "publisher_traceback": "Traceback" in pub.stderr,
            "publisher_dead_letters": len(file_letters),
            "dead_letters_without_reason": sum(1 for d in letters if not (d.get("error") and d.get("error_type"))),
            "worker_alive": alive, "worker_bug_path": log.count("a bug, not the message's fault"),
            "ok": bool(alive and want_good <= applied and want_applied <= applied and want_letters <= lettered
                       and "Traceback" not in pub.stderr and pub.returncode in (0, 2)),
        }
    finally:
        stack.down()


def erasure_section(work: Path) -> dict[str, Any]:
    """Three real patients through the stack; ``stam erase`` one; an independent scan of Redis, Milvus, every topic
    from offset 0 and every file under STAM_HOME finds neither its id nor sample texts; the other patients' exports
    are unchanged byte for byte."""
    from stam.backends.redis_state import RedisStateStore
    from stam.erase import pick_samples, scan
    from stam.export import export_state
    from stam.transport import redis_client

    paths = sorted(BUNDLES.glob("*.json"))[4:7]
    stack = Stack(work / "erasure")
    try:
        with _worker(stack, "worker"):
            pub = _publish(stack, paths, None)
            pub.wait()
            applied = _wait_applied(stack, 900)
        client = redis_client(stack.settings)
        states = RedisStateStore(client, prefix=stack.settings.collection_prefix)
        patients = states.patients()
        target, others = patients[0], patients[1:]

        def exports() -> dict[str, bytes]:
            return {p: json.dumps(export_state(states.load(p)), sort_keys=True).encode() for p in others}

        before = exports()
        samples = pick_samples(stack.settings, target, client=client)
        before_scan = scan(stack.settings, target, samples)
        erase = subprocess.run([sys.executable, "-m", "stam.cli", "erase", "--patient", target, "--json",
                                "--request-id", "chaos-erasure"], cwd=REPO, env=stack.env(), capture_output=True,
                               text=True)
        states = RedisStateStore(redis_client(stack.settings), prefix=stack.settings.collection_prefix)
        after_scan = scan(stack.settings, target, samples)
        unchanged = exports() == before
        receipt = json.loads(erase.stdout)["receipt"] if erase.stdout.strip().startswith("{") else None
        return {
            "patients": len(patients), "applied": applied, "sample_texts": len(samples),
            "residuals_before_erasure": sum(before_scan["residuals"].values()),
            "erase_exit": erase.returncode, "receipt_names_patient": target in erase.stdout,
            "receipt_removed": receipt.get("removed") if receipt else None,
            "receipt_published_and_verified": bool(receipt and receipt["verification"]["verified"]),
            "residuals_after_erasure": after_scan["residuals"], "verified": after_scan["verified"],
            "other_exports_unchanged": unchanged,
            "ok": bool(applied and after_scan["verified"] and unchanged and erase.returncode == 0
                       and target not in erase.stdout and sum(before_scan["residuals"].values()) > 0),
        }
    finally:
        stack.down()


def restart_section(work: Path) -> dict[str, Any]:
    """``stam demo`` as ``make demo`` runs it, then the ``--as-of`` command it prints, run as printed (the stack
    is started again from what it kept on disk): it must answer from the kept log."""
    import re
    import shlex

    home = (work / "demo").resolve()
    env = dict(os.environ, STAM_HOME=str(home))
    for k in ("STAM_BROKER_URL", "STAM_REDIS_URL", "STAM_MILVUS_URI"):
        env.pop(k, None)
    demo = subprocess.run([sys.executable, "-m", "stam.cli", "demo"], cwd=REPO, env=env, capture_output=True,
                          text=True)
    line = next((x for x in demo.stdout.splitlines() if x.startswith("Ask more")), "")
    command = line.split(": ", 1)[1] if ": " in line else ""
    stam = [sys.executable, "-m", "stam.cli"]
    answered = None
    try:
        outputs = []
        for part in command.split(" && "):  # run as printed, with this interpreter's stam
            words = shlex.split(part)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words.pop(0)
            run = subprocess.run(stam + words[1:], cwd=REPO, env=env, capture_output=True, text=True)
            outputs.append({"command": " ".join(words[:3]), "exit": run.returncode})
            answered = run
        ok = bool(demo.returncode == 0 and command and answered is not None and answered.returncode == 0
                  and len(answered.stdout.strip().splitlines()) >= 2)
        return {"demo_exit": demo.returncode, "printed_command": command.replace(str(home), "<home>"),
                "steps": outputs, "answer_lines": len(answered.stdout.splitlines()) if answered else 0,
                "answer_head": answered.stdout.splitlines()[:3] if answered else [], "ok": ok}
    finally:
        from stam import stack

        stack.down(home)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundles", type=int, default=4, help="Synthea bundles streamed (default 4)")
    ap.add_argument("--worker-kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--only", default="faults,bad_input,erasure,restart", help="comma-separated sections (default: all)")
    ap.add_argument("--hostile", type=int, default=1000, help="malformed or hostile raw entries (default 1000)")
    ap.add_argument("--hostile-files", type=int, default=200, help="malformed files for stam publish (default 200)")
    ap.add_argument("--redis-aof", action="store_true", help="keep Redis's append-only file in the faulted run "
                    "(default: off, the worst case: a Redis kill -9 loses writes and the worker rebuilds them)")
    ap.add_argument("--keep", default=None, help="keep the stacks' homes and logs under this folder")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stam-chaos-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sections = args.only.split(",")
        if "faults" in sections:
            report["faults"] = faults_section(args.bundles, args.worker_kills, args.seed, work,
                                              redis_without_aof=not args.redis_aof)
        if "bad_input" in sections:
            report["bad_input"] = bad_input_section(args.hostile, args.hostile_files, args.seed, work)
        if "erasure" in sections:
            report["erasure"] = erasure_section(work)
        if "restart" in sections:
            report["restart"] = restart_section(work)
    report["ok"] = all(v.get("ok", False) for v in report.values() if isinstance(v, dict))
    text = json.dumps(stamp(report), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
