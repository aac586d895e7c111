"""benchmarks.sizing: the Lindley queue, the lag test, the load model and the worker count, checked by hand."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import sizing
from stam.transport import local_redis_client, stop_local_redis


def test_lindley_matches_a_hand_computed_queue() -> None:
    # arrivals 0, 1, 2, 10; services 3, 3, 1, 1:
    # e0 starts at 0 (wait 0), done 3; e1 arrives 1, starts 3 (wait 2), done 6;
    # e2 arrives 2, starts 6 (wait 4), done 7; e3 arrives 10 to an idle server (wait 0).
    waits = sizing.lindley_waits(np.array([0.0, 1.0, 2.0, 10.0]), np.array([3.0, 3.0, 1.0, 1.0]))
    assert waits.tolist() == [0.0, 2.0, 4.0, 0.0]


def test_lindley_matches_the_recursion_step_by_step() -> None:
    rng = np.random.default_rng(7)
    arrivals = np.sort(rng.uniform(0, 100, 500))
    services = rng.exponential(0.18, 500)
    expected = [0.0]
    for n in range(1, 500):
        expected.append(max(0.0, expected[-1] + services[n - 1] - (arrivals[n] - arrivals[n - 1])))
    assert np.allclose(sizing.lindley_waits(arrivals, services), expected)


def _run(rate: float) -> dict[str, Any]:
    # one worker, mean service 25 ms: utilisation = rate x 0.025
    return sizing.simulate(rate=rate, hours=1.0, workers=1, partitions=12, weights=np.ones(50),
                           service_mean_s=0.025, service_sigma=0.5, seed=3)


def test_lag_stays_bounded_at_half_utilisation() -> None:
    out = _run(20.0)
    assert out["utilisation"] == pytest.approx(0.5)
    assert out["bounded"] is True
    assert out["lag_max_exact"] < 60
    assert out["rate_out_entries_per_s"] == pytest.approx(out["rate_in_entries_per_s"], rel=0.01)
    assert len(out["lag_max_per_10_min"]) == 6


def test_lag_grows_without_bound_at_1_3() -> None:
    out = _run(52.0)
    assert out["utilisation"] == pytest.approx(1.3)
    assert out["bounded"] is False
    # the server does 40 entries/s, 52 arrive: ~12/s pile up, ~43,000 after an hour
    assert 35_000 < out["lag_at_end"] < 52_000
    series = out["lag_max_per_10_min"]
    assert all(b > a for a, b in zip(series, series[1:], strict=False))


def _admissions(path: Path) -> Path:
    rows = [
        "subject_id,hadm_id,admittime,dischtime,deathtime,admission_type",
        "1,11,2100-01-01 00:00:00,2100-01-03 00:00:00,,URGENT",  # 2 days
        "1,12,2100-02-01 00:00:00,2100-02-01 12:00:00,,URGENT",  # 0.5 day
        "2,21,2100-03-01 06:00:00,2100-03-02 06:00:00,,ELECTIVE",  # 1 day
        "3,31,2100-04-01 06:00:00,,,ELECTIVE",  # no discharge: left out
    ]
    out = path / "admissions.csv.gz"
    with gzip.open(out, "wt") as fh:
        fh.write("\n".join(rows) + "\n")
    return out


def test_load_model_on_a_tiny_admissions_table(tmp_path: Path) -> None:
    adm = sizing.read_admissions(_admissions(tmp_path))
    assert adm["inpatient_days"] == pytest.approx(3.5)
    assert adm["admissions"] == 3 and adm["skipped"] == 1
    assert adm["admission_span_days"] == pytest.approx(31.5 + 1.0)  # subject 1: Jan 1 to Feb 1 noon
    model = sizing.load_model(700, adm, beds=10, occupancy=0.6, peak_factor=4.0, hospitals=3)
    # 700 entries / 3.5 inpatient-days = 200 per inpatient-day; 6 occupied beds -> 1,200 entries a day
    assert model["entries_per_inpatient_day"] == 200.0
    assert model["hospital"]["entries_per_day"] == pytest.approx(1200.0)
    assert model["hospital"]["mean_entries_per_s"] == round(1200 / 86400, 2)
    raw = sizing.rates(200.0, 10, 0.6, 4.0, hospitals=3)
    assert raw["mean_entries_per_s"] == pytest.approx(3 * 1200 / 86400)
    assert raw["peak_entries_per_s"] == pytest.approx(4 * 3 * 1200 / 86400)


def _store(memories_per_patient: float = 100.0) -> sizing.StoreModel:
    return sizing.StoreModel(memories_per_entry=1.0, redis_bytes_per_memory=1500.0, milvus_loaded_bytes_per_memory=1600.0,
                             milvus_object_bytes_per_memory=3200.0, transitions_per_entry=2.0, transition_bytes=1000.0,
                             entry_bytes=800.0, memories_per_patient=memories_per_patient)


FEED = {"one_worker": {"entries_per_s": 50.0, "applied": 90_000, "warmup": {"entries": 10_000},
                       "worker_peak_rss_mb": [1700.0],
                       "stages": {"update": {"p50_ms": 2.0, "p99_ms": 4.0, "n": 1000}}}}


def test_per_entry_cost_from_a_tiny_feed() -> None:
    cost = sizing.write_cost(FEED)
    # 1/50 s = 20 ms beats the stage means (update ~2.1 ms plus the assumed extract/link/impact, ~0.5 ms)
    assert cost.per_entry_s == pytest.approx(0.020)
    assert cost.sigma == pytest.approx(math.log(2.0) / sizing.Z99)
    # (1,700 - 700) MiB over the 100,000 memories it held (90,000 measured + 10,000 warm-up)
    assert cost.per_warm_memory_bytes == pytest.approx(1000 * 1024 * 1024 / 100_000)
    assert cost.source["entries_per_s"] == "measured (--feed)"
    assert cost.source["stage.update"] == "measured (--feed)"
    assert cost.source["stage.extract"] == "assumed"
    # the same numbers nested under "feed", as the sketch had it
    assert sizing.write_cost({"feed": FEED}).per_entry_s == pytest.approx(0.020)


def test_a_small_feed_gives_no_memory_slope() -> None:
    small = {"one_worker": {**FEED["one_worker"], "applied": 1000, "warmup": {"entries": 0}}}
    cost = sizing.write_cost(small)
    # 1,000 MiB over 1,000 memories would be 1 MiB each: mostly fixed cost; the whole-demo slope is used instead
    demo_rss = sizing.ASSUMED_FEED["worker_peak_rss_mb"]
    assert cost.per_warm_memory_bytes == pytest.approx((demo_rss - 700) * 1024 * 1024 / 298_965)
    assert cost.source["bytes_per_warm_memory"].startswith("assumed")


def test_missing_feed_falls_back_to_stated_assumptions() -> None:
    cost = sizing.write_cost(None)
    assert set(cost.source.values()) == {"assumed"}
    p50, p99 = (sizing.ASSUMED_FEED["stages"]["update"][k] for k in ("p50_ms", "p99_ms"))
    update = p50 * math.exp((math.log(p99 / p50) / sizing.Z99) ** 2 / 2)  # log-normal mean through p50 and p99
    assert cost.stage_mean_ms["update"] == pytest.approx(update, abs=1e-3)
    means = sum(cost.stage_mean_ms.values()) / 1000
    assert cost.per_entry_s == pytest.approx(max(1 / sizing.ASSUMED_FEED["entries_per_s"], means), abs=1e-5)
    assert cost.rss_mb == sizing.ASSUMED_FEED["worker_peak_rss_mb"]


def test_worker_count_from_a_tiny_feed() -> None:
    cost = sizing.write_cost(FEED)
    opt = sizing.Options(headroom=1.5, min_workers=2, worker_ram_gb=8.0)
    # 110 entries/s x 20 ms = 2.2 busy processes; x 1.5 = 3.3 -> 4. Memory: 10 patients x 100 memories x
    # 10,485.76 bytes = 10.5 MB, one process's worth
    plan = sizing.plan_workers(110.0, 10, cost, _store(), opt)
    assert (plan["for_cpu"], plan["for_memory"], plan["planned"], plan["bound_by"]) == (4, 1, 4, "cpu")
    assert plan["utilisation_at_peak"] == pytest.approx(2.2 / 4)
    # 30,000 patients: 3M memories x 10,485.76 bytes = 31.46 GB over (8 GB - 700 MiB) = 7.27 GB each -> 4.33 -> 5
    plan = sizing.plan_workers(110.0, 30_000, cost, _store(), opt)
    assert (plan["for_memory"], plan["planned"], plan["bound_by"]) == (5, 5, "memory")
    # a quiet feed still gets the failover minimum
    plan = sizing.plan_workers(1.0, 1, cost, _store(), opt)
    assert (plan["for_cpu"], plan["planned"], plan["bound_by"]) == (1, 2, "failover minimum")


def test_partitions_leave_room_for_four_times_the_processes() -> None:
    assert sizing.partitions_for(3, 4) == 12
    assert sizing.partitions_for(4, 4) == 24
    assert sizing.partitions_for(50, 4) == 240


def test_replay_measure_leaves_out_outboxes_and_never_writes_the_replay(tmp_path: Path) -> None:
    replay = tmp_path / "replay"
    replay.mkdir()
    rdb = replay / "redis-stam.rdb"
    client = local_redis_client(rdb)
    client.hset("stam:{p1}:mem", mapping={"m1": "x" * 500, "m2": "y" * 500, "m3": "z" * 500})
    client.set("stam:{p1}:ver", 3)
    client.set("stam:{p1}:outbox:e1", "o" * 5000)
    stop_local_redis(client, save=True)
    (replay / "replay.json").write_text(json.dumps({"entries": 3}))
    (replay / "events.jsonl").write_text('{"a": 1}\n' * 6)
    before = rdb.read_bytes()
    out = sizing.measure_replay(replay)
    assert out is not None
    assert rdb.read_bytes() == before
    assert (out["memories"], out["memories_per_entry"], out["transitions_per_entry"]) == (3, 1.0, 2.0)
    kinds = out["redis"]["bytes_by_key_kind"]
    assert kinds["outbox"] > 5000
    assert out["redis"]["bytes_per_memory"] == pytest.approx((kinds["mem"] + kinds["ver"]) / 3, abs=0.1)
    assert out["redis"]["bytes_per_memory_by_patient"]["max"] == pytest.approx(out["redis"]["bytes_per_memory"])
