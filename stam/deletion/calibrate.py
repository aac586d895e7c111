"""Conformal risk control for the deletion gate (paper, appendix "Deletion-Gate Calibration and Diagnostics").

The gate deletes an archived memory when its deletion score ``s(m)`` is at least ``tau``. ``tau`` is chosen on a
sealed calibration set of concept types, never on the types the scorer was trained or tuned on. For a protected
type ``t`` (uncertain or never-forget) with memories ``M_t``::

    L_t(tau) = |{m in M_t : s(m) >= tau}| / |M_t|          (0 for a safe-to-forget type)

and the strict criterion picks the smallest ``tau`` with ``(sum_t L_t(tau) + 1) / (n + 1) <= alpha`` over the
``n`` calibration types (all of them, safe-to-forget included). The never-forget-only criterion counts only
never-forget types as protected; it is computed as the paper's diagnostic, never used to delete.

What this guarantees, as narrowly as the paper states it: if the concept types the gate meets are exchangeable
with the calibration types, the expected deletion loss over a new concept type is at most ``alpha``, with loss
measured against the endurance labels (:mod:`stam.deletion.labels`). Safe-to-forget types add zero loss, so
this is not a per-class bound on protected types; it bounds neither deletion precision nor any memory's
clinical risk, and it is only as good as the labels.

``tau`` choice within a step: ``L_t`` only changes at score values, so every ``tau`` in ``(s_(k-1), s_k]`` has
the same calibration loss. :func:`calibrate` returns ``s_k``, the largest (most conservative) point of the
first feasible step; no feasible step (too few calibration types for ``alpha``, or protected memories scored
above everything): ``tau`` is infinite and nothing is deleted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from stam.deletion.labels import Endurance

STRICT = "strict"
NEVER_FORGET_ONLY = "never-forget-only"
CRITERIA = (STRICT, NEVER_FORGET_ONLY)


@dataclass(frozen=True)
class TypeScores:
    """One concept type of the calibration set: its endurance label and its memories' deletion scores."""

    concept_type: str
    label: Endurance
    scores: tuple[float, ...]


def _protected(label: Endurance, criterion: str) -> bool:
    if criterion == STRICT:
        return label.protected
    if criterion == NEVER_FORGET_ONLY:
        return label is Endurance.NEVER_FORGET
    raise ValueError(f"unknown criterion {criterion!r}; known: {', '.join(CRITERIA)}")


def type_loss(t: TypeScores, tau: float, criterion: str = STRICT) -> float:
    """``L_t(tau)``: the share of a protected type's memories scored at or above ``tau`` (0 if not protected)."""
    if not _protected(t.label, criterion) or not t.scores:
        return 0.0
    return sum(s >= tau for s in t.scores) / len(t.scores)


def risk(types: Sequence[TypeScores], tau: float, criterion: str = STRICT) -> float:
    """The conformal bound at ``tau``: ``(sum_t L_t(tau) + 1) / (n + 1)``."""
    return (sum(type_loss(t, tau, criterion) for t in types) + 1.0) / (len(types) + 1)


def calibrate(types: Sequence[TypeScores], alpha: float = 0.01, criterion: str = STRICT) -> float:
    """The smallest ``tau`` (the largest point of the first feasible step) with ``risk <= alpha``; ``inf`` when
    no ``tau`` is feasible."""
    if not 0 < alpha < 1:
        raise ValueError("alpha must be between 0 and 1")
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; known: {', '.join(CRITERIA)}")
    if (1.0 / (len(types) + 1)) > alpha:
        return math.inf  # even with no loss at all, n calibration types cannot certify alpha
    # Loss only falls as tau rises, so the feasible taus are an upward-closed set: bisect over score values.
    values = sorted({s for t in types for s in t.scores})
    lo, hi = 0, len(values)  # answer index in [0, len]; len means "above every score"
    while lo < hi:
        mid = (lo + hi) // 2
        if risk(types, values[mid], criterion) <= alpha:
            hi = mid
        else:
            lo = mid + 1
    return values[lo] if lo < len(values) else math.inf


@dataclass(frozen=True)
class Diagnostics:
    """What a threshold does to a labelled set of memories (the paper's table)."""

    tau: float
    memories: int
    deleted: int
    removed_share: float
    safe_recall: float
    """Share of safe-to-forget memories deleted."""
    safe_precision: float
    """Share of deleted memories that are safe to forget (1.0 when nothing is deleted)."""
    never_forget_loss: float
    """Share of never-forget memories deleted."""
    uncertain_loss: float
    """Share of uncertain memories deleted."""

    def as_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
                for k, v in self.__dict__.items()}


def diagnose(types: Iterable[TypeScores], tau: float) -> Diagnostics:
    by: dict[Endurance, list[float]] = {e: [] for e in Endurance}
    for t in types:
        by[t.label].extend(t.scores)
    total = sum(len(v) for v in by.values())
    gone = {e: sum(s >= tau for s in v) for e, v in by.items()}
    deleted = sum(gone.values())

    def share(n: int, d: int) -> float:
        return n / d if d else 0.0

    return Diagnostics(
        tau=tau, memories=total, deleted=deleted, removed_share=share(deleted, total),
        safe_recall=share(gone[Endurance.SAFE], len(by[Endurance.SAFE])),
        safe_precision=share(gone[Endurance.SAFE], deleted) if deleted else 1.0,
        never_forget_loss=share(gone[Endurance.NEVER_FORGET], len(by[Endurance.NEVER_FORGET])),
        uncertain_loss=share(gone[Endurance.UNCERTAIN], len(by[Endurance.UNCERTAIN])))


def resplit_check(types: Sequence[TypeScores], alpha: float = 0.01, *, rounds: int = 200, calibration: float = 0.5,
                  seed: int = 0, criterion: str = STRICT) -> dict[str, float | int]:
    """The guarantee checked empirically: ``rounds`` random splits of the types into calibration and test; tau
    from the calibration part, the mean protected loss over the test types at that tau. Under exchangeability
    its expectation is at most ``alpha``. Returns the mean and 95th percentile of the test loss, and how often
    nothing could be deleted (tau infinite)."""
    rng = random.Random(seed)
    losses: list[float] = []
    infinite = 0
    cut = max(1, round(len(types) * calibration))
    for _ in range(rounds):
        order = list(types)
        rng.shuffle(order)
        cal, test = order[:cut], order[cut:]
        tau = calibrate(cal, alpha, criterion)
        infinite += math.isinf(tau)
        if test:
            losses.append(sum(type_loss(t, tau, criterion) for t in test) / len(test))
    arr = np.asarray(losses or [0.0])
    return {"rounds": rounds, "alpha": alpha, "calibration_types": cut, "test_types": len(types) - cut,
            "mean_test_loss": round(float(arr.mean()), 5), "p95_test_loss": round(float(np.quantile(arr, 0.95)), 5),
            "rounds_deleting_nothing": infinite}
