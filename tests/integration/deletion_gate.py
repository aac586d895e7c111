"""A deletion gate for tests: not a calibration, a head trained on one patient's candidates to call observations
safe to forget (tau 0.5), so that a sweep picks a known kind of memory. The tests that use it test what a
deletion does, not how good the gate is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from schemas import Category
from stam.deletion.candidates import select
from stam.deletion.gate import Gate, GateSpec
from stam.deletion.labels import concept_type
from stam.deletion.scorer import render, train
from stam.patient_state import PatientState


def observation_gate(state: PatientState, embedder: Any, calibration_id: str, folder: Path | None = None) -> Gate:
    memories = [c.stored.memory for c in select(state).candidates]
    safe = np.asarray([m.category is Category.OBSERVATION for m in memories], dtype=np.float32)
    assert 0 < safe.sum() < len(safe), "the test needs candidates of both kinds"
    head = train(embedder.embed([render(m) for m in memories]), safe, encoder=embedder.model_name,
                 types=[concept_type(m) for m in memories])
    gate = Gate(head, GateSpec(tau=0.5, alpha=0.1, criterion="strict", encoder=embedder.model_name,
                               calibration_id=calibration_id, created="2026-11-25T00:00:00+00:00",
                               calibration_types=0))
    if folder is not None:
        gate.save(folder)
    return gate
