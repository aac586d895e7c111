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

Layout: ``codes`` (code systems), ``reading`` (tables, rows, times, lookups), ``builder`` (one patient's rows and
the entries made of them, counts per table), one module per table family (``encounters``, ``diagnoses``,
``orders``, ``measurements``), ``patient`` (the families put together), ``checks`` (:func:`poe_check`) and this
module (a MIMIC-IV folder -> patients' entries, the ``FORMAT`` of the source registry).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from schemas import RecordEntry
from stam.errors import SourceError
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult
from stam.sources.mimic.builder import MimicResult, TableCount
from stam.sources.mimic.checks import poe_check
from stam.sources.mimic.codes import (
    ANCHOR_YEAR,
    LOINC_AGE,
    LOINC_SEX,
    MIMIC_CS,
    SOURCE,
    SYS_DRUG,
    SYS_ENCOUNTER,
    SYS_FORMULARY,
    SYS_HCPCS,
    SYS_ICD9_PROC,
    SYS_ICD10_PCS,
    SYS_ITEMS,
    SYS_LAB,
    SYS_MICRO,
    SYS_MICRO_SUSC,
    SYS_NDC,
    SYS_OMR,
    SYS_ORDER,
    SYS_PATIENT,
    SYS_PHARMACY_ORDER,
)
from stam.sources.mimic.orders import PHARMACY_STATUS, SAME_ACT, dosage_text
from stam.sources.mimic.patient import PatientBuilder
from stam.sources.mimic.reading import TABLES, Row, is_mimic_root, iter_table, load_lookups, parse_mimic_time, row_bytes


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
    lk = load_lookups(root, wanted)
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
                result.bad.append(BadInput(f"{table}.csv", row_bytes(row), "SourceError",
                                           f"MIMIC-IV {table} row has no subject_id"))
                continue
            by_subject[subject][table].append(row)
    for subject in sorted(by_subject, key=lambda s: (len(s), s)):
        rows = dict(by_subject.pop(subject))
        entries = PatientBuilder(subject, rows, chosen, lk, result).run()
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


__all__ = ["ANCHOR_YEAR", "FORMAT", "LOINC_AGE", "LOINC_SEX", "MIMIC_CS", "PHARMACY_STATUS", "SAME_ACT", "SOURCE",
           "SYS_DRUG", "SYS_ENCOUNTER", "SYS_FORMULARY", "SYS_HCPCS", "SYS_ICD9_PROC", "SYS_ICD10_PCS", "SYS_ITEMS",
           "SYS_LAB", "SYS_MICRO", "SYS_MICRO_SUSC", "SYS_NDC", "SYS_OMR", "SYS_ORDER", "SYS_PATIENT",
           "SYS_PHARMACY_ORDER", "TABLES", "MimicResult", "Row", "TableCount", "dosage_text", "is_mimic_root",
           "iter_mimic", "iter_table", "load_mimic", "parse_mimic_time", "poe_check"]
