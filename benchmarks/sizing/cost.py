"""The per-entry cost of the write path (the report's ``write_cost``): from a hospital-feed JSON, each missing value
an assumption named as such, fitted as a log-normal service time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.sizing.units import DEMO_ENTRIES_TOTAL, MIB, Z99, ceil_int

# What is assumed where ``--feed`` does not say: measured earlier on the 2-core development machine.
ASSUMED_FEED: dict[str, Any] = {
    "entries_per_s": 155.6,
    "worker_peak_rss_mb": 2482.2,
    "entries_held": DEMO_ENTRIES_TOTAL,
    "stages": {"extract": {"p50_ms": 0.132, "p99_ms": 4.44}, "link": {"p50_ms": 0.098, "p99_ms": 4.80},
               "impact": {"p50_ms": 0.584, "p99_ms": 7.20}, "update": {"p50_ms": 1.905, "p99_ms": 10.04}},
}
ASSUMED_FEED_WHY = (
    "no --feed: the whole MIMIC-IV demo through the embedded stack with one worker process on the 2-core dev "
    "machine (python -m benchmarks.mimic_ingest, 298,965 entries held): 155.6 entries/s, stage p50/p99 from the "
    "worker's histograms, peak RSS 2.48 GB (docs/benchmarks/mimic.md, 'Cost per entry on a long record')")
MIN_MEMORIES_FOR_SLOPE = 100_000
"""A worker's peak RSS gives its bytes per warm memory only when it held at least this many memories."""
WORKER_BASE_RSS_MB = 700.0
"""RSS of a worker holding almost nothing (docs/benchmarks/index.md: ~700 MB, PyTorch and MiniLM most of it)."""


