"""The store gate: history cues, the margin rule, calibration's trade-off, the HTTP bearer check."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from schemas.query import GateMode
from stam.config import Settings
from stam.read.store_gate import GateSample, StoreGate, calibrate, history_cue, load_gate, write_gate_file
from workers.query_consumer import check_bearer


@pytest.mark.parametrize("question", [
    "How has her creatinine changed?", "What was the first hemoglobin?", "earliest A1c", "previous dose of lisinopril",
    "Any history of asthma?", "potassium trend", "Was he ever on warfarin?", "Was metformin stopped?",
    "Did the dose increase?", "What did she take before the surgery?",
])
def test_questions_about_change_and_the_past_reach_history(question: str) -> None:
    assert history_cue(question)
    d = StoreGate(threshold=10.0).decide(question, GateMode.AUTO, s_active=0.9, s_history=0.1)
    assert d.serve_history and d.cue


@pytest.mark.parametrize("question", ["What is the current creatinine?", "Which medications does he take?",
                                      "however the blood pressure now"])
def test_present_questions_have_no_cue(question: str) -> None:
    assert history_cue(question) is None


def test_margin_rule_and_modes() -> None:
    gate = StoreGate(threshold=0.05)
    assert not gate.decide("current dose", GateMode.AUTO, 0.80, 0.84).serve_history
    assert gate.decide("current dose", GateMode.AUTO, 0.70, 0.80).serve_history
    assert not gate.decide("current dose", GateMode.AUTO, 0.70, None).serve_history  # empty HISTORY
    assert not gate.decide("first dose", GateMode.ACTIVE, 0.1, 0.9).serve_history
    assert gate.decide("current dose", GateMode.BOTH, 0.9, 0.1).serve_history


def test_calibration_trades_quality_for_skips_with_lambda() -> None:
    # Low margins: ACTIVE alone agrees; high margins: it does not; cues always serve history.
    samples = ([GateSample(margin=-0.2 + i * 0.01, cue=False, agree=True, tokens_active=100, tokens_both=200)
                for i in range(10)]
               + [GateSample(margin=0.3 + i * 0.01, cue=False, agree=False, tokens_active=100, tokens_both=200)
                  for i in range(5)]
               + [GateSample(margin=0.9, cue=True, agree=False, tokens_active=100, tokens_both=200)] * 5)
    assert calibrate(samples, lam=0.0).skip_rate == 0.0  # no weight on cost: ties keep serving HISTORY
    strict = calibrate(samples, lam=0.01)
    assert strict.disagreement == 0.0 and strict.skip_rate == pytest.approx(0.5)
    assert -0.2 <= strict.threshold < 0.3
    loose = calibrate(samples, lam=2.0)  # serving cost dominates: skip even where the arms disagree
    assert loose.skip_rate == pytest.approx(0.75) and loose.disagreement == pytest.approx(0.25)
    assert loose.served_tokens_gate < strict.served_tokens_gate < strict.served_tokens_both


def test_gate_file_round_trip(tmp_path: Path) -> None:
    cal = calibrate([GateSample(margin=0.1, cue=False, agree=True)], lam=0.2)
    path = tmp_path / "gate.json"
    write_gate_file(path, cal, source="test")
    assert load_gate(path, default=-1.0).threshold == pytest.approx(cal.threshold)
    assert load_gate(tmp_path / "missing.json", default=-1.0).threshold == -1.0


def test_http_requires_a_configured_bearer_token() -> None:
    assert check_bearer(Settings(), "Bearer anything") == (
        503, "query endpoint disabled: no STAM_QUERY_TOKEN or STAM_QUERY_TOKENS_FILE configured")
    s = Settings(query_token=SecretStr("s3cret"))
    assert check_bearer(s, None)[0] == 401  # type: ignore[index]
    assert check_bearer(s, "Bearer wrong")[0] == 401  # type: ignore[index]
    assert check_bearer(s, "s3cret")[0] == 401  # type: ignore[index]
    assert check_bearer(s, "Bearer s3cret") is None


def test_a_date_in_the_question_is_a_history_cue() -> None:
    assert history_cue("Body Height on 1938-02-11") == "date 1938-02-11"
    assert history_cue("creatinine in 2019") == "date 2019"
    assert history_cue("What was the sodium on 3/14/2150?") == "date 3/14/2150"
    assert history_cue("sodium 140 mmol/L") is None
