"""Deterministic identifiers. Never derived from a clock or a random source, so replays are idempotent."""

from __future__ import annotations

import hashlib


def digest(*parts: str, size: int = 16) -> str:
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\x1f")
    return h.hexdigest()


def memory_id(patient_id: str, entry_id: str, position: int) -> str:
    """Patient-scoped: two patients' entries that happen to share an id never share a memory id (Milvus keys
    vectors by memory id)."""
    return "m-" + digest(patient_id, entry_id, str(position), size=12)


def transition_id(entry_id: str, memory_id: str, kind: str) -> str:
    return "t-" + digest(entry_id, memory_id, kind, size=12)
