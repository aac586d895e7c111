"""The benchmarks' CPU accounting: a named process's CPU is not counted again in the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.write_path import CpuMeter

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(30)"


def test_named_child_is_counted_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        meter = CpuMeter({"driver": os.getpid(), "child": child.pid})
        time.sleep(3.0)  # the child burns ~1 s of CPU (less what it spent before the meter began), then sleeps
        report = meter.report(entries=10)
    finally:
        child.kill()
        child.wait()
    spent = report["cpu_s"]
    assert 0.3 <= spent["child"] <= 1.2
    assert spent["driver"] < 0.3  # the driver slept: the child's second is not its own
    per_entry = report["cpu_ms_per_entry"]  # finer than cpu_s: each part rounded to 0.01 ms, not 0.1 s
    assert abs(report["cpu_ms_per_entry_total"] - (per_entry["child"] + per_entry["driver"])) <= 0.02
    assert abs(report["cpu_s_total"] - (spent["child"] + spent["driver"])) <= 0.1 + 1e-9  # each rounded on its own
    assert abs(report["cpu_ms_per_entry"]["child"] - 100 * spent["child"]) < 6  # ms per entry; spent is rounded
    assert report["cores"] == os.cpu_count()
