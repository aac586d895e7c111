"""MIMIC-IV (hosp + icu modules, the layout of the full database and of the demo) -> record entries.

Rows are read from the ``.csv.gz`` (or ``.csv``) tables, grouped by ``subject_id`` and turned into entries
that are yielded patient by patient, each patient's entries in clinical-event order. The patient id is the
MIMIC ``subject_id`` as written in the tables.

What each table becomes (``resource_type`` / identity / times):

==================  =========================  =================================================================
table               entry                      notes
==================  =========================  =================================================================
admissions          Encounter, two entries:    one "hospital admission" concept: in progress at admittime, then
                    admission and discharge    its discharge at dischtime (finished), which ends what ends with
                                               the admission; ``deathtime`` also gives a death Observation
transfers           Encounter (care unit)      one "care unit" concept: each transfer supersedes the last
services            Encounter (service)        one "hospital service" concept
icustays            Encounter (ICU stay)       one "ICU stay" concept
diagnoses_icd       Condition                  ICD-9-CM / ICD-10-CM code, title from d_icd_diagnoses; clinical
                                               time = admission, recorded time = discharge
procedures_icd      Procedure                  ICD-9 procedure / ICD-10-PCS code, title from d_icd_procedures
hcpcsevents         Procedure                  HCPCS/CPT code
poe (+poe_detail)   MedicationRequest for      identity = the order (its poe_id); medication orders are named
                    medication orders, else    by their drug (prescriptions/pharmacy of the same poe_id).
                    ServiceRequest             'Change' -> references role ``replaces`` the order it
                                               discontinues (superseded by the new order); 'D/C' -> status
                                               stopped on the order it discontinues (resolves it)
pharmacy            MedicationRequest, two     same source_ref as its POE order (versions of one order):
(+prescriptions)    entries: start and stop    start (active) at starttime with drug, NDC, dose, route,
                                               frequency; stop at stoptime with the final status
emar (+detail)      MedicationAdministration   identity = the drug; "Not Given"/"Hold" -> not-done,
                                               "Stopped" -> stopped; dose given from emar_detail
labevents           Observation                identity = d_labitems itemid; value, unit, flag, reference range
microbiologyevents  Observation                test / organism / antibiotic susceptibility
omr                 Observation                identity = result_name (weight, BMI, blood pressure...)
inputevents,        MedicationAdministration   identity = d_items itemid; amount, rate, start/end
ingredientevents
outputevents,       Observation                identity = d_items itemid
datetimeevents
procedureevents     Procedure                  identity = d_items itemid
==================  =========================  =================================================================

Every row with a ``hadm_id`` names its admission (``RecordEntry.encounter`` = ``Encounter/<hadm_id>``), and each
table declares how its facts end (``RecordEntry.lifecycle``, ``stam.lifecycle``): POE orders of every type and
services end with their admission; pharmacy orders, orphan prescriptions, transfers (care units), ICU stays, ICU
inputs with an interval and ICU procedures with an interval (lines, drains) are current inside their interval and
no longer than their admission; administrations (``emar``, ICU inputs without an interval), billed procedures and
HCPCS events are events; diagnoses are states; measurements keep their latest value current.

Entry ids keep the source row: ``mimic-iv:<table>:<row key>[:start|:stop]`` (the row key is the table's
id column where it has one: poe_id, pharmacy_id, emar_id, labevent_id, microevent_id, transfer_id,
hadm_id, stay_id, orderid; otherwise the columns that identify the row). MIMIC times carry no zone; they are
read as UTC (they are shifted to the 2100s by de-identification anyway). A row that cannot be read (no
subject, a bad time) becomes a :class:`BadInput` with the row re-serialised as CSV and the reason.

``prescriptions`` rows are folded into the pharmacy order they belong to (same ``pharmacy_id``); a
prescription without a pharmacy row becomes its own MedicationRequest. ``patients`` gives the patient's
demographics with the admissions (one ``Patient`` entry, ``mimic-iv:patients:<subject_id>``, lifecycle state, with
no clinical time: it holds throughout the record): the sex (``gender``), the age in the anchor year
(``anchor_age``: MIMIC's de-identified age, 91 for every patient older than 89) and that anchor year (the age at a
time T is ``anchor_age + year(T) - anchor_year``, an estimate to a year: the birthday is not recorded); and ``dod``
as a death Observation when no admission recorded the death. ``drgcodes``, ``provider`` and ``caregiver`` carry no
clinical fact of the record and are not read.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import Coding, Lifecycle, Quantity, RecordEntry, Reference, ReferenceRole
from schemas.common import CodeSystem
from stam.errors import SourceError
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult

SOURCE = "mimic-iv"
MIMIC_CS = "http://mimic.mit.edu/fhir/mimic/CodeSystem/"
SYS_ORDER = MIMIC_CS + "mimic-poe-order"
SYS_PHARMACY_ORDER = MIMIC_CS + "mimic-pharmacy-order"
SYS_DRUG = MIMIC_CS + "mimic-medication-name"
SYS_FORMULARY = MIMIC_CS + "mimic-medication-formulary-drug-cd"
SYS_NDC = "http://hl7.org/fhir/sid/ndc"
SYS_LAB = MIMIC_CS + "mimic-d-labitems"
SYS_ITEMS = MIMIC_CS + "mimic-d-items"
SYS_MICRO = MIMIC_CS + "mimic-microbiology-test"
SYS_MICRO_SUSC = MIMIC_CS + "mimic-microbiology-susceptibility"
SYS_OMR = MIMIC_CS + "mimic-observation-omr"
SYS_ENCOUNTER = MIMIC_CS + "mimic-encounter-concept"
SYS_ICD9_PROC = MIMIC_CS + "mimic-procedure-icd9"
SYS_ICD10_PCS = "http://www.cms.gov/Medicare/Coding/ICD10"
SYS_HCPCS = "http://www.cms.gov/Medicare/Coding/HCPCSReleaseCodeSets"
SYS_PATIENT = MIMIC_CS + "mimic-patient"
LOINC_SEX = "76689-9"
"""LOINC "Sex assigned at birth" (MIMIC's ``gender``)."""
LOINC_AGE = "30525-0"
"""LOINC "Age" (MIMIC's ``anchor_age``: the age in the anchor year)."""
ANCHOR_YEAR = "anchor-year"
"""The code of the anchor year: the de-identified calendar year in which the patient's age is ``anchor_age``."""

# Tables read, in the order their rows are considered when two events share a clinical time.
TABLES: tuple[str, ...] = (
    "admissions", "transfers", "services", "icustays", "diagnoses_icd", "procedures_icd", "hcpcsevents",
    "poe", "pharmacy", "prescriptions", "emar", "labevents", "microbiologyevents", "omr",
    "inputevents", "ingredientevents", "outputevents", "procedureevents", "datetimeevents",
)
_LOOKUPS = ("d_icd_diagnoses", "d_icd_procedures", "d_labitems", "d_items", "poe_detail", "emar_detail",
            "patients")
_MODULE = {"icustays": "icu", "inputevents": "icu", "ingredientevents": "icu", "outputevents": "icu",
           "procedureevents": "icu", "datetimeevents": "icu", "d_items": "icu"}

# emar event_txt -> status. Anything "Not ..." or held is an administration that did not happen.
_EMAR_NOT_DONE = ("Not ", "Hold Dose", "Infusion Reconciliation Not Done")
PHARMACY_STATUS = {
    "Discontinued": "stopped",
    "Discontinued via patient discharge": "stopped",
    "Inactive (Due to a change order)": "stopped",
    "Expired": "completed",
    "H": "on-hold",
}
_ICU_STATUS = {"Stopped": "stopped", "Paused": "on-hold", "Rewritten": "entered-in-error"}
SAME_ACT = timedelta(hours=1)
"""A pharmacy stop this long or less before the POE order that discontinued the order is the same discontinuation,
recorded by the pharmacy first; one earlier than that is the order's own end, and the POE order comes later."""

Row = dict[str, str]


@dataclass
class TableCount:
    rows: int = 0
    entries: int = 0
    bad: int = 0
    folded: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "entries": self.entries, "bad": self.bad, "folded": self.folded}


