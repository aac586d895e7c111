"""The teacher-agreement benchmark's scoring: candidate numbers read back from the prompt the reasoner builds,
fact matching against the teacher, judgement agreement, and paired bootstrap intervals that contain the
observed difference and exclude zero only when one run really differs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.llm_agreement import compare, current_count, judged, note_counts
from stam.reasoning import prompts


def test_current_count_reads_the_prompt_the_reasoner_builds() -> None:
    msgs = prompts.judge_messages("Medication: x; current", "2020-01-01", ["a", "b", "c"], ["d"])
    assert current_count(msgs) == 3
    assert current_count(prompts.judge_messages("Medication: x", None, ["a"], [])) == 1


def test_facts_are_matched_by_name_and_status_is_scored_on_matches() -> None:
    teacher = [["condition", "hypertension", "active"], ["medication", "lisinopril 10 mg", "active"]]
    student = [["condition", "essential hypertension", "history"], ["condition", "anemia", "active"]]
    assert note_counts(student, teacher) == (1, 2, 2, 0)


def test_judgements_agree_per_part() -> None:
    t = {"new_is": "current", "links": [{"n": 1, "type": "treatment_for"}], "ended": [{"n": 2, "reason": "stopped"}]}
    same = dict(t, past_reason=None)
    assert judged(same, t) == {"verdict": True, "ended": True, "links": True, "all": True}
    other = {"new_is": "current", "links": [], "ended": [{"n": 2, "reason": "superseded"}], "past_reason": None}
    assert judged(other, t) == {"verdict": True, "ended": True, "links": False, "all": False}
    assert judged(None, t)["all"] is False


def _run(path: Path, facts: list[list[list[str]]], engine: str = "vllm") -> Path:
    path.write_text(json.dumps({
        "model": "m", "engine": engine, "adapters": {}, "concurrency": 1, "extraction_wall_s": 1.0,
        "notes": [{"note": f"n{i}", "facts": f, "error": None, "seconds": 1.0} for i, f in enumerate(facts)],
        "judgements": [{"reply": {"new_is": "current", "links": [], "ended": []},
                        "teacher": {"new_is": "current" if i % 2 else "past"}} for i in range(10)]}))
    return path


def test_compare_gives_paired_intervals_around_the_difference(tmp_path: Path, capsys: object) -> None:
    fact = [["condition", "hypertension", "active"]]
    teacher = _run(tmp_path / "t.json", [fact] * 40)
    good = _run(tmp_path / "good.json", [fact] * 40)
    bad = _run(tmp_path / "bad.json", [fact if i % 2 else [] for i in range(40)])
    compare(argparse.Namespace(teacher=teacher, runs=[good, bad], baseline=bad, resamples=500, seed=0))
    out = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    g = out["runs"][str(good)]
    assert out["notes"] == 40 and g["extraction"]["f1"] == 1.0
    diff = g["extraction"]["f1_minus_baseline"]
    assert diff["difference"] == round(1.0 - 2 * 20 / 60, 3)
    assert 0 < diff["ci95"][0] <= diff["difference"] <= diff["ci95"][1]
    assert g["judgement"]["verdict"]["agreement"] == 0.5 and g["judgement"]["calls"] == 10
    lo, hi = g["judgement"]["verdict"]["ci95"]
    assert lo < 0.5 < hi
