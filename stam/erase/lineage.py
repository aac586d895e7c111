"""Which adapters and trace sets learnt from a patient (for erasure: weights cannot forget one patient; the
adapters listed here must be retrained without them, and the trace sets rewritten)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stam.serving.adapters import META


def trained_on(patient_id: str, roots: Iterable[Path]) -> dict[str, list[str]]:
    """Adapter folders (``stam_adapter.json``) and trace sets (``manifest.json`` of ``stam train traces``, or the
    ``plan.json`` of a run not finished yet) under ``roots`` whose patients include ``patient_id`` (training or
    validation)."""
    adapters: set[str] = set()
    traces: set[str] = set()
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for meta in root.rglob(META):
            data = _json(meta)
            if patient_id in (data.get("patients") or []) or patient_id in (data.get("validation_patients") or []):
                adapters.add(str(meta.parent))
        for manifest in root.rglob("manifest.json"):
            data = _json(manifest)
            splits = data.get("splits") or {}
            if isinstance(splits, dict) and any(patient_id in (s.get("patients") or []) for s in splits.values()
                                                if isinstance(s, dict)):
                traces.add(str(manifest.parent))
        for plan in root.rglob("plan.json"):  # an unfinished teacher run (stam train traces --resume)
            notes = _json(plan).get("notes")
            if isinstance(notes, dict) and patient_id in notes:
                traces.add(str(plan.parent))
    return {"adapters": sorted(adapters), "trace_sets": sorted(traces)}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
