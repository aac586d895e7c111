"""Sizing past one machine: what a 1,000-bed hospital and a 20-hospital network need, from measured numbers
(``python -m benchmarks.sizing``; what it prints and its options: ``benchmarks/sizing/__main__.py``).

The parts, one module each: ``load`` (the load model), ``cost`` (the per-entry cost), ``stores`` (the store model),
``plans`` (the plans), ``simulation`` (the lag simulation), ``units`` (what they share); ``__main__`` is the command
line and assembles the report. The names the tests use are re-exported here.
"""

from benchmarks.sizing.cost import ASSUMED_FEED, WriteCost, cost_report, lognormal_mean, lognormal_through, write_cost
from benchmarks.sizing.load import (
                                    count_entries,
                                    count_mimic,
                                    load_counts,
                                    load_model,
                                    rates,
                                    read_admissions,
                                    record_span_days,
)
from benchmarks.sizing.plans import Options, partitions_for, plan_scale, plan_workers
from benchmarks.sizing.simulation import lag_bounded, lindley_waits, partition_of, patient_weights, simulate, simulations
from benchmarks.sizing.stores import (
                                    StoreModel,
                                    measure_replay,
                                    milvus_bytes_per_memory,
                                    per_year,
                                    store_model,
)
from benchmarks.sizing.units import DEMO_ENTRIES_TOTAL, Z99

__all__ = [
    "ASSUMED_FEED", "DEMO_ENTRIES_TOTAL", "Options", "StoreModel", "WriteCost", "Z99", "cost_report", "count_entries",
    "count_mimic", "lag_bounded", "lindley_waits", "load_counts", "load_model", "lognormal_mean", "lognormal_through",
    "measure_replay", "milvus_bytes_per_memory", "partition_of", "partitions_for", "patient_weights", "per_year",
    "plan_scale", "plan_workers", "rates", "read_admissions", "record_span_days", "simulate", "simulations",
    "store_model", "write_cost",
]
