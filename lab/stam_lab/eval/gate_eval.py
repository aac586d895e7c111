"""Calibrating the store gate with a reader, on MIMIC-QA and on Synthea (``stam eval gate``).

The gate's threshold only decides questions that do not ask for the past by their wording (no history intent,
no cue): for those, HISTORY is served when its best cosine beats ACTIVE's by more than the threshold. For each
such question the reader answers twice, from the packet with ACTIVE only and from the packet with both stores,
and the two arms *agree* when ACTIVE alone does as well:

- MIMIC-QA (gold answers from the rows): the ACTIVE-only answer's token F1 is at least the other's;
- Synthea (questions derived from the stored state, ``stam.read.calibrate.labelled_set``; no gold answer): the two
  answers are the same after normalisation.

:func:`stam.read.store_gate.calibrate` then picks, per lambda, the threshold minimising ``disagreement - lambda * skip
rate`` (questions that ask for the past are counted as served: they never skip). The report gives, per source and
for both together, the threshold, skip rate, disagreement and served tokens per lambda.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas.query import GateMode, QueryRequest
from stam.read.calibrate import labelled_set
from stam.read.service import QueryService
from stam.read.store_gate import GateSample, calibrate
from stam_lab.eval.mimic_qa import Question
from stam_lab.eval.qa import normalize_answer, token_f1
from stam_lab.eval.synthea import replay_synthea

Answer = Callable[[str, str], str]


def _sample(service: QueryService, answer: Answer, patient: str, question: str, as_of: datetime | None,
            gold: str | Sequence[str] | None) -> tuple[GateSample, dict[str, Any]]:
    def req(mode: GateMode) -> QueryRequest:
        return QueryRequest(request_id=f"gate-{mode.value}", patient_id=patient, question=question, gate=mode,
                            as_of=as_of)

    auto = service.packet(req(GateMode.AUTO))
    active, both = service.packet(req(GateMode.ACTIVE)), service.packet(req(GateMode.BOTH))
    g = both.gate
    margin = None if g.s_history is None else g.s_history - (g.s_active if g.s_active is not None else -1.0)
    row: dict[str, Any] = {"question": question, "cue": auto.gate.cue, "margin": margin,
                           "tokens_active": active.tokens, "tokens_both": both.tokens}
    if auto.gate.cue is not None:  # asks for the past by its wording: always served, no reader call needed
        return GateSample(margin=margin, cue=True, agree=True, tokens_active=active.tokens,
                          tokens_both=both.tokens), row
    a = answer(question, active.rendered)
    b = answer(question, both.rendered) if both.rendered != active.rendered else a
    agree = token_f1(a, gold) >= token_f1(b, gold) if gold is not None else normalize_answer(a) == normalize_answer(b)
    row |= {"answer_active": a, "answer_both": b, "agree": agree}
    return GateSample(margin=margin, cue=False, agree=agree, tokens_active=active.tokens,
                      tokens_both=both.tokens), row


def mimic_samples(service: QueryService, questions: Sequence[Question], answer: Answer, *,
                  limit: int) -> tuple[list[GateSample], list[dict[str, Any]]]:
    """Samples in question order until ``limit`` questions without a cue were answered by the reader."""
    samples: list[GateSample] = []
    rows: list[dict[str, Any]] = []
    for q in questions:
        if sum(not s.cue for s in samples) >= limit:
            break
        as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
        s, row = _sample(service, answer, q.patient_id, q.question, as_of, q.golds)
        samples.append(s)
        rows.append(row | {"qtype": q.qtype})
    return samples, rows


def labelled_samples(service: QueryService, items: Sequence[dict[str, Any]], answer: Answer, *,
                     limit: int) -> tuple[list[GateSample], list[dict[str, Any]]]:
    samples: list[GateSample] = []
    rows: list[dict[str, Any]] = []
    for item in items:
        if sum(not s.cue for s in samples) >= limit:
            break
        s, row = _sample(service, answer, item["patient_id"], item["question"], None, None)
        samples.append(s)
        rows.append(row | {"kind": item.get("kind")})
    return samples, rows


def report(samples: Sequence[GateSample], lambdas: Sequence[float]) -> dict[str, Any]:
    decided = [s for s in samples if not s.cue]
    return {"questions": len(samples), "decided_by_threshold": len(decided),
            "ties": sum(1 for s in decided if s.margin is not None and abs(s.margin) <= 0.005),
            "disagree_when_skipped": sum(1 for s in decided if not s.agree),
            "by_lambda": {str(lam): calibrate(samples, lam).as_dict() for lam in lambdas}}


def synthea_items(bundles: Path, workdir: Path, embedder: Any, *, patients: Sequence[str] | None,
                  per_patient: int) -> tuple[Any, list[dict[str, Any]]]:
    """Replay the Synthea bundles and derive the labelled question set from their stored state."""
    run, _ = replay_synthea(bundles, variant="stam", workdir=workdir, patients=patients, embedder=embedder)
    return run, labelled_set(run.deps.states, sorted(run.entries), per_patient=per_patient)


__all__ = ["labelled_samples", "mimic_samples", "report", "synthea_items"]
