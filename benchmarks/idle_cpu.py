"""What an idle embedded stack costs: CPU of each process with nothing to do (issue 35: "an idle stack is idle").

Starts the embedded stack in a temporary home (SeaweedFS ``weed mini``, the Tansu broker on its S3, Redis, Milvus
Lite), creates the topics and measures each process's CPU (user + system seconds from psutil, its children
included) over ``--seconds``: first the stack alone, then with one ``stam worker`` that has joined its consumer
group (one warm-up entry is published and its transitions read before the worker counts as idle) and settled
for ``--settle`` seconds. Prints JSON: per phase, each process's share of one core (percent) and the total.

Usage: python -m benchmarks.idle_cpu [--seconds 30] [--settle 15] [--storage s3] [--phases stack worker]
(make bench-idle). The goal of issue 35: the stack with an idle worker under 5% of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.write_path import DATA, REPO, CpuMeter
from stam.net import free_port
from stam_lab.eval.provenance import stamp

WARM_PATIENT = "idle-warmup"
WARM_BUNDLE = "7bf5504f-bb24-43e0-b58f-f9c7d8a7a9aa.json"  # its first entry, as another patient


def measure(pids: dict[str, int], seconds: float) -> dict[str, Any]:
    """Each process's CPU over ``seconds`` of wall time, as a percentage of one core."""
    meter = CpuMeter(pids)  # each process with its children, less the other named ones
    time.sleep(seconds)
    spent, wall = meter.spent()
    per = {n: round(100 * spent[n] / wall, 2) for n in pids}
    return {"seconds": round(wall, 1), "cpu_pct_of_one_core": per,
            "total_pct_of_one_core": round(sum(per.values()), 2)}


def _warm_up(settings: Any) -> float:
    """One entry through the worker (the group joined, the model loaded, the stores opened); seconds it took."""
    from stam.cli import consume_transitions
    from stam.publish import Publisher, PublishSummary
    from stam.sources.fhir_r4 import load_bundle

    entry = load_bundle(DATA / "synthea-r4-bundles" / WARM_BUNDLE).entries[0].model_copy(update={"patient_id": WARM_PATIENT,
                                                                    "entry_id": "idle-warmup-0"})

    async def publish() -> None:
        async with Publisher(settings) as pub:
            await pub.send_entries([entry], PublishSummary())

    started = time.monotonic()
    asyncio.run(publish())
    done = asyncio.run(consume_transitions(settings, until_entries={entry.entry_id}, timeout=300, show=False))
    if not done["entries_done"]:
        raise SystemExit("the warm-up entry was not applied within 300 s; see the worker's log")
    return time.monotonic() - started


def _worker(home: Path, log: Any, extra: dict[str, str]) -> subprocess.Popen[bytes]:
    """``stam worker`` as a user starts it against the stack (its web on a free port, no metrics port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAM_")}
    env.update(STAM_HOME=str(home), STAM_WEB_PORT=str(free_port()), **extra)
    return subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured wall time per phase (default 30)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds waited before each measurement")
    parser.add_argument("--storage", default="s3", choices=["s3", "memory"], help="the broker's storage engine")
    parser.add_argument("--phases", nargs="+", default=["stack", "worker"], choices=["stack", "worker"],
                        help="stack: the stack alone; worker: the stack and one idle worker (default: both)")
    parser.add_argument("--worker-env", nargs="*", default=[], metavar="STAM_X=V",
                        help="settings of the worker (e.g. STAM_LAG_INTERVAL_S=0), to find what it polls")
    args = parser.parse_args()
    from stam import stack
    from topology.admin import ensure_topics

    report: dict[str, Any] = {"benchmark": "idle_cpu", "storage": args.storage, "worker_env": args.worker_env,
                              "cores": os.cpu_count(),
                              "loadavg_1m_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="stam-idle-") as tmp:
        home = Path(tmp)
        info = stack.up(home, storage=args.storage)
        worker: subprocess.Popen[bytes] | None = None
        try:
            settings = stack.settings(info, home)
            asyncio.run(ensure_topics(settings))
            pids = {n: p.pid for n, p in info.processes.items()}
            if "stack" in args.phases:
                time.sleep(args.settle)
                report["stack"] = measure(pids, args.seconds)
            if "worker" in args.phases:
                with open(home / "worker.log", "wb") as log:
                    worker = _worker(home, log, dict(kv.split("=", 1) for kv in args.worker_env))
                    report["warm_up_s"] = round(_warm_up(settings), 1)
                    time.sleep(args.settle)
                    report["stack_and_worker"] = measure({**pids, "worker": worker.pid}, args.seconds)
        finally:
            if worker is not None:
                worker.terminate()
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
            stack.down(home)
    report["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(stamp(report), indent=2))


if __name__ == "__main__":
    main()
