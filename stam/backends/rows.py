"""The compact timeline row of a stored memory: what the read path needs of it to place it in time.

The state store keeps one row per memory beside the full record (Redis ``stam:{ID}:tl``, written in the same
transaction), so a query reads a patient's timeline without parsing every record (a patient with 20,000 memories
holds ~20 MB of records, ~3 MB of rows). A row is a JSON array of :data:`FIELDS`, in that order; long free text is
cut to its first :data:`TEXT_CHARS` characters (the full text stays in the record, which is what is served).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson

from schemas import LIFECYCLE_BY_CATEGORY, Category, Store, StoredMemory

FIELDS = ("memory_id", "patient_id", "entry_id", "position", "category", "source_ref", "concept", "display", "unit",
          "dosage", "value", "effective_start", "effective_end", "in_history", "evidence_id", "successor_id", "reason",
          "embed_key", "ended_at", "encounter_id", "value_text", "lifecycle")
"""Times are seconds since the epoch (None when absent)."""
ROW_VERSION = 4
TEXT_CHARS = 160


def row_of(record: dict[str, Any]) -> list[Any]:
    """The row of a stored memory given as its JSON object (a parsed record)."""
    m = record["memory"]
    c = m.get("concept")
    return [m["memory_id"], m["patient_id"], m["entry_id"], m["position"], m["category"], m.get("source_ref"),
            f"{c['system']}|{c['code']}" if c else None, ((c or {}).get("display") or m["text"])[:TEXT_CHARS],
            m.get("unit"), m.get("dosage"), m.get("value"), _epoch(m.get("effective_start")),
            _epoch(m.get("effective_end")),
            record["store"] == Store.HISTORY.value, record.get("evidence_id"), record.get("successor_id"),
            record.get("reason"), f"c:{m['embed_text']}" if c and m.get("embed_text") else f"m:{m['memory_id']}",
            _epoch(record.get("ended_at")), m.get("encounter_id"), (m.get("value_text") or None) and
            m["value_text"][:TEXT_CHARS], m.get("lifecycle") or LIFECYCLE_BY_CATEGORY[Category(m["category"])].value]


def _epoch(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def encode(stored: StoredMemory) -> bytes:
    return orjson.dumps([ROW_VERSION, *row_of(stored.model_dump(mode="json"))])


def decode_many(raw: list[bytes]) -> list[list[Any]] | None:
    """Rows from their stored bytes; None when one was written in another row version (read the records)."""
    rows: list[list[Any]] = orjson.loads(b"[" + b",".join(raw) + b"]") if raw else []
    if any(r[0] != ROW_VERSION for r in rows):
        return None
    return [r[1:] for r in rows]
