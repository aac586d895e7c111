"""Write-path benchmark: Synthea patients through the embedded stack with one worker process.

Prints JSON (stdout):
- ``end_to_end``: entries/s from the first publish to the last transition through the real broker and
  the Faust worker; stage p50/p99 from the worker's prometheus histograms (bucket-interpolated); stale
  redo count; the worker's peak RSS (VmHWM).
- ``in_process``: the same entries through the stage functions directly (no broker), exact per-stage
  p50/p99, to show where the time goes.

Usage: python -m benchmarks.write_path [--patients 5] [--skip-broker]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stam.net import free_port
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3), "p99_ms": round(float(np.percentile(arr, 99)), 3),
            "mean_ms": round(float(arr.mean()), 3), "n": len(values)}


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Quantile from cumulative prometheus buckets (le, count), linear inside the bucket."""
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            frac = (rank - prev_c) / (c - prev_c) if c > prev_c else 0
            return prev_le + (le - prev_le) * frac
        prev_le, prev_c = le, c
    return None


def scrape_metrics(port: int) -> dict[str, Any]:
    """A worker's /metrics on ``port``: the stage histograms' buckets and the counters the benchmarks report."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    stages: dict[str, list[tuple[float, float]]] = {}
    for m in re.finditer(r'stam_stage_seconds_bucket\{le="([^"]+)",stage="(\w+)"\} (\S+)', text):
        stages.setdefault(m.group(2), []).append((float(m.group(1)), float(m.group(3))))
    out: dict[str, Any] = {}
    for stage, b in stages.items():
        b.sort()
        p50, p99 = hist_quantile(b, 0.5), hist_quantile(b, 0.99)
        out[stage] = {"p50_ms": round(p50 * 1000, 3) if p50 is not None else None,
                      "p99_ms": round(p99 * 1000, 3) if p99 is not None else None, "n": int(b[-1][1])}
    redo = re.search(r"^stam_stale_redo_total (\S+)", text, re.M)
    return {"stages": out, "stale_redo": float(redo.group(1)) if redo else 0.0}


def vmhwm_mb(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of process ``pid`` in MB; None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class CpuMeter:
    """CPU seconds (user + system) spent by named processes, each with its live children (less the named ones among
    them: the driver starts the stack), since the meter began.

    On a machine whose cores are all busy, the entries/s a path reaches is about cores / (CPU seconds per entry
    summed over every process it uses), so the split says where the time goes and what a ratio between two
    paths measured on the same cores can be."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.reset()

    def reset(self) -> None:
        """Count from now."""
        self.started = time.monotonic()
        self.base = self._read()

    def _read(self) -> dict[str, float]:
        import psutil

        out: dict[str, float] = {}
        named = set(self.pids.values())
        for name, pid in self.pids.items():
            try:
                proc = psutil.Process(pid)
                procs, todo = [proc], [proc]
                while todo:  # its children, but not another named process or what that one started
                    kids = [k for k in todo.pop().children() if k.pid not in named]
                    procs += kids
                    todo += kids
            except psutil.Error:
                continue
            total = 0.0
            for q in procs:
                try:
                    t = q.cpu_times()
                except psutil.Error:
                    continue
                total += t.user + t.system
            out[name] = total
        return out

    def spent(self) -> tuple[dict[str, float], float]:
        """CPU seconds of each named process since the meter began, and the wall seconds."""
        now, wall = self._read(), time.monotonic() - self.started
        return {n: max(0.0, now.get(n, 0.0) - self.base.get(n, 0.0)) for n in self.pids}, wall

    def report(self, entries: int) -> dict[str, Any]:
        """CPU seconds per component and in all, ms per entry, and how busy the machine's cores were."""
        spent, wall = self.spent()
        total = sum(spent.values())
        cores = os.cpu_count() or 1
        return {"cpu_s": {n: round(v, 1) for n, v in spent.items()}, "cpu_s_total": round(total, 1),
                "cpu_ms_per_entry": {n: round(1000 * v / entries, 2) for n, v in spent.items()} if entries else {},
                "cpu_ms_per_entry_total": round(1000 * total / entries, 2) if entries else None,
                "wall_s": round(wall, 1), "cores": cores, "cores_busy": round(total / wall, 2) if wall else None}


def in_process(entries: list[Any], home: Path) -> dict[str, Any]:
    from stam.compose import local_deps
    from stam.embedding import Embedder
    from stam.stages import extract_stage, impact_stage, link_stage, update_stage

    emb = Embedder()
    deps, _client = local_deps(home / "inproc-milvus.db", home / "inproc.rdb", embedder=emb)
    times: dict[str, list[float]] = {"extract": [], "link": [], "impact": [], "update": []}
    started = time.perf_counter()
    for e in entries:
        t0 = time.perf_counter()
        x = extract_stage(e, deps)
        t1 = time.perf_counter()
        y = link_stage(x, deps)
        t2 = time.perf_counter()
        z = impact_stage(y, deps)
        t3 = time.perf_counter()
        update_stage(z, deps)
        t4 = time.perf_counter()
        for k, a, b in (("extract", t0, t1), ("link", t1, t2), ("impact", t2, t3), ("update", t3, t4)):
            times[k].append(b - a)
    elapsed = time.perf_counter() - started
    return {"entries": len(entries), "seconds": round(elapsed, 3),
            "entries_per_s": round(len(entries) / elapsed, 1),
            "stages": {k: _pct(v) for k, v in times.items()},
            "embedding_cache": {"hits": emb.hits, "misses": emb.misses}}


