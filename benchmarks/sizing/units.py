"""The sizing model's shared units and the MIMIC-IV demo's measured totals (used by the load, cost, store and
simulation parts of :mod:`benchmarks.sizing`)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

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


def ceil_int(x: float) -> int:
    """``x`` rounded up to a whole count, a float's rounding noise (``3.0000000001``) not counting as one more."""
    return math.ceil(x - 1e-9)
