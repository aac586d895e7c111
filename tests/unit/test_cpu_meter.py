"""The benchmarks' CPU accounting: a named process's CPU is not counted again in the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.write_path import CpuMeter

# Told to start (after the meter began), the child burns 1 s of CPU, says so, then sleeps: the test waits for its
# word, not a fixed time, so a busy machine (parallel test processes, other jobs) changes nothing but how long.
BURN = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
        "while time.process_time() - t < 1.0: pass\nprint('burnt', flush=True)\ntime.sleep(300)")


def test_named_child_is_counted_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        meter = CpuMeter({"driver": os.getpid(), "child": child.pid})
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "burnt\n"  # the child burnt ~1 s of CPU; the driver only waited for it
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
