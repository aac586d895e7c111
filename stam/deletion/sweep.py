"""The deletion sweep: score every patient's candidates with a calibrated gate and order the deletions.

:func:`scan` reads one patient's state, takes the candidates (:func:`stam.deletion.candidates.select`), scores
them with the gate's head and keeps those at or over tau. Nothing is changed here: the sweep publishes
:class:`schemas.DeletionOrder` messages on ``stam.deletions.v1`` (:func:`publish_orders`), and the update stage,
the single writer of patient state, applies them as ``deleted`` transitions (:func:`stam.stages.delete_batch`),
checking each memory again against the state it meets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from schemas import DeletionOrder, DeletionVerdict, StoredMemory
from stam.backends.base import StateStore
from stam.deletion.candidates import select
from stam.deletion.gate import Gate
from stam.deletion.scorer import render
from stam.ids import digest
from topology import topics as t

ORDER_MAX_MEMORIES = 256
"""Memories per order: an order of 256 ids with verdicts stays far below the broker's message limit."""


@dataclass
class PatientSweep:
    patient_id: str
    version: int
    memories: int
    history: int
    candidates: int
    kept: dict[str, int] = field(default_factory=dict)
    chosen: list[tuple[StoredMemory, float]] = field(default_factory=list)
    """Candidates whose score reached tau, with their score."""

    def summary(self) -> dict[str, Any]:
        return {"patient_id": self.patient_id, "state_version": self.version, "memories": self.memories,
                "history": self.history, "candidates": self.candidates, "kept_by_rule": self.kept,
                "delete": len(self.chosen)}


def scan(states: StateStore, embed: Callable[[list[str]], Any], gate: Gate,
         patients: Iterable[str]) -> Iterator[PatientSweep]:
    """One :class:`PatientSweep` per patient, in the order given."""
    for pid in patients:
        state = states.load(pid)
        sel = select(state)
        kept: dict[str, int] = {}
        for why in sel.kept.values():
            if why.value != "active":
                kept[why.value] = kept.get(why.value, 0) + 1
        out = PatientSweep(pid, state.version, len(state.memories), state.counts()["history"], len(sel.candidates),
                           kept)
        if sel.candidates:
            vectors = np.asarray(embed([render(c.stored.memory) for c in sel.candidates]), dtype=np.float32)
            scores, chosen = gate.decide(vectors)
            out.chosen = [(c.stored, float(s)) for c, s, k in zip(sel.candidates, scores.tolist(), chosen.tolist(),
                                                                   strict=True) if k]
        yield out


def orders(sweep: PatientSweep, gate: Gate, *, now: datetime | None = None,
           size: int = ORDER_MAX_MEMORIES) -> list[DeletionOrder]:
    """The orders that carry one patient's chosen memories (ids derive from the calibration, the patient's state
    version and the memories, so ordering the same sweep twice yields the same orders)."""
    now = now or datetime.now(UTC)
    spec = gate.spec
    out = []
    chosen = sorted(sweep.chosen, key=lambda x: x[0].memory.memory_id)
    for lo in range(0, len(chosen), size):
        part = chosen[lo: lo + size]
        ids = tuple(s.memory.memory_id for s, _ in part)
        out.append(DeletionOrder(
            order_id="del-" + digest(spec.calibration_id, sweep.patient_id, str(sweep.version), *ids, size=12),
            patient_id=sweep.patient_id, memory_ids=ids, ordered_at=now,
            verdicts=tuple(DeletionVerdict(score=round(min(max(score, 0.0), 1.0), 6), tau=spec.tau, alpha=spec.alpha,
                                           calibration_id=spec.calibration_id, criterion=spec.criterion)
                           for _, score in part)))
    return out


async def publish_orders(settings: Any, items: Sequence[DeletionOrder], sealer: Any = None) -> int:
    """Send the orders to ``stam.deletions.v1``, sealed for their patients and keyed by pseudonym like every STAM
    message, and wait until the broker has each. Returns how many were sent."""
    # deferred: stam.crypto, topology.admin pull in redis, aiokafka, cryptography
    from stam.crypto import sealer_for
    from topology.admin import producer

    if not items:
        return 0
    sealer = sealer or sealer_for(settings)
    sealed = [(sealer.message_key(o.patient_id), sealer.seal(o.patient_id, o.model_dump_json().encode()))
              for o in items]
    sealer.durable()
    topic = t.DELETIONS.name(settings.topic_prefix)
    async with producer(settings) as out:
        for key, value in sealed:
            await out.send_and_wait(topic, key=key, value=value)
    return len(sealed)


def wait_applied(states: StateStore, items: Sequence[DeletionOrder], timeout_s: float,
                 poll_s: float = 0.5) -> tuple[int, int]:
    """Wait until the ordered memories are gone from the state store, at most ``timeout_s``: (gone, left). A
    memory left was kept by the update stage (the state it met needed it) or is still in flight."""
    deadline = time.monotonic() + timeout_s
    wanted = [(o.patient_id, list(o.memory_ids)) for o in items]
    total = sum(len(ids) for _, ids in wanted)
    while True:
        left = sum(len(states.memories(pid, ids)) for pid, ids in wanted)
        if left == 0 or time.monotonic() >= deadline:
            return total - left, left
        time.sleep(poll_s)


