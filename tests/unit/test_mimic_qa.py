"""MIMIC-QA question set on the real MIMIC-IV demo: determinism, patient split, evidence the loader publishes,
and answers recomputed by hand (a few lines of csv reading) for two patients, plus questions of the
current-versus-history templates read off the CSV rows by hand (zcat | grep)."""

from __future__ import annotations

import csv
import gzip
import re
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from stam.sources.mimic import SYS_DRUG, iter_mimic, load_mimic
from stam_lab.eval.mimic_qa import PER_PATIENT, QTYPES, Question, build_questions, read_jsonl, split_of, write_jsonl
from tests.conftest import DATA

pytestmark = pytest.mark.slow  # loads MIMIC-IV demo tables: skipped by `make test-fast`

MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENTS = ("10000032", "10019917")  # four admissions; one admission (read by hand in test_mimic.py)
# Many medication orders: POE orders with several pharmacy rows, IV orders whose pharmacy row starts first.
MED_HEAVY = ("10005866", "10035631")


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


@pytest.fixture(scope="module")
def published() -> dict[str, list[Any]]:
    """The entries the loader publishes for the two patients and the medication-heavy ones."""
    need_mimic()
    return {entries[0].patient_id: entries for entries in iter_mimic(MIMIC, subjects=(*PATIENTS, *MED_HEAVY))
            if entries}


def rows(table: str, subject: str) -> list[dict[str, str]]:
    with gzip.open(MIMIC / "hosp" / f"{table}.csv.gz", "rt", newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["subject_id"] == subject]


def of(qs: list[Question], patient: str, qtype: str, template: str | None = None) -> list[Question]:
    return [q for q in qs if q.patient_id == patient and q.qtype == qtype
            and (template is None or q.question_id.split(":")[1] == template)]


def when(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=None)


def test_same_input_same_questions(demo: list[Question]) -> None:
    # Built again for every tenth patient (the whole demo again would take half a minute): the same questions.
    sample = sorted({q.patient_id for q in demo})[::10]
    assert len(sample) == 10 and build_questions(MIMIC, subjects=sample) == [q for q in demo if q.patient_id in sample]
    assert PER_PATIENT == 27 and len(demo) == PER_PATIENT * 100 and len({q.question_id for q in demo}) == len(demo)
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
        admissions = {r["hadm_id"]: r for r in rows("admissions", patient)}
        for q in of(every, patient, "current_medication"):
            assert q.as_of is not None
            (ev,) = q.evidence  # one order started most recently
            table, key = ev.split(":")[1:3]
            ph = pharmacy[key] if table == "pharmacy" else None
            order = poe[ph["poe_id"] if ph else key] if (ph is None or ph["poe_id"]) else None
            started = (ph["starttime"] or ph["entertime"]) if ph else order["ordertime"]  # type: ignore[index]
            assert when(started) <= when(q.as_of)
            assert q.answer in drugs.get(key, set()) | drugs.get(order["poe_id"] if order else "", set()) | (
                {ph["medication"].strip()} if ph else set())
            hadm = (ph or order or {}).get("hadm_id")
            if hadm:  # its admission not yet over
                assert when(admissions[hadm]["dischtime"]) > when(q.as_of)
            if order is not None and order["discontinued_by_poe_id"]:  # not yet discontinued
                assert when(poe[order["discontinued_by_poe_id"]]["ordertime"]) > when(q.as_of)
            if ph is not None and ph["stoptime"] and not (order and order["discontinued_by_poe_id"]):
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


# --- current-versus-history templates ------------------------------------------------------------------------


