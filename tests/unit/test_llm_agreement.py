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
    assert g["judgement"]["teacher_ending"] == g["judgement"]["teacher_linking"] == 0  # agreeing on nothing
    lo, hi = g["judgement"]["verdict"]["ci95"]
    assert lo < 0.5 < hi


def test_the_matrix_summary_has_a_row_per_configuration_present(tmp_path: Path) -> None:
    from benchmarks.llm_matrix import configs, summarise

    table = configs(tmp_path / "adapters")
    assert set(table) == {f"{m}-{e}" for m in ("0.5b", "0.5b+lora", "1.5b") for e in ("llamacpp", "vllm")}
    assert "--judge-model" in table["0.5b+lora-vllm"] and "--lora" not in table["0.5b-vllm"]
    fact = [["condition", "hypertension", "active"]]
    _run(tmp_path / "1.5b-vllm.agree.json", [fact] * 10)
    _run(tmp_path / "0.5b-vllm.agree.json", [fact if i % 2 else [] for i in range(10)])
    (tmp_path / "0.5b-vllm.gold.json").write_text(json.dumps({
        "notes": 6, "dead_lettered_notes": 0, "extraction": {"precision": 0.8, "recall": 0.4, "f1": 0.533},
        "link_update_calls_per_new_memory": 0.5, "seconds_per_note": {"mean": 30.0, "max": 50.0}}))
    rows = summarise(tmp_path, table, "1.5b-vllm")["configurations"]
    assert set(rows) == {"0.5b-vllm", "1.5b-vllm"}
    assert rows["0.5b-vllm"]["gold"]["f1"] == 0.533 and rows["0.5b-vllm"]["gold"]["seconds_per_note"] == 30.0
    assert rows["0.5b-vllm"]["agreement"]["notes_vs_teacher"]["f1"] == round(2 * 5 / 15, 3)
    assert rows["1.5b-vllm"]["agreement"]["notes_vs_teacher"]["f1_minus_baseline"]["difference"] > 0


def test_a_stopped_run_goes_on_from_its_journal(tmp_path: Path) -> None:
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import pytest

    from benchmarks.llm_agreement import Journal

    out, header = tmp_path / "agree.json", {"model": "m", "notes": ["a", "b", "c", "d"]}
    calls: list[int] = []
    release = threading.Event()

    def fn(i: int) -> dict[str, object]:
        calls.append(i)
        if i == 2:  # Ctrl-C while note 2 is in flight, once notes 0 and 1 are in the journal
            journal = out.parent / "agree.json.journal"
            deadline = time.monotonic() + 60  # a loaded machine (make test's four processes on 2 cores) is slow
            while len(journal.read_text().splitlines()) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            # To the main thread, as a terminal's Ctrl-C reaches a program: a process-wide kill from this thread
            # may be taken by this thread, and the main thread, blocked waiting for this note, then does not see
            # it until the note ends (CI once saw no KeyboardInterrupt at all).
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            release.wait(5)
        return {"note": i, "seconds": 1.0, "facts": []}

    pool = ThreadPoolExecutor(1)
    # Python's own Ctrl-C handler, as the command has: an earlier test in the same pytest process may have left
    # another (a Faust/mode worker's), which does not raise KeyboardInterrupt (seen twice under make test).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            Journal(out, header).phase("note", pool, fn, 4)
    finally:
        signal.signal(signal.SIGINT, before)
    release.set()
    pool.shutdown(wait=True)
    assert calls == [0, 1, 2]  # note 3 never started; note 2 finished but after the stop: not kept
    assert (out.parent / "agree.json.journal").stat().st_mode & 0o777 == 0o600

    with pytest.raises(SystemExit, match="another run's journal"):
        Journal(out, header | {"model": "other"})

    calls.clear()
    again = Journal(out, header)
    assert again.segment == 2 and sorted(again.done["note"]) == [0, 1]
    with ThreadPoolExecutor(2) as pool:
        again.phase("note", pool, lambda i: {"note": i, "seconds": 1.0, "facts": []}, 4)
    assert [r["note"] for r in again.rows("note")] == [0, 1, 2, 3]
    assert set(again.walls["note"]) == {1, 2} and again.wall("note") == round(sum(again.walls["note"].values()), 1)
    assert len(Journal(out, header).rows("note")) == 4  # all of it read back from the file


def test_the_matrix_reads_the_report_past_ray_lines_on_stdout() -> None:
    from benchmarks.llm_matrix import report_of

    raylet = "(raylet) Task ServeController.graceful_shutdown failed. There are infinite retries remaining.\n"
    assert report_of(raylet + '{\n  "benchmark": "llm_notes",\n  "notes": 6\n}\n') == {"benchmark": "llm_notes",
                                                                                      "notes": 6}
    assert report_of(raylet) is None and report_of('{"cut off": ') is None
