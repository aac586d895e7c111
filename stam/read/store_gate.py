"""The store gate: serve ACTIVE only, or ACTIVE + HISTORY.

Signals are query-memory similarities (the paper's section 3.4): ``s_active`` and ``s_history``, the best
cosine between the question and a memory of each store. HISTORY is served when the question carries a
history cue (change, first/earliest, previous, history, trend, ever, highest/lowest, how many, ... or a
date: such questions are about past states by their wording) or when ``s_history - s_active`` exceeds the
calibrated threshold (the past matches the question better than the present does).

Calibration (:func:`calibrate`) picks the threshold on a replayed or labelled set. For every question the
two arms are compared: ``agree`` says the ACTIVE-only arm is as good as ACTIVE+HISTORY (same answer from
the reader, or, without a reader, the same gold evidence recall). A threshold tau skips HISTORY for the
questions without a cue whose margin is at most tau. With lambda the weight of serving cost, tau minimises

    loss(tau) = disagreement rate among all questions caused by skipping  -  lambda * skip rate(tau)

so lambda = 0 never trades quality for tokens and a larger lambda skips more. Ties go to the lower tau
(serving more history).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas.query import GateDecision, GateMode
from stam.config import DEFAULT_GATE_THRESHOLD as DEFAULT_THRESHOLD
from stam.read.intent import Intent

HISTORY_CUES = (
    r"chang\w*", r"first", r"earliest", r"initial(?:ly)?", r"previous(?:ly)?", r"prior", r"before", r"history",
    r"historical", r"trend\w*", r"ever", r"past", r"used to", r"formerly", r"former", r"last time",
    r"over time", r"stopp?ed", r"discontinu\w*", r"resolved", r"no longer", r"increas\w*", r"decreas\w*",
    r"went (?:up|down)", r"since when", r"how long", r"originally", r"switch\w*", r"replac\w*",
    # Aggregates over time need every value, not only the current one.
    r"highest", r"lowest", r"maximum", r"minimum", r"peak", r"nadir", r"how many",
)
_CUE = re.compile(r"\b(" + "|".join(HISTORY_CUES) + r")\b", re.IGNORECASE)
# A question that names a date or a year asks about a point in time, which may be past.
_DATE = re.compile(r"\b(?:1[89]|2[0-2])\d\d(?:-\d\d(?:-\d\d)?)?\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b")
TIE_EPSILON = 0.005
"""Margins within this of the threshold are ties, and a tie is not "HISTORY matches better": every value of a
coded concept shares one vector, so their margins differ by float noise only."""


def history_cue(question: str, *, dates: bool = True) -> str | None:
    """The first history cue word of the question; with ``dates``, a date counts as one (the read path reads a
    date as the time to view the state at instead, see :mod:`stam.read.intent`)."""
    m = _CUE.search(question)
    if m:
        return m.group(1).lower()
    d = _DATE.search(question) if dates else None
    return f"date {d.group(0)}" if d else None


@dataclass(frozen=True)
class StoreGate:
    threshold: float = DEFAULT_THRESHOLD

    def decide(self, question: str, mode: GateMode, s_active: float | None, s_history: float | None,
               intent: Intent | None = None) -> GateDecision:
        common: dict[str, Any] = {"mode": mode, "s_active": s_active, "s_history": s_history,
                                  "threshold": self.threshold}
        if mode is GateMode.ACTIVE:
            return GateDecision(serve_history=False, reason="mode active: HISTORY not served", **common)
        if mode is GateMode.BOTH:
            return GateDecision(serve_history=True, reason="mode both: HISTORY always served", **common)
        if s_history is None:
            return GateDecision(serve_history=False, reason="HISTORY holds nothing for this patient", **common)
        if intent is not None and intent.needs_history:
            cue = intent.cue or intent.time_text or intent.kind
            return GateDecision(serve_history=True, reason=f"the question asks for {intent.kind} ({cue!r})",
                                cue=cue, **common)
        word = history_cue(question, dates=intent is None)
        if word:
            return GateDecision(serve_history=True, reason=f"history cue {word!r} in the question", cue=word,
                                **common)
        margin = s_history - (s_active if s_active is not None else -1.0)
        if margin > self.threshold + TIE_EPSILON:
            return GateDecision(serve_history=True, reason=f"HISTORY matches better (margin {margin:.3f} > "
                                f"{self.threshold:.3f} + {TIE_EPSILON})", **common)
        return GateDecision(serve_history=False, reason=f"ACTIVE suffices (margin {margin:.3f} <= "
                            f"{self.threshold:.3f} + {TIE_EPSILON})", **common)


@dataclass(frozen=True)
class GateSample:
    """One replayed question: the gate's signals and whether ACTIVE-only agrees with ACTIVE+HISTORY."""

    margin: float | None
    """s_history - s_active; None when HISTORY is empty for the patient."""
    cue: bool
    agree: bool
    tokens_active: int = 0
    tokens_both: int = 0


@dataclass(frozen=True)
class Calibration:
    threshold: float
    lam: float
    skip_rate: float
    disagreement: float
    served_tokens_gate: float
    served_tokens_both: float
    n: int

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": round(self.threshold, 6), "lambda": self.lam, "skip_rate": round(self.skip_rate, 4),
                "disagreement": round(self.disagreement, 4),
                "served_tokens_gate_mean": round(self.served_tokens_gate, 1),
                "served_tokens_both_mean": round(self.served_tokens_both, 1), "n": self.n}


def _evaluate(samples: Sequence[GateSample], tau: float) -> tuple[float, float, float]:
    skipped = [s for s in samples if s.margin is None or (not s.cue and s.margin <= tau)]
    n = len(samples)
    skip_rate = len(skipped) / n
    disagreement = sum(1 for s in skipped if not s.agree) / n
    skipped_ids = {id(s) for s in skipped}
    tokens = sum(s.tokens_active if id(s) in skipped_ids else s.tokens_both for s in samples) / n
    return skip_rate, disagreement, tokens


def calibrate(samples: Sequence[GateSample], lam: float) -> Calibration:
    """The threshold minimising disagreement - lam * skip rate over the samples (see module doc)."""
    if not samples:
        raise ValueError("calibration needs at least one sample")
    margins = sorted({s.margin for s in samples if s.margin is not None})
    # Candidates: below every margin (serve all), and each observed margin (skip up to and including it).
    candidates = [(margins[0] - 1e-6) if margins else DEFAULT_THRESHOLD, *margins]
    best: tuple[float, float] | None = None
    for tau in candidates:
        skip, dis, _ = _evaluate(samples, tau)
        loss = dis - lam * skip
        if best is None or loss < best[0] - 1e-12:
            best = (loss, tau)
    assert best is not None
    tau = best[1]
    skip, dis, tokens = _evaluate(samples, tau)
    both = sum(s.tokens_both for s in samples) / len(samples)
    return Calibration(threshold=tau, lam=lam, skip_rate=skip, disagreement=dis, served_tokens_gate=tokens,
                       served_tokens_both=both, n=len(samples))


def write_gate_file(path: Path, cal: Calibration, *, source: str) -> None:
    data = cal.as_dict() | {"source": source, "calibrated_at": datetime.now(UTC).isoformat()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def load_gate(path: Path | None, default: float) -> StoreGate:
    """The calibrated gate from ``path`` when it exists, else the configured default threshold."""
    if path is not None and path.is_file():
        return StoreGate(threshold=float(json.loads(path.read_text())["threshold"]))
    return StoreGate(threshold=default)