def test_new_templates_hand_checked(heavy: list[Question]) -> None:
    """Questions whose rows were read by hand from the CSV files."""
    by_id = {q.question_id: q for q in heavy}
    lab = "mimic-iv:labevents:"
    expected = [
        # INR(PT) 51237 of 10000032: ... 584 (2180-08-07 06:15, 1.7, no unit), 596 (2180-08-10 12:00, 1.6).
        ("previous_value:10000032:51237", "What was the INR(PT) (Blood) value before the most recent one?",
         "1.7", None, (lab + "584", lab + "596")),
        # Lactate 50813: 267 (2180-06-26 16:39, 1.7), 379 (2180-07-23 06:48, value '___', valuenum 1.6),
        # 513 (2180-08-05 21:27, 2.1): as of 2180-07-30 the latest is 379, the one before 267.
        ("previous_value:10000032:50813@21800730T020700",
         "As of 2180-07-30 02:07:00, what was the Lactate (Blood) value before the most recent one?",
         "1.7 mmol/L", "2180-07-30T02:07:00+00:00", (lab + "267", lab + "379")),
        # Magnesium 50960: first 31 (2180-03-23 11:51, 1.8 mg/dL), last 579 (2180-08-07 06:15, valuenum '2').
        ("change_since_first:10000032:50960", "How has the patient's Magnesium (Blood) changed since the first "
         "result?", "1.8 mg/dL to 2 mg/dL", None, (lab + "31", lab + "579")),
        # POE 10000032-30 (Furosemide, New, 2180-05-07 00:04:41; pharmacy 99060160: 20 mg PO/NG DAILY) ended only
        # by 10000032-50 (Change, 09:27:50), whose one pharmacy row 19796602 starts 2180-05-08 08:00 (stoptime
        # before it, 'Discontinued via patient discharge': ':start' and ':stop') with prescription Furosemide 40 mg,
        # route PO/NG, frequency DAILY; the other orders placed at 00:04:41 are other drugs.
        ("order_changed_into:10000032:10000032-30", "What was the Furosemide order of 2180-05-07 00:04:41 changed "
         "into?", "Furosemide 40 mg PO/NG DAILY", "2180-05-08T08:00:00+00:00",
         ("mimic-iv:poe:10000032-30", "mimic-iv:poe:10000032-50", "mimic-iv:pharmacy:19796602:start")),
        # POE 10035631-394 (Vancomycin, 2112-11-13 12:22:26; pharmacy 38257416: 1000 mg IV Q 8H) ended only by
        # 10035631-430 (Change, 2112-11-15 09:16:32), whose pharmacy row 80347361 (Vancomycin 750 mg, IV, Q 8H)
        # starts 16:00, after 430 was itself changed by 10035631-432 (10:53:30): one entry, no ':start'.
        ("order_changed_into:10035631:10035631-394", "What was the Vancomycin order of 2112-11-13 12:22:26 changed "
         "into?", "Vancomycin 750 mg IV Q 8H", "2112-11-15T16:00:00+00:00",
         ("mimic-iv:poe:10035631-394", "mimic-iv:poe:10035631-430", "mimic-iv:pharmacy:80347361")),
        # Pharmacy 31659569 (Phytonadione, 2182-01-09 08:00 to 13:00, Discontinued; POE 10019917-42 never D/C'd).
        ("drug_active_at:10019917:phytonadione@21820109T103000",
         "As of 2182-01-09 10:30:00, was Phytonadione an active medication order?", "yes",
         "2182-01-09T10:30:00+00:00", ("mimic-iv:pharmacy:31659569:start",)),
        # Epoetin Alfa: POE 10019917-15's two pharmacy rows (49692826, 6636385) expired 2182-01-09 06:00; the next
        # order (10019917-31) is placed later that morning and starts 09:00: at 06:35 none is active.
        ("drug_active_at:10019917:epoetin-alfa@21820109T063500",
         "As of 2182-01-09 06:35:00, was Epoetin Alfa an active medication order?", "no",
         "2182-01-09T06:35:00+00:00", ("mimic-iv:pharmacy:49692826:start", "mimic-iv:pharmacy:49692826:stop",
                                        "mimic-iv:pharmacy:6636385:start", "mimic-iv:pharmacy:6636385:stop")),
    ]
    for qid, text, answer, as_of, evidence in expected:
        q = by_id[f"mimic-qa:{qid}"]
        assert (q.question, q.answer, q.as_of, q.evidence) == (text, answer, as_of, evidence), q


def test_new_lab_templates_recomputed_from_labevents(every: list[Question]) -> None:
    checked: Counter[str] = Counter()
    for patient in PATIENTS:
        labs = rows("labevents", patient)
        for q in of(every, patient, "previous_value") + of(every, patient, "change_since_first"):
            itemid = q.question_id.split(":")[3].split("@")[0]
            mine = [r for r in labs if r["itemid"] == itemid
                    and (q.as_of is None or when(r["charttime"]) <= when(q.as_of))]
            times = sorted({r["charttime"] for r in mine})
            at = {t: [r for r in mine if r["charttime"] == t] for t in times}
            shown = {t: f"{g[0]['valuenum']} {g[0]['valueuom']}".strip() for t, g in at.items()}
            ids = {t: {f"mimic-iv:labevents:{r['labevent_id']}" for r in g} for t, g in at.items()}
            one, two = (times[-2], times[-1]) if q.qtype == "previous_value" else (times[0], times[-1])
            for t in (one, two):  # each time's results agree
                assert len({float(r["valuenum"]) for r in at[t]}) == 1
            expected = shown[one] if q.qtype == "previous_value" else f"{shown[one]} to {shown[two]}"
            assert q.answer == expected and set(q.evidence) == ids[one] | ids[two], q
            if q.as_of is not None:  # asked between two results, never after the last one
                assert any(when(r["charttime"]) > when(q.as_of) for r in labs if r["itemid"] == itemid)
            checked[q.qtype, q.as_of is None] += 1
    assert len(checked) == 3 and min(checked.values()) >= 3, checked  # change_since_first is never timed


