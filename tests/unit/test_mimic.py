"""MIMIC-IV adapter on the real demo (patient 10019917, read by hand from poe/pharmacy/prescriptions)."""

from __future__ import annotations

import csv
import gzip
import shutil
from pathlib import Path
from typing import Any

import pytest

from stam.errors import SourceError
from stam.sources.mimic import TABLES, is_mimic_root, load_mimic
from tests.conftest import DATA

pytestmark = pytest.mark.slow  # loads the whole MIMIC-IV demo: skipped by `make test-fast`

MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"


@pytest.fixture(scope="module")
def patient() -> Any:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    return load_mimic(MIMIC, subjects=[PATIENT])


def by_id(result: Any) -> dict[str, Any]:
    return {e.entry_id: e for e in result.entries}


def test_every_row_is_accounted_for(patient: Any) -> None:
    counts = patient.counts()
    assert set(counts) == {*TABLES, "patients"}  # patients: read with the admissions (the demographics entry)
    assert not patient.bad
    for table, c in counts.items():
        if table == "prescriptions":  # folded into the pharmacy order of the same pharmacy_id
            assert c["entries"] == 0 and c["folded"] == c["rows"] == 18
        elif table == "admissions":  # the admission and its discharge, and the death when there is one
            discharged = sum(1 for e in patient.entries if e.entry_id.endswith(":discharge"))
            deaths = sum(1 for e in patient.entries if e.entry_id.endswith(":death"))
            assert c["entries"] == c["rows"] + discharged + deaths and discharged == c["rows"]
        elif table == "patients":
            assert c == {"rows": 1, "entries": 1, "bad": 0, "folded": 0}
        elif table == "pharmacy":  # start + stop, or start only when a POE order is the stop
            assert c["entries"] == 2 * c["rows"] - c["folded"] - sum(
                1 for e in patient.entries if e.entry_id.startswith("mimic-iv:pharmacy:")
                and not e.entry_id.endswith((":start", ":stop")))
        else:
            assert c["entries"] == c["rows"], table
    assert counts["poe"]["rows"] == 53 and counts["labevents"]["rows"] == 89
    assert {e.patient_id for e in patient.entries} == {PATIENT}


def test_entries_are_in_clinical_event_order_and_keep_row_identity(patient: Any) -> None:
    def event_time(e: Any) -> Any:
        return e.effective_end if e.entry_id.endswith((":stop", ":discharge")) else e.effective_at

    # The demographics entry has no clinical time of its own (it holds throughout the record): it comes first.
    assert patient.entries[0].entry_id == "mimic-iv:patients:10019917" and event_time(patient.entries[0]) is None
    times = [event_time(e) for e in patient.entries[1:]]
    assert times == sorted(times)
    ids = by_id(patient)
    assert "mimic-iv:poe:10019917-27" in ids
    lab = next(e for e in patient.entries if e.entry_id.startswith("mimic-iv:labevents:"))
    assert lab.attributes["labevent_id"] == lab.entry_id.rsplit(":", 1)[1]
    assert len(ids) == len(patient.entries)


def test_patients_row_gives_sex_age_and_its_anchor_year(patient: Any) -> None:
    """patients.csv.gz: 10019917,M,44,2182,2014 - 2016 (read by hand). One Patient entry, three facts, lifecycle
    state, no clinical time; each fact's memory says its value in its text (a reader and a baseline see it)."""
    from schemas import Lifecycle
    from stam.reasoning.coded import CodedReasoner
    from stam.sources.mimic import ANCHOR_YEAR, LOINC_AGE, LOINC_SEX

    e = by_id(patient)["mimic-iv:patients:10019917"]
    assert (e.resource_type, e.source_ref, e.lifecycle) == ("Patient", "Patient/10019917", Lifecycle.STATE)
    assert e.effective_at is None and e.effective_end is None and e.encounter is None
    facts = {c.code: q for c, q in e.components}
    assert facts[LOINC_SEX].text == "M" and facts[LOINC_AGE].value == 44 and facts[LOINC_AGE].unit == "years"
    assert facts[ANCHOR_YEAR].value == 2182
    memories = CodedReasoner().extract(e)
    assert [m.text for m in memories] == ["Sex: M", "Age in the anchor year: 44 years", "Anchor year of the age: 2182"]
    assert all(m.lifecycle is Lifecycle.STATE and m.effective_start is None for m in memories)
    assert len({m.position for m in memories}) == 3  # three threads, not versions of one fact


