"""The MIMIC-IV rows MIMIC-QA's templates read (:func:`load_rows`): each hosp table read once, only the columns
the templates need, per patient; lab results, admissions and stays, medication orders as the loader publishes them
(:mod:`stam_lab.eval.mimic_orders`), discontinuations, changes and dosages, billed diagnoses, ages."""

from __future__ import annotations

import csv
import gzip
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from stam.sources.mimic import PHARMACY_STATUS, SAME_ACT, SOURCE, dosage_text
from stam_lab.eval.mimic_orders import Orders, RowsIn
from stam_lab.eval.mimic_orders import build as build_orders
from stam_lab.eval.mimic_orders import ended_by as ended_by_poe

# Pharmacy statuses that mean the order was stopped before running its course (the loader's "stopped").
_DISCONTINUED = frozenset(k for k, v in PHARMACY_STATUS.items() if v == "stopped")

def _open(root: Path, table: str) -> IO[str] | None:
    for name in (f"{table}.csv.gz", f"{table}.csv"):
        path = root / "hosp" / name
        if path.is_file():
            return gzip.open(path, "rt", newline="", encoding="utf-8") if name.endswith(".gz") else \
                path.open(newline="", encoding="utf-8")
    return None


def _columns(root: Path, table: str, columns: tuple[str, ...], subjects: set[str] | None) -> Iterator[tuple[str, ...]]:
    """The named columns of a hosp table, row by row (rows of the chosen subjects when the table has subject_id)."""
    fh = _open(root, table)
    if fh is None:
        return
    with fh:
        reader = csv.reader(fh)
        header = next(reader)
        idx = [header.index(c) for c in columns]
        sub = header.index("subject_id") if "subject_id" in header else None
        for row in reader:
            if subjects is None or sub is None or row[sub] in subjects:
                yield tuple(row[i] for i in idx)