def lognormal_through(p50: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal whose median is ``p50`` and 99th percentile ``p99``."""
    sigma = max(0.0, math.log(p99 / p50) / Z99) if p99 > 0 and p50 > 0 else 0.0
    return math.log(p50), sigma


def lognormal_mean(p50: float, p99: float) -> float:
    """Mean of the log-normal whose median is ``p50`` and 99th percentile ``p99``."""
    mu, sigma = lognormal_through(p50, p99)
    return math.exp(mu + sigma * sigma / 2)


@dataclass(frozen=True)
class WriteCost:
    """What one worker process costs per entry: time, its log-normal shape, memory, and where each came from."""
    entries_per_s: float  # one worker process, flat out
    per_entry_s: float  # what the simulation and the plan use
    sigma: float  # log-normal shape of the service time (the update stage's tail)
    rss_mb: float
    entries_held: float  # entries whose state the worker held at that RSS
    per_warm_memory_bytes: float
    stage_mean_ms: dict[str, float]
    source: dict[str, str]


def _one_worker(feed: dict[str, Any] | None) -> dict[str, Any]:
    if not feed:
        return {}
    for node in (feed.get("feed", {}).get("one_worker") if isinstance(feed.get("feed"), dict) else None,
                 feed.get("one_worker")):
        if isinstance(node, dict):
            return node
    return {}


def write_cost(feed: dict[str, Any] | None, *, memories_per_entry: float = 1.0) -> WriteCost:
    """The per-entry cost of one worker process from a hospital-feed JSON (``feed.one_worker`` or ``one_worker``:
    ``entries_per_s``, ``worker_peak_rss_mb`` (a number or one per worker), ``stages``), each missing value taken
    from :data:`ASSUMED_FEED`. Per-entry time = the larger of 1/throughput and the sum of the stage means (each
    stage a log-normal through its p50/p99): the worker runs its four stages on one core."""
    one = _one_worker(feed)
    source: dict[str, str] = {}

    def pick(key: str, value: Any) -> Any:
        if value is None:
            source[key] = "assumed"
            return ASSUMED_FEED[key]
        source[key] = "measured (--feed)"
        return value

    eps = pick("entries_per_s", one.get("entries_per_s") or None)
    at_rate = feed.get("one_worker_at_rate") if isinstance(feed, dict) else None
    if isinstance(at_rate, dict) and at_rate.get("entries_per_s") and at_rate["entries_per_s"] < eps:
        # A continuous feed met a lower ceiling than a flat-out burst drains at: the fixed-rate run fell behind its
        # rate, so what it applied per second is the capacity a live feed gets.
        eps = float(at_rate["entries_per_s"])
        source["entries_per_s"] = "measured (--feed: the fixed-rate run, which fell behind its rate)"
    rss_raw = one.get("worker_peak_rss_mb")
    if isinstance(rss_raw, list):
        rss_raw = max((r for r in rss_raw if r is not None), default=None)
    rss = pick("worker_peak_rss_mb", rss_raw)
    held_raw = None
    measured = one.get("applied") or one.get("entries")
    if source["worker_peak_rss_mb"] != "assumed" and measured:
        warm: dict[str, Any] = one["warmup"] if isinstance(one.get("warmup"), dict) else {}
        held_raw = float(measured) + float(warm.get("applied") or warm.get("entries") or 0)
    held = pick("entries_held", held_raw or None)
    stages_in: dict[str, Any] = one["stages"] if isinstance(one.get("stages"), dict) else {}
    means: dict[str, float] = {}
    sigma_update = 0.0
    for stage, default in ASSUMED_FEED["stages"].items():
        got = stages_in.get(stage) or {}
        p50, p99 = got.get("p50_ms"), got.get("p99_ms")
        if p50 is None or p99 is None or p50 <= 0:
            p50, p99 = default["p50_ms"], default["p99_ms"]
            source[f"stage.{stage}"] = "assumed"
        else:
            source[f"stage.{stage}"] = "measured (--feed)"
        p99 = max(p99, p50)
        means[stage] = lognormal_mean(p50, p99)
        if stage == "update":
            sigma_update = lognormal_through(p50, p99)[1]
    per_entry = max(1.0 / eps, sum(means.values()) / 1000)
    held_memories = held * memories_per_entry
    if source["entries_held"] != "assumed" and held_memories >= MIN_MEMORIES_FOR_SLOPE:
        warm_bytes = max(0.0, rss - WORKER_BASE_RSS_MB) * MIB / held_memories
        source["bytes_per_warm_memory"] = "measured (--feed)"
    else:
        warm_bytes = (ASSUMED_FEED["worker_peak_rss_mb"] - WORKER_BASE_RSS_MB) * MIB / (
            ASSUMED_FEED["entries_held"] * memories_per_entry)
        source["bytes_per_warm_memory"] = "assumed" if source["entries_held"] == "assumed" else (
            f"assumed: the feed's worker held {held_memories:,.0f} memories, too few for a slope (its RSS is mostly "
            "fixed cost); the whole-demo run's peak RSS at 298,965 entries is used")
    return WriteCost(entries_per_s=float(eps), per_entry_s=per_entry, sigma=sigma_update, rss_mb=float(rss),
                     entries_held=float(held), per_warm_memory_bytes=warm_bytes,
                     stage_mean_ms={k: round(v, 3) for k, v in means.items()}, source=source)


def cost_report(cost: WriteCost, *, headroom: float) -> dict[str, Any]:
    """The report's ``write_cost``: the cost, the rule it follows, and processes per 1,000 entries/s."""
    per_1000 = 1000 * cost.per_entry_s
    return {
        "entries_per_s_one_worker": cost.entries_per_s,
        "stage_mean_ms_lognormal": cost.stage_mean_ms,
        "stage_mean_sum_ms": round(sum(cost.stage_mean_ms.values()), 3),
        "per_entry_ms": round(cost.per_entry_s * 1000, 3),
        "per_entry_rule": "max(1000 / entries_per_s, sum of stage log-normal means): the four stages share one core",
        "capacity_entries_per_s_per_worker": round(1 / cost.per_entry_s, 1),
        "service_time": {"distribution": "log-normal", "mean_ms": round(cost.per_entry_s * 1000, 3),
                         "sigma": round(cost.sigma, 4),
                         "p99_ms": round(1000 * _lognormal_quantile(cost.per_entry_s, cost.sigma, Z99), 2),
                         "note": "shape (sigma) through the update stage's p50/p99, scaled to the per-entry mean"},
        "per_1000_entries_per_s": {"worker_processes_busy": round(per_1000, 2),
                                   "worker_processes_with_headroom": ceil_int(per_1000 * headroom),
                                   "headroom": headroom},
        "worker_peak_rss_mb": cost.rss_mb, "entries_held_at_that_rss": cost.entries_held,
        "worker_base_rss_mb": WORKER_BASE_RSS_MB,
        "bytes_per_warm_memory": round(cost.per_warm_memory_bytes),
        "memory_note": "worker RSS modelled as base + bytes per warm memory x memories of the patients it keeps "
                       "warm (state cache and impact projection); linear, from one peak-RSS measurement",
        "source": cost.source,
    }


def _lognormal_quantile(mean: float, sigma: float, z: float) -> float:
    mu = math.log(mean) - sigma * sigma / 2
    return math.exp(mu + sigma * z)
