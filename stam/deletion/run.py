"""The gate's calibration run on a replayed store (``stam deletion calibrate``): label the concept types of the
candidates, split them, train the head, choose tau on the sealed calibration split, and report the paper's
diagnostics. Nothing is deleted here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from datetime import UTC, date, datetime
from typing import Any

import numpy as np

from schemas import AtomicMemory
from stam.deletion.calibrate import NEVER_FORGET_ONLY, STRICT, TypeScores, calibrate, diagnose, resplit_check
from stam.deletion.candidates import select
from stam.deletion.gate import Gate, GateSpec, calibration_id
from stam.deletion.judge import Label, by_type, code_labels, judge_type
from stam.deletion.labels import Endurance
from stam.deletion.scorer import render, split_types, train
from stam.patient_state import PatientState


def candidate_types(states: Iterable[PatientState]) -> tuple[dict[str, list[AtomicMemory]], dict[str, int]]:
    """The candidates of every patient (:func:`stam.deletion.candidates.select`) grouped by concept type, and how
    many HISTORY memories each keep rule held back."""
    memories: list[AtomicMemory] = []
    kept: dict[str, int] = {}
    for state in states:
        sel = select(state)
        memories.extend(c.stored.memory for c in sel.candidates)
        for why in sel.kept.values():
            kept[why.value] = kept.get(why.value, 0) + 1
    return by_type(memories), kept


def label_types(types: dict[str, list[AtomicMemory]], *, judge: Any = None,
                progress: Callable[[int, int], None] | None = None, known: Iterable[Label] = (),
                on_label: Callable[[Label], None] | None = None, limit: int = 0,
                seed: int = 0) -> tuple[list[Label], list[Label]]:
    """(labels used, labels from codes). With a judge (an LLMClient) every type is judged and the codes are only
    compared; without one, the codes' labels are used and the types they do not decide are left out. ``known``:
    labels kept from an earlier run (a label file), used as they are; only the other types are judged, each
    handed to ``on_label`` as it comes (a long labelling run can be stopped and resumed). ``limit``: judge at
    most this many of them, a seeded random sample (the others stay unlabelled and out of the calibration)."""
    today = date.today()
    codes = code_labels(types, today=today)
    have = {x.concept_type: x for x in known if x.concept_type in types}
    if judge is None:
        return (list(have.values()) or codes), codes
    out = list(have.values())
    todo = [(t, ms) for t, ms in sorted(types.items()) if t not in have]
    if limit and len(todo) > limit:
        todo = sorted(random.Random(seed).sample(todo, limit))
    for i, (_t, ms) in enumerate(todo, 1):
        label = judge_type(judge, ms, today=today)
        out.append(label)
        if on_label is not None:
            on_label(label)
        if progress is not None:
            progress(i, len(todo))
    return out, codes


def calibration_run(types: dict[str, list[AtomicMemory]], labels: list[Label], embed: Callable[[list[str]], Any],
                    *, encoder: str, alpha: float = 0.01, seed: int = 0, rounds: int = 200
                    ) -> tuple[dict[str, Any], dict[str, Gate]]:
    """Split the labelled types, train the head on ``train``, pick tau on ``calibration`` and diagnose it on the
    calibration split, on ``held_out`` (dev and calibration types: none the head was trained on) and on the
    whole ``store`` (every labelled candidate, training types included: what a sweep of this store would
    delete). The re-split check runs over the held-out types. Returns the report and the gate of each
    criterion (the head with its tau), which ``stam deletion sweep`` applies."""
    label_of = {x.concept_type: x.endurance for x in labels if x.concept_type in types}
    split = split_types(label_of, seed=seed)
    rows = [(t, m) for t in sorted(label_of) for m in types[t]]
    if not rows:
        raise ValueError("no labelled candidate memories")
    vectors = np.asarray(embed([render(m) for _, m in rows]), dtype=np.float32)
    part = np.asarray([split[t] for t, _ in rows])
    safe = np.asarray([label_of[t] is Endurance.SAFE for t, _ in rows], dtype=np.float32)
    names = [t for t, _ in rows]
    tr = part == "train"
    head = train(vectors[tr], safe[tr], encoder=encoder, types=[n for n, k in zip(names, tr, strict=True) if k],
                 seed=seed)
    scores = head.score(vectors)

    def grouped(mask: np.ndarray) -> list[TypeScores]:
        by: dict[str, list[float]] = {}
        for n, s, k in zip(names, scores.tolist(), mask.tolist(), strict=True):
            if k:
                by.setdefault(n, []).append(s)
        return [TypeScores(t, label_of[t], tuple(v)) for t, v in sorted(by.items())]

    cal, dev, everything = grouped(part == "calibration"), grouped(part == "dev"), grouped(np.ones_like(tr))
    held_out = grouped(part != "train")
    taus = {c: calibrate(cal, alpha, c) for c in (STRICT, NEVER_FORGET_ONLY)}

    def fin(x: float) -> float | None:
        return None if math.isinf(x) else round(x, 6)

    counts = {e.value: sum(1 for x in label_of.values() if x is e) for e in Endurance}
    created = datetime.now(UTC).isoformat(timespec="seconds")
    cal_types = [x.concept_type for x in cal]
    gates = {c: Gate(head, GateSpec(tau=t, alpha=alpha, criterion=c, encoder=encoder, created=created,
                                    calibration_id=calibration_id(head, cal_types, alpha, c),
                                    calibration_types=len(cal_types)))
             for c, t in taus.items()}
    return {
        "alpha": alpha, "seed": seed, "encoder": encoder, "head_trained_on": head.trained_on,
        "calibration_id": {c: g.spec.calibration_id for c, g in gates.items()},
        "types": {"candidates": len(types), "labelled": len(label_of), "by_label": counts,
                  "by_split": {k: sum(1 for v in split.values() if v == k) for k in ("train", "dev", "calibration")}},
        "memories": {"labelled": len(rows), "by_split": {k: int((part == k).sum())
                                                         for k in ("train", "dev", "calibration")}},
        "dev": diagnose(dev, 0.5).as_dict(),
        "tau": {c: fin(t) for c, t in taus.items()},
        "calibration_split": {c: diagnose(cal, t).as_dict() for c, t in taus.items()},
        "store": {c: diagnose(everything, t).as_dict() for c, t in taus.items()},
        "held_out": {c: diagnose(held_out, t).as_dict() for c, t in taus.items()},
        "resplit": resplit_check(cal + dev, alpha, rounds=rounds, seed=seed),
        "paper": {"tau": 0.988, "removed_share": 0.023, "safe_recall": 0.161, "safe_precision": 0.929,
                  "never_forget_loss": 0.003},
    }, gates


__all__ = ["calibration_run", "candidate_types", "label_types"]