@dataclass
class MimicResult(SourceResult):
    """Entries (filled by :func:`load_mimic`, not by :func:`iter_mimic`, which yields them), rows that could not
    be read, and counts per table."""

    tables: dict[str, TableCount] = field(default_factory=lambda: defaultdict(TableCount))
    patients: int = 0

    def counts(self) -> dict[str, dict[str, int]]:
        return {t: c.as_dict() for t, c in sorted(self.tables.items())}

    def detail(self) -> dict[str, Any]:
        return {"tables": self.counts()}


def is_mimic_root(path: Path) -> bool:
    """A MIMIC-IV folder: ``hosp/`` with ``admissions`` (gzip or plain CSV)."""
    return path.is_dir() and any((path / "hosp").glob("admissions.csv*"))


def _table_path(root: Path, table: str) -> Path | None:
    folder = root / _MODULE.get(table, "hosp")
    for name in (f"{table}.csv.gz", f"{table}.csv"):
        if (folder / name).is_file():
            return folder / name
    return None


def iter_table(root: Path, table: str, subjects: set[str] | None) -> Iterator[Row]:
    """The rows of one MIMIC-IV table (gzip or plain CSV, hosp/ or icu/), of ``subjects`` only when given."""
    path = _table_path(root, table)
    if path is None:
        return
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if subjects is None or row.get("subject_id") in subjects:
                yield row


