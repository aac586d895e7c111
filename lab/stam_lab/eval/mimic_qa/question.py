"""MIMIC-QA's question (:class:`Question`) and the stable hashes its split and choices are made with."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """One question: ``answer`` is computed from the rows at or before ``as_of`` (the whole record when None);
    ``evidence`` holds the entry ids of the rows that support it; ``also``: other forms of the same answer that
    are scored as right (``golds``: all of them)."""

    question_id: str
    patient_id: str
    qtype: str
    question: str
    answer: str
    as_of: str | None
    evidence: tuple[str, ...]
    split: str
    also: tuple[str, ...] = ()

    @property
    def golds(self) -> tuple[str, ...]:
        return (self.answer, *self.also)


def split_of(patient_id: str) -> str:
    """train / dev / test (60/20/20) from a stable hash of the patient id."""
    bucket = stable_hash("split", patient_id) % 100
    return "train" if bucket < 60 else "dev" if bucket < 80 else "test"


def stable_hash(*parts: str) -> int:
    """A stable 64-bit hash of ``parts`` (sha256): the same on every machine and run, unlike ``hash``."""
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big")