def test_change_order_replaces_the_order_it_discontinues(patient: Any) -> None:
    e = by_id(patient)["mimic-iv:poe:10019917-27"]  # Nutrition / Diet Order, Change of 10019917-8
    assert e.resource_type == "ServiceRequest" and e.status == "active"
    assert [(r.role, r.target) for r in e.references] == [("replaces", "ServiceRequest/poe-10019917-8")]
    assert e.codes[0].code == "10019917-27" and e.codes[0].display == "Nutrition: Diet Order"
    assert e.effective_at is not None and e.effective_at.isoformat() == "2182-01-08T13:15:00+00:00"


def test_dc_order_is_the_discontinued_orders_final_state(patient: Any) -> None:
    e = by_id(patient)["mimic-iv:poe:10019917-60"]  # D/C of 10019917-33, Ferric Gluconate 125 mg
    assert e.resource_type == "MedicationRequest" and e.status == "stopped"
    assert e.codes[0].code == "10019917-33"  # the identity of the order it ends
    assert any(c.display == "Ferric Gluconate" for c in e.codes)
    assert [(r.role, r.target) for r in e.references] == [("discontinues", "MedicationRequest/poe-10019917-33")]


def test_pharmacy_order_carries_drug_dose_and_the_poe_identity(patient: Any) -> None:
    starts = [e for e in patient.entries if e.entry_id.startswith("mimic-iv:pharmacy:")
              and e.attributes.get("poe_id") == "10019917-33"]
    assert starts, "pharmacy row of order 10019917-33"
    e = starts[0]
    assert e.source_ref == "MedicationRequest/poe-10019917-33" and e.codes[0].code == "10019917-33"
    assert e.dosage and e.dosage.startswith("125 mg")
    # POE 10019917-60 discontinued it: the D/C is the stop, the pharmacy row gives only the start.
    assert e.attributes["stopped_by_poe_id"] == "10019917-60" and e.status == "active"


def _mini_copy(tmp_path: Path, bad_lab_time: str) -> Path:
    """A MIMIC-shaped folder with the patient's admissions and labs, one lab row with a bad time."""
    root = tmp_path / "mimic"
    (root / "hosp").mkdir(parents=True)
    for name in ("admissions", "d_labitems"):
        shutil.copy(MIMIC / "hosp" / f"{name}.csv.gz", root / "hosp" / f"{name}.csv.gz")
    with gzip.open(MIMIC / "hosp" / "labevents.csv.gz", "rt", newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if r["subject_id"] == PATIENT][:5]
        fields = reader.fieldnames
    rows[2]["charttime"] = bad_lab_time
    with gzip.open(root / "hosp" / "labevents.csv.gz", "wt", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)  # type: ignore[arg-type]
        w.writeheader()
        w.writerows(rows)
    return root


def test_a_bad_row_becomes_bad_input_with_its_bytes_and_the_rest_goes_on(patient: Any, tmp_path: Path) -> None:
    root = _mini_copy(tmp_path, "2182-13-45 25:00:00")
    assert is_mimic_root(root)
    result = load_mimic(root, tables=["admissions", "labevents"])
    assert result.tables["labevents"].rows == 5 and result.tables["labevents"].entries == 4
    (bad,) = result.bad
    assert bad.source == "labevents.csv" and "bad time in charttime" in bad.error
    assert b"2182-13-45 25:00:00" in bad.raw and bad.raw.startswith(b"labevent_id,")


def test_not_a_mimic_folder_and_unknown_tables_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not a MIMIC-IV folder"):
        load_mimic(tmp_path)
    if MIMIC.is_dir():
        with pytest.raises(SourceError, match="unknown MIMIC-IV tables"):
            load_mimic(MIMIC, subjects=[PATIENT], tables=["chartevents_typo"])


def test_entry_ids_are_unique_across_the_whole_demo(patient: Any) -> None:
    """Row keys without a global id (omr, a death from patients.dod) carry the subject: no two rows of
    the demo share an entry id (a shared id would make the second row a replay, and lose it)."""
    from collections import Counter

    from stam.sources.mimic import iter_mimic

    ids: Counter[str] = Counter()
    for batch in iter_mimic(MIMIC):
        ids.update(e.entry_id for e in batch)
    assert sum(ids.values()) > 290_000
    assert [k for k, n in ids.items() if n > 1] == []


def test_pharmacy_versions_share_the_poe_orders_reference(patient: Any) -> None:
    """IV therapy orders are ServiceRequests in POE; their pharmacy rows must carry the same reference so a
    Change naming the order ends them too (10012853-273 -> Change 10012853-284)."""
    other = load_mimic(MIMIC, subjects=["10012853"], tables=["poe", "pharmacy"])
    refs = {e.source_ref for e in other.entries if e.attributes.get("poe_id") == "10012853-273"}
    assert refs == {"ServiceRequest/poe-10012853-273"}