@dataclass
class StackWorker:
    settings: Any
    worker: subprocess.Popen[bytes]
    metrics_port: int
    stack_pids: dict[str, int]
    """The embedded stack's processes by name (broker, s3, redis, milvus)."""


@contextmanager
def stack_with_worker(home: Path) -> Iterator[StackWorker]:
    """The embedded stack in ``home`` with topics and one write-path worker process; both stopped on exit."""
    from stam import stack
    from topology.admin import ensure_topics

    info = stack.up(home)
    try:
        metrics_port = free_port()
        settings = stack.settings(info, home, web_port=0)
        asyncio.run(ensure_topics(settings))
        env = dict(os.environ, STAM_HOME=str(home), STAM_BROKER_URL=info.broker_url,
                   STAM_REDIS_URL=info.redis_url, STAM_MILVUS_URI=info.milvus_uri, STAM_WEB_PORT="0",
                   STAM_METRICS_PORT=str(metrics_port))
        with open(home / "worker.log", "wb") as log:
            # The four stages, as the in-process run beside it (and the figures in docs/scaling.md) measure them.
            worker = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--stages", "all", "--loglevel",
                                       "warning"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                yield StackWorker(settings, worker, metrics_port,
                                  {n: p.pid for n, p in info.processes.items()})
            finally:
                worker.terminate()
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
    finally:
        stack.down(home)


def end_to_end(entries: list[Any], home: Path, timeout: float) -> dict[str, Any]:
    from stam.cli import consume_transitions
    from stam.publish import Publisher, PublishSummary

    with stack_with_worker(home) as sw:
        settings, worker, metrics_port = sw.settings, sw.worker, sw.metrics_port
        # Warm-up: one entry of a patient not in the measured set, so model load and group join are excluded.
        warm = entries[0].model_copy(update={"patient_id": "warmup", "entry_id": "warmup"})

        async def publish(items: list[Any]) -> None:
            async with Publisher(settings) as pub:
                await pub.send_entries(items, PublishSummary())

        asyncio.run(publish([warm]))
        warmed = asyncio.run(consume_transitions(settings, until_entries={"warmup"}, timeout=300, show=False))

        seen_transitions = warmed["transitions"]

        def burst(items: list[Any]) -> dict[str, Any]:
            nonlocal seen_transitions
            started = time.monotonic()
            asyncio.run(publish(items))
            published = time.monotonic() - started
            counts = asyncio.run(consume_transitions(settings, until_entries={e.entry_id for e in items},
                                                      timeout=timeout, show=False))
            elapsed = time.monotonic() - started
            new_transitions, seen_transitions = counts["transitions"] - seen_transitions, counts["transitions"]
            return {"entries": len(items), "entries_applied": counts["entries_done"],
                    "transitions": new_transitions, "dead_letters": counts["dead_letters"],
                    "publish_seconds": round(published, 3), "seconds": round(elapsed, 3),
                    "entries_per_s": round(counts["entries_done"] / elapsed, 1)}

        cold = burst(entries)
        # The same records as new patients: every entry is processed in full again, but the concept
        # embeddings are cached (a hospital feed's vocabulary of codes saturates quickly).
        renamed = [e.model_copy(update={"patient_id": "b2-" + e.patient_id, "entry_id": "b2-" + e.entry_id})
                   for e in entries]
        warm_run = burst(renamed)
        scraped = scrape_metrics(metrics_port)
        return {"cold_concept_cache": cold, "warm_concept_cache": warm_run,
                "worker_peak_rss_mb": vmhwm_mb(worker.pid),
                "stages_from_histograms_both_runs": scraped["stages"], "stale_redo": scraped["stale_redo"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skip-broker", action="store_true")
    args = parser.parse_args()
    from stam.sources.fhir_r4 import load_bundle

    bundles = sorted((DATA / "synthea-r4-bundles").glob("*.json"))[: args.patients]
    if not bundles:
        raise SystemExit(f"no Synthea bundles under {DATA}")
    entries = [e for b in bundles for e in load_bundle(b).entries]
    report: dict[str, Any] = {"benchmark": "write_path", "patients": len(bundles), "entries": len(entries),
                              "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="stam-bench-") as tmp:
        home = Path(tmp)
        report["in_process"] = in_process(entries, home)
        if not args.skip_broker:
            report["end_to_end"] = end_to_end(entries, home / "stack", args.timeout)
    print(json.dumps(stamp(report), indent=2))


if __name__ == "__main__":
    main()
