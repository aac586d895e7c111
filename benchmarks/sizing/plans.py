"""The plans (the report's ``plans``): for a hospital or a network, worker processes and their memory, topic
partitions and consumer groups, Redis Cluster shards, Milvus query nodes, broker load and the query consumer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.sizing.cost import WORKER_BASE_RSS_MB, WriteCost, lognormal_mean
from benchmarks.sizing.stores import StoreModel
from benchmarks.sizing.units import DAY_S, GB, MIB, YEAR_DAYS, ceil_int

SENSIBLE_PARTITIONS = (12, 24, 48, 60, 96, 120, 180, 240, 360, 480, 720, 960, 1440)
"""Partition counts offered: each divisible by 2, 3, 4 and 6 (most by 5 too), so they spread evenly over common
process counts."""

# Query consumer: "Read path at 1,000 patients x 2,000 memories" (docs/benchmarks/read-path.md; 2-core machine, no
# reader model).
QUERY_P50_MS, QUERY_P99_MS = 14.9, 35.1
QUERY_BASE_RSS_MB = 900.0  # 2.8 GB with 1,000 patients warm, 1.9 MB each
QUERY_BYTES_PER_WARM_MEMORY = 1.9 * MIB / 2000

# extracted/linked/impacted envelopes (docs/benchmarks/index.md: faust_floor's 3 kB write-path shape)
STAGE_MESSAGE_BYTES = 3000
STAGE_MESSAGES_PER_ENTRY = 3
KAFKA_BROKERS, KAFKA_RF, KAFKA_CORES_PER_BROKER = 3, 3, 2
ENTRIES_RETENTION_DAYS = 7
REDIS_MIN_PRIMARIES = 3  # Redis Cluster's minimum
MILVUS_NODE_CORES, MILVUS_OTHER_CORES = 8, 8


@dataclass(frozen=True)
class Options:
    """What a plan is sized with (the command line's headroom, RAM, shard and node sizes, query load)."""
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
    """Write worker processes at ``peak_rate``: for CPU, for the warm memories of ``concurrent_patients``, and the
    failover minimum; their RAM and cache settings."""
    busy = peak_rate * cost.per_entry_s
    for_cpu = ceil_int(busy * opt.headroom)
    warm_memories = concurrent_patients * store.memories_per_patient
    usable = opt.worker_ram_gb * GB - WORKER_BASE_RSS_MB * MIB
    for_memory = ceil_int(warm_memories * cost.per_warm_memory_bytes / usable) if usable > 0 else for_cpu
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
        "settings": {"STAM_STATE_CACHE_PATIENTS": max(2000, ceil_int(1.25 * concurrent_patients / planned)),
                     "STAM_PROJECTION_MAX_VECTORS": max(250_000, ceil_int(1.25 * per_worker_mem))},
    }


def plan_scale(name: str, rate: dict[str, float], cost: WriteCost, store: StoreModel, opt: Options
               ) -> dict[str, Any]:
    """The plan of one scale (the report's ``plans.hospital`` or ``plans.network``)."""
    peak, mean, occupied = rate["peak_entries_per_s"], rate["mean_entries_per_s"], rate["occupied_beds"]
    workers = plan_workers(peak, occupied, cost, store, opt)
    w = workers["planned"]
    entries_year = mean * DAY_S * YEAR_DAYS
    mem_year = entries_year * store.memories_per_entry
    redis_gb = mem_year * store.redis_bytes_per_memory / GB
    shards = max(REDIS_MIN_PRIMARIES, ceil_int(redis_gb / opt.redis_shard_gb))
    milvus_gb = mem_year * store.milvus_loaded_bytes_per_memory / GB
    nodes = max(1, ceil_int(milvus_gb / opt.milvus_node_gb))
    # query consumer
    q_peak = occupied * opt.queries_per_bed_hour / 3600 * opt.peak_factor
    q_cost = lognormal_mean(QUERY_P50_MS, QUERY_P99_MS) / 1000
    q_for_cpu = ceil_int(q_peak * q_cost * opt.headroom)
    q_warm = occupied * store.memories_per_patient * QUERY_BYTES_PER_WARM_MEMORY
    q_usable = opt.worker_ram_gb * GB - QUERY_BASE_RSS_MB * MIB
    q_for_mem = ceil_int(q_warm / q_usable)
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
