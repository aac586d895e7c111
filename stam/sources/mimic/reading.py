"""Reading MIMIC-IV tables: where each table lives (``hosp/`` or ``icu/``, gzip or plain CSV), its rows, MIMIC times
and values, and the dictionary and detail tables every patient's rows are looked up in (:class:`Lookups`)."""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stam.errors import SourceError

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

Row = dict[str, str]


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


def parse_number(value: str | None) -> float | None:
    """A MIMIC number; None when empty or unreadable (a text value in a numeric column)."""
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def row_bytes(row: Row) -> bytes:
    """A row re-serialised as CSV (header and row), the content of a :class:`BadInput`."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(row))
    writer.writeheader()
    writer.writerow(row)
    return out.getvalue().encode()


def clean_text(value: str | None) -> str | None:
    """MIMIC de-identification writes '___' for removed text: treat it as absent."""
    if value is None:
        return None
    v = value.strip()
    return v if v and set(v) != {"_"} else None


@dataclass
class Lookups:
    """Dictionary tables (ICD titles, lab and ICU items) and detail tables (POE details, eMAR doses, patients) by
    key, read once before the patients' rows."""

    icd_dx: dict[tuple[str, str], str] = field(default_factory=dict)
    icd_proc: dict[tuple[str, str], str] = field(default_factory=dict)
    labitems: dict[str, Row] = field(default_factory=dict)
    items: dict[str, Row] = field(default_factory=dict)
    poe_detail: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    emar_dose: dict[str, str] = field(default_factory=dict)
    dod: dict[str, str] = field(default_factory=dict)
    patients: dict[str, Row] = field(default_factory=dict)


def load_lookups(root: Path, subjects: set[str] | None) -> Lookups:
    """The lookups of ``subjects`` (every subject when None); dictionary tables are read whole."""
    lk = Lookups()
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