def _t(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _readable(value: str) -> bool:
    """A time the loader can read (a row whose time it cannot read is a BadInput, not an entry)."""
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def iso(t: datetime) -> str:
    """A MIMIC time (naive, read as UTC) as the ISO string a question's ``as_of`` is (``+00:00``)."""
    return t.replace(tzinfo=UTC).isoformat()


def shown(t: datetime) -> str:
    """A time as a question's words show it (``2180-05-06 22:00:00``)."""
    return t.strftime("%Y-%m-%d %H:%M:%S")


def compact(t: datetime) -> str:
    """A time as a question id carries it (``21800506T220000``)."""
    return t.strftime("%Y%m%dT%H%M%S")


@dataclass(frozen=True)
class Lab:
    """One lab result: its row's id, item, charttime, number and unit (as MIMIC writes them)."""

    labevent_id: str
    itemid: str
    time: datetime
    valuenum: str
    unit: str

    @property
    def entry_id(self) -> str:
        return f"{SOURCE}:labevents:{self.labevent_id}"

    @property
    def answer(self) -> str:
        return f"{self.valuenum} {self.unit}".strip()


@dataclass(frozen=True)
class _Stop:
    """A medication order discontinued (or changed) at ``time``; ``name`` "" when the published rows name no drug."""

    time: datetime
    name: str
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class _Change:
    """A POE medication order (``old``) ended by exactly one row, a 'Change' whose own order is ``new``."""

    old: str
    old_name: str
    old_time: datetime
    new: str
    new_name: str
    time: datetime


@dataclass(frozen=True)
class _Dose:
    """One pharmacy row of a POE order as the loader publishes it: its entry (``entry_id``, the ``:start`` or the
    single entry) at ``start``, the drug it names and its ``dosage`` (the loader's string; None when it has none)."""

    entry_id: str
    start: datetime
    name: str
    dosage: str | None


@dataclass(frozen=True)
class Stay:
    """An admission: its times, where the patient went, and the entries of its admission and discharge."""

    hadm: str
    admit: datetime
    discharge: datetime | None
    location: str

    @property
    def admitted(self) -> str:
        return f"{SOURCE}:admissions:{self.hadm}"

    @property
    def discharged(self) -> str:
        return f"{SOURCE}:admissions:{self.hadm}:discharge"


@dataclass
class PatientRows:
    """One patient's rows, as the templates read them (:func:`load_rows`)."""

    labs: dict[str, list[Lab]]
    admissions: list[tuple[datetime, str]]
    orders: Orders
    stops: list[_Stop]
    changes: list[_Change]
    stays: list[Stay]  # by admittime
    doses: dict[str, list[_Dose]]  # each POE order's pharmacy rows (file order)
    diagnoses: dict[str, list[str]]  # each admission's diagnoses_icd entries (hadm_id -> entry ids)
    age: tuple[float, float] | None  # (anchor_age, anchor_year)


def _main(names: list[tuple[int, str, str]]) -> tuple[int, str, str]:
    """The prescription the loader describes an order by: its first of drug_type MAIN, else its first."""
    return min(names, key=lambda x: (x[1] != "MAIN", x[0]))


def _drug(names: list[tuple[int, str, str]]) -> str:
    """The loader's drug name of an order (the drug of its :func:`_main` prescription)."""
    return _main(names)[2].strip()


def load_rows(root: Path, subjects: set[str] | None) -> tuple[dict[str, PatientRows], dict[str, str]]:
    """Each patient's rows (only the columns the templates need, each table read once) and lab item displays."""
    labitems = {i: (label.strip(), fluid.strip())
                for i, label, fluid in _columns(root, "d_labitems", ("itemid", "label", "fluid"), None)}
    labs, all_items = _labs(root, subjects)
    admissions, stays = _admissions(root, subjects)
    discharge = {subject: {s.hadm: (s.discharge, s.discharged) for s in ss if s.discharge is not None}
                 for subject, ss in stays.items()}
    diagnoses: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    known = {s.hadm for ss in stays.values() for s in ss}
    for subject, hadm, seq, version in _columns(root, "diagnoses_icd", ("subject_id", "hadm_id", "seq_num",
                                                                        "icd_version"), subjects):
        if hadm in known and version in ("9", "10"):
            diagnoses[subject][hadm].append(f"{SOURCE}:diagnoses_icd:{hadm}:{seq}")
    ages = {subject: (float(age), float(year)) for subject, age, year in _columns(
        root, "patients", ("subject_id", "anchor_age", "anchor_year"), subjects) if age and year}
    meds = _medications(root, subjects, discharge)
    stops, doses = _pharmacy_stops_and_doses(meds)
    changes = _poe_changes(meds, stops)

    displays = {i: (f"{label} ({fluid})" if fluid else label) for i, (label, fluid) in labitems.items() if label}
    out: dict[str, PatientRows] = {}
    for subject in sorted(set(labs) | set(admissions) | set(meds.orders) | set(stops) | set(doses)):
        # A display shared by two items of the patient would make the question ambiguous: neither is asked about.
        shared = Counter(displays[i] for i in all_items[subject] if i in displays)
        kept = {i: sorted(rows, key=lambda r: (r.time, int(r.labevent_id)))
                for i, rows in labs[subject].items() if i in displays and shared[displays[i]] == 1}
        out[subject] = PatientRows(kept, sorted(admissions[subject]),
                                   meds.orders.get(subject) or Orders((), discharge.get(subject, {})),
                                   sorted(stops[subject], key=lambda s: (s.time, s.evidence)),
                                   sorted(changes[subject], key=lambda c: (c.time, c.new)),
                                   sorted(stays[subject], key=lambda s: (s.admit, s.hadm)), dict(doses[subject]),
                                   {h: sorted(v) for h, v in diagnoses[subject].items()}, ages.get(subject))
    return out, displays


def _labs(root: Path, subjects: set[str] | None) -> tuple[dict[str, dict[str, list[Lab]]], dict[str, set[str]]]:
    """Each patient's lab results by item (rows with a time the loader can read), and every item of the patient."""
    labs: dict[str, dict[str, list[Lab]]] = defaultdict(lambda: defaultdict(list))
    all_items: dict[str, set[str]] = defaultdict(set)
    for lid, subject, itemid, charttime, valuenum, unit in _columns(
            root, "labevents", ("labevent_id", "subject_id", "itemid", "charttime", "valuenum", "valueuom"), subjects):
        all_items[subject].add(itemid)
        if not _readable(charttime):
            continue
        labs[subject][itemid].append(Lab(lid, itemid, _t(charttime), valuenum.strip(), unit.strip()))
    return labs, all_items


def _admissions(root: Path, subjects: set[str] | None) -> tuple[dict[str, list[tuple[datetime, str]]],
                                                                 dict[str, list[Stay]]]:
    """Each patient's admissions (admittime, hadm_id) and stays (those that do not end before they start)."""
    admissions: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
    stays: dict[str, list[Stay]] = defaultdict(list)
    for subject, hadm, admittime, dischtime, location in _columns(
            root, "admissions", ("subject_id", "hadm_id", "admittime", "dischtime", "discharge_location"), subjects):
        if _readable(admittime):
            admissions[subject].append((_t(admittime), hadm))
            end = _t(dischtime) if dischtime and _readable(dischtime) else None
            if end is None or end >= _t(admittime):
                stays[subject].append(Stay(hadm, _t(admittime), end, location.strip()))
    return admissions, stays


@dataclass
class _Medications:
    """The medication rows of the chosen patients, with drug names as the loader gives them."""

    pharmacy: list[tuple[str, ...]]
    pharmacy_name: dict[str, str]  # pharmacy_id -> the loader's drug name
    pharmacy_med: dict[str, str]  # poe_id -> the medication of its last pharmacy row
    rx_by_pharmacy: dict[str, list[tuple[int, str, str]]]  # pharmacy_id -> (file position, drug_type, drug)
    rx_dose: dict[int, dict[str, str]]  # each prescription's dose and route (by file position)
    poe: dict[str, tuple[str, ...]]  # poe_id -> its row (a time the loader can read)
    poe_name: dict[str, str]  # poe_id -> the loader's drug name ("" when the rows name none)
    ended_by: dict[str, str]  # poe_id -> the POE order that ended it
    enders: Counter[str]  # poe_id -> how many Change/D/C rows name it
    orders: dict[str, Orders]  # per patient, the orders as the loader publishes them


def _medications(root: Path, subjects: set[str] | None,
                 discharge: dict[str, dict[str, tuple[datetime, str]]]) -> _Medications:
    # Drug names, the way the loader names orders (file order kept as the first tuple element).
    rx_by_pharmacy: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    rx_by_poe: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    rx_dose: dict[int, dict[str, str]] = {}
    rx_rows: list[tuple[str, ...]] = []
    for n, (subject, pid, poe_id, kind, drug, dose, unit, route, rx_start, rx_stop, hadm) in enumerate(_columns(
            root, "prescriptions", ("subject_id", "pharmacy_id", "poe_id", "drug_type", "drug", "dose_val_rx",
                                    "dose_unit_rx", "route", "starttime", "stoptime", "hadm_id"), subjects)):
        if pid:
            rx_by_pharmacy[pid].append((n, kind, drug))
            rx_dose[n] = {"dose_val_rx": dose, "dose_unit_rx": unit, "route": route}
        if poe_id:
            rx_by_poe[poe_id].append((n, kind, drug))
        rx_rows.append((subject, pid, drug, rx_start, rx_stop, hadm))
    emar_med = {poe_id: med for poe_id, med in _columns(root, "emar", ("poe_id", "medication"), subjects) if poe_id}
    pharmacy = list(_columns(root, "pharmacy", ("subject_id", "pharmacy_id", "poe_id", "starttime", "entertime",
                                                 "stoptime", "status", "medication", "route", "frequency", "hadm_id"),
                             subjects))
    pharmacy_med = {r[2]: r[7] for r in pharmacy if r[2]}  # the last pharmacy row of an order, as the loader
    pharmacy_ids = {r[1] for r in pharmacy}

    poe: dict[str, tuple[str, ...]] = {}
    for r in _columns(root, "poe", ("poe_id", "subject_id", "ordertime", "order_type", "transaction_type",
                                    "discontinue_of_poe_id", "discontinued_by_poe_id", "hadm_id"), subjects):
        if _readable(r[2]):
            poe[r[0]] = r
    enders: Counter[str] = Counter()
    for _pid, _, _, _, tx, of, _, _ in poe.values():
        if of and tx in ("Change", "D/C"):
            enders[of] += 1

    def poe_name(poe_id: str) -> str:
        rx = rx_by_poe.get(poe_id, [])
        return _drug(rx) if rx else (pharmacy_med.get(poe_id) or emar_med.get(poe_id) or "").strip()

    pharmacy_name = {}
    for r in pharmacy:
        rx = rx_by_pharmacy.get(r[1], [])
        pharmacy_name[r[1]] = _drug(rx) if rx else r[7].strip()
    orphans = [(subject, f"{pid or 'none'}:{drug.strip().lower()}", drug, a, b, hadm)
               for subject, pid, drug, a, b, hadm in rx_rows if pid not in pharmacy_ids and drug.strip()]
    names = {p: poe_name(p) for p in poe}
    orders = build_orders(RowsIn(poe, pharmacy, pharmacy_name, names, orphans), discharge)
    return _Medications(pharmacy, pharmacy_name, pharmacy_med, rx_by_pharmacy, rx_dose, poe, names,
                        ended_by_poe(poe), enders, orders)


def _pharmacy_stops_and_doses(meds: _Medications) -> tuple[dict[str, list[_Stop]], dict[str, dict[str, list[_Dose]]]]:
    """Per patient, the pharmacy orders discontinued on their own (not by a POE order), and each POE order's
    pharmacy rows with the dosage the loader publishes on them."""
    stops: dict[str, list[_Stop]] = defaultdict(list)
    doses: dict[str, dict[str, list[_Dose]]] = defaultdict(lambda: defaultdict(list))
    poe, ended_by = meds.poe, meds.ended_by
    for subject, pid, poe_id, starttime, entertime, stoptime, status, _med, route, freq, _hadm in meds.pharmacy:
        name = meds.pharmacy_name[pid]
        if not _readable(starttime or entertime) or (stoptime and not _readable(stoptime)):
            continue
        start = _t(starttime or entertime)
        stop = _t(stoptime) if stoptime else None
        ender = ended_by.get(poe_id) if poe_id else None
        by_time = _t(poe[ender][2]) if ender else None
        # The loader's rule: the POE order that discontinued the order is its stop, unless the pharmacy stop is more
        # than an hour earlier (SAME_ACT): then the pharmacy's own stop ends the row (':start' and ':stop').
        poe_stops = by_time is not None and (stop is None or stop > by_time - SAME_ACT)
        if poe_id:
            # The loader's dosage (of the prescription it names the order by) on the entry it publishes at start:
            # ':start', or the single entry (ended by POE before it started; no stop time or no final status).
            single = (by_time is not None and by_time <= start) if poe_stops else \
                not stoptime or status not in PHARMACY_STATUS
            rx = meds.rx_by_pharmacy.get(pid, [])
            dosage = dosage_text(meds.rx_dose[_main(rx)[0]] if rx else None, {"route": route, "frequency": freq})
            doses[subject][poe_id].append(_Dose(f"{SOURCE}:pharmacy:{pid}" + ("" if single else ":start"), start,
                                                name, dosage))
        if not poe_stops and stop is not None and status in _DISCONTINUED:
            stop = max(stop, start)
            stops[subject].append(_Stop(stop, name, (f"{SOURCE}:pharmacy:{pid}:start",
                                                     f"{SOURCE}:pharmacy:{pid}:stop")))
    return stops, doses


def _poe_changes(meds: _Medications, stops: dict[str, list[_Stop]]) -> dict[str, list[_Change]]:
    """Per patient, the POE medication orders ended by exactly one 'Change'; the POE discontinuations and changes
    are added to ``stops`` (without a drug where the rows name none)."""
    poe, enders, poe_name = meds.poe, meds.enders, meds.poe_name
    changes: dict[str, list[_Change]] = defaultdict(list)
    for pid, subject, ordertime, order_type, tx, of, _, _ in poe.values():
        if order_type == "Medications" and tx == "Change" and of in poe and enders[of] == 1 \
                and poe[of][3] == "Medications" and poe[of][4] in ("New", "Change"):
            changes[subject].append(_Change(of, poe_name[of], _t(poe[of][2]), pid, poe_name[pid], _t(ordertime)))
        if tx not in ("Change", "D/C") or not of:
            continue
        name = poe_name[of] if order_type == "Medications" and of in poe and enders[of] == 1 else ""
        if name:
            stops[subject].append(_Stop(_t(ordertime), name, (f"{SOURCE}:poe:{of}", f"{SOURCE}:poe:{pid}")))
        elif order_type == "Medications" or of in meds.pharmacy_med:
            # Ends a medication (or an IV order with pharmacy rows) without one drug to name: no question at its time.
            stops[subject].append(_Stop(_t(ordertime), "", ()))
    return changes
