"""Sizing past one machine: what a 1,000-bed hospital and a 20-hospital network need, from measured numbers.

Prints JSON (stdout):

- ``load_model``: entries per inpatient-day from the MIMIC-IV demo (every STAM entry of its 100 patients over the
  sum of their admission lengths; outpatient and pre-admission rows are counted too, so it overstates the load per
  bed a little), and from it the mean and peak entries/s of one hospital and of the network.
- ``write_cost``: the per-entry cost of the write path (from ``--feed``, a ``benchmarks.hospital_feed`` JSON; each
  value not found there is an assumption, named as such), fitted as a log-normal service time.
- ``stores``: Redis bytes per memory, measured with ``MEMORY USAGE`` on a copy of a kept replay's Redis file;
  Milvus bytes per memory, estimated from the collection's schema (FLAT index = the raw vectors) and checked
  against the replay's Milvus Lite files; transitions per entry and their size; per inpatient-year and per
  patient-year of record.
- ``plans``: for each scale, worker processes and cores, memory, topic partitions and consumer groups, Redis
  Cluster shards, Milvus query nodes, broker load and the query consumer.
- ``simulation``: the partitioned write path at each scale's peak, simulated (Poisson arrivals, patients drawn by
  their MIMIC entry counts, patient -> partition by a stable hash, partitions round-robin to worker processes,
  each worker a FIFO single server: exact Lindley recursion), plus a deliberately under-provisioned case; lag
  every simulated minute, max per 10-minute window, and whether it stays bounded.
- ``assumed``: every number that was not measured here, with where it comes from.

Usage: python -m benchmarks.sizing [--feed FEED.json] [--seed 0] [--hours 4] [--counts mimic-counts.json]
       [--replay-dir DIR] [--beds 1000] [--occupancy 0.85] [--peak-factor 4] [--hospitals 20]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.sizing.cost import ASSUMED_FEED_WHY, WriteCost, cost_report, write_cost
from benchmarks.sizing.load import (
    count_entries,
    count_mimic,
    load_counts,
    load_model,
    rates,
    read_admissions,
    record_span_days,
)
from benchmarks.sizing.plans import Options, plan_scale
from benchmarks.sizing.simulation import simulations
from benchmarks.sizing.stores import StoreModel, measure_replay, per_year, store_model
from benchmarks.sizing.units import DEMO_ENTRIES_TOTAL, YEAR_DAYS
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
MIMIC = DATA / "mimic-iv-demo-2.2"
REPLAY = REPO / ".stam" / "bench" / "mimic-all"
"""``make bench-asof`` keeps its replay of every demo patient with every table here (``stam eval`` replays have the
same shape: ``--replay-dir`` takes any)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (this module's docstring is its help)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sizing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feed", type=Path, default=None, help="a benchmarks.hospital_feed JSON (per-entry cost)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hours", type=float, default=4.0, help="simulated hours per case")
    parser.add_argument("--counts", type=Path, default=None,
                        help="{subject_id: entries} of the MIMIC-IV demo (default: counted from the replay's "
                             "entries.jsonl, else from the MIMIC-IV folder: ~30 s)")
    parser.add_argument("--entries-jsonl", type=Path, default=None,
                        help="the demo's entries, for the record span of a patient-year (default: the replay's "
                             "entries.jsonl; without one, admissions only)")
    parser.add_argument("--mimic", type=Path, default=MIMIC)
    parser.add_argument("--replay-dir", type=Path, default=REPLAY, help="a kept stam eval replay (Redis, Milvus)")
    parser.add_argument("--beds", type=int, default=1000)
    parser.add_argument("--occupancy", type=float, default=0.85)
    parser.add_argument("--peak-factor", type=float, default=4.0, help="busiest hour over the daily mean")
    parser.add_argument("--hospitals", type=int, default=20)
    parser.add_argument("--headroom", type=float, default=1.5, help="worker processes = busy processes at peak x this")
    parser.add_argument("--min-workers", type=int, default=2, help="processes kept for failover")
    parser.add_argument("--worker-ram-gb", type=float, default=8.0, help="RAM per worker or query process")
    parser.add_argument("--redis-shard-gb", type=float, default=25.0, help="data per Redis Cluster primary")
    parser.add_argument("--milvus-node-gb", type=float, default=48.0, help="loaded data per Milvus query node")
    parser.add_argument("--queries-per-bed-hour", type=float, default=1.0)
    parser.add_argument("--no-simulate", action="store_true")
    return parser.parse_args(argv)


def options(args: argparse.Namespace) -> Options:
    """The plans' options from the command line."""
    return Options(headroom=args.headroom, min_workers=args.min_workers, worker_ram_gb=args.worker_ram_gb,
                   redis_shard_gb=args.redis_shard_gb, milvus_node_gb=args.milvus_node_gb,
                   queries_per_bed_hour=args.queries_per_bed_hour, peak_factor=args.peak_factor)


def add_years(store_report: dict[str, Any], store: StoreModel, *, per_day: float, total: int,
              entries_jsonl: Path, admissions: dict[str, Any]) -> None:
    """What a year holds, per occupied bed and per patient-year of record, into the report's ``stores``."""
    span_days = record_span_days(entries_jsonl)
    span_src = f"first to last clinical day of each patient's entries ({entries_jsonl.name})"
    if span_days is None:
        span_days, span_src = admissions["admission_span_days"], (
            "first admission to last discharge per patient (admissions only: shorter than the record, so this "
            "overstates entries per year)")
    store_report["per_inpatient_year"] = {
        **per_year(store, per_day * YEAR_DAYS),
        "note": "one occupied bed for a year: entries per inpatient-day x 365"}
    store_report["per_patient_year_of_record"] = {
        **per_year(store, total / (span_days / YEAR_DAYS)), "patient_years": round(span_days / YEAR_DAYS, 2),
        "note": f"the demo's entries over its patients' record spans: {span_src}"}


# a table
def assumptions(args: argparse.Namespace, cost: WriteCost) -> dict[str, Any]:
    """The report's ``assumed``: every number that was not measured here, with where it comes from."""
    return {
        "write_cost": ASSUMED_FEED_WHY if "assumed" in cost.source.values() else None,
        "worker_base_rss_mb": "700 MB (docs/benchmarks/index.md: PyTorch and MiniLM)",
        "peak_factor": f"{args.peak_factor}x the daily mean in the busiest hour",
        "headroom": f"{args.headroom}x the busy processes at peak; {args.min_workers} processes at least",
        "warm_set": "every admitted patient warm in one worker (state cache and impact projection), each with "
                    "the mean MIMIC-IV demo record; a smaller warm set trades RAM for reloads not measured here",
        "query": f"{args.queries_per_bed_hour} question per occupied bed per hour, same peak factor; warm query "
                 "p50/p99 14.9/35.1 ms and 1.9 MB per 2,000-memory patient (docs/benchmarks/read-path.md)",
        "kafka": "3 brokers, 2 cores each, RF 3; stage envelopes 3 kB",
        "redis": f"{args.redis_shard_gb} GB of data per primary, 1 replica, 1 core per node",
        "milvus": f"{args.milvus_node_gb} GB loaded per query node (a 64 GB node), 8 cores per node plus 8 "
                  "for proxy, coordinators, data and index nodes",
    }


def main(argv: list[str] | None = None) -> None:
    """Print the sizing report (JSON) for the command line's scales and inputs."""
    args = parse_args(argv)
    admissions_path = args.mimic / "hosp" / "admissions.csv.gz"
    if not admissions_path.is_file():
        raise SystemExit(f"MIMIC-IV demo admissions not found at {admissions_path} (--mimic or STAM_SHARED_DATA)")
    admissions = read_admissions(admissions_path)
    entries_jsonl = args.entries_jsonl or args.replay_dir / "entries.jsonl"
    counts = load_counts(args.counts) or count_entries(entries_jsonl) or count_mimic(args.mimic)
    total = sum(counts.values()) if counts else DEMO_ENTRIES_TOTAL
    feed = json.loads(args.feed.read_text()) if args.feed and args.feed.is_file() else None
    opt = options(args)

    load = load_model(total, admissions, beds=args.beds, occupancy=args.occupancy, peak_factor=args.peak_factor,
                      hospitals=args.hospitals)
    replay = measure_replay(args.replay_dir) if args.replay_dir.is_dir() else None
    store, store_report = store_model(replay, counts)
    cost = write_cost(feed, memories_per_entry=store.memories_per_entry)

    per_day = load["entries_per_inpatient_day"]
    add_years(store_report, store, per_day=per_day, total=total, entries_jsonl=entries_jsonl, admissions=admissions)

    hospital_rate = rates(per_day, args.beds, args.occupancy, args.peak_factor)
    network_rate = rates(per_day, args.beds, args.occupancy, args.peak_factor, args.hospitals)
    plans = {"hospital": plan_scale("hospital", hospital_rate, cost, store, opt),
             "network": plan_scale("network", network_rate, cost, store, opt)}
    report: dict[str, Any] = {
        "benchmark": "sizing", "cpu_count": os.cpu_count(),
        "inputs": {"feed": str(args.feed) if args.feed else None, "feed_found": feed is not None,
                   "counts": str(args.counts) if counts else None,
                   "admissions": str(admissions_path), "replay": str(args.replay_dir) if replay else None,
                   "seed": args.seed, "hours": args.hours},
        "load_model": load,
        "write_cost": cost_report(cost, headroom=opt.headroom),
        "stores": store_report,
        "plans": plans,
        "options": asdict(opt),
        "assumed": assumptions(args, cost),
    }
    if not args.no_simulate:
        report["simulation"] = simulations(plans, cost, counts, hours=args.hours, seed=args.seed,
                                           partition_factor=opt.partition_factor)
    print(json.dumps(stamp(report), indent=1))


if __name__ == "__main__":
    main()