def _dosage(rx: dict[str, str], ph: dict[str, str]) -> str:
    """A pharmacy row's dosage written from the rows: dose and unit of the prescription, route, frequency."""
    return " ".join(b for b in (f"{rx['dose_val_rx']} {rx['dose_unit_rx']}".strip(), ph["route"] or rx["route"],
                                ph["frequency"]) if b)


def test_order_changed_into_matches_the_change_rows(heavy: list[Question]) -> None:
    checked = 0
    for patient in (*PATIENTS, *MED_HEAVY):
        poe = {r["poe_id"]: r for r in rows("poe", patient)}
        pharmacy = {r["pharmacy_id"]: r for r in rows("pharmacy", patient)}
        main: dict[str, dict[str, str]] = {}  # each pharmacy row's first MAIN prescription
        for r in rows("prescriptions", patient):
            if r["drug_type"] == "MAIN":
                main.setdefault(r["pharmacy_id"], r)

        def described(pid: str, main: dict[str, dict[str, str]] = main,
                      pharmacy: dict[str, dict[str, str]] = pharmacy) -> str:
            return f"{main[pid]['drug'].strip()} {_dosage(main[pid], pharmacy[pid])}".casefold()

        for q in of(heavy, patient, "order_changed_into"):
            old, new = (poe[e.removeprefix("mimic-iv:poe:")] for e in q.evidence[:2])
            assert new["transaction_type"] == "Change" and new["discontinue_of_poe_id"] == old["poe_id"]
            assert old["order_type"] == "Medications" and q.as_of is not None and old["ordertime"] in q.question
            assert sum(r["discontinue_of_poe_id"] == old["poe_id"] for r in poe.values()) == 1
            # the new order's pharmacy rows at its first start: the evidence, all with the answer's drug and dosage
            mine = [r for r in pharmacy.values() if r["poe_id"] == new["poe_id"]]
            first = min(r["starttime"] for r in mine)
            pids = sorted(r["pharmacy_id"] for r in mine if r["starttime"] == first)
            assert sorted(e.split(":")[2] for e in q.evidence[2:]) == pids
            assert {described(pid) for pid in pids} == {q.answer.casefold()}, q
            # asked when both the Change and the new dosage are in the record
            assert when(q.as_of) == max(when(new["ordertime"]), when(first))
            # a change the rows can tell apart: none of the old order's pharmacy rows reads the same
            olds = [r["pharmacy_id"] for r in pharmacy.values() if r["poe_id"] == old["poe_id"]]
            assert olds and q.answer.casefold() not in {described(pid) for pid in olds if pid in main}
            checked += 1
    assert len(of(heavy, "10000032", "order_changed_into")) == 3 and checked >= 40, checked


def test_order_changed_into_answer_is_on_the_published_entry(heavy: list[Question],
                                                             published: dict[str, list[Any]]) -> None:
    """The answer is the drug and dosage the loader publishes on the new order's pharmacy entry; every evidence
    entry is in the record at ``as_of``."""
    for q in (q for q in heavy if q.qtype == "order_changed_into"):
        assert q.as_of is not None
        entries = {e.entry_id: e for e in published[q.patient_id]}
        assert all(_when_published(entries[ev]) <= when(q.as_of) for ev in q.evidence)
        for ev in q.evidence[2:]:
            e = entries[ev]
            drug = next(c.display for c in e.codes if c.system == SYS_DRUG)
            assert ev.startswith("mimic-iv:pharmacy:") and f"{drug} {e.dosage}" == q.answer, (q, e)
        old_ref = entries[q.evidence[0]].source_ref
        old_doses = {f"{c.display} {e.dosage}".casefold() for e in published[q.patient_id]
                     if e.source_ref == old_ref and e.entry_id.startswith("mimic-iv:pharmacy:") and e.dosage
                     for c in e.codes if c.system == SYS_DRUG}
        assert old_doses and q.answer.casefold() not in old_doses, q


