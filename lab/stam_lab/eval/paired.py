"""Paired comparisons of two configurations scored question by question (no scipy; numpy only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["mcnemar_exact", "paired_bootstrap", "sign_flip_permutation"]

_EXACT_MAX_NONZERO = 16
_CHUNK = 1 << 20  # cells (resamples x questions) drawn per numpy batch, to bound memory


def _check_pair(a: Sequence[Any], b: Sequence[Any]) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired inputs differ in length: {len(a)} != {len(b)}")
    if not a:
        raise ValueError("paired inputs are empty")


def _as_arrays(a: Sequence[float], b: Sequence[float]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    _check_pair(a, b)
    return np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test on paired right/wrong outcomes.

    ``b`` counts questions A got right and B wrong, ``c`` the reverse. The two-sided p-value is
    ``min(1, 2 * P[X <= min(b, c)])`` with ``X ~ Binomial(b + c, 1/2)``, computed in exact integer arithmetic;
    it is 1.0 when there are no discordant pairs. Also reports ``n`` and both accuracies.
    """
    _check_pair(a_correct, b_correct)
    b = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if y and not x)
    n_disc = b + c
    if n_disc == 0:
        p = 1.0
    else:
        tail = sum(math.comb(n_disc, k) for k in range(min(b, c) + 1))
        p = min(1.0, 2 * tail / 2**n_disc)
    n = len(a_correct)
    return {
        "n": n,
        "b": b,
        "c": c,
        "discordant": n_disc,
        "a_accuracy": sum(1 for x in a_correct if x) / n,
        "b_accuracy": sum(1 for y in b_correct if y) / n,
        "p_value": p,
    }


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    *,
    n_resamples: int = 10000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Paired bootstrap of the mean difference ``b - a`` (questions resampled with replacement, pairs kept).

    Returns the observed ``mean_difference``, the percentile interval ``ci_low``/``ci_high`` at ``confidence``
    (numpy's linear quantiles of the resampled means), and ``share_le_zero``: the share of resampled mean
    differences that are <= 0 (a one-sided bootstrap p-value for "B beats A"). Deterministic for a fixed seed.
    """
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must lie strictly between 0 and 1")
    xa, xb = _as_arrays(a, b)
    diff = xb - xa
    n = diff.size
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples, dtype=np.float64)
    step = max(1, _CHUNK // n)
    for start in range(0, n_resamples, step):
        stop = min(n_resamples, start + step)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return {
        "n": n,
        "mean_difference": float(diff.mean()),
        "ci_low": float(low),
        "ci_high": float(high),
        "confidence": confidence,
        "share_le_zero": float(np.mean(means <= 0.0)),
        "n_resamples": n_resamples,
        "seed": seed,
    }


def sign_flip_permutation(
    a: Sequence[float],
    b: Sequence[float],
    *,
    n_permutations: int = 10000,
    seed: int = 0,
) -> dict[str, Any]:
    """Two-sided paired sign-flip permutation test of the mean difference ``b - a``.

    Under the null each non-zero difference is equally likely to carry either sign; the p-value is the share
    of sign assignments whose ``|sum|`` reaches the observed ``|sum|`` (zero differences never change it).
    With at most 16 non-zero differences all ``2**m`` assignments are enumerated (``method="exact"``;
    ``p = 1.0`` when all differences are zero); otherwise ``n_permutations`` seeded random assignments are
    drawn and ``p = (count + 1) / (n_permutations + 1)`` (``method="monte_carlo"``).
    """
    xa, xb = _as_arrays(a, b)
    diff = xb - xa
    nz = diff[diff != 0.0]
    m = nz.size
    observed = abs(float(nz.sum()))
    # Sums of the same magnitudes in another order may differ in the last bits; compare with a small slack.
    tol = 1e-9 * max(1.0, float(np.abs(nz).sum()))
    if m <= _EXACT_MAX_NONZERO:
        total = 1 << m
        if m == 0:
            count = total
        else:
            bits = (np.arange(total, dtype=np.int64)[:, None] >> np.arange(m, dtype=np.int64)) & 1
            sums = (1 - 2 * bits).astype(np.float64) @ nz
            count = int(np.count_nonzero(np.abs(sums) >= observed - tol))
        p = count / total
        method, draws = "exact", total
    else:
        if n_permutations < 1:
            raise ValueError("n_permutations must be >= 1")
        rng = np.random.default_rng(seed)
        count = 0
        step = max(1, _CHUNK // m)
        for start in range(0, n_permutations, step):
            rows = min(n_permutations, start + step) - start
            signs = rng.integers(0, 2, size=(rows, m)) * 2 - 1
            count += int(np.count_nonzero(np.abs(signs.astype(np.float64) @ nz) >= observed - tol))
        p = (count + 1) / (n_permutations + 1)
        method, draws = "monte_carlo", n_permutations
    return {
        "n": diff.size,
        "n_nonzero": m,
        "mean_difference": float(diff.mean()),
        "p_value": p,
        "method": method,
        "n_permutations": draws,
        "seed": seed if method == "monte_carlo" else None,
    }
