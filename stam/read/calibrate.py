"""Store-gate calibration sets and replay.

A calibration set is JSON Lines, one question per line::

    {"patient_id": "...", "question": "...", "evidence": ["<source entry id>", ...]}

``evidence`` (optional) names the entries whose memories answer the question (gold evidence). Replay asks
every question twice, ACTIVE only and ACTIVE+HISTORY, and records whether the two arms agree: with a reader
configured, whether the two answers are the same after normalisation; without one, whether the ACTIVE-only
packet recalls as much gold evidence as the full one (a labelled set is then required).

:func:`labelled_set` derives a set from stored patients deterministically: for every concept with both an
ACTIVE memory and superseded/ended ones, a question about its current value (gold: the ACTIVE memory's
entry) and one naming a past value's date (gold: that HISTORY memory's entry); for every concept only in
HISTORY (a stopped drug, a resolved condition), a question about it (gold: its latest memory).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from schemas import Store
from schemas.query import GateMode, QueryRequest
from stam.backends.base import StateStore
from stam.read.service import QueryService
from stam.read.store_gate import GateSample


def load_set(path: Path) -> list[dict[str, Any]]:
    items = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not item.get("patient_id") or not item.get("question"):
            raise ValueError(f"{path}:{n}: each line needs patient_id and question")
        items.append(item)
    return items


def labelled_set(states: StateStore, patient_ids: Iterable[str], *, per_patient: int = 12) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for pid in sorted(patient_ids):
        state = states.load(pid)
        by_concept: dict[str, list[Any]] = {}
        for s in state.memories.values():
            if s.memory.concept_key:
                by_concept.setdefault(s.memory.concept_key, []).append(s)
        chosen: list[dict[str, Any]] = []
        for key in sorted(by_concept):
            group = sorted(by_concept[key], key=lambda s: (s.memory.effective_start is None, s.memory.effective_start))
            active = [s for s in group if s.store is Store.ACTIVE]
            past = [s for s in group if s.store is Store.HISTORY]
            name = (group[-1].memory.concept.display if group[-1].memory.concept else None) or key
            if active and past:
                chosen.append({"patient_id": pid, "question": f"What is the patient's {name}?",
                               "evidence": [active[-1].memory.entry_id], "kind": "current"})
                old = past[len(past) // 2]
                when = old.memory.effective_start.date().isoformat() if old.memory.effective_start else "that time"
                chosen.append({"patient_id": pid, "question": f"{name} on {when}",
                               "evidence": [old.memory.entry_id], "kind": "past-value"})
            elif past and not active:
                chosen.append({"patient_id": pid, "question": f"Does the patient have {name}?",
                               "evidence": [past[-1].memory.entry_id], "kind": "ended"})
        out.extend(chosen[:per_patient])
    return out


def _norm(text: str | None) -> str:
    return " ".join(re.sub(r"[^a-z0-9. ]", " ", (text or "").lower()).split())


def _recall(packet: Any, gold: Sequence[str]) -> float:
    if not gold:
        return 1.0
    served = {i.source_entry_id for i in packet.items}
    return sum(1 for g in gold if g in served) / len(gold)


async def replay(service: QueryService, items: Sequence[dict[str, Any]], *, k_active: int = 8,
                 k_history: int = 8) -> list[GateSample]:
    """One :class:`GateSample` per question (both arms asked)."""
    use_reader = service.reader is not None
    samples: list[GateSample] = []
    for n, item in enumerate(items):
        arms = {}
        auto = service.packet(QueryRequest(request_id=f"calibrate-{n}-auto", patient_id=item["patient_id"],
                                           question=item["question"], k_active=k_active, k_history=k_history,
                                           answer=False))
        for mode in (GateMode.ACTIVE, GateMode.BOTH):
            req = QueryRequest(request_id=f"calibrate-{n}-{mode.value}", patient_id=item["patient_id"],
                               question=item["question"], k_active=k_active, k_history=k_history, gate=mode,
                               answer=use_reader)
            answer = await service.answer(req)
            if not answer.ok or answer.packet is None:
                raise ValueError(f"question {n} could not be answered: {answer.error}")
            arms[mode] = answer
        a, b = arms[GateMode.ACTIVE], arms[GateMode.BOTH]
        assert a.packet is not None and b.packet is not None
        if use_reader:
            agree = _norm(a.answer) == _norm(b.answer)
        else:
            if "evidence" not in item:
                raise ValueError("without a reader, calibration needs gold evidence in every item")
            agree = _recall(a.packet, item["evidence"]) >= _recall(b.packet, item["evidence"])
        g = b.packet.gate
        margin = None if g.s_history is None else g.s_history - (g.s_active if g.s_active is not None else -1.0)
        # A question whose wording asks for history is always served HISTORY (the threshold never decides it).
        samples.append(GateSample(margin=margin, cue=auto.gate.cue is not None, agree=agree,
                                  tokens_active=a.packet.tokens, tokens_both=b.packet.tokens))
    return samples