@pytest.fixture(scope="module")
def heavy() -> list[Question]:
    """Every candidate question of the two patients and the medication-heavy ones."""
    need_mimic()
    return build_questions(MIMIC, per_patient=100_000, subjects=(*PATIENTS, *MED_HEAVY))


def _when_published(e: Any) -> datetime:
    t = e.effective_end if e.entry_id.endswith(":stop") else e.effective_at or e.recorded_at  # Patient: no time
    return t.replace(tzinfo=None) if t is not None else datetime.min


def _drug(name: str) -> str:
    """A drug name without a strength in parentheses, any spelling ("Oxycodone-Acetaminophen (5mg-325mg)")."""
    return " ".join(re.sub(r"\s*\([^()]*\)\s*$", "", name).split()).casefold()


class _Orders:
    """One patient's medication orders read from the published entries alone: the entries of each order
    (source_ref) in publishing order, the times each was replaced or discontinued by another entry, and when each
    admission was discharged (its discharge entry)."""

    def __init__(self, entries: list[Any]) -> None:
        self.versions: dict[str, list[Any]] = {}
        self.ends: dict[str, list[datetime]] = {}
        self.by_drug: dict[str, set[str]] = {}
        self.discharged: dict[str, datetime] = {}
        for e in entries:
            if e.entry_id.endswith(":discharge") and e.effective_end is not None:
                self.discharged[e.encounter] = e.effective_end.replace(tzinfo=None)
            if e.resource_type not in ("MedicationRequest", "ServiceRequest"):
                continue
            self.versions.setdefault(e.source_ref, []).append(e)
            for r in e.references:
                if r.role in ("replaces", "discontinues"):
                    self.ends.setdefault(r.target, []).append(_when_published(e))
            for c in e.codes:
                if c.system == SYS_DRUG and c.display:
                    self.by_drug.setdefault(_drug(c.display), set()).add(e.source_ref)

    def active(self, drug: str, at: datetime) -> bool:
        """An order whose latest entry at ``at`` is active and names the drug, not replaced or discontinued since,
        its admission not discharged and its own end time (an entry with one and no stop) not passed."""
        for ref in self.by_drug.get(drug, ()):
            seen = [e for e in self.versions[ref] if _when_published(e) <= at]
            if not seen:
                continue
            last = seen[-1]
            names = {_drug(c.display) for c in last.codes if c.system == SYS_DRUG and c.display}
            discharged = self.discharged.get(last.encounter)
            own_end = last.effective_end.replace(tzinfo=None) if last.effective_end else None
            if last.status == "active" and drug in names and \
                    not any(_when_published(last) <= t <= at for t in self.ends.get(ref, ())) and \
                    (discharged is None or at < discharged) and (own_end is None or at < own_end):
                return True
        return False


def _asked_drug(q: Question) -> str:
    text = q.question.split(", ", 1)[1]
    for head, tail in (("was ", " an active medication order?"), ("is the patient currently receiving ", "?")):
        if text.startswith(head):
            return _drug(text.removeprefix(head).removesuffix(tail))
    raise AssertionError(q.question)


def test_yes_no_medication_answers_agree_with_the_published_entries(heavy: list[Question],
                                                                    published: dict[str, list[Any]]) -> None:
    """drug_active_at and currently_receiving, checked against the published entries alone (a second reading of
    the rows: each order's latest entry, its Change/D/C, its admission's discharge entry)."""
    orders = {p: _Orders(entries) for p, entries in published.items()}
    times = {p: {e.entry_id: _when_published(e) for e in entries} for p, entries in published.items()}
    answers: Counter[tuple[str, str]] = Counter()
    for q in (q for q in heavy if q.qtype in ("drug_active_at", "currently_receiving")):
        assert q.as_of is not None
        at = when(q.as_of)
        assert orders[q.patient_id].active(_asked_drug(q), at) == (q.answer == "yes"), q
        # yes: the entries in effect of the active orders; no: the start and end of the order(s) that ended last
        assert all(times[q.patient_id][ev] < at for ev in q.evidence)
        assert (len(q.evidence) >= 2) if q.answer == "no" else not any(ev.endswith(":stop") for ev in q.evidence)
        answers[q.qtype, q.answer] += 1
    # Ended by the discharge: "no" with the discharge entry as evidence, asked after the admission.
    after = [q for q in heavy if q.qtype == "currently_receiving" and any(e.endswith(":discharge") for e in q.evidence)]
    assert after and all(q.answer == "no" for q in after)
    assert min(answers.values()) > 40, answers


