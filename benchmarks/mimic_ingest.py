"""MIMIC-IV demo ingestion through the embedded stack (Tansu, Redis, Milvus Lite) and one worker process.

Publishes the MIMIC-IV folder with ``stam publish`` logic, waits until every published entry has produced
its transitions, then checks POE supersession against the source rows in every patient's final state:

- a 'Change' order X with ``discontinue_of_poe_id`` Y: no memory of order Y is left ACTIVE, and one of
  them is in HISTORY with reason ``superseded`` and successor = the memory of X;
- a 'D/C' order Z of Y: no memory of order Y is left ACTIVE and Z's memory is in HISTORY (stopped).

Prints JSON (stdout): time taken, entries/s, per-table counts (rows, entries, dead-lettered rows),
transitions by kind and reason, the POE check, worker peak RSS, CPU seconds per process
(the stack's, the worker's, this driver's) and per entry.

Usage: python -m benchmarks.mimic_ingest [--subjects 10019917,10031404] [--tables poe,pharmacy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.write_path import CpuMeter, scrape_metrics, stack_with_worker, vmhwm_mb
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
MIMIC = DATA / "mimic-iv-demo-2.2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", default=None)
    parser.add_argument("--tables", default=None)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--home", default=None, help="stack folder (default: a temporary one, removed)")
    args = parser.parse_args()
    if not MIMIC.is_dir():
        sys.exit(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    subjects = args.subjects.split(",") if args.subjects else None
    tables = args.tables.split(",") if args.tables else None

    from stam.backends.redis_state import RedisStateStore
    from stam.cli import consume_transitions
    from stam.export import export_state
    from stam.publish import publish_paths
    from stam.sources.mimic import iter_mimic, poe_check
    from stam.transport import redis_client

    tmp = tempfile.TemporaryDirectory(prefix="stam-mimic-") if args.home is None else None
    home = Path(args.home or tmp.name)  # type: ignore[union-attr]
    home.mkdir(parents=True, exist_ok=True)
    ids = {e.entry_id for batch in iter_mimic(MIMIC, subjects=subjects, tables=tables) for e in batch}
    with stack_with_worker(home) as sw:
        settings, worker, metrics_port = sw.settings, sw.worker, sw.metrics_port
        cpu = CpuMeter({**sw.stack_pids, "worker": worker.pid, "driver": os.getpid()})
        started = time.monotonic()
        summary = asyncio.run(publish_paths(settings, [MIMIC], subjects=subjects, tables=tables))
        published = time.monotonic() - started
        counts = asyncio.run(consume_transitions(settings, until_entries=ids, timeout=args.timeout, show=False))
        elapsed = time.monotonic() - started
        scraped = scrape_metrics(metrics_port)
        spent = cpu.report(counts["entries_done"])
        states = RedisStateStore(redis_client(settings))
        check = poe_check(lambda sid: export_state(states.load(sid)), MIMIC, set(subjects) if subjects else None)
        kinds = {k: v for k, v in counts.items() if ":" in k}
        report = {
            "patients": len(summary.patients), "entries_published": summary.sent,
            "entries_applied": counts["entries_done"], "dead_lettered_at_publish": summary.dead_lettered,
            "dead_letters_seen": counts["dead_letters"],
            "publish_seconds": round(published, 1), "seconds_to_last_transition": round(elapsed, 1),
            "note": "seconds include the worker joining its consumer group on Tansu (~30 s)",
            "entries_per_s": round(counts["entries_done"] / elapsed, 1),
            "transitions": counts["transitions"], "transitions_by_kind": dict(sorted(kinds.items())),
            "tables": summary.sources.get("mimic-iv", {}).get("tables"),
            "poe_check": check, "stages": scraped["stages"], "stale_redo": scraped["stale_redo"],
            "worker_peak_rss_mb": vmhwm_mb(worker.pid),
            "stack_peak_rss_mb": {n: vmhwm_mb(pid) for n, pid in sw.stack_pids.items()},
            # driver: this process (the publisher, then the transition consumer)
            "cpu": spent,
        }
        print(json.dumps(stamp(report), indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
