"""The lag simulation (the report's ``simulation``): the partitioned write path at each plan's peak, each worker a
FIFO single server solved exactly by the Lindley recursion, plus a deliberately under-provisioned case."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from benchmarks.sizing.cost import WriteCost
from benchmarks.sizing.plans import partitions_for
from benchmarks.sizing.units import DEMO_COUNTS_LOGNORMAL, FloatArray, IntArray


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
    """The report's ``simulation``: every plan at its peak, the network on its CPU workers alone, and one worker fed
    1.3x its capacity."""
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
