"""Question-answering metrics: SQuAD-style normalization, token F1, exact match, evidence recall, summaries."""

from __future__ import annotations

import re
import statistics
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["QAScore", "evidence_recall", "exact_match", "normalize_answer", "summarize", "token_f1"]

_ARTICLES = frozenset({"a", "an", "the"})
# A decimal point between two digits is protected by a placeholder so the punctuation pass leaves it alone.
_DECIMAL = re.compile(r"(?<=\d)\.(?=\d)")
_PLACEHOLDER = "\x00"
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Normalize an answer the SQuAD / MedLoCoMo way, keeping decimal numbers whole.

    Steps: lowercase; a ``.`` with a digit on both sides is kept (``7.4`` stays ``7.4``); every other ASCII
    punctuation character becomes a space (so ``mg/dL`` -> ``mg dl``, ``non-small`` -> ``non small``); the
    articles ``a``, ``an``, ``the`` are dropped as whole tokens; whitespace is collapsed to single spaces.
    Example: ``"The 7.4 mg/dL."`` -> ``"7.4 mg dl"``. Unlike SQuAD, punctuation splits tokens instead of
    being deleted, so ``mg/dL`` and ``mg dl`` agree.
    """
    text = _DECIMAL.sub(_PLACEHOLDER, s.lower())
    text = "".join(" " if ch in _PUNCT else ch for ch in text).replace(_PLACEHOLDER, ".")
    return " ".join(tok for tok in text.split() if tok not in _ARTICLES)


def _golds(gold: str | Sequence[str]) -> list[str]:
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("gold must be a string or a non-empty sequence of acceptable answers")
    return golds


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens and not gold_tokens:
        return 1.0
    if not pred_tokens or not gold_tokens:
        return 0.0
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Bag-of-tokens F1 between normalized prediction and gold; the best over several acceptable golds.

    Both sides empty after normalization -> 1.0; exactly one empty -> 0.0. ``gold`` may be one string or a
    non-empty sequence of strings (ValueError when empty).
    """
    pred_tokens = normalize_answer(prediction).split()
    return max(_f1_one(pred_tokens, normalize_answer(g).split()) for g in _golds(gold))


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold (any of several), else 0.0."""
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in _golds(gold)) else 0.0


def evidence_recall(served_ids: Iterable[str], gold_ids: Iterable[str]) -> float | None:
    """Share of distinct gold evidence ids present in the served packet; None when there are no gold ids."""
    gold = set(gold_ids)
    if not gold:
        return None
    return len(gold & set(served_ids)) / len(gold)


@dataclass
class QAScore:
    """The scores of one answered question."""

    question_id: str
    qtype: str
    f1: float
    em: float
    evidence_recall: float | None
    served_tokens: int


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _recall_mean(scores: Sequence[QAScore]) -> float | None:
    return _mean([s.evidence_recall for s in scores if s.evidence_recall is not None])


def summarize(scores: Sequence[QAScore]) -> dict[str, Any]:
    """Aggregate per-question scores.

    Returns ``n``; micro means ``f1``, ``em`` (over all questions), ``evidence_recall`` (over the questions that
    have gold evidence; None when none do), ``served_tokens_mean`` and ``served_tokens_median``; type-macro
    ``f1_type_macro`` and ``em_type_macro`` (the unweighted mean over question types of the per-type means);
    and ``per_type`` = {qtype: {n, f1, em, evidence_recall}} sorted by type. Floats are rounded to 4 decimals
    (macro averages are computed from unrounded per-type means). Empty input gives n=0 and None everywhere.
    """
    by_type: dict[str, list[QAScore]] = {}
    for s in scores:
        by_type.setdefault(s.qtype, []).append(s)
    per_type = {
        qtype: {
            "n": len(group),
            "f1": _mean([s.f1 for s in group]),
            "em": _mean([s.em for s in group]),
            "evidence_recall": _recall_mean(group),
        }
        for qtype, group in sorted(by_type.items())
    }
    type_f1 = [statistics.fmean([s.f1 for s in group]) for group in by_type.values()]
    type_em = [statistics.fmean([s.em for s in group]) for group in by_type.values()]
    tokens = [s.served_tokens for s in scores]
    return {
        "n": len(scores),
        "f1": _mean([s.f1 for s in scores]),
        "em": _mean([s.em for s in scores]),
        "evidence_recall": _recall_mean(scores),
        "served_tokens_mean": _mean(tokens),
        "served_tokens_median": round(float(statistics.median(tokens)), 4) if tokens else None,
        "f1_type_macro": _mean(type_f1),
        "em_type_macro": _mean(type_em),
        "per_type": per_type,
    }
