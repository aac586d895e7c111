"""`stam eval qa` end to end on one real MIMIC-IV patient loaded with every table: the STAM replay on real stores,
append-only (the same memories, never ended) with and without STAM's read path, flat RAG and full context over the
same entries, a real reader (the packaged Qwen2.5-Coder-0.5B through llama.cpp in process) answering from every
system's context, and STAM at a comparator's median context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATA

pytestmark = [pytest.mark.integration, pytest.mark.model]  # make test runs it alone, after the others (Makefile)
MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"
QTYPES = ("last_value", "value_at_time")  # two: each question is about 7 reader calls (~40 s here)


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any, embedder: Any) -> tuple[dict[str, Any], list[Any], Any]:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    pytest.importorskip("llama_cpp", reason="the llm extra is not installed (make setup installs it)")
    from stam.errors import WeightsError
    from stam.read.reader import LocalReader
    from stam_lab.eval.mimic_qa import build_questions
    from stam_lab.eval.qa_run import READER_SYSTEM, evaluate_qa

    try:
        reader = LocalReader("qwen2.5-coder-0.5b-instruct-q4_k_m", n_ctx=4096, system=READER_SYSTEM)
    except WeightsError as exc:
        pytest.skip(str(exc))
    questions = [next(q for q in build_questions(MIMIC, subjects=[PATIENT]) if q.qtype == t) for t in QTYPES]
    report = evaluate_qa(MIMIC, questions, workdir=Path(tmp_path_factory.mktemp("eval-qa")), embedder=embedder,
                         budget=800, reader=reader, match="flat-rag", keep_rows=True,
                         deletion_gate=_delete_every_candidate(embedder.model_name, embedder.dim))
    return report, questions, reader


def _delete_every_candidate(encoder: str, dim: int) -> Any:
    """Not a calibrated gate: a head that scores every memory ~1, so the sweep deletes every candidate and only the
    keep rules hold memories back (the worst a gate could do)."""
    import numpy as np

    from stam.deletion.gate import Gate, GateSpec
    from stam.deletion.scorer import Head

    return Gate(Head(np.zeros(dim, dtype=np.float32), 20.0, encoder, "test"),
                GateSpec(tau=0.5, alpha=0.5, criterion="strict", encoder=encoder, calibration_id="test-every",
                         created="2026-11-26T00:00:00+00:00", calibration_types=0))


def test_every_system_is_answered_by_the_same_reader_and_scored(run: tuple[dict[str, Any], list[Any], Any]) -> None:
    from stam_lab.eval.qa import exact_match, token_f1

    report, questions, reader = run
    assert report["reader"] == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    systems = {"stam", "stam-both", "append-only", "append-only+threads", "flat-rag", "full-context", "stam@flat-rag",
               "stam+deletion"}
    assert set(report["systems"]) == systems
    best = 0.0
    for name in systems:
        rows = report["rows"][name]
        assert [r["question_id"] for r in rows] == [q.question_id for q in questions]
        for r, q in zip(rows, questions, strict=True):
            assert isinstance(r["prediction"], str) and r["prediction"]
            assert r["f1"] == token_f1(r["prediction"], q.answer) and r["em"] == exact_match(r["prediction"], q.answer)
            best = max(best, r["f1"])
        s = report["systems"][name]
        assert 0.0 <= s["f1"] <= 1.0 and 0.0 <= s["em"] <= 1.0 and "type_macro_f1" in s
    assert best > 0.0  # the reader answers something right from some context
    # One answer per distinct (question, context): systems serving the same context share it.
    distinct = {(q.question, r["tokens"], name) for name in systems for q, r in zip(questions, report["rows"][name],
                                                                                   strict=True)}
    assert 0 < reader.usage["calls"] <= len(distinct)
    paired = report["paired_vs_stam"]["append-only"]
    assert {"mcnemar_em", "bootstrap_f1", "sign_flip_f1", "mcnemar_all_evidence"} <= set(paired)
    assert report["stale_current_items"]["stam"] == 0  # nothing the rows say was replaced is served as current
    assert report["systems"]["stam"]["evidence_recall"] == 1.0


def test_context_matching_runs_stam_at_the_comparators_median(run: tuple[dict[str, Any], list[Any], Any]) -> None:
    report, _, _ = run
    m = report["matching"]
    assert m["comparator"] == "flat-rag" and m["target_tokens"] == int(report["systems"]["flat-rag"]["tokens_median"])
    assert m["matched"] and 0.8 <= m["ratio"] <= 1.25
    assert all(r["tokens"] <= m["target_tokens"] for r in report["rows"]["stam@flat-rag"])
    # the full-context budget is honoured and the oldest entries are what it drops
    assert all(r["tokens"] <= 800 for r in report["rows"]["full-context"])


def test_deletion_keeps_what_the_questions_and_the_record_need(run: tuple[dict[str, Any], list[Any], Any]) -> None:
    """Every candidate deleted (lab results are held by their codes, the value before the current one and a
    thread's start by rule): the questions about this patient's lab series keep their evidence and nothing the
    rows say was replaced is served as current."""
    report, questions, _ = run
    d = report["deletion"]
    assert d["gate"]["calibration_id"] == "test-every" and d["skipped"] == 0
    assert 0 < d["deleted"] == d["ordered"] == d["candidates"] < d["history_before"]
    assert "mimic-d-labitems" not in d["deleted_by_code_system"] and d["kept_by_rule"]["coded-never-forget"] > 0
    assert sum(d["deleted_by_code_system"].values()) == d["deleted"]
    assert [r["question_id"] for r in report["rows"]["stam+deletion"]] == [q.question_id for q in questions]
    assert report["systems"]["stam+deletion"]["evidence_recall"] == report["systems"]["stam"]["evidence_recall"]
    assert report["stale_current_items"]["stam+deletion"] == 0
    assert {"mcnemar_all_evidence", "bootstrap_recall"} <= set(report["paired_vs_stam"]["stam+deletion"])