def parse_mimic_time(value: str | None, column: str = "time") -> datetime | None:
    """A MIMIC time (no zone: read as UTC); None when empty; a SourceError naming ``column`` when unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    except ValueError as exc:
        raise SourceError(f"bad time in {column}: {value!r}") from exc


def _num(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _row_bytes(row: Row) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(row))
    writer.writeheader()
    writer.writerow(row)
    return out.getvalue().encode()


def _clean(value: str | None) -> str | None:
    """MIMIC de-identification writes '___' for removed text: treat it as absent."""
    if value is None:
        return None
    v = value.strip()
    return v if v and set(v) != {"_"} else None


@dataclass
class _Lookups:
    icd_dx: dict[tuple[str, str], str] = field(default_factory=dict)
    icd_proc: dict[tuple[str, str], str] = field(default_factory=dict)
    labitems: dict[str, Row] = field(default_factory=dict)
    items: dict[str, Row] = field(default_factory=dict)
    poe_detail: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    emar_dose: dict[str, str] = field(default_factory=dict)
    dod: dict[str, str] = field(default_factory=dict)
    patients: dict[str, Row] = field(default_factory=dict)


def _load_lookups(root: Path, subjects: set[str] | None) -> _Lookups:
    lk = _Lookups()
    for r in iter_table(root, "d_icd_diagnoses", None):
        lk.icd_dx[(r["icd_code"].strip(), r["icd_version"])] = r["long_title"]
    for r in iter_table(root, "d_icd_procedures", None):
        lk.icd_proc[(r["icd_code"].strip(), r["icd_version"])] = r["long_title"]
    lk.labitems = {r["itemid"]: r for r in iter_table(root, "d_labitems", None)}
    lk.items = {r["itemid"]: r for r in iter_table(root, "d_items", None)}
    for r in iter_table(root, "poe_detail", subjects):
        lk.poe_detail.setdefault(r["poe_id"], []).append((r["field_name"], r["field_value"]))
    for r in iter_table(root, "emar_detail", subjects):
        # The first detail row with a given dose describes the administration (later rows are products).
        if r.get("dose_given") and r["emar_id"] not in lk.emar_dose:
            lk.emar_dose[r["emar_id"]] = f"{r['dose_given']} {r.get('dose_given_unit') or ''}".strip()
    for r in iter_table(root, "patients", subjects):
        lk.patients[r["subject_id"]] = r
        if r.get("dod"):
            lk.dod[r["subject_id"]] = r["dod"]
    return lk


def dosage_text(rx: Row | None, ph: Row | None) -> str | None:
    """An order's dosage as the record writes it: the prescription's dose and unit, the route (pharmacy's first), the
    pharmacy's frequency; None when the rows give none."""
    bits = []
    if rx and rx.get("dose_val_rx"):
        bits.append(f"{rx['dose_val_rx']} {rx.get('dose_unit_rx') or ''}".strip())
    route = (ph or {}).get("route") or (rx or {}).get("route")
    if route:
        bits.append(route)
    if ph and ph.get("frequency"):
        bits.append(ph["frequency"])
    return " ".join(bits) or None


class _Builder:
    """Turns one patient's rows into entries; collects (sort time, table rank, entry)."""

    def __init__(self, subject: str, rows: dict[str, list[Row]], chosen: tuple[str, ...], lk: _Lookups,
                 result: MimicResult) -> None:
        self.subject = subject
        self.rows = rows
        self.chosen = chosen
        self.lk = lk
        self.result = result
        self.out: list[tuple[datetime, int, int, int, RecordEntry]] = []
        self._seq = 0
        self.admissions = {r["hadm_id"]: r for r in rows.get("admissions", [])}
        # Drug names for orders: prescriptions (MAIN drug first), then pharmacy, then emar.
        self.rx_by_pharmacy: dict[str, list[Row]] = defaultdict(list)
        self.drug_by_poe: dict[str, list[Row]] = defaultdict(list)
        for r in rows.get("prescriptions", []):
            if r.get("pharmacy_id"):
                self.rx_by_pharmacy[r["pharmacy_id"]].append(r)
            if r.get("poe_id"):
                self.drug_by_poe[r["poe_id"]].append(r)
        for group in (*self.rx_by_pharmacy.values(), *self.drug_by_poe.values()):
            group.sort(key=lambda r: (r.get("drug_type") != "MAIN",))
        self.pharmacy_ids = {r["pharmacy_id"] for r in rows.get("pharmacy", [])} if "pharmacy" in chosen else set()
        self.pharmacy_by_poe = {r["poe_id"]: r for r in rows.get("pharmacy", []) if r.get("poe_id")}
        self.emar_by_poe = {r["poe_id"]: r for r in rows.get("emar", []) if r.get("poe_id")}
        self.poe = {r["poe_id"]: r for r in rows.get("poe", [])}
        # Which order ended which: from the discontinuing order's discontinue_of_poe_id (always set on Change and
        # D/C rows) and from the ended order's discontinued_by_poe_id (not always filled in).
        self.ended_by: dict[str, str] = {}
        for r in self.poe.values():
            if r.get("discontinued_by_poe_id") and r["discontinued_by_poe_id"] in self.poe:
                self.ended_by.setdefault(r["poe_id"], r["discontinued_by_poe_id"])
        for r in self.poe.values():
            if r.get("discontinue_of_poe_id") and r["transaction_type"] in ("Change", "D/C"):
                self.ended_by[r["discontinue_of_poe_id"]] = r["poe_id"]
        self.order_codes: dict[str, tuple[Coding, ...]] = {}

    # --- emit ------------------------------------------------------------------------------------------

    def emit(self, table: str, key: str, when: datetime | None, *, last: bool = False, **fields: Any) -> None:
        """One entry at clinical time ``when``; ``last``: after every other entry of the same time (a discharge).
        Of one table's entries at one time, a stop comes before a start (unless it stops what started then): a pharmacy
        row that ends when the next row of the same order begins must not end the row that replaced it."""
        entry = RecordEntry(patient_id=self.subject, entry_id=f"{SOURCE}:{table}:{key}", source=SOURCE,
                            **fields)
        sort_time = when or entry.effective_at or entry.recorded_at
        if sort_time is None:
            raise SourceError(f"{table} row {key} has no time")
        began = entry.effective_at
        phase = 0 if key.endswith(":stop") and began is not None and began < sort_time else 1
        rank = -1 if table == "patients" else len(TABLES) if last else TABLES.index(table)
        self.out.append((sort_time, rank, phase, self._seq, entry))
        self._seq += 1
        self.result.tables[table].entries += 1

    def run(self) -> list[RecordEntry]:
        for table in self.chosen:
            handler: Callable[[Row], None] = getattr(self, f"_{table}")
            for row in self.rows.get(table, []):
                self.result.tables[table].rows += 1
                try:
                    handler(row)
                except (SourceError, ValidationError, ValueError, KeyError) as exc:
                    self.result.tables[table].bad += 1
                    reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                    self.result.bad.append(BadInput(f"{table}.csv", _row_bytes(row), type(exc).__name__,
                                                    f"MIMIC-IV {table} row: {reason}"[:2000]))
        if "admissions" in self.chosen:
            try:
                self._death()
            except SourceError as exc:
                self.result.tables["admissions"].bad += 1
                self.result.bad.append(BadInput("admissions.csv", self.subject.encode(), "SourceError",
                                                f"MIMIC-IV death time: {exc}"))
            self._demographics()
        self.out.sort(key=lambda x: (x[0], x[1], x[2], x[3]))
        return [e for *_, e in self.out]

    # --- encounters ------------------------------------------------------------------------------------

    def _admissions(self, r: Row) -> None:
        """Two entries: the admission at admittime (in progress), and its discharge at dischtime (finished), which
        ends every fact of the admission that ends with it (``stam.lifecycle``)."""
        start, end = parse_mimic_time(r["admittime"], "admittime"), parse_mimic_time(r.get("dischtime"), "dischtime")
        ref = f"Encounter/{r['hadm_id']}"
        attributes = {"hadm_id": r["hadm_id"], "admission_type": r.get("admission_type")}
        display = (f"Hospital admission ({r.get('admission_type') or 'unknown type'}; from "
                   f"{r.get('admission_location') or 'unknown'})")
        self.emit("admissions", r["hadm_id"], start, source_ref=ref, encounter=ref, resource_type="Encounter",
                  effective_at=start, recorded_at=start, status="in-progress",
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-admission", display=display),),
                  attributes=attributes)
        if end is None:
            return
        if start is not None and end < start:
            raise SourceError(f"dischtime {r.get('dischtime')} is before admittime {r['admittime']}")
        discharged = f"{display[:-1]}; discharged to {r.get('discharge_location') or 'n/a'})"
        self.emit("admissions", f"{r['hadm_id']}:discharge", end, last=True, source_ref=ref, encounter=ref,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=end,
                  status="finished",
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-admission", display=discharged),),
                  attributes={**attributes, "discharge_location": r.get("discharge_location") or None})

    def _death(self) -> None:
        deaths = [(r["deathtime"], r["hadm_id"]) for r in self.rows.get("admissions", []) if r.get("deathtime")]
        when_s, key = deaths[0] if deaths else (self.lk.dod.get(self.subject), f"{self.subject}:dod")
        if not when_s:
            return
        when = parse_mimic_time(when_s, "deathtime")
        self.emit("admissions", f"{key}:death", when, source_ref=f"Observation/death-{self.subject}",
                  resource_type="Observation", effective_at=when, recorded_at=when, status="final",
                  codes=(Coding(system=CodeSystem.SNOMED.value, code="419620001", display="Death"),),
                  value=Quantity(text="deceased"))

    def _demographics(self) -> None:
        """The patient's sex, age in the anchor year and that year (one ``Patient`` entry with three facts), first in
        the record: it has no clinical time of its own and holds throughout the record."""
        r = self.lk.patients.get(self.subject)
        if r is None or not self.out:
            return
        table = self.result.tables["patients"]
        table.rows += 1
        parts: list[tuple[Coding, Quantity]] = []
        if _clean(r.get("gender")):
            parts.append((Coding(system=CodeSystem.LOINC.value, code=LOINC_SEX, display="Sex"),
                          Quantity(text=r["gender"].strip())))
        age, year = _num(r.get("anchor_age")), _num(r.get("anchor_year"))
        if age is not None and year is not None:
            parts.append((Coding(system=CodeSystem.LOINC.value, code=LOINC_AGE, display="Age in the anchor year"),
                          Quantity(value=age, unit="years")))
            parts.append((Coding(system=SYS_PATIENT, code=ANCHOR_YEAR, display="Anchor year of the age"),
                          Quantity(value=year)))
        if not parts:
            table.bad += 1
            self.result.bad.append(BadInput("patients.csv", _row_bytes(r), "SourceError",
                                            "MIMIC-IV patients row: neither gender nor anchor_age/anchor_year"))
            return
        first = min(t for t, *_ in self.out)
        self.emit("patients", self.subject, first, source_ref=f"Patient/{self.subject}", resource_type="Patient",
                  lifecycle=Lifecycle.STATE, codes=tuple(c for c, _ in parts), components=tuple(parts),
                  attributes={"gender": r.get("gender") or None, "anchor_age": age, "anchor_year": year,
                              "anchor_year_group": r.get("anchor_year_group") or None})

    def _transfers(self, r: Row) -> None:
        start, end = parse_mimic_time(r["intime"], "intime"), parse_mimic_time(r.get("outtime"), "outtime")
        unit = r.get("careunit") or ("discharged" if r["eventtype"] == "discharge" else "unknown unit")
        self.emit("transfers", r["transfer_id"], start, source_ref=f"Encounter/transfer-{r['transfer_id']}",
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.INTERVAL,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=start,
                  codes=(Coding(system=SYS_ENCOUNTER, code="care-unit", display="Care unit"),),
                  value=Quantity(text=unit), attributes={"hadm_id": r.get("hadm_id"), "eventtype": r["eventtype"]})

    def _services(self, r: Row) -> None:
        when = parse_mimic_time(r["transfertime"], "transfertime")
        self.emit("services", f"{r['hadm_id']}:{r['transfertime']}", when,
                  source_ref=f"Encounter/service-{r['hadm_id']}-{r['curr_service']}", resource_type="Encounter",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=when,
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-service", display="Hospital service"),),
                  value=Quantity(text=r["curr_service"]),
                  attributes={"hadm_id": r.get("hadm_id"), "prev_service": r.get("prev_service") or None})

    def _icustays(self, r: Row) -> None:
        start, end = parse_mimic_time(r["intime"], "intime"), parse_mimic_time(r.get("outtime"), "outtime")
        self.emit("icustays", r["stay_id"], start, source_ref=f"Encounter/icu-{r['stay_id']}",
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.INTERVAL,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=start,
                  status="finished" if end else "in-progress",
                  codes=(Coding(system=SYS_ENCOUNTER, code="icu-stay",
                                display=f"ICU stay ({r.get('first_careunit')})"),),
                  value=Quantity(value=_num(r.get("los")), unit="d"),
                  attributes={"hadm_id": r.get("hadm_id"), "last_careunit": r.get("last_careunit")})

    def _encounter(self, hadm_id: str | None) -> str | None:
        """The admission a row belongs to, as the admission's own reference (rows without one: None)."""
        return f"Encounter/{hadm_id}" if hadm_id else None

    # --- diagnoses and procedures ----------------------------------------------------------------------

    def _admission_times(self, hadm_id: str) -> tuple[datetime | None, datetime | None]:
        adm = self.admissions.get(hadm_id)
        if adm is None:
            raise SourceError(f"hadm_id {hadm_id} is not in admissions")
        return parse_mimic_time(adm["admittime"], "admittime"), parse_mimic_time(adm.get("dischtime"), "dischtime")

    def _diagnoses_icd(self, r: Row) -> None:
        code, version = r["icd_code"].strip(), r["icd_version"]
        system = {"9": CodeSystem.ICD9.value, "10": CodeSystem.ICD10.value}.get(version)
        if system is None:
            raise SourceError(f"icd_version {version!r} is neither 9 nor 10")
        start, discharged = self._admission_times(r["hadm_id"])
        self.emit("diagnoses_icd", f"{r['hadm_id']}:{r['seq_num']}", start,
                  source_ref=f"Condition/{r['hadm_id']}-{r['seq_num']}", resource_type="Condition",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=start, recorded_at=discharged or start, status="active",
                  codes=(Coding(system=system, code=code, display=self.lk.icd_dx.get((code, version))),),
                  attributes={"hadm_id": r["hadm_id"], "seq_num": int(r["seq_num"])})

    def _procedures_icd(self, r: Row) -> None:
        code, version = r["icd_code"].strip(), r["icd_version"]
        system = {"9": SYS_ICD9_PROC, "10": SYS_ICD10_PCS}.get(version)
        if system is None:
            raise SourceError(f"icd_version {version!r} is neither 9 nor 10")
        when = parse_mimic_time(r["chartdate"], "chartdate")
        self.emit("procedures_icd", f"{r['hadm_id']}:{r['seq_num']}", when,
                  source_ref=f"Procedure/{r['hadm_id']}-{r['seq_num']}", resource_type="Procedure",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=when, recorded_at=when, status="completed",
                  codes=(Coding(system=system, code=code, display=self.lk.icd_proc.get((code, version))),),
                  attributes={"hadm_id": r["hadm_id"]})

    def _hcpcsevents(self, r: Row) -> None:
        when = parse_mimic_time(r["chartdate"], "chartdate")
        self.emit("hcpcsevents", f"{r['hadm_id']}:{r['seq_num']}", when,
                  source_ref=f"Procedure/hcpcs-{r['hadm_id']}-{r['seq_num']}", resource_type="Procedure",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=when, recorded_at=when, status="completed",
                  codes=(Coding(system=SYS_HCPCS, code=r["hcpcs_cd"].strip(),
                                display=r.get("short_description") or None),),
                  attributes={"hadm_id": r["hadm_id"]})

    # --- orders and medications ------------------------------------------------------------------------

    def _drug_codings(self, rx: list[Row], fallback_name: str | None) -> list[Coding]:
        out: list[Coding] = []
        if rx:
            main = rx[0]
            out.append(Coding(system=SYS_DRUG, code=main["drug"].strip().lower(), display=main["drug"].strip()))
            if main.get("formulary_drug_cd"):
                out.append(Coding(system=SYS_FORMULARY, code=main["formulary_drug_cd"], display=main["drug"]))
            ndc = main.get("ndc", "").strip()
            if ndc and ndc.strip("0") and ndc != "0":
                out.append(Coding(system=SYS_NDC, code=ndc.split(".")[0].zfill(11), display=main["drug"]))
        elif fallback_name:
            out.append(Coding(system=SYS_DRUG, code=fallback_name.strip().lower(), display=fallback_name.strip()))
        return out

    def _order_name(self, r: Row) -> tuple[str, list[Coding]]:
        """Display name of a POE order and the drug codings of a medication order."""
        poe_id = r["poe_id"]
        if r["order_type"] == "Medications":
            ph = self.pharmacy_by_poe.get(poe_id)
            em = self.emar_by_poe.get(poe_id)
            fallback = (ph or {}).get("medication") or (em or {}).get("medication")
            drugs = self._drug_codings(self.drug_by_poe.get(poe_id, []), fallback)
            return (drugs[0].display or "medication order") if drugs else "medication order (drug not recorded)", drugs
        name = r["order_type"] + (f": {r['order_subtype']}" if r.get("order_subtype") else "")
        details = "; ".join(f"{k}: {v}" for k, v in self.lk.poe_detail.get(poe_id, []) if _clean(v))
        return (f"{name} ({details})" if details else name), []

    @staticmethod
    def _order_ref(order_type: str, poe_id: str) -> str:
        rtype = "MedicationRequest" if order_type == "Medications" else "ServiceRequest"
        return f"{rtype}/poe-{poe_id}"

    def _poe(self, r: Row) -> None:
        poe_id, tx = r["poe_id"], r["transaction_type"]
        when = parse_mimic_time(r["ordertime"], "ordertime")
        rtype = "MedicationRequest" if r["order_type"] == "Medications" else "ServiceRequest"
        target = r.get("discontinue_of_poe_id") or None
        attributes: dict[str, Any] = {"poe_id": poe_id, "transaction_type": tx, "order_type": r["order_type"],
                                      "hadm_id": r.get("hadm_id") or None}
        refs: list[Reference] = []
        if tx == "D/C":
            if not target:
                raise SourceError(f"D/C order {poe_id} names no discontinue_of_poe_id")
            # The D/C row is the discontinued order's final state: same identity, status stopped.
            original = self.poe.get(target)
            codes = self.order_codes.get(target)
            if codes is None:
                name, drugs = self._order_name(original or r)
                codes = (Coding(system=SYS_ORDER, code=target, display=name), *drugs)
            refs.append(Reference(role=ReferenceRole.DISCONTINUES, target=self._order_ref(r["order_type"], target)))
            attributes["discontinue_of_poe_id"] = target
            self.emit("poe", poe_id, when, source_ref=f"{rtype}/poe-{poe_id}", resource_type=rtype,
                      encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.ENCOUNTER,
                      effective_at=when, recorded_at=when, status="stopped", codes=codes,
                      references=tuple(refs), attributes=attributes)
            return
        name, drugs = self._order_name(r)
        codes = (Coding(system=SYS_ORDER, code=poe_id, display=name), *drugs)
        self.order_codes[poe_id] = codes
        if tx == "Change":
            if not target:
                raise SourceError(f"Change order {poe_id} names no discontinue_of_poe_id")
            refs.append(Reference(role=ReferenceRole.REPLACES, target=self._order_ref(r["order_type"], target)))
            attributes["discontinue_of_poe_id"] = target
        status = "on-hold" if tx == "H" else "active"
        self.emit("poe", poe_id, when, source_ref=f"{rtype}/poe-{poe_id}", resource_type=rtype,
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.ENCOUNTER,
                  effective_at=when, recorded_at=when, status=status, codes=codes, references=tuple(refs),
                  attributes=attributes)

    def _pharmacy(self, r: Row) -> None:
        pid, poe_id = r["pharmacy_id"], r.get("poe_id") or None
        enc = self._encounter(r.get("hadm_id"))
        start = parse_mimic_time(r.get("starttime") or r.get("entertime"), "starttime")
        stop = parse_mimic_time(r.get("stoptime"), "stoptime")
        rx = self.rx_by_pharmacy.get(pid, [])
        self.result.tables["prescriptions"].folded += len(rx)
        drugs = self._drug_codings(rx, r.get("medication"))
        name = drugs[0].display if drugs else (r.get("medication") or "medication")
        if poe_id:
            identity = self.order_codes.get(poe_id, (Coding(system=SYS_ORDER, code=poe_id, display=name),))[0]
            if drugs and name and identity.display and name.lower() not in identity.display.lower():
                # An IV therapy or TPN order is named by its order type in POE ("IV therapy: IV fluids"); its
                # pharmacy versions say which drug runs (the same order: same code).
                identity = Coding(system=identity.system, code=identity.code, display=f"{name} ({identity.display})")
            # The POE order's own reference (IV therapy and TPN orders are ServiceRequests in POE), so a Change
            # or D/C naming the order reaches its pharmacy versions too.
            source_ref = self._order_ref(self.poe[poe_id]["order_type"] if poe_id in self.poe else "Medications",
                                         poe_id)
        else:
            identity = Coding(system=SYS_PHARMACY_ORDER, code=pid, display=name)
            source_ref = f"MedicationRequest/pharmacy-{pid}"
        codes = (identity, *drugs)
        dosage = dosage_text(rx[0] if rx else None, r)
        attributes = {"pharmacy_id": pid, "poe_id": poe_id, "hadm_id": r.get("hadm_id") or None,
                      "pharmacy_status": r.get("status") or None, "prescription_rows": len(rx)}
        final = PHARMACY_STATUS.get(r.get("status") or "")
        if start is None:
            raise SourceError(f"pharmacy row {pid} has neither starttime nor entertime")
        ended_by = self.ended_by.get(poe_id or "")
        entered = parse_mimic_time(r.get("entertime"), "entertime") or start
        common: dict[str, Any] = {"source_ref": source_ref, "resource_type": "MedicationRequest", "encounter": enc,
                                  "lifecycle": Lifecycle.INTERVAL, "codes": codes, "dosage": dosage,
                                  "attributes": attributes}
        by_time = parse_mimic_time(self.poe[ended_by]["ordertime"], "ordertime") if ended_by else None
        if ended_by and by_time is not None and "poe" in self.chosen and (stop is None or stop > by_time - SAME_ACT):
            attributes["stopped_by_poe_id"] = ended_by
            if by_time <= start:
                # Discontinued before the pharmacy's start time: the order never became current.
                self.emit("pharmacy", f"{pid}", start, effective_at=start, recorded_at=entered,
                          status=final or "stopped", **common)
                return
            # The POE order that discontinued this one (a 'Change' or a 'D/C') is the stop: it supersedes or ends the
            # order with an explicit link. Its pharmacy stop, within an hour before it, is the same act recorded by
            # the pharmacy: a second, pharmacy-timed stop would end the order before the change that caused it.
            self.result.tables["pharmacy"].folded += 1
            self.emit("pharmacy", f"{pid}:start", start, effective_at=start, recorded_at=entered, status="active",
                      **common)
            return
        if stop is None or final is None:
            # No final status: current until its stop time, when it has one (an interval), else until its admission
            # ends.
            open_end = stop if stop is not None and final is None and stop > start else None
            self.emit("pharmacy", f"{pid}", start, effective_at=start, effective_end=open_end, recorded_at=entered,
                      status=final or "active", **common)
            return
        stop = max(stop, start)
        self.emit("pharmacy", f"{pid}:start", start, effective_at=start, recorded_at=entered, status="active", **common)
        self.emit("pharmacy", f"{pid}:stop", stop, effective_at=start, effective_end=stop, recorded_at=stop,
                  status=final, **common)

    def _prescriptions(self, r: Row) -> None:
        # Folded into the pharmacy order of the same pharmacy_id (counted there); only orphans are entries.
        if r.get("pharmacy_id") in self.pharmacy_ids:
            return
        start, stop = parse_mimic_time(r.get("starttime"), "starttime"), parse_mimic_time(r.get("stoptime"), "stoptime")
        drugs = self._drug_codings([r], None)
        key = f"{r.get('pharmacy_id') or 'none'}:{r['drug'].strip().lower()}"
        self.emit("prescriptions", key, start, source_ref=f"MedicationRequest/prescription-{key}",
                  resource_type="MedicationRequest", encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL, effective_at=start,
                  effective_end=stop if stop and start and stop >= start else None, recorded_at=start,
                  status="active", codes=tuple(drugs), dosage=dosage_text(r, None),
                  attributes={"pharmacy_id": r.get("pharmacy_id") or None, "poe_id": r.get("poe_id") or None})

    def _emar(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        event = (r.get("event_txt") or "").strip()
        status = ("not-done" if event.startswith(_EMAR_NOT_DONE)
                  else "stopped" if event.startswith("Stopped") else None)
        med = r.get("medication") or ""
        if not med.strip():
            # Some administrations leave the medication blank; the order they belong to names the drug.
            rx = self.drug_by_poe.get(r.get("poe_id") or "", [])
            ph = self.pharmacy_by_poe.get(r.get("poe_id") or "") or {}
            med = (rx[0]["drug"] if rx else None) or ph.get("medication") or ""
        if not med.strip():
            raise SourceError(f"emar row {r['emar_id']} names no medication, nor does its order")
        self.emit("emar", r["emar_id"], when, source_ref=f"MedicationAdministration/{r['emar_id']}",
                  resource_type="MedicationAdministration", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status=status,
                  codes=(Coding(system=SYS_DRUG, code=med.strip().lower(), display=f"{med.strip()} administration"),),
                  dosage=self.lk.emar_dose.get(r["emar_id"]), value=Quantity(text=event or None),
                  attributes={"emar_id": r["emar_id"], "poe_id": r.get("poe_id") or None,
                              "pharmacy_id": r.get("pharmacy_id") or None, "event": event or None})

    # --- measurements ----------------------------------------------------------------------------------

    def _labevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        item = self.lk.labitems.get(r["itemid"], {})
        label = item.get("label") or f"lab item {r['itemid']}"
        display = f"{label} ({item['fluid']})" if item.get("fluid") else label
        num = _num(r.get("valuenum"))
        value = Quantity(value=num, unit=r.get("valueuom") or None) if num is not None else Quantity(
            text=_clean(r.get("value")) or None, unit=r.get("valueuom") or None)
        attrs = {"labevent_id": r["labevent_id"], "hadm_id": r.get("hadm_id") or None,
                 "flag": r.get("flag") or None, "ref_range_lower": _num(r.get("ref_range_lower")),
                 "ref_range_upper": _num(r.get("ref_range_upper")), "priority": r.get("priority") or None}
        self.emit("labevents", r["labevent_id"], when, source_ref=f"Observation/lab-{r['labevent_id']}",
                  resource_type="Observation", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_LAB, code=r["itemid"], display=display),), value=value,
                  attributes={k: v for k, v in attrs.items() if v is not None})

    def _microbiologyevents(self, r: Row) -> None:
        when = parse_mimic_time(r.get("charttime") or r["chartdate"], "charttime")
        test = r.get("test_name") or "microbiology test"
        spec = r.get("spec_type_desc") or "specimen"
        org = _clean(r.get("org_name"))
        if org and r.get("ab_name"):
            code = Coding(system=SYS_MICRO_SUSC, code=f"{r['test_itemid']}/{r['org_itemid']}/{r['ab_itemid']}",
                          display=f"{r['ab_name']} susceptibility of {org} ({spec})")
            value = Quantity(text=r.get("interpretation") or r.get("dilution_text") or None)
        else:
            code = Coding(system=SYS_MICRO, code=r["test_itemid"] or test, display=f"{test} ({spec})")
            value = Quantity(text=org or _clean(r.get("comments")) or "no organism reported")
        self.emit("microbiologyevents", r["microevent_id"], when,
                  source_ref=f"Observation/micro-{r['microevent_id']}", resource_type="Observation",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(code,), value=value,
                  attributes={"microevent_id": r["microevent_id"], "hadm_id": r.get("hadm_id") or None})

    def _omr(self, r: Row) -> None:
        when = parse_mimic_time(r["chartdate"], "chartdate")
        name, raw = r["result_name"], r.get("result_value") or ""
        num = _num(raw)
        # omr has no row id: subject_id + chartdate + seq_num + result_name identify the row.
        self.emit("omr", f"{self.subject}:{r['chartdate']}:{r['seq_num']}:{name}", when,
                  source_ref=f"Observation/omr-{self.subject}-{r['chartdate']}-{r['seq_num']}-{name}",
                  resource_type="Observation",
                  effective_at=when, recorded_at=when, status="final",
                  codes=(Coding(system=SYS_OMR, code=name.lower(), display=name),),
                  value=Quantity(value=num) if num is not None else Quantity(text=raw or None))

    def _item(self, itemid: str) -> tuple[str, Row]:
        item = self.lk.items.get(itemid, {})
        return item.get("label") or f"ICU item {itemid}", item

    def _inputevents(self, r: Row, table: str = "inputevents") -> None:
        start, end = parse_mimic_time(r["starttime"], "starttime"), parse_mimic_time(r.get("endtime"), "endtime")
        label, _ = self._item(r["itemid"])
        rate = f"rate {r['rate']} {r.get('rateuom') or ''}".strip() if r.get("rate") else None
        key = f"{r['stay_id']}:{r.get('orderid')}:{r['itemid']}:{r['starttime']}"
        self.emit(table, key, start, source_ref=f"MedicationAdministration/{table}-{key}",
                  resource_type="MedicationAdministration", encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL if end and start and end > start else Lifecycle.EVENT, effective_at=start,
                  effective_end=end if end and start and end >= start else None,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or start,
                  status=_ICU_STATUS.get(r.get("statusdescription") or ""),
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=_num(r.get("amount")), unit=r.get("amountuom") or None), dosage=rate,
                  attributes={"stay_id": r["stay_id"], "orderid": r.get("orderid") or None,
                              "statusdescription": r.get("statusdescription") or None})

    def _ingredientevents(self, r: Row) -> None:
        self._inputevents(r, "ingredientevents")

    def _outputevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r['itemid']}:{r['charttime']}"
        self.emit("outputevents", key, when, source_ref=f"Observation/output-{key}", resource_type="Observation",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=_num(r.get("value")), unit=r.get("valueuom") or None),
                  attributes={"stay_id": r["stay_id"]})

    def _procedureevents(self, r: Row) -> None:
        start, end = parse_mimic_time(r["starttime"], "starttime"), parse_mimic_time(r.get("endtime"), "endtime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r.get('orderid')}:{r['itemid']}"
        status = _ICU_STATUS.get(r.get("statusdescription") or "", "completed")
        self.emit("procedureevents", key, start, source_ref=f"Procedure/icu-{key}", resource_type="Procedure",
                  encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL if end and start and end > start else Lifecycle.EVENT,
                  effective_at=start, effective_end=end if end and start and end >= start else None,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or start, status=status,
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=_num(r.get("value")), unit=r.get("valueuom") or None),
                  attributes={"stay_id": r["stay_id"], "orderid": r.get("orderid") or None})

    def _datetimeevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r['itemid']}:{r['charttime']}"
        self.emit("datetimeevents", key, when, source_ref=f"Observation/datetime-{key}",
                  resource_type="Observation", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(text=r.get("value") or None), attributes={"stay_id": r["stay_id"]})


