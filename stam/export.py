"""The documented, stable JSON shape of a patient's state (``stam state --json``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from schemas import Store, StoredMemory
from stam.patient_state import PatientState, lifecycle_of

EXPORT_VERSION = 1
_EPOCH = datetime(1, 1, 1, tzinfo=UTC)


def memory_record(s: StoredMemory) -> dict[str, Any]:
    m = s.memory
    return {
        "memory_id": m.memory_id,
        "store": s.store.value,
        "category": m.category.value,
        "text": m.text,
        "concept": m.concept.model_dump() if m.concept else None,
        "status": m.status,
        "value": m.value,
        "value_text": m.value_text,
        "unit": m.unit,
        "dosage": m.dosage,
        "effective_start": m.effective_start.isoformat() if m.effective_start else None,
        "effective_end": m.effective_end.isoformat() if m.effective_end else None,
        "recorded_at": m.recorded_at.isoformat() if m.recorded_at else None,
        "source_entry_id": m.entry_id,
        "source_ref": m.source_ref,
        "source_system": m.source_system,
        "reason": s.reason.value if s.reason else None,
        "successor_id": s.successor_id,
        "evidence_id": s.evidence_id,
        "archived_by_entry": s.archived_by_entry,
        "archived_at": s.archived_at.isoformat() if s.archived_at else None,
        "encounter_id": m.encounter_id,
        "lifecycle": lifecycle_of(m).value,
        "ended_at": s.ended_at.isoformat() if s.ended_at else None,
    }


def export_state(state: PatientState) -> dict[str, Any]:
    def ordered(store: Store) -> list[dict[str, Any]]:
        items = sorted(state.in_store(store),
                       key=lambda s: (s.memory.effective_start or _EPOCH, s.memory.memory_id))
        return [memory_record(s) for s in items]

    return {
        "export_version": EXPORT_VERSION,
        "patient_id": state.patient_id,
        "state_version": state.version,
        "counts": state.counts(),
        "active": ordered(Store.ACTIVE),
        "history": ordered(Store.HISTORY),
        "relations": [
            {"source_id": r.source_id, "target_id": r.target_id, "type": r.type.value,
             "directed": r.directed, "weight": r.weight}
            for r in sorted(state.relations(), key=lambda r: (r.source_id, r.target_id, r.type.value))
        ],
    }


_CATEGORY_ORDER = ["condition", "medication", "allergy", "careplan", "order", "immunization", "procedure",
                   "observation", "report", "encounter", "note", "other"]


def _for_reading(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text mode: problems and medications first, then the rest; most recent first within a category."""
    recent_first = sorted(records, key=lambda r: r["effective_start"] or "", reverse=True)
    return sorted(recent_first, key=lambda r: _CATEGORY_ORDER.index(r["category"]))


def render_text(state: PatientState, *, limit: int | None = None) -> str:
    data = export_state(state)
    data["active"], data["history"] = _for_reading(data["active"]), _for_reading(data["history"])
    lines = [f"Patient {state.patient_id}  (state version {state.version})",
             f"ACTIVE {data['counts']['active']}  HISTORY {data['counts']['history']}  "
             f"relations {data['counts']['relations']}", "", "ACTIVE (what holds now):"]
    for rec in data["active"][:limit]:
        lines.append(f"  - {rec['text']}")
    lines += ["", "HISTORY (what held, why it stopped, what replaced it):"]
    by_id = {r["memory_id"]: r for r in data["active"] + data["history"]}
    for rec in data["history"][:limit]:
        succ = by_id.get(rec["successor_id"] or "")
        tail = f" -> {succ['text']}" if succ else ""
        if rec["ended_at"]:
            tail += f" (ended {rec['ended_at'][:16].replace('T', ' ')})"
        lines.append(f"  - [{rec['reason']}] {rec['text']}{tail}")
    if limit is not None and max(len(data["active"]), len(data["history"])) > limit:
        lines.append(f"  ... (first {limit} of each store; --json for everything)")
    return "\n".join(lines)