def test_every_evidence_id_is_published_for_medication_heavy_patients(heavy: list[Question],
                                                                      published: dict[str, list[Any]]) -> None:
    assert set(Counter(q.qtype for q in heavy if q.patient_id in MED_HEAVY)) == set(QTYPES)
    ids = {p: {e.entry_id for e in entries} for p, entries in published.items()}
    for q in heavy:
        assert q.evidence and set(q.evidence) <= ids[q.patient_id], (q.question_id, set(q.evidence) - ids[q.patient_id])


def test_yes_no_templates_are_balanced_and_every_template_has_its_share(demo: list[Question]) -> None:
    for qtype in ("drug_active_at", "currently_receiving"):
        answers = Counter(q.answer for q in demo if q.qtype == qtype)
        assert set(answers) == {"yes", "no"} and abs(answers["yes"] - answers["no"]) <= 0.1 * sum(answers.values())
    per_type = Counter(q.qtype for q in demo)
    assert set(per_type) == set(QTYPES)
    # about 1.5 per template and patient (100 patients) where the rows give candidates; fewer where they are rare:
    # an order started most recently that the rows and the published versions agree on, a discharge of an admission
    # that ended alone
    assert min(n for t, n in per_type.items() if t not in ("current_medication", "discharge_changes")) >= 110, per_type
    assert per_type["current_medication"] >= 40 and per_type["discharge_changes"] >= 80, per_type


def test_encounter_templates_hand_checked(heavy: list[Question]) -> None:
    """Read by hand from the CSV rows of 10019917: patients (M, anchor_age 44, anchor_year 2182); admissions
    22585261 (2182-01-07 23:25:00 to 2182-01-10 16:52:00); diagnoses_icd (seq 1-4); labevents 51222 Hemoglobin (9.6
    at 01-08 03:57, 10.2 at 01-08 14:49 [240103], 8.3 at 01-09 04:05, 9.9 at 01-10 08:05), 50983 Sodium (140 at 01-08
    03:57 [240097], 142 at 01-09 05:55); pharmacy rows running at the discharge (stop 21:00 after it, no D/C):
    10329604 (POE 10019917-30, Cyanocobalamin), 65196717 (-32, FoLIC Acid), 306660 (-36, flush), 50339329 (-49,
    Pantoprazole), and POE orders -12, -16, -17 (no pharmacy row, no D/C); 22544245 (-33) was discontinued by the D/C
    10019917-60 at 12:37:20. -30 and -32 were ordered (01-09 07:10:56) after their pharmacy start (01-08 08:00): the
    POE entry is their newest version at the discharge."""
    by_id = {q.question_id: q for q in heavy}
    dc = "2182-01-10T16:52:00+00:00"
    expected = [
        ("age:10019917:22585261", "How old is the patient?", "44 years", "2182-01-07T23:25:00+00:00",
         ("mimic-iv:patients:10019917",)),
        ("billed_diagnoses:10019917:22585261", "How many diagnoses were billed for this admission?", "4", dc,
         tuple(f"mimic-iv:diagnoses_icd:22585261:{k}" for k in (1, 2, 3, 4))),
        ("first_day:10019917:22585261:51222", "What was the highest Hemoglobin (Blood) value within the first day of "
         "this admission?", "10.2 g/dL", dc, ("mimic-iv:labevents:240103",)),
        ("hour_n:10019917:22585261:50983", "What was the most recent Sodium (Blood) value at hour 17 of this stay?",
         "140 mEq/L", dc, ("mimic-iv:labevents:240097",)),
        ("discharge_changes:10019917:22585261", "What changed at discharge: how many of the patient's medication "
         "orders did the discharge end?", "7", dc,
         ("mimic-iv:admissions:22585261:discharge", "mimic-iv:pharmacy:306660:start",
          "mimic-iv:pharmacy:50339329:start", "mimic-iv:poe:10019917-12", "mimic-iv:poe:10019917-16",
          "mimic-iv:poe:10019917-17", "mimic-iv:poe:10019917-30", "mimic-iv:poe:10019917-32")),
    ]
    for qid, text, answer, as_of, evidence in expected:
        q = by_id[f"mimic-qa:{qid}"]
        assert (q.question, q.answer, q.as_of, q.evidence) == (text, answer, as_of, evidence), q