def iter_mimic(root: str | Path, *, subjects: Iterable[str | int] | None = None,
               tables: Iterable[str] | None = None,
               result: MimicResult | None = None) -> Iterator[list[RecordEntry]]:
    """Each patient's entries in clinical-event order, one list per patient (ascending subject_id).

    ``subjects`` limits the patients read; ``tables`` limits the tables (default: all of :data:`TABLES`).
    Counts per table and rows that could not be read accumulate in ``result``.
    """
    root = Path(root)
    if not is_mimic_root(root):
        raise SourceError(f"{root} is not a MIMIC-IV folder (no hosp/admissions.csv.gz)")
    wanted = {str(s) for s in subjects} if subjects is not None else None
    chosen = tuple(tables) if tables is not None else TABLES
    unknown = set(chosen) - set(TABLES)
    if unknown:
        raise SourceError(f"unknown MIMIC-IV tables {sorted(unknown)}; known: {', '.join(TABLES)}")
    result = result if result is not None else MimicResult()
    for table in chosen:  # every chosen table appears in the counts, with zeros when it has no rows
        result.tables[table].rows += 0
    lk = _load_lookups(root, wanted)
    by_subject: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    # Orders need their drug names even when only 'poe' is chosen: prescriptions/pharmacy are read as lookups.
    needed = set(chosen) | ({"prescriptions", "pharmacy", "emar"} if "poe" in chosen else set())
    needed |= {"admissions"}
    for table in TABLES:
        if table not in needed:
            continue
        for row in iter_table(root, table, wanted):
            subject = row.get("subject_id")
            if not subject:
                result.tables[table].bad += 1
                result.bad.append(BadInput(f"{table}.csv", _row_bytes(row), "SourceError",
                                           f"MIMIC-IV {table} row has no subject_id"))
                continue
            by_subject[subject][table].append(row)
    for subject in sorted(by_subject, key=lambda s: (len(s), s)):
        rows = dict(by_subject.pop(subject))
        entries = _Builder(subject, rows, chosen, lk, result).run()
        result.patients += 1
        yield entries


