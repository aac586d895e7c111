"""A calibrated deletion gate as files: the scorer's head and the threshold chosen for it.

``stam deletion calibrate --gate-out DIR`` writes ``DIR/head.npz`` and ``DIR/gate.json``; ``stam deletion sweep
--gate DIR`` reads them. ``calibration_id`` names the head (a digest of its training types and labels), the
calibration split, alpha and the criterion, so every ``deleted`` transition points back to one calibration.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stam.deletion.scorer import Head


@dataclass(frozen=True)
class GateSpec:
    tau: float
    """Inf: no threshold met the bound on the calibration split; such a gate deletes nothing."""
    alpha: float
    criterion: str
    encoder: str
    calibration_id: str
    created: str
    calibration_types: int

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tau"] = None if math.isinf(self.tau) else self.tau
        return d


def calibration_id(head: Head, calibration_types: Iterable[str], alpha: float, criterion: str) -> str:
    digest = hashlib.sha256(json.dumps([head.trained_on, sorted(calibration_types), alpha, criterion]).encode())
    return f"gate-{head.trained_on[:8]}-{digest.hexdigest()[:8]}"


class Gate:
    """A head and its threshold: which memories the gate would delete."""

    def __init__(self, head: Head, spec: GateSpec) -> None:
        if head.encoder != spec.encoder:
            raise ValueError(f"the head was trained over {head.encoder}, the gate names {spec.encoder}")
        self.head, self.spec = head, spec

    def decide(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scores, delete?) for memory embeddings; nothing passes an infinite threshold."""
        scores = self.head.score(np.asarray(vectors, dtype=np.float32)) if len(vectors) else np.zeros(0)
        return scores, scores >= self.spec.tau

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.head.save(folder / "head.npz")
        (folder / "gate.json").write_text(json.dumps(self.spec.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> Gate:
        try:
            spec = json.loads((folder / "gate.json").read_text())
            head = Head.load(folder / "head.npz")
        except FileNotFoundError as exc:
            raise ValueError(f"{folder} is not a deletion gate (no {Path(exc.filename).name}); write one with "
                             "`stam deletion calibrate --gate-out`") from None
        spec["tau"] = math.inf if spec.get("tau") is None else float(spec["tau"])
        return cls(head, GateSpec(**spec))
