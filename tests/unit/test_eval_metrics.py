"""QA metrics and paired significance tests (stam_lab.eval), checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from stam_lab.eval.paired import mcnemar_exact, paired_bootstrap, sign_flip_permutation
from stam_lab.eval.qa import QAScore, evidence_recall, exact_match, normalize_answer, summarize, token_f1


@pytest.mark.parametrize(("raw", "expected"), [
    ("7.4 mg/dL", "7.4 mg dl"),
    ("The 7.4 mg/dL.", "7.4 mg dl"),
    ("  An   Aspirin,  a day! ", "aspirin day"),
    ("non-small-cell", "non small cell"),
    ("BP 120/80", "bp 120 80"),
    ("Theophylline and anemia", "theophylline and anemia"),
    ("", ""),
    ("the a an", ""),
])
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_token_f1_hand_values() -> None:
    assert token_f1("the 7.4 mg/dL", "7.4 mg/dl") == 1.0
    assert token_f1("aspirin 81 mg", "aspirin 325 mg") == pytest.approx(2 / 3)
    # pred 4 tokens, gold 2, overlap 2: P = 1/2, R = 1, F1 = 2/3
    assert token_f1("metformin 500 mg daily", "metformin 500") == pytest.approx(2 / 3)
    assert token_f1("warfarin", "heparin") == 0.0
    # repeated tokens count as a bag: pred {x:2}, gold {x:1} -> overlap 1, P = 1/2, R = 1
    assert token_f1("x x", "x") == pytest.approx(2 / 3)


def test_token_f1_empty_conventions() -> None:
    assert token_f1("", "") == 1.0
    assert token_f1("the", "a") == 1.0  # both empty after normalization
    assert token_f1("", "aspirin") == 0.0
    assert token_f1("aspirin", "the") == 0.0


def test_token_f1_best_over_golds() -> None:
    assert token_f1("aspirin 81 mg", ["ibuprofen", "aspirin 325 mg", "81 mg aspirin"]) == 1.0
    assert token_f1("aspirin", ["aspirin 81 mg", "ibuprofen"]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        token_f1("aspirin", [])


def test_exact_match() -> None:
    assert exact_match("The Aspirin.", "aspirin") == 1.0
    assert exact_match("7.4 mg/dL", "7.4 mg dl") == 1.0
    assert exact_match("74 mg/dL", "7.4 mg/dL") == 0.0
    assert exact_match("aspirin 81 mg", "aspirin") == 0.0
    assert exact_match("aspirin", ("ibuprofen", "ASPIRIN")) == 1.0
    assert exact_match("", "") == 1.0
    with pytest.raises(ValueError):
        exact_match("aspirin", [])


def test_evidence_recall() -> None:
    assert evidence_recall(["e1", "e2", "e9"], ["e1", "e2", "e3", "e4"]) == 0.5
    assert evidence_recall(iter(["e1"]), {"e1"}) == 1.0
    assert evidence_recall([], ["e1"]) == 0.0
    assert evidence_recall(["e1", "e1"], ["e1", "e1", "e2"]) == 0.5  # distinct gold ids
    assert evidence_recall(["e1"], []) is None


def test_summarize_micro_versus_type_macro() -> None:
    scores = [
        QAScore("q1", "current", f1=1.0, em=1.0, evidence_recall=1.0, served_tokens=100),
        QAScore("q2", "current", f1=1.0, em=1.0, evidence_recall=0.5, served_tokens=200),
        QAScore("q3", "current", f1=0.5, em=0.0, evidence_recall=None, served_tokens=300),
        QAScore("q4", "history", f1=0.0, em=0.0, evidence_recall=0.0, served_tokens=1000),
    ]
    out = summarize(scores)
    assert out["n"] == 4
    assert out["f1"] == 0.625  # (1 + 1 + 0.5 + 0) / 4
    assert out["em"] == 0.5
    assert out["evidence_recall"] == 0.5  # (1 + 0.5 + 0) / 3, q3 has no gold evidence
    assert out["served_tokens_mean"] == 400.0
    assert out["served_tokens_median"] == 250.0
    assert out["f1_type_macro"] == 0.4167  # (2.5/3 + 0) / 2
    assert out["em_type_macro"] == 0.3333  # (2/3 + 0) / 2
    assert out["per_type"] == {
        "current": {"n": 3, "f1": 0.8333, "em": 0.6667, "evidence_recall": 0.75},
        "history": {"n": 1, "f1": 0.0, "em": 0.0, "evidence_recall": 0.0},
    }


def test_summarize_without_evidence_or_scores() -> None:
    out = summarize([QAScore("q1", "t", f1=0.5, em=0.0, evidence_recall=None, served_tokens=7)])
    assert out["evidence_recall"] is None and out["per_type"]["t"]["evidence_recall"] is None
    assert out["f1"] == out["f1_type_macro"] == 0.5
    empty = summarize([])
    assert empty["n"] == 0 and empty["f1"] is None and empty["per_type"] == {}


def _outcomes(b: int, c: int, both: int = 5, neither: int = 3) -> tuple[list[bool], list[bool]]:
    a = [True] * b + [False] * c + [True] * both + [False] * neither
    bb = [False] * b + [True] * c + [True] * both + [False] * neither
    return a, bb


def test_mcnemar_exact_hand_value() -> None:
    a, b = _outcomes(10, 2)
    out = mcnemar_exact(a, b)
    assert (out["b"], out["c"], out["discordant"], out["n"]) == (10, 2, 12, 20)
    # 2 * (C(12,0) + C(12,1) + C(12,2)) / 2**12 = 2 * 79 / 4096
    assert out["p_value"] == pytest.approx(2 * 79 / 4096)
    assert out["p_value"] == pytest.approx(0.03857, abs=1e-5)
    assert mcnemar_exact(b, a)["p_value"] == out["p_value"]  # symmetric
    assert out["a_accuracy"] == 15 / 20 and out["b_accuracy"] == 7 / 20


def test_mcnemar_no_discordant_pairs_and_cap() -> None:
    a, b = _outcomes(0, 0)
    assert mcnemar_exact(a, b)["p_value"] == 1.0
    a, b = _outcomes(3, 3)  # 2 * P[X <= 3], X ~ Bin(6, 1/2) = 2 * 42/64 > 1 -> capped
    assert mcnemar_exact(a, b)["p_value"] == 1.0


def test_mcnemar_matches_scipy_binomtest() -> None:
    stats = pytest.importorskip("scipy.stats")
    for b_count, c_count in [(10, 2), (7, 1), (15, 9), (40, 25), (1, 0)]:
        a, b = _outcomes(b_count, c_count)
        expected = stats.binomtest(min(b_count, c_count), b_count + c_count, 0.5).pvalue
        assert mcnemar_exact(a, b)["p_value"] == pytest.approx(expected, rel=1e-9)


def test_sign_flip_exact_all_positive() -> None:
    out = sign_flip_permutation([0.0] * 5, [1.0] * 5)
    assert out["method"] == "exact" and out["n_permutations"] == 32
    assert out["p_value"] == pytest.approx(2 / 32)
    assert out["mean_difference"] == 1.0


def test_sign_flip_exact_ignores_zero_differences() -> None:
    # differences [1, 1, 1, 0, 0, -1]: non-zero m = 4, observed |sum| = 2; of 16 sign patterns, |sum| >= 2 when
    # all four agree (2) or exactly three agree (8) -> p = 10/16
    out = sign_flip_permutation([0, 0, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0])
    assert out["n_nonzero"] == 4 and out["method"] == "exact"
    assert out["p_value"] == pytest.approx(10 / 16)
    all_zero = sign_flip_permutation([1.0, 2.0], [1.0, 2.0])
    assert all_zero["p_value"] == 1.0 and all_zero["n_nonzero"] == 0


def test_sign_flip_monte_carlo() -> None:
    a = [0.0] * 30
    b = [1.0] * 30  # exact p would be 2 / 2**30
    out = sign_flip_permutation(a, b, n_permutations=999, seed=3)
    assert out["method"] == "monte_carlo" and out["n_permutations"] == 999
    assert out["p_value"] == pytest.approx(1 / 1000)  # no draw reaches |sum| = 30: (0 + 1) / (999 + 1)
    assert out == sign_flip_permutation(a, b, n_permutations=999, seed=3)
    noisy = sign_flip_permutation(a, [(-1.0) ** i for i in range(30)], n_permutations=2000, seed=1)
    assert noisy["p_value"] > 0.5  # mean difference exactly 0


def test_paired_bootstrap_clear_case_and_determinism() -> None:
    a = [0.2, 0.4, 0.1, 0.5, 0.3, 0.6, 0.2, 0.4, 0.3, 0.5] * 3
    b = [x + d for x, d in zip(a, [0.3, 0.5, 0.4, 0.6, 0.5] * 6, strict=True)]
    out = paired_bootstrap(a, b, n_resamples=2000, seed=7)
    assert out["mean_difference"] == pytest.approx(0.46)
    assert out["ci_low"] <= 0.46 <= out["ci_high"]
    assert 0.3 < out["ci_low"] < out["ci_high"] < 0.6
    assert out["share_le_zero"] == 0.0
    assert out == paired_bootstrap(a, b, n_resamples=2000, seed=7)
    assert paired_bootstrap(a, b, n_resamples=2000, seed=8)["ci_low"] != out["ci_low"]
    assert paired_bootstrap(b, a, n_resamples=500)["share_le_zero"] == 1.0


def test_paired_bootstrap_constant_difference() -> None:
    out = paired_bootstrap([1.0, 2.0, 3.0], [1.5, 2.5, 3.5], n_resamples=100, confidence=0.9)
    assert math.isclose(out["ci_low"], 0.5) and math.isclose(out["ci_high"], 0.5)


@pytest.mark.parametrize("call", [
    lambda: mcnemar_exact([True], [True, False]),
    lambda: mcnemar_exact([], []),
    lambda: paired_bootstrap([1.0], [1.0, 2.0]),
    lambda: paired_bootstrap([], []),
    lambda: paired_bootstrap([1.0], [2.0], confidence=1.0),
    lambda: paired_bootstrap([1.0], [2.0], n_resamples=0),
    lambda: sign_flip_permutation([1.0, 2.0], [1.0]),
    lambda: sign_flip_permutation([], []),
])
def test_invalid_inputs_raise(call: object) -> None:
    assert callable(call)
    with pytest.raises(ValueError):
        call()