def load_mimic(root: str | Path, *, subjects: Iterable[str | int] | None = None,
               tables: Iterable[str] | None = None) -> MimicResult:
    """All entries in one list (patient by patient); for tests and small selections."""
    result = MimicResult()
    for entries in iter_mimic(root, subjects=subjects, tables=tables, result=result):
        result.entries.extend(entries)
    return result


def _detects(path: Path, head: bytes) -> bool:
    return is_mimic_root(path)


def _load(paths: list[Path], options: LoadOptions) -> Iterator[SourceResult]:
    """Patient by patient (a MIMIC-IV folder is too large to hold at once), then each root's bad rows and
    table counts."""
    for root in paths:
        result = MimicResult()
        for entries in iter_mimic(root, subjects=options.subjects, tables=options.tables, result=result):
            yield SourceResult(entries=entries)
        yield result


FORMAT = SourceFormat(name="mimic-iv", detects=_detects, load=_load, label="a MIMIC-IV hosp/")
"""MIMIC-IV: a folder with ``hosp/admissions.csv[.gz]``."""


def poe_check(export: Callable[[str], dict[str, Any]], root: str | Path,
              subjects: set[str] | None = None) -> dict[str, Any]:
    """Check every POE 'Change' and 'D/C' order of the selected patients against their exported state
    (``export(subject_id)`` returns the ``stam state --json`` shape):

    - a 'Change' order X of Y: no memory of order Y is left ACTIVE, and one of them is in HISTORY with
      reason ``superseded`` and successor = the memory of X;
    - a 'D/C' order Z of Y: no memory of order Y is left ACTIVE and Z's memory is in HISTORY.

    Returns counts (``change_ok``, ``change_wrong``, ``dc_ok``, ``dc_wrong``, ``*_target_not_in_data``) and up
    to ten examples of wrong ones.
    """
    with gzip.open(Path(root) / "hosp" / "poe.csv.gz", "rt", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["transaction_type"] in ("Change", "D/C")
                and (subjects is None or r["subject_id"] in subjects)]
    by_subject: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_subject.setdefault(r["subject_id"], []).append(r)
    out: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    for subject, orders in by_subject.items():
        ex = export(subject)
        mems = ex["active"] + ex["history"]
        by_entry: dict[str, list[dict[str, Any]]] = {}
        by_order: dict[str, list[dict[str, Any]]] = {}
        for m in mems:
            by_entry.setdefault(m["source_entry_id"], []).append(m)
            ref = m["source_ref"] or ""
            if "/poe-" in ref:
                by_order.setdefault(ref.split("/poe-", 1)[1], []).append(m)
        for r in orders:
            kind = "change" if r["transaction_type"] == "Change" else "dc"
            new = by_entry.get(f"mimic-iv:poe:{r['poe_id']}", [])
            olds = by_order.get(r["discontinue_of_poe_id"], [])
            if not new:
                out[f"{kind}_missing_entry"] += 1
                continue
            if not olds:
                out[f"{kind}_target_not_in_data"] += 1
                continue
            still_active = [m for m in olds if m["store"] == "active"]
            if kind == "change":
                linked = [m for m in olds if m["reason"] == "superseded" and m["successor_id"] == new[0]["memory_id"]]
                good = not still_active and bool(linked)
            else:
                good = not still_active and new[0]["store"] == "history"
            out[f"{kind}_{'ok' if good else 'wrong'}"] += 1
            if not good and len(failures) < 10:
                failures.append({"poe_id": r["poe_id"], "of": r["discontinue_of_poe_id"], "kind": kind,
                                 "old": [(m["store"], m["reason"], m["source_entry_id"]) for m in olds]})
    return {"counts": dict(sorted(out.items())), "examples_of_wrong": failures}
