"""HL7 v2 source on the 139 real sample messages (microsoft/FHIR-Converter, MIT), plus property tests.

Facts asserted below were read by hand in the sample files; synthetic variants are derived from real messages
by editing one field, so every test starts from real data.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import Category, CodeSystem, RecordEntry
from stam.errors import SourceError
from stam.reasoning.coded import RESOURCE_CATEGORY
from stam.sources.hl7v2 import NDC, Hl7Result, load_hl7, parse_dtm, parse_message, split_messages
from tests.conftest import DATA

SAMPLES = DATA / "hl7v2-samples"
needs_samples = pytest.mark.skipif(not SAMPLES.is_dir(), reason=f"HL7 v2 samples not found at {SAMPLES}")

# Message types whose every sample must map (the list).
MUST_MAP = {"ORU^R01", "RDE^O11", "RDE^O25", "RDS^O13", "PPR^PC1", "PPR^PC2", "PPR^PC3", "MDM^T01", "MDM^T02",
            "MDM^T05", "MDM^T06", "MDM^T09", "MDM^T10", "VXU^V04", "ADT^A01", "ADT^A03", "ADT^A08"}


def sample(name: str) -> bytes:
    return (SAMPLES / name).read_bytes()


def parse(name: str) -> list[RecordEntry]:
    return parse_message(sample(name), name)


def by_ref(entries: list[RecordEntry], ref: str) -> RecordEntry:
    found = [e for e in entries if e.source_ref == ref]
    assert len(found) == 1, [e.source_ref for e in entries]
    return found[0]


def edit(raw: bytes, segment: str, field: int, value: str, control_id: str | None = None) -> bytes:
    """A real message with one field of its first ``segment`` replaced (and optionally a new MSH-10)."""
    lines = raw.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    out = []
    done = False
    for line in lines:
        fields = line.split("|")
        if fields[0] == segment and not done:
            index = field - 1 if segment == "MSH" else field
            fields += [""] * (index + 1 - len(fields))
            fields[index] = value
            done = True
        if fields[0] == "MSH" and control_id is not None:
            fields[9] = control_id
        out.append("|".join(fields))
    assert done, segment
    return "\r".join(out).encode()


@pytest.fixture(scope="module")
def samples() -> Hl7Result:
    if not SAMPLES.is_dir():
        pytest.skip(f"HL7 v2 samples not found at {SAMPLES} (set STAM_SHARED_DATA)")
    return load_hl7([SAMPLES])


# --- the whole set -------------------------------------------------------------------------------------------

def test_every_file_is_mapped_or_dead_lettered_exactly_once(samples: Hl7Result) -> None:
    files = sorted(SAMPLES.glob("*.hl7"))
    assert len(files) == 139
    outcome = Counter[str]()
    for f in files:
        one = load_hl7([f])
        assert (len(one.entries) > 0) != (len(one.bad) == 1), f.name
        assert sum(row["messages"] for row in one.by_type.values()) == 1, f.name
        if one.bad:
            assert one.bad[0].source == f.name and one.bad[0].raw == f.read_bytes()
            outcome["bad"] += 1
        else:
            outcome["mapped"] += 1
    assert outcome == {"mapped": 110, "bad": 29}
    totals = Counter[str]()
    for row in samples.by_type.values():
        totals.update(row)
        assert row["messages"] == row["mapped"] + row["bad"]
        assert (row["entries"] == 0) == (row["mapped"] == 0)
    assert totals == {"messages": 139, "mapped": 110, "bad": 29, "entries": len(samples.entries)}
    assert len(samples.bad) == 29 and len(samples.entries) == 358


def test_counts_per_message_type(samples: Hl7Result) -> None:
    bt = samples.by_type
    for mtype in MUST_MAP:
        assert bt[mtype]["mapped"] == bt[mtype]["messages"] > 0, mtype
    assert bt["ORU^R01"] == {"messages": 5, "mapped": 5, "entries": 56, "bad": 0}
    assert bt["VXU^V04"]["entries"] == 10 and bt["RDE^O11"]["entries"] == 4
    scheduling = {t: row for t, row in bt.items() if t.startswith("SIU^")}
    assert sum(row["messages"] for row in scheduling.values()) == 15
    assert all(row["bad"] == row["messages"] for row in scheduling.values())
    for mtype in ("ADT^A29", "ADT^A40", "ADT^A41", "ADT^A45", "ADT^A47", "BAR^P02"):
        assert bt[mtype]["bad"] == bt[mtype]["messages"] == 2, mtype
    # Person-level messages map when they carry clinical segments, are dead letters when demographics only.
    assert bt["ADT^A28"] == {"messages": 2, "mapped": 1, "entries": 4, "bad": 1}


def test_bad_reasons_are_precise_and_name_the_message_type(samples: Hl7Result) -> None:
    for bad in samples.bad:
        mtype = re.match(r"[A-Z0-9]{3}\^[A-Z0-9]{3}", bad.error)
        assert mtype is not None and bad.error_type == "SourceError", bad.error
        assert mtype.group(0) in samples.by_type
    reasons = Counter(b.error.split(" ", 1)[1] for b in samples.bad)
    assert reasons["scheduling message (appointment booking/update): appointment data is not a clinical fact"] == 15
    assert sum(n for r, n in reasons.items() if "identity operation" in r) == 8
    demographics = [b for b in samples.bad if b.source in ("ADT-A28-02.hl7", "ADT-A31-02.hl7")]
    assert all("carries no clinical facts" in b.error and "segments: EVN PID PV1" in b.error for b in demographics)


def test_every_resource_type_has_a_coded_category_and_medications_are_medication(samples: Hl7Result) -> None:
    kinds = Counter(e.resource_type for e in samples.entries)
    assert set(kinds) <= set(RESOURCE_CATEGORY), kinds
    for e in samples.entries:
        assert e.source == "hl7v2" and e.patient_id.startswith("hl7v2:")
        assert e.attributes["hl7_message"] and e.attributes["hl7_control_id"]
        if "Medication" in (e.resource_type or ""):
            assert RESOURCE_CATEGORY[e.resource_type or ""] is Category.MEDICATION
    # In the order the messages were sent (MSH-7), each message's entries in clinical order.
    sent = [e.recorded_at or e.effective_at or datetime(1, 1, 1, tzinfo=UTC) for e in samples.entries]
    assert sent == sorted(sent)


def test_attributes_never_carry_patient_names(samples: Hl7Result) -> None:
    names = set()
    for f in SAMPLES.glob("*.hl7"):
        for line in f.read_text(encoding="utf-8-sig").splitlines():
            if line.startswith("PID|"):
                fields = line.split("|")
                name = fields[5] if len(fields) > 5 else ""
                names |= {p for p in re.split(r"[\^&~]", name) if len(p) > 3}
    assert {"EVERYMAN", "DUCK", "Finn", "KARLS"} <= names
    for e in samples.entries:
        blob = " ".join(str(v) for v in e.attributes.values())
        assert not [n for n in names if n in blob], (e.source_ref, blob)


# --- facts read in specific files ----------------------------------------------------------------------------

@needs_samples
def test_oru_lab_results_with_loinc_value_unit_and_report() -> None:
    entries = parse("LAB-ORU-2.hl7")
    hb = by_ref(entries, "Observation/82503246-20509-6")
    assert hb.resource_type == "Observation" and hb.status == "final"
    assert [(c.system, c.code, c.display) for c in hb.codes] == [(CodeSystem.LOINC, "20509-6", "HEMOGLOBIN")]
    assert hb.value is not None and (hb.value.value, hb.value.unit) == (13.4, "g/l-1")
    assert hb.effective_at == datetime(2014, 10, 6, 8, 30, tzinfo=timezone(timedelta(hours=7)))
    assert hb.recorded_at == datetime(2014, 10, 6, 9, 31, tzinfo=timezone(timedelta(hours=7)))
    assert hb.patient_id == "hl7v2:1:10006579"
    assert {(r.role, r.target) for r in hb.references} == {("part-of", "DiagnosticReport/82503246")}
    report = by_ref(entries, "DiagnosticReport/82503246")
    assert report.codes[0].code == "24317-0" and len(report.references) == 6  # 5 members + based-on the order
    assert ("based-on", "ServiceRequest/88502218") in {(r.role, r.target) for r in report.references}
    # The order that report answers (LAB-ORM-1) carries the same placer number.
    order = parse("LAB-ORM-1.hl7")[0]
    assert (order.resource_type, order.source_ref, order.status) == ("ServiceRequest", "ServiceRequest/88502218",
                                                                     "active")
    # SN value '^182' with unit mg/dl; a CBC from NIST with UCUM units and an HH flag.
    glucose = [e for e in parse("ORU-R01-RMGEAD.hl7") if e.resource_type == "Observation"][0]
    assert glucose.value is not None and (glucose.value.value, glucose.value.unit) == (182.0, "mg/dl")
    assert glucose.attributes["abnormal_flags"] == "H" and glucose.attributes["reference_range"] == "70_105"
    wbc = by_ref(parse("LRI_2.0-NG_CBC_Typ_Message.hl7"), "Observation/R-991133-26464-8")
    assert wbc.value is not None and wbc.value.value == 105600 and wbc.attributes["abnormal_flags"] == "HH"


@needs_samples
def test_preliminary_result_is_superseded_by_the_final_one_of_the_same_source_ref() -> None:
    first, second = parse("LAB-ORU-1.hl7"), parse("LAB-ORU-2.hl7")
    prelim, final = by_ref(first, "Observation/82503246-20570-8"), by_ref(second, "Observation/82503246-20570-8")
    assert (prelim.status, prelim.value and prelim.value.value) == ("preliminary", 40.1)
    assert (final.status, final.value and final.value.value) == ("final", 39.7)
    assert prelim.entry_id != final.entry_id
    # OBX with status I and no value (leukocytes, haemoglobin in the first message) carry no result: not mapped.
    assert not [e for e in first if e.codes and e.codes[0].code in ("11156-7", "20509-6")]


@needs_samples
def test_problem_add_update_delete() -> None:
    add = parse("PC1-Problem-Add-v2.3.1.hl7")[0]
    assert (add.resource_type, add.source_ref, add.status) == ("Condition", "Condition/26744", "active")
    assert (add.codes[0].system, add.codes[0].code) == (CodeSystem.ICD9, "596.5")
    assert add.patient_id == "hl7v2:WEST:10290" and add.effective_at == datetime(2004, 6, 29, tzinfo=UTC)
    update = parse("PC1-Problem-Update-v2.3.1.hl7")[0]
    assert (update.source_ref, update.status) == ("Condition/26793", "resolved")  # life cycle 'Resolved'
    assert update.effective_end == datetime(2004, 6, 29, tzinfo=UTC)
    delete = parse("PC1-Problem-Delete-v2.3.1.hl7")[0]
    assert (delete.source_ref, delete.status, delete.codes[0].code) == ("Condition/26806", "resolved", "300.7")
    assert delete.text == "Patient reported problem was a mistake."
    assert delete.effective_end == datetime(2004, 6, 29, 17, 54, tzinfo=UTC)  # PRB-2 action time, no offset
    # The same problem instance deleted (PC3) and updated (PC2) later: same source_ref, a new version each.
    raw = sample("PC1-Problem-Add-v2.3.1.hl7")
    deleted = parse_message(edit(edit(raw, "MSH", 9, "PPR^PC3"), "PRB", 1, "DE", control_id="400"), "pc3")[0]
    assert (deleted.source_ref, deleted.status) == ("Condition/26744", "resolved")
    updated = parse_message(edit(edit(raw, "MSH", 9, "PPR^PC2"), "PRB", 14, "remission", control_id="401"), "pc2")[0]
    assert (updated.source_ref, updated.status) == ("Condition/26744", "remission")
    assert len({add.entry_id, deleted.entry_id, updated.entry_id}) == 3


@needs_samples
def test_pharmacy_order_dosage_status_and_replacement() -> None:
    order = parse("RDE-O11-01.hl7")
    med = by_ref(order, "MedicationRequest/1163422591")
    assert med.status == "active" and [(c.system, c.code) for c in med.codes] == [(NDC, "0143963401")]
    assert med.dosage is not None and med.dosage.startswith("5 mg/hr at 23 mL/hr Intravenous")
    assert "Titrate to BP less than 180" in med.dosage
    plus_0215 = timezone(timedelta(hours=2, minutes=15))
    assert (med.effective_at, med.effective_end) == (datetime(2019, 11, 4, 10, 30, tzinfo=plus_0215),
                                                     datetime(2019, 11, 4, 11, 30, tzinfo=plus_0215))
    assert RESOURCE_CATEGORY[med.resource_type or ""] is Category.MEDICATION
    two = [e for e in parse("RDE-O11-02.hl7") if e.resource_type == "MedicationRequest"]
    assert sorted(e.source_ref or "" for e in two) == ["MedicationRequest/1163422591", "MedicationRequest/1422591"]
    raw = sample("RDE-O11-01.hl7")
    stopped = by_ref(parse_message(edit(raw, "ORC", 1, "DC", control_id="x1"), "dc"), "MedicationRequest/1163422591")
    assert stopped.status == "stopped"
    cancelled = by_ref(parse_message(edit(raw, "ORC", 1, "CA", control_id="x2"), "ca"), "MedicationRequest/1163422591")
    assert cancelled.status == "cancelled"
    changed = parse_message(edit(edit(raw, "ORC", 1, "XO"), "ORC", 8, "99887766", control_id="x3"), "xo")
    change = by_ref(changed, "MedicationRequest/1163422591")
    assert change.status == "active"
    assert ("replaces", "MedicationRequest/99887766") in {(r.role, r.target) for r in change.references}


@needs_samples
def test_dispense_is_a_medication_statement() -> None:
    dispensed = [e for e in parse("RDS-O13-02.hl7") if e.resource_type == "MedicationStatement"]
    assert len(dispensed) == 2
    amoxicillin = [e for e in dispensed if e.codes[0].system == CodeSystem.RXNORM][0]
    assert amoxicillin.codes[0].code == "308191" and amoxicillin.effective_at == datetime(2020, 12, 12, tzinfo=UTC)
    assert amoxicillin.attributes["medication_event"] == "dispense"
    assert amoxicillin.attributes["dispense_quantity"] == "10 Capsule"
    assert RESOURCE_CATEGORY["MedicationStatement"] is Category.MEDICATION


@needs_samples
def test_document_note_text() -> None:
    notes = [e for e in parse("MDM-T02-03.hl7") if e.resource_type == "DocumentReference"]
    assert len(notes) == 1
    note = notes[0]
    assert note.source_ref == "DocumentReference/2RWRVAJ627408" and note.codes == ()
    assert note.text is not None and len(note.text.splitlines()) == 29
    assert "Neat rugby sound evening hostel curio chastity pulley wallet xylophone" in note.text
    assert note.effective_at == datetime(2021, 8, 1, 9, 6, 42, tzinfo=timezone(timedelta(hours=2, minutes=15)))
    replacement = by_ref(parse("MDM-T10-02.hl7"), "DocumentReference/1.2.840.317.5947431.51.20080131160038")
    assert ("replaces", "DocumentReference/1.2.840.317.5947431.51.20080131155715") in {
        (r.role, r.target) for r in replacement.references}
    # A notification without content still maps the order the document belongs to.
    echo = parse("MDM-T01-01.hl7")
    assert [(e.resource_type, e.source_ref, e.status) for e in echo] == [
        ("ServiceRequest", "ServiceRequest/00012345", "completed")]


@needs_samples
def test_formatted_text_escapes_become_newlines() -> None:
    raw = sample("MDM-T02-02.hl7").replace(
        b"OBX|1|TX|obs-id^obs-text^coding-system^^|1|Toilet cylinder crackers",
        b"OBX|1|FT|obs-id^obs-text^coding-system^^|1|First line\\.br\\Second \\T\\ third\\H\\ bold\\N\\ line")
    note = by_ref(parse_message(raw, "ft"), "DocumentReference/1.2.840.317.5947431.51.20080131160038")
    assert note.text is not None and note.text.startswith("First line\nSecond & third bold line")


@needs_samples
def test_immunizations_with_cvx_and_completion_status() -> None:
    shots = parse("VXU.hl7")
    assert [(e.codes[0].system, e.codes[0].code, e.effective_at) for e in shots] == [
        (CodeSystem.CVX, "88", datetime(2013, 11, 12, tzinfo=UTC)),
        (CodeSystem.CVX, "88", datetime(2014, 10, 12, tzinfo=UTC)),
        (NDC, "49281-0215-88", datetime(2015, 6, 24, tzinfo=UTC))]
    assert shots[0].attributes["information_source"] == "Historical Administration"
    assert shots[2].source_ref == "Immunization/13696" and shots[2].dosage == "0.5 mL Intramuscular Right Deltoid"
    flu = parse("IZ_1_1.1_Admin_Child_Max_Message.hl7")
    assert [(e.resource_type, e.codes[0].code, e.status) for e in flu] == [("Immunization", "140", "completed")]
    raw = sample("IZ_1_1.1_Admin_Child_Max_Message.hl7")
    refused = parse_message(edit(raw, "RXA", 20, "RE", control_id="r1"), "re")[0]
    assert refused.status == "not-done" and refused.source_ref == flu[0].source_ref
    deleted = parse_message(edit(raw, "RXA", 21, "D", control_id="r2"), "d")[0]
    assert deleted.status == "entered-in-error"


@needs_samples
def test_adt_visit_diagnoses_allergies_procedures() -> None:
    admit = parse("ADT-A01-01.hl7")
    visit = by_ref(admit, "Encounter/40007716")
    assert visit.status == "in-progress" and visit.codes[0].code == "P"
    assert visit.effective_at == datetime(2015, 2, 8, 11, 34, 19, tzinfo=timezone(timedelta(hours=1, minutes=10)))
    assert ("reason", f"concept:{CodeSystem.SNOMED}|140004") in {(r.role, r.target) for r in visit.references}
    stroke = by_ref(admit, "Condition/DI20")
    assert (stroke.codes[0].system, stroke.codes[0].code) == (CodeSystem.SNOMED, "422504002")
    assert by_ref(admit, "Procedure/PR1006").codes[0].code == "76164006"
    assert [e.codes[0].display for e in admit if e.resource_type == "AllergyIntolerance"] == ["PENICILLIN"]
    assert visit.patient_id == "hl7v2:test1:PATID1234"
    discharge = by_ref(parse("ADT-A03-01.hl7"), "Encounter/40007716")
    assert discharge.status == "finished" and discharge.effective_end is not None
    assert by_ref(parse("ADT-A08-01.hl7"), "Encounter/40007716").attributes["hl7_event"] == "A08"
    assert by_ref(parse("ADT-A11-02.hl7"), "Encounter/40007716").status == "entered-in-error"
    assert by_ref(parse("ADT-A13-02.hl7"), "Encounter/40007716").effective_end is None  # discharge cancelled
    icd9 = [e for e in parse("ADT01-23.hl7") if e.resource_type == "Condition"][0]
    assert (icd9.codes[0].system, icd9.codes[0].code) == (CodeSystem.ICD9, "71596")
    assert icd9.patient_id == "hl7v2:1:10006579"
    peanut = parse("ADT-A60-02.hl7")[0]
    assert (peanut.resource_type, peanut.source_ref) == ("AllergyIntolerance", "AllergyIntolerance/56789")
    assert peanut.effective_at == datetime(2018, 5, 1, tzinfo=UTC)


@needs_samples
def test_patient_identifier_rule_and_refusals() -> None:
    assert parse("ADT04-23.hl7")[0].patient_id == "hl7v2:local:123456789"
    assert parse("VXU.hl7")[0].patient_id == "hl7v2:NIST-MPI-1:90012"
    raw = sample("ADT-A01-02.hl7")
    with pytest.raises(SourceError, match=r"^ADT\^A01: PID-3 .* empty"):
        parse_message(edit(raw, "PID", 3, ""), "x")
    with pytest.raises(SourceError, match="social-security"):
        parse_message(edit(raw, "PID", 3, "123456789^^^USSSA^SS"), "x")
    no_pid = b"\r".join(line for line in raw.split(b"\n") if not line.startswith(b"PID"))
    with pytest.raises(SourceError, match="no PID segment"):
        parse_message(no_pid, "x")
    with pytest.raises(SourceError, match=r"bad HL7 date/time '2015-02-08' in PV1-44"):
        parse_message(edit(raw, "PV1", 44, "2015-02-08"), "x")
    with pytest.raises(SourceError, match=r"^SIU\^S12 scheduling"):
        parse("SIU-S12-01.hl7")


def test_dtm_rules() -> None:
    assert parse_dtm("20210115160010", "t") == datetime(2021, 1, 15, 16, 0, 10, tzinfo=UTC)
    assert parse_dtm("198908181126+0215", "t") == datetime(1989, 8, 18, 11, 26,
                                                           tzinfo=timezone(timedelta(hours=2, minutes=15)))
    assert parse_dtm("20150624084727.655-0500", "t") == datetime(2015, 6, 24, 8, 47, 27, 655000,
                                                                 tzinfo=timezone(timedelta(hours=-5)))
    assert parse_dtm("2004062916460000", "t") == datetime(2004, 6, 29, 16, 46, tzinfo=UTC)
    assert parse_dtm("201805", "t") == datetime(2018, 5, 1, tzinfo=UTC)
    assert parse_dtm("", "t") is None
    for bad in ("2010201200+0215", "20211", "2021-01-01", "20210101+2500", "00000101"):
        with pytest.raises(SourceError, match="bad HL7 date/time"):
            parse_dtm(bad, "t")


@needs_samples
def test_replay_gives_the_same_ids_and_a_new_control_id_new_ones(samples: Hl7Result) -> None:
    again = load_hl7([SAMPLES])
    assert [e.entry_id for e in again.entries] == [e.entry_id for e in samples.entries]
    assert [e.model_dump() for e in again.entries] == [e.model_dump() for e in samples.entries]
    # Sample files that repeat a message (same MSH-10, same segment, same content) give the same entry.
    first: dict[str, RecordEntry] = {}
    for e in samples.entries:
        assert first.setdefault(e.entry_id, e) == e
    assert len(first) == 347
    raw = sample("LAB-ORU-2.hl7")
    once, twice = parse_message(raw, "a"), parse_message(raw, "b")
    assert [e.entry_id for e in once] == [e.entry_id for e in twice]
    # Segment separators do not change identity: \r, \n and \r\n give the same entries.
    cr = parse_message(raw.replace(b"\n", b"\r"), "cr")
    crlf = parse_message(raw.replace(b"\n", b"\r\n"), "crlf")
    assert [e.entry_id for e in cr] == [e.entry_id for e in crlf] == [e.entry_id for e in once]
    resent = parse_message(edit(raw, "MSH", 10, "ControlID-2"), "c")
    assert not {e.entry_id for e in resent} & {e.entry_id for e in once}
    assert [e.source_ref for e in resent] == [e.source_ref for e in once]


@needs_samples
def test_a_file_with_several_messages_and_junk(tmp_path: Path) -> None:
    parts = [sample("LAB-ORU-2.hl7").replace(b"\n", b"\r\n"), sample("SIU-S12-01.hl7").replace(b"\n", b"\r"),
             sample("VXU.hl7")]
    junk = b"this is not HL7\n"
    f = tmp_path / "batch.txt"
    f.write_bytes(junk + b"\n".join(parts))
    assert len(split_messages(f.read_bytes())) == 4
    result = load_hl7([tmp_path])
    assert [b.source for b in result.bad] == ["batch.txt:1", "batch.txt:3"]
    assert result.bad[0].raw == junk and "does not start with an MSH segment" in result.bad[0].error
    assert result.bad[1].error.startswith("SIU^S12 scheduling")
    assert result.by_type["ORU^R01"]["mapped"] == 1 and result.by_type["VXU^V04"]["entries"] == 3
    assert result.by_type["unknown"] == {"messages": 1, "mapped": 0, "entries": 0, "bad": 1}
    assert len(result.entries) == len(parse("LAB-ORU-2.hl7")) + 3
    # batch envelopes (FHS/BHS/BTS/FTS) are not messages
    wrapped = b"FHS|^~\\&|X\rBHS|^~\\&|X\r" + sample("VXU.hl7") + b"\rBTS|1\rFTS|1\r"
    assert len(parse_message(wrapped, "batch")) == 3


# --- properties ------------------------------------------------------------------------------------------

SEED_FILES = ["ORU-R01-RMGEAD.hl7", "LAB-ORU-2.hl7", "ADT-A01-01.hl7", "RDE-O11-01.hl7", "RDS-O13-02.hl7", "VXU.hl7",
              "PC1-Problem-Add-v2.3.1.hl7", "MDM-T02-02.hl7", "ADT04-23.hl7", "ORM-O01-02.hl7"]
SEEDS = [(SAMPLES / n).read_bytes() for n in SEED_FILES] if SAMPLES.is_dir() else [b"MSH|^~\\&|A|B|||2020||ADT^A01|1|P|2.5"]
FIELD_TEXT = st.text(alphabet=st.sampled_from(list("0123456789ABCXYZ|^~&\\.+- \r\n")), max_size=20)


def check(raw: bytes) -> None:
    try:
        entries = parse_message(raw, "fuzz")
    except SourceError as exc:
        assert str(exc)  # refused with a reason
        return
    assert entries and all(isinstance(e, RecordEntry) and e.source == "hl7v2" for e in entries)
    for e in entries:
        RecordEntry.model_validate(e.model_dump())  # round-trips through the wire contract


@st.composite
def mutated(draw: Any) -> bytes:
    raw: bytes = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        kind = draw(st.sampled_from(["truncate", "swap", "drop", "corrupt", "duplicate", "endings"]))
        if kind == "truncate":
            raw = raw[:draw(st.integers(0, len(raw)))]
        elif kind == "swap":
            a, b = draw(st.lists(st.sampled_from([b"|", b"^", b"~", b"&", b"\\", b"\n"]), min_size=2, max_size=2,
                                 unique=True))
            raw = raw.replace(a, b"\0").replace(b, a).replace(b"\0", b)
        elif kind == "drop" and len(lines) > 1:
            lines.pop(draw(st.integers(0, len(lines) - 1)))
            raw = b"\n".join(lines)
        elif kind == "corrupt":
            i = draw(st.integers(0, len(lines) - 1))
            fields = lines[i].split(b"|")
            j = draw(st.integers(0, len(fields) - 1))
            fields[j] = draw(FIELD_TEXT).encode()
            lines[i] = b"|".join(fields)
            raw = b"\n".join(lines)
        elif kind == "duplicate":
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            raw = b"\n".join(lines)
        else:
            raw = raw.replace(b"\n", draw(st.sampled_from([b"\r", b"\r\n", b"\n\n", b"\x0b"])))
    return raw


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300) | st.binary(max_size=200).map(lambda b: b"MSH|^~\\&|" + b))
def test_random_bytes_parse_or_raise_source_error(raw: bytes) -> None:
    check(raw)


@needs_samples
@settings(max_examples=300, deadline=None)
@given(raw=mutated())
def test_mutated_real_messages_parse_or_raise_source_error(raw: bytes) -> None:
    check(raw)


@needs_samples
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(mutated() | st.sampled_from(SEEDS), min_size=1, max_size=4))
def test_every_message_of_a_file_is_counted_once(tmp_path: Path, messages: list[bytes]) -> None:
    f = tmp_path / "many.hl7"
    data = b"\n".join(messages)
    f.write_bytes(data)
    units = split_messages(data)
    result = load_hl7([f])
    rows = result.by_type.values()
    expected = len(units) or 1  # an empty file is one dead letter ("holds no HL7 message")
    assert sum(r["messages"] for r in rows) == expected == sum(r["mapped"] + r["bad"] for r in rows)
    assert sum(r["entries"] for r in rows) == len(result.entries)
    assert all(b.raw in (units or [data]) and b.error for b in result.bad)
