"""The deletion scorer: how safe to forget an archived memory looks, from its rendered concept and content.

The paper fine-tunes bge-small-en-v1.5 with a binary head. Here the encoder is the project's embedding model
(MiniLM, packaged, offline), frozen, and the head a logistic layer trained with torch: a memory's score is the
head's probability that it is *safe to forget*; never-forget and uncertain are the protected (negative) class.
Trained and tuned on concept types of the train and dev splits only; the threshold comes from the sealed
calibration split (:mod:`stam.deletion.calibrate`).

Splits are by concept type (:func:`split_types`), stratified by label, so near-duplicate memories of one type
never sit on both sides.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas import AtomicMemory
from stam.deletion.labels import Endurance

SPLITS = ("train", "dev", "calibration")


def render(memory: AtomicMemory) -> str:
    """What the scorer reads: category, concept and the memory's own text."""
    concept = memory.concept.display if memory.concept is not None and memory.concept.display else ""
    return f"{memory.category.value} | {concept} | {memory.text.strip()}"


def split_types(labels: dict[str, Endurance], fractions: tuple[float, float, float] = (0.5, 0.2, 0.3), *,
                seed: int = 0) -> dict[str, str]:
    """Concept type -> ``train``/``dev``/``calibration``, each label's types shuffled and cut by ``fractions``."""
    if abs(sum(fractions) - 1.0) > 1e-9 or min(fractions) <= 0:
        raise ValueError("fractions must be three positive shares that sum to 1")
    rng = random.Random(seed)
    out: dict[str, str] = {}
    for e in Endurance:
        types = sorted(t for t, x in labels.items() if x is e)
        rng.shuffle(types)
        a = round(len(types) * fractions[0])
        b = a + round(len(types) * fractions[1])
        out.update({t: SPLITS[0] for t in types[:a]})
        out.update({t: SPLITS[1] for t in types[a:b]})
        out.update({t: SPLITS[2] for t in types[b:]})
    return out


@dataclass
class Head:
    """A logistic layer over frozen embeddings."""

    weight: np.ndarray
    bias: float
    encoder: str
    trained_on: str
    """A digest of the training types and labels (what a calibration id refers back to)."""

    def score(self, vectors: np.ndarray) -> np.ndarray:
        out: np.ndarray = 1.0 / (1.0 + np.exp(-(vectors @ self.weight + self.bias)))
        return out

    def save(self, path: Path) -> None:
        np.savez(path, weight=self.weight, bias=np.asarray(self.bias),
                 meta=np.asarray(json.dumps({"encoder": self.encoder, "trained_on": self.trained_on})))

    @classmethod
    def load(cls, path: Path) -> Head:
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            return cls(f["weight"], float(f["bias"]), meta["encoder"], meta["trained_on"])


def train(vectors: np.ndarray, safe: np.ndarray, *, encoder: str, types: Sequence[str], epochs: int = 300,
          lr: float = 0.05, l2: float = 1e-3, seed: int = 0) -> Head:
    """Fit the head on ``vectors`` (one row per memory) with ``safe`` (1: safe to forget, 0: protected); each
    type weighs the same in the loss, so a type charted 5,000 times does not drown 200 rare ones."""
    if len(vectors) == 0 or len(set(safe.tolist())) < 2:
        raise ValueError("training needs memories of both classes")
    # deferred: torch is slow to import
    import torch  # here, not at import: scoring with a trained head (the sweep, the worker) needs numpy only

    torch.manual_seed(seed)
    x = torch.as_tensor(vectors, dtype=torch.float32)
    y = torch.as_tensor(safe, dtype=torch.float32)
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    w = torch.as_tensor([1.0 / counts[t] for t in types], dtype=torch.float32)
    w = w / w.sum()
    layer = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.Adam(layer.parameters(), lr=lr, weight_decay=l2)
    for _ in range(epochs):
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(layer(x).squeeze(1), y, reduction="none")
                * w).sum()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's stub
        opt.step()
    digest = hashlib.sha256(json.dumps(sorted(set(zip(types, safe.tolist(), strict=True)))).encode()).hexdigest()
    return Head(layer.weight.detach().numpy()[0].astype(np.float32), float(layer.bias.detach().numpy()[0]),
                encoder, digest[:12])
