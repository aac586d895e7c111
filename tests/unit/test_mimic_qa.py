"""MIMIC-QA question set on the real MIMIC-IV demo: determinism, patient split, evidence the loader publishes,
and answers recomputed by hand (a few lines of csv reading) for two patients."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from stam.eval.mimic_qa import QTYPES, Question, build_questions, read_jsonl, split_of, write_jsonl
from stam.sources.mimic import load_mimic
from tests.conftest import DATA

MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENTS = ("10000032", "10019917")  # four admissions; one admission (read by hand in test_mimic.py)


def need_mimic() -> None:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")


@pytest.fixture(scope="module")
def demo() -> list[Question]:
    need_mimic()
    return build_questions(MIMIC)


@pytest.fixture(scope="module")
def every() -> list[Question]:
    """Every candidate question of the two patients (no per-patient budget)."""
    need_mimic()
    return build_questions(MIMIC, per_patient=100_000, subjects=PATIENTS)


def rows(table: str, subject: str) -> list[dict[str, str]]:
    with gzip.open(MIMIC / "hosp" / f"{table}.csv.gz", "rt", newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["subject_id"] == subject]


def of(qs: list[Question], patient: str, qtype: str, template: str | None = None) -> list[Question]:
    return [q for q in qs if q.patient_id == patient and q.qtype == qtype
            and (template is None or q.question_id.split(":")[1] == template)]


def when(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=None)


def test_same_input_same_questions(demo: list[Question]) -> None:
    assert build_questions(MIMIC) == demo
    assert len(demo) == 12 * 100 and len({q.question_id for q in demo}) == len(demo)
    assert set(Counter(q.qtype for q in demo)) == set(QTYPES)
    some = build_questions(MIMIC, subjects=list(reversed(PATIENTS)))  # the subset is the full set's questions
    assert some == [q for q in demo if q.patient_id in PATIENTS]


def test_split_is_by_patient(demo: list[Question]) -> None:
    splits: dict[str, set[str]] = {}
    for q in demo:
        splits.setdefault(q.patient_id, set()).add(q.split)
        assert q.split == split_of(q.patient_id)
    assert all(len(s) == 1 for s in splits.values())
    per_split = Counter(next(iter(s)) for s in splits.values())
    assert set(per_split) == {"train", "dev", "test"} and 45 <= per_split["train"] <= 75


def test_every_evidence_id_is_an_entry_the_loader_publishes(every: list[Question]) -> None:
    assert set(Counter(q.qtype for q in every)) == set(QTYPES)
    for patient in PATIENTS:
        published = {e.entry_id for e in load_mimic(MIMIC, subjects=[patient]).entries}
        for q in (q for q in every if q.patient_id == patient):
            assert q.evidence, q
            assert set(q.evidence) <= published, (q.question_id, set(q.evidence) - published)


def test_lab_answers_recomputed_from_labevents(every: list[Question]) -> None:
    for patient in PATIENTS:
        labs = rows("labevents", patient)

        def item_rows(q: Question, labs: list[dict[str, str]] = labs) -> list[dict[str, str]]:
            itemid = q.question_id.split(":")[3].split("@")[0]
            return [r for r in labs if r["itemid"] == itemid]

        checked: Counter[str] = Counter()
        for q in of(every, patient, "last_value"):
            mine = item_rows(q)
            last = max(r["charttime"] for r in mine)
            at_last = [r for r in mine if r["charttime"] == last]
            assert q.answer == f"{at_last[0]['valuenum']} {at_last[0]['valueuom']}".strip()
            assert sorted(q.evidence) == sorted(f"mimic-iv:labevents:{r['labevent_id']}" for r in at_last)
            checked["last"] += 1
        for q in of(every, patient, "max_value"):
            top = max(float(r["valuenum"]) for r in item_rows(q) if r["valuenum"])
            assert float(q.answer.split()[0]) == top
            checked["max"] += 1
        for q in of(every, patient, "value_at_time"):
            assert q.as_of is not None
            before = [r for r in item_rows(q) if when(r["charttime"]) <= when(q.as_of)]
            latest = max(before, key=lambda r: r["charttime"])
            assert q.answer == f"{latest['valuenum']} {latest['valueuom']}".strip()
            assert any(when(r["charttime"]) > when(q.as_of) for r in item_rows(q))  # not simply the last value
            checked["at"] += 1
        for q in of(every, patient, "count", "count_lab"):
            assert q.as_of is not None
            assert q.answer == str(sum(when(r["charttime"]) <= when(q.as_of) for r in item_rows(q)))
            checked["count"] += 1
        assert min(checked.values()) >= 1 and len(checked) == 4, checked


def test_count_of_admissions_is_the_admissions_rows(demo: list[Question], every: list[Question]) -> None:
    for patient in PATIENTS:
        adm = rows("admissions", patient)
        (q,) = of(every, patient, "count", "count_admissions")
        assert q.answer == str(len(adm)) and q.as_of is None
        assert set(q.evidence) == {f"mimic-iv:admissions:{r['hadm_id']}" for r in adm}
        assert q in demo  # the admissions count is every patient's first count question
    assert of(every, "10000032", "count", "count_admissions")[0].answer == "4"


def test_medication_answers_match_their_rows(every: list[Question]) -> None:
    for patient in PATIENTS:
        pharmacy = {r["pharmacy_id"]: r for r in rows("pharmacy", patient)}
        poe = {r["poe_id"]: r for r in rows("poe", patient)}
        drugs: dict[str, set[str]] = {}
        for r in rows("prescriptions", patient):
            for key in (r["pharmacy_id"], r["poe_id"]):
                drugs.setdefault(key, set()).add(r["drug"].strip())
        for q in of(every, patient, "current_medication"):
            assert q.as_of is not None
            for ev in q.evidence:
                pid = ev.split(":")[2]
                ph = pharmacy[pid]
                assert ev.endswith(":start") and when(ph["starttime"] or ph["entertime"]) <= when(q.as_of)
                assert q.answer in drugs.get(pid, {ph["medication"].strip()})
                if ph["poe_id"] in poe and poe[ph["poe_id"]]["discontinued_by_poe_id"]:  # not yet discontinued
                    assert when(poe[poe[ph["poe_id"]]["discontinued_by_poe_id"]]["ordertime"]) > when(q.as_of)
                elif ph["stoptime"]:
                    assert when(ph["stoptime"]) > when(q.as_of)
        for q in of(every, patient, "discontinued_medication"):
            assert q.as_of is not None
            if q.evidence[0].startswith("mimic-iv:poe:"):
                order, ender = (poe[e.split(":")[2]] for e in q.evidence[:2])
                assert ender["transaction_type"] in ("D/C", "Change")
                assert ender["discontinue_of_poe_id"] == order["poe_id"] and when(ender["ordertime"]) == when(q.as_of)
                assert q.answer in drugs.get(order["poe_id"], {q.answer})
            else:
                ph = pharmacy[q.evidence[0].split(":")[2]]
                assert ph["status"].startswith(("Discontinued", "Inactive"))
                assert max(when(ph["stoptime"]), when(ph["starttime"])) == when(q.as_of)
        assert of(every, patient, "current_medication") and of(every, patient, "discontinued_medication")


def test_jsonl_round_trip(demo: list[Question], tmp_path: Path) -> None:
    path = tmp_path / "mimic_qa.jsonl"
    assert write_jsonl(demo, path) == len(demo)
    back: Any = read_jsonl(path)
    assert back == demo and isinstance(back[0].evidence, tuple)
