"""The hospital-feed benchmark's latency per half second of publishing: a stall shows where in the run it was."""

from __future__ import annotations

from benchmarks.hospital_feed import half_seconds


def test_entries_fall_in_the_half_second_they_were_sent() -> None:
    got = half_seconds([(0.1, 0.10), (0.4, 0.30), (0.2, 0.20), (1.2, 1.5), (1.49, 0.5)])
    assert got == [[0.0, 3, 0.2, 0.3], [1.0, 2, 1.0, 1.5]]  # nothing sent in [0.5, 1.0): no row
    assert half_seconds([]) == []
