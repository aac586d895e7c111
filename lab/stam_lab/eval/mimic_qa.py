"""MIMIC-QA: a deterministic question set over the MIMIC-IV (demo) tables, answered from the rows themselves.

In the spirit of the paper's MIMIC-QA (template questions with answer operations, no language model anywhere,
a patient-disjoint split), restricted to what the project publishes: every question's ``evidence`` is a tuple of
entry ids that :mod:`stam.sources.mimic` produces for that patient (``mimic-iv:labevents:<labevent_id>``,
``mimic-iv:poe:<poe_id>``, ``mimic-iv:pharmacy:<pharmacy_id>:start|:stop``, ``mimic-iv:admissions:<hadm_id>``).

Times are MIMIC clinical times (lab ``charttime``, pharmacy ``starttime``/``stoptime``, POE ``ordertime``), read
as UTC like the loader does; ``as_of`` is an ISO string with ``+00:00`` and a row counts when its time is at or
before ``as_of`` (inclusive). Templates (``qtype``):

- ``first_value`` / ``last_value``: the earliest / latest result of a lab item (d_labitems ``label (fluid)``).
  Results sharing the first (last) ``charttime`` are all evidence; if they disagree, the question is skipped.
- ``min_value`` / ``max_value``: the lowest / highest numeric result; every row with that value is evidence.
- ``value_at_time``: the result in effect at ``as_of`` = the latest result at or before it. ``as_of`` is the
  midpoint (floored to the minute) between one result time and the item's next, so it is never the last one.
- ``previous_value``: "What was the <display> value before the most recent one?": the result of the time before
  the latest one. Half the items (by hash) ask it at a time instead ("As of <T>, ..."; ``as_of`` = the midpoint
  between a result time j >= 1 and the next one, so group j is the latest then); either form falls back to the
  other when it has no pair of agreed groups. Evidence: the rows of both times (a reader needs the latest to
  know which one is previous); skipped when either time's results disagree.
- ``change_since_first``: "How has the patient's <display> changed since the first result?" (whole record).
  Answer ``"<first> to <latest>"``, each value written as the other lab templates write it ("3.9 mEq/L to 4.4
  mEq/L", also when the two are equal); token F1 then credits each number and unit, one value with its unit
  gets 0.6, and only exact match checks the order. The signed difference with its unit ("+0.5 mEq/L", as the
  read path's computed fact writes it) is the same answer in another form and is scored as right too (``also``).
  Evidence: the rows of the first and latest times.
- ``current_medication``: at ``as_of`` (the moment some pharmacy order ended), among the pharmacy orders active
  then (start <= as_of < end), the drug of the one started most recently. An order's end is what the loader
  publishes: the ordertime of the POE 'Change'/'D/C' that ended it, else the pharmacy ``stoptime`` (orders with
  no stop, on hold, or ended before they started are never active). Evidence: the order's ``:start`` entry.
  Skipped when the most recent start is shared by two drugs, or when a POE medication order placed since then
  is still open at ``as_of`` (POE orders without pharmacy rows stay active in the published rows) for another
  drug.
- ``discontinued_medication``: at ``as_of`` (a discontinuation time), the medication order discontinued or
  changed most recently: a POE medication order ended by one 'D/C' or 'Change' (evidence: the order's row and
  the ending row), or a pharmacy order with a discontinued status that no POE order ended (evidence: its
  ``:start`` and ``:stop``). Skipped when something else ended at the same time: another drug, or an order
  whose drug the rows do not name (an order ended twice, an IV order, an unnamed medication).
- ``drug_active_at``: "As of <T>, was <drug> an active medication order?", "yes" or "no". The drug's orders
  (any spelling of the name: MIMIC writes tall-man letters, "LORazepam" / "Lorazepam") are its pharmacy
  orders, active over the loader's interval as for ``current_medication``, and its POE medication orders ended
  by a 'Change'/'D/C' (from ordertime to that row). "yes": an order is active at T (evidence: the ``:start``
  or POE entry of each one active); "no": none is, and one had ended by T (evidence: the start and ending
  entries of the order(s) that ended last: ``:start`` + ``:stop``, or + the POE row that ended it). Times:
  the midpoint of an active interval ("yes" candidates) and the midpoint between an end and the drug's next
  order or the discharge of the admission it ended in, whichever comes first ("no" candidates; none when it
  ended outside an admission or at discharge), floored to the minute and strictly inside. Skipped: an order of
  the drug starts or ends exactly at T; an order of the drug whose state the rows leave open covers T (a POE
  order with no pharmacy row and no Change/D/C, which the loader publishes active for good; a POE order
  between its ordertime and its first pharmacy start; a pharmacy order on hold or without a stoptime); and
  any case where the order's published versions disagree with the intervals: a POE order and its pharmacy
  rows share one order identity, and the answer must also hold when each order is as its latest published
  entry at T says (active, naming the drug, not ended by a Change/D/C since); e.g. a second pharmacy row of
  one POE order that stops while the first still runs, or an IV order's POE row (which names no drug)
  published after its pharmacy start. Unnamed drugs are never asked about. Per patient, "yes" and "no"
  candidates alternate (the first side by hash), so the chosen questions are about half yes.
- ``order_changed_into``: "What was the <drug> order of <ordertime> changed into?": a POE medication order
  ended by exactly one row, a 'Change'; answer: what the Change's own (new) order prescribes, ``"<drug>
  <dosage>"`` as the loader publishes it on the new order's first pharmacy version (its earliest start): the
  drug the loader names that row by and its ``dosage`` (dose_val_rx/dose_unit_rx of the same prescription,
  route, frequency), e.g. "Vancomycin 750 mg IV Q 8H". Evidence: the old order's and the Change's POE entries
  and the entry of each pharmacy row of the new order at that start (``:start``, or the single entry the loader
  publishes when the order was ended before it started or the row has no stop). ``as_of`` is that start, or
  the Change's ordertime when the pharmacy start is earlier: the new dosage is only in the record from the
  pharmacy start on (asked at the ordertime, the answer would postdate the question), and every evidence entry
  is in the record then. Skipped: either order unnamed, the old order ended more than once, another POE order
  of the same drug placed at the same ordertime (the question would not say which), the new order without a
  pharmacy row, rows of the new order at its first start without a dosage or disagreeing on drug + dosage,
  and changes the published rows cannot tell apart: the answer equals (case aside) the drug + dosage of one
  of the old order's pharmacy rows (under its own name or the question's), or the old order has no pharmacy
  row with a dosage. Most Changes alter dose, route or frequency and keep the drug; the answer never repeats
  the old order's published drug + dosage (about half the Changes only alter what the rows do not show).
- ``count``: the number of hospital admissions (whole record, ``as_of`` None; evidence: every admission), or
  the number of results of a lab item charted up to ``as_of`` (evidence: those rows).

Lab questions use only items with a d_labitems label that no other item of the same patient shares (the
published entry displays ``label (fluid)``: e.g. blood-gas and chemistry "Glucose (Blood)" would be the same
words) and, for the value templates, with >= 3 numeric results in one unit (MCHC is written in % and g/dL).
Numbers are ``valuenum`` as MIMIC writes it, followed by ``valueuom`` when there is one.

Choice: for each patient and template, candidates are ordered by a hash of (seed, question_id) (for
``drug_active_at``, yes and no alternating, each in that order); templates are taken round robin from a
per-patient rotation of :data:`QTYPES` until ``per_patient`` questions (the admissions count is the first
``count`` candidate; a template without candidates leaves its turn to the others). The default
:data:`PER_PATIENT` = 18 keeps 1.5 questions per template and patient with 12 templates, the share each had
with 8 templates and 12: every template gets one question per patient where it has one, and six of them a
second (which six turns with the rotation). The split is by a hash of the patient id (60/20/20), so a
patient's questions are all in one split whatever the seed.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import IO, Any

from stam.errors import SourceError
from stam.sources.mimic import PHARMACY_STATUS, SAME_ACT, SOURCE, dosage_text, is_mimic_root
from stam_lab.eval.mimic_orders import NEAR, Orders, RowsIn, drug_key
from stam_lab.eval.mimic_orders import build as build_orders
from stam_lab.eval.mimic_orders import ended_by as ended_by_poe

__all__ = ["PER_PATIENT", "QTYPES", "SPLITS", "Question", "balanced_sample", "build_questions", "read_jsonl", "split_of",
           "write_jsonl"]

QTYPES: tuple[str, ...] = ("first_value", "last_value", "previous_value", "change_since_first", "min_value",
                           "max_value", "value_at_time", "current_medication", "drug_active_at",
                           "discontinued_medication", "order_changed_into", "count", "currently_receiving",
                           "discharge_changes", "first_day", "hour_n", "billed_diagnoses", "age")
PER_PATIENT = 27  # questions per patient by default: 1.5 per template (see the module docstring)
SPLITS: tuple[str, ...] = ("train", "dev", "test")
# Pharmacy statuses that mean the order was stopped before running its course (the loader's "stopped").
_DISCONTINUED = frozenset(k for k, v in PHARMACY_STATUS.items() if v == "stopped")


@dataclass(frozen=True)
class Question:
    """One question: ``answer`` is computed from the rows at or before ``as_of`` (the whole record when None);
    ``evidence`` holds the entry ids of the rows that support it; ``also``: other forms of the same answer that
    are scored as right (``golds``: all of them)."""

    question_id: str
    patient_id: str
    qtype: str
    question: str
    answer: str
    as_of: str | None
    evidence: tuple[str, ...]
    split: str
    also: tuple[str, ...] = ()

    @property
    def golds(self) -> tuple[str, ...]:
        return (self.answer, *self.also)


def split_of(patient_id: str) -> str:
    """train / dev / test (60/20/20) from a stable hash of the patient id."""
    bucket = _hash("split", patient_id) % 100
    return "train" if bucket < 60 else "dev" if bucket < 80 else "test"


def _hash(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big")


# --- reading -------------------------------------------------------------------------------------------------


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


def _iso(t: datetime) -> str:
    return t.replace(tzinfo=UTC).isoformat()


def _shown(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _compact(t: datetime) -> str:
    return t.strftime("%Y%m%dT%H%M%S")


@dataclass(frozen=True)
class _Lab:
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


def _difference(first: _Lab, latest: _Lab) -> tuple[str, ...]:
    """The change as a signed difference with its unit ("+0.4 mg/dL"), written as the read path's computed fact
    writes it; none when the units differ or a value is not a number."""
    try:
        delta = float(latest.valuenum) - float(first.valuenum)
    except ValueError:
        return ()
    if first.unit != latest.unit:
        return ()
    return (f"{delta:+.4g} {latest.unit}".strip(),)


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
class _Stay:
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
class _Patient:
    labs: dict[str, list[_Lab]]
    admissions: list[tuple[datetime, str]]
    orders: Orders
    stops: list[_Stop]
    changes: list[_Change]
    stays: list[_Stay]  # by admittime
    doses: dict[str, list[_Dose]]  # each POE order's pharmacy rows (file order)
    diagnoses: dict[str, list[str]]  # each admission's diagnoses_icd entries (hadm_id -> entry ids)
    age: tuple[float, float] | None  # (anchor_age, anchor_year)


def _main(names: list[tuple[int, str, str]]) -> tuple[int, str, str]:
    """The prescription the loader describes an order by: its first of drug_type MAIN, else its first."""
    return min(names, key=lambda x: (x[1] != "MAIN", x[0]))


def _drug(names: list[tuple[int, str, str]]) -> str:
    """The loader's drug name of an order (the drug of its :func:`_main` prescription)."""
    return _main(names)[2].strip()


def _load(root: Path, subjects: set[str] | None) -> tuple[dict[str, _Patient], dict[str, str]]:
    """Each patient's rows (only the columns the templates need, each table read once) and lab item displays."""
    labitems = {i: (label.strip(), fluid.strip())
                for i, label, fluid in _columns(root, "d_labitems", ("itemid", "label", "fluid"), None)}
    labs: dict[str, dict[str, list[_Lab]]] = defaultdict(lambda: defaultdict(list))
    all_items: dict[str, set[str]] = defaultdict(set)
    for lid, subject, itemid, charttime, valuenum, unit in _columns(
            root, "labevents", ("labevent_id", "subject_id", "itemid", "charttime", "valuenum", "valueuom"), subjects):
        all_items[subject].add(itemid)
        if not _readable(charttime):
            continue
        labs[subject][itemid].append(_Lab(lid, itemid, _t(charttime), valuenum.strip(), unit.strip()))
    admissions: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
    stays: dict[str, list[_Stay]] = defaultdict(list)
    for subject, hadm, admittime, dischtime, location in _columns(
            root, "admissions", ("subject_id", "hadm_id", "admittime", "dischtime", "discharge_location"), subjects):
        if _readable(admittime):
            admissions[subject].append((_t(admittime), hadm))
            end = _t(dischtime) if dischtime and _readable(dischtime) else None
            if end is None or end >= _t(admittime):
                stays[subject].append(_Stay(hadm, _t(admittime), end, location.strip()))
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

    # Drug names, the way the loader names orders (file order kept as the first tuple element).
    rx_by_pharmacy: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    rx_by_poe: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    rx_dose: dict[int, dict[str, str]] = {}  # each prescription's dose and route (by file position)
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
    ended_by = ended_by_poe(poe)
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
    orders = build_orders(RowsIn(poe, pharmacy, pharmacy_name, {p: poe_name(p) for p in poe}, orphans), discharge)

    stops: dict[str, list[_Stop]] = defaultdict(list)
    doses: dict[str, dict[str, list[_Dose]]] = defaultdict(lambda: defaultdict(list))
    for subject, pid, poe_id, starttime, entertime, stoptime, status, _med, route, freq, _hadm in pharmacy:
        name = pharmacy_name[pid]
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
            rx = rx_by_pharmacy.get(pid, [])
            dosage = dosage_text(rx_dose[_main(rx)[0]] if rx else None, {"route": route, "frequency": freq})
            doses[subject][poe_id].append(_Dose(f"{SOURCE}:pharmacy:{pid}" + ("" if single else ":start"), start,
                                                name, dosage))
        if not poe_stops and stop is not None and status in _DISCONTINUED:
            stop = max(stop, start)
            stops[subject].append(_Stop(stop, name, (f"{SOURCE}:pharmacy:{pid}:start",
                                                     f"{SOURCE}:pharmacy:{pid}:stop")))

    changes: dict[str, list[_Change]] = defaultdict(list)
    for pid, subject, ordertime, order_type, tx, of, _, _ in poe.values():
        if order_type == "Medications" and tx == "Change" and of in poe and enders[of] == 1 \
                and poe[of][3] == "Medications" and poe[of][4] in ("New", "Change"):
            changes[subject].append(_Change(of, poe_name(of), _t(poe[of][2]), pid, poe_name(pid), _t(ordertime)))
        if tx not in ("Change", "D/C") or not of:
            continue
        name = poe_name(of) if order_type == "Medications" and of in poe and enders[of] == 1 else ""
        if name:
            stops[subject].append(_Stop(_t(ordertime), name, (f"{SOURCE}:poe:{of}", f"{SOURCE}:poe:{pid}")))
        elif order_type == "Medications" or of in pharmacy_med:
            # Ends a medication (or an IV order with pharmacy rows) without one drug to name: no question at its time.
            stops[subject].append(_Stop(_t(ordertime), "", ()))

    displays = {i: (f"{label} ({fluid})" if fluid else label) for i, (label, fluid) in labitems.items() if label}
    out: dict[str, _Patient] = {}
    for subject in sorted(set(labs) | set(admissions) | set(orders) | set(stops) | set(doses)):
        # A display shared by two items of the patient would make the question ambiguous: neither is asked about.
        shared = Counter(displays[i] for i in all_items[subject] if i in displays)
        kept = {i: sorted(rows, key=lambda r: (r.time, int(r.labevent_id)))
                for i, rows in labs[subject].items() if i in displays and shared[displays[i]] == 1}
        out[subject] = _Patient(kept, sorted(admissions[subject]),
                                orders.get(subject) or Orders((), discharge.get(subject, {})),
                                sorted(stops[subject], key=lambda s: (s.time, s.evidence)),
                                sorted(changes[subject], key=lambda c: (c.time, c.new)),
                                sorted(stays[subject], key=lambda s: (s.admit, s.hadm)), dict(doses[subject]),
                                {h: sorted(v) for h, v in diagnoses[subject].items()}, ages.get(subject))
    return out, displays


# --- templates -----------------------------------------------------------------------------------------------

_Make = Callable[[], "Question | None"]
_Candidate = tuple[int, str, _Make]  # (order key, question id, builds the question or None when ambiguous)


class _Templates:
    """The candidate questions of one patient, by qtype."""

    def __init__(self, patient: str, rows: _Patient, displays: dict[str, str], seed: int) -> None:
        self.patient = patient
        self.rows = rows
        self.displays = displays
        self.seed = str(seed)

    def qid(self, template: str, params: str) -> str:
        return f"mimic-qa:{template}:{self.patient}:{params}"

    def question(self, qid: str, qtype: str, text: str, answer: str, as_of: datetime | None,
                 evidence: Iterable[str], also: tuple[str, ...] = ()) -> Question:
        return Question(qid, self.patient, qtype, text, answer, _iso(as_of) if as_of else None,
                        tuple(evidence), split_of(self.patient), also)

    def candidate(self, qid: str, make: _Make, first: bool = False) -> _Candidate:
        return (-1 if first else _hash(self.seed, qid), qid, make)

    def fixed(self, q: Question) -> _Candidate:
        return self.candidate(q.question_id, partial(_same_question, q))

    def all(self) -> dict[str, list[_Candidate]]:
        out: dict[str, list[_Candidate]] = defaultdict(list)
        for itemid, rows in sorted(self.rows.labs.items()):
            for qtype, cand in self.lab(itemid, rows):
                out[qtype].append(cand)
        out["current_medication"] = self.current()
        out["discontinued_medication"] = self.discontinued()
        out["drug_active_at"] = self.drug_active()
        out["order_changed_into"] = self.changed()
        out["count"].extend(self.admissions())
        out["currently_receiving"] = self.receiving()
        out["discharge_changes"] = self.discharge_changes()
        for qtype, cand in self.encounter_labs():
            out[qtype].append(cand)
        out["billed_diagnoses"] = self.billed()
        out["age"] = self.age()
        return out

    # labs

    def lab(self, itemid: str, rows: list[_Lab]) -> Iterator[tuple[str, _Candidate]]:
        """first/last/min/max/value_at_time need >= 3 numeric results in one unit; count needs two result times."""
        display = self.displays[itemid]
        groups = _by_time(rows)
        if len(groups) >= 2:
            pick = 1 + _hash(self.seed, "count", self.patient, itemid) % (min(len(groups), 12) - 1)
            upto = [r for g in groups[: pick + 1] for r in g]
            when = groups[pick][0].time
            qid = self.qid("count_lab", f"{itemid}@{_compact(when)}")
            yield "count", self.fixed(self.question(
                qid, "count", f"How many {display} results had been charted for the patient as of {_shown(when)}?",
                str(len(upto)), when, (r.entry_id for r in upto)))
        numeric = [r for r in rows if r.valuenum]
        if len(numeric) < 3 or len({r.unit for r in numeric}) != 1:
            return
        for qtype, group, words in (("first_value", groups[0], "first"), ("last_value", groups[-1], "most recent")):
            if _agreed(group):
                qid = self.qid(qtype, itemid)
                yield qtype, self.fixed(self.question(
                    qid, qtype, f"What was the {words} {display} value recorded for the patient?",
                    group[0].answer, None, (r.entry_id for r in group)))
        values = [float(r.valuenum) for r in numeric]
        for qtype, target, words in (("min_value", min(values), "lowest"), ("max_value", max(values), "highest")):
            hits = [r for r, v in zip(numeric, values, strict=True) if v == target]
            qid = self.qid(qtype, itemid)
            yield qtype, self.fixed(self.question(
                qid, qtype, f"What was the {words} {display} value recorded for the patient?", hits[0].answer, None,
                (r.entry_id for r in hits)))
        usable = [i for i in range(len(groups) - 1) if _agreed(groups[i])]
        if usable:
            i = usable[_hash(self.seed, "at", self.patient, itemid) % len(usable)]
            when = _between(groups[i][0].time, groups[i + 1][0].time)
            qid = self.qid("value_at_time", f"{itemid}@{_compact(when)}")
            yield "value_at_time", self.fixed(self.question(
                qid, "value_at_time", f"As of {_shown(when)}, what was the patient's most recent {display} value?",
                groups[i][0].answer, when, (r.entry_id for r in groups[i])))
        previous = self.previous(itemid, display, groups)
        if previous is not None:
            yield "previous_value", self.fixed(previous)
        if len(groups) >= 2 and _agreed(groups[0]) and _agreed(groups[-1]):
            qid = self.qid("change_since_first", itemid)
            yield "change_since_first", self.fixed(self.question(
                qid, "change_since_first", f"How has the patient's {display} changed since the first result?",
                f"{groups[0][0].answer} to {groups[-1][0].answer}", None,
                (r.entry_id for r in (*groups[0], *groups[-1])), also=_difference(groups[0][0], groups[-1][0])))

    def previous(self, itemid: str, display: str, groups: list[list[_Lab]]) -> Question | None:
        """The result before the latest one: of the whole record, or as of a time between two later results
        (half the items, by hash, ask at a time; each falls back to the other form when its own has no pair of
        agreed groups)."""
        whole = len(groups) >= 2 and _agreed(groups[-2]) and _agreed(groups[-1])
        # as of a time between group j and j + 1 (so group j is the latest then and j - 1 the one before)
        usable = [j for j in range(1, len(groups) - 1) if _agreed(groups[j - 1]) and _agreed(groups[j])]
        timed = _hash(self.seed, "previous", self.patient, itemid) % 2 == 1
        if usable and (timed or not whole):
            j = usable[_hash(self.seed, "previous-at", self.patient, itemid) % len(usable)]
            when = _between(groups[j][0].time, groups[j + 1][0].time)
            return self.question(
                self.qid("previous_value", f"{itemid}@{_compact(when)}"), "previous_value",
                f"As of {_shown(when)}, what was the {display} value before the most recent one?",
                groups[j - 1][0].answer, when, (r.entry_id for r in (*groups[j - 1], *groups[j])))
        if whole:
            return self.question(
                self.qid("previous_value", itemid), "previous_value",
                f"What was the {display} value before the most recent one?", groups[-2][0].answer, None,
                (r.entry_id for r in (*groups[-2], *groups[-1])))
        return None

    # medications

    def current(self) -> list[_Candidate]:
        """At each time an order's active interval ended (its own end or its admission's discharge)."""
        orders = self.rows.orders
        ends = sorted({e for name in orders.by_name for _, e, _ in orders.spans(name) if e is not None})
        return [self.candidate(self.qid("current_medication", _compact(t)), partial(self.current_at, t)) for t in ends]

    def current_at(self, when: datetime) -> Question | None:
        """Among the medication orders active at ``when``, the drug of the one whose version in effect started most
        recently. None unless the rows and the published versions agree on every other order active then (an
        order placed and not yet dispensed, or on hold, is unclear: it must not be the latest), and the most recent
        start names one drug."""
        orders = self.rows.orders
        unclear = {o.ref: max(v.time for v in o.versions if v.time <= when) for o in orders.orders
                   if any(a <= when and (b is None or when < b) for a, b in o.unclear)}
        active = [(o, v) for o, v in orders.active_at(when) if v.medication and o.ref not in unclear]
        running = {o.ref for o in orders.orders if o.ref not in unclear and orders.rows_active(o, when)}
        if not active or running != {o.ref for o, _ in active}:
            return None
        latest = max(v.time for _, v in active)
        top = [v for _, v in active if v.time == latest]
        names = {v.name for v in top}
        if len(names) != 1 or "" in names or any(t >= latest for t in unclear.values()):
            return None
        return self.question(
            self.qid("current_medication", _compact(when)), "current_medication",
            f"As of {_shown(when)}, which of the patient's active medication orders was started most recently?",
            names.pop(), when, sorted({v.entry_id for v in top}))

    def discontinued(self) -> list[_Candidate]:
        times = sorted({s.time for s in self.rows.stops})
        return [self.candidate(self.qid("discontinued_medication", _compact(t)), partial(self.discontinued_at, t))
                for t in times]

    def discontinued_at(self, when: datetime) -> Question | None:
        last = [s for s in self.rows.stops if s.time == when]
        names = {s.name for s in last}
        if len(names) != 1 or "" in names:
            return None
        return self.question(
            self.qid("discontinued_medication", _compact(when)), "discontinued_medication",
            f"As of {_shown(when)}, which medication order was most recently discontinued or changed?",
            names.pop(), when, sorted({e for s in last for e in s.evidence}))

    def _yes_no(self, qtype: str, times: Callable[[str, list[tuple[datetime, datetime | None, Any]]],
                                                   list[datetime]], text: str) -> list[_Candidate]:
        """Yes/no questions about each drug at the times ``times`` proposes, answered from every order of the drug
        (:meth:`Orders.state`); yes and no alternate (from a per-patient hashed side), each in hash order, so a
        patient's questions are balanced when both exist."""
        orders = self.rows.orders
        answers: dict[str, list[Question]] = {"yes": [], "no": []}
        seen: set[tuple[str, datetime]] = set()
        for key in sorted(orders.by_name):
            spans = orders.spans(key)
            if not spans:
                continue
            shown = next(r.name for o in orders.by_name[key] for r in o.runs if drug_key(r.name) == key)
            for when in times(key, spans):
                if (key, when) in seen:
                    continue
                seen.add((key, when))
                state = orders.state(key, when)
                if state is None:
                    continue
                answer = "yes" if state.active else "no"
                slug = "".join(ch if ch.isalnum() else "-" for ch in key)[:40]
                answers[answer].append(self.question(
                    self.qid(qtype, f"{slug}@{_compact(when)}"), qtype, text.format(t=_shown(when), drug=shown),
                    answer, when, state.shown))
        for qs in answers.values():
            qs.sort(key=lambda q: (_hash(self.seed, q.question_id), q.question_id))
        first, second = answers["yes"], answers["no"]
        if _hash(self.seed, qtype, self.patient) % 2:
            first, second = second, first
        out: list[_Candidate] = []
        for i in range(max(len(first), len(second))):
            for qs in (first, second):
                if i < len(qs):
                    out.append((len(out), qs[i].question_id, partial(_same_question, qs[i])))
        return out

    def drug_active(self) -> list[_Candidate]:
        """Inside an admission: the midpoint of each active interval of a drug (a "yes" candidate), and the
        midpoint between its end and the drug's next order or the discharge, whichever is first (a "no"
        candidate; none when it ended at the discharge)."""
        def times(key: str, spans: list[tuple[datetime, datetime | None, Any]]) -> list[datetime]:
            out = []
            for start, end, order in spans:
                cap = self.rows.orders.discharge.get(order.hadm or "")
                stop = end if end is not None else cap[0] if cap else None
                if stop is None:
                    continue
                nxt = min((s for s in self.rows.orders.starts(key) if s > stop), default=None)
                out += [t for t in (_inside(start, stop),
                                    _inside(stop, min(x for x in (nxt, cap[0] if cap else None) if x is not None))
                                    if cap is not None and stop < cap[0] else None) if t is not None]
            return out
        return self._yes_no("drug_active_at", times, "As of {t}, was {drug} an active medication order?")

    def receiving(self) -> list[_Candidate]:
        """"Is the patient currently receiving X" at a time T: the midpoint of each active interval of a drug
        ("yes"), inside the admission after an order of it ended ("no"), and after the admission it ended in: the
        midpoint between the discharge and the next admission, or a day after the last discharge ("no": what the
        discharge ended is not current any more)."""
        stays = self.rows.stays

        def times(key: str, spans: list[tuple[datetime, datetime | None, Any]]) -> list[datetime]:
            out = []
            for start, end, order in spans:
                cap = self.rows.orders.discharge.get(order.hadm or "")
                stop = end if end is not None else cap[0] if cap else None
                if stop is None:
                    continue
                nxt = min((s for s in self.rows.orders.starts(key) if s > stop), default=None)
                out.append(_inside(start, stop))
                if cap is not None and stop < cap[0]:
                    out.append(_inside(stop, min(x for x in (nxt, cap[0]) if x is not None)))
                if cap is not None:
                    later = min((s.admit for s in stays if s.admit > cap[0]), default=cap[0] + timedelta(days=2))
                    if nxt is None or nxt > later:
                        out.append(_inside(cap[0], min(later, cap[0] + timedelta(days=2))))
            return [t for t in out if t is not None]
        return self._yes_no("currently_receiving", times, "As of {t}, is the patient currently receiving {drug}?")

    # the encounter

    def stay_at(self, when: datetime) -> _Stay | None:
        """The admission current at ``when``: the latest that began at or before it."""
        return max((s for s in self.rows.stays if s.admit <= when), key=lambda s: (s.admit, s.hadm), default=None)

    def ended_stays(self) -> list[_Stay]:
        """Admissions with a discharge, each the only one current from its admission to its discharge (no other
        admission begins in between)."""
        out = []
        for s in self.rows.stays:
            if s.discharge is not None and self.stay_at(s.discharge) == s and s.discharge > s.admit:
                out.append(s)
        return out

    def discharge_changes(self) -> list[_Candidate]:
        out = []
        for s in self.ended_stays():
            qid = self.qid("discharge_changes", s.hadm)
            out.append(self.candidate(qid, partial(self.discharge_changes_of, s)))
        return out

    def discharge_changes_of(self, stay: _Stay) -> Question | None:
        """What changed at discharge: the admission's medication orders still active at the discharge, whose own end
        (if any) is later. Asked at the discharge. A list of the drugs when there are at most three, else how many
        orders. None when any order of the admission is unclear then, or ends exactly then."""
        orders = self.rows.orders
        assert stay.discharge is not None
        before = stay.discharge - NEAR
        mine = [o for o in orders.orders if o.hadm == stay.hadm]
        ended: list[tuple[Any, Any]] = []
        for o in mine:
            if any(stay.discharge - NEAR < b < stay.discharge + NEAR for b in orders.boundaries(o)
                   if b != stay.discharge):
                return None
            if any(a <= before and (b is None or before < b) for a, b in o.unclear):
                return None
            runs = orders.rows_active(o, before)
            v = orders.published(o, before)
            if bool(runs) != (v is not None):
                return None
            if v is not None and v.medication:
                if any(r.end is not None and r.end <= stay.discharge for r in runs):
                    return None  # its own end is the discharge's time: which ended it is not clear
                ended.append((o, v))
        if not ended:
            return None
        names = sorted({v.name for _, v in ended}, key=str.casefold)
        evidence = sorted({stay.discharged, *(v.entry_id for _, v in ended)})
        head = "What changed at discharge: "
        if len(names) <= 3 and all(names):
            return self.question(
                self.qid("discharge_changes", stay.hadm), "discharge_changes",
                head + "which of the patient's medication orders did the discharge end?", ", ".join(names),
                stay.discharge, evidence)
        return self.question(
            self.qid("discharge_changes", stay.hadm), "discharge_changes",
            head + "how many of the patient's medication orders did the discharge end?", str(len(ended)),
            stay.discharge, evidence)

    def encounter_labs(self) -> Iterator[tuple[str, _Candidate]]:
        """first_day and hour_n questions of each admission and lab item, asked at the discharge."""
        for s in self.ended_stays():
            assert s.discharge is not None
            for itemid, rows in sorted(self.rows.labs.items()):
                numeric = [r for r in rows if r.valuenum]
                if not numeric or len({r.unit for r in numeric}) != 1:
                    continue
                display = self.displays[itemid]
                q = self.first_day(s, itemid, display, rows)
                if q is not None:
                    yield "first_day", self.fixed(q)
                q = self.hour_n(s, itemid, display, rows)
                if q is not None:
                    yield "hour_n", self.fixed(q)

    def first_day(self, s: _Stay, itemid: str, display: str, rows: list[_Lab]) -> Question | None:
        """The highest result within the first 24 hours of the admission (at least two result times then, and
        results of the item outside that day by the discharge, so the day matters)."""
        assert s.discharge is not None
        end = s.admit + timedelta(days=1)
        day = [r for r in rows if s.admit <= r.time < end and r.valuenum]
        outside = [r for r in rows if (r.time < s.admit or end <= r.time <= s.discharge) and r.valuenum]
        if len({r.time for r in day}) < 2 or not outside or end > s.discharge:
            return None
        top = max(float(r.valuenum) for r in day)
        hits = [r for r in day if float(r.valuenum) == top]
        if max(float(r.valuenum) for r in outside) == top:
            return None  # the whole record's highest would read the same: the day would not matter
        return self.question(
            self.qid("first_day", f"{s.hadm}:{itemid}"), "first_day",
            f"What was the highest {display} value within the first day of this admission?", hits[0].answer,
            s.discharge, (r.entry_id for r in hits))

    def hour_n(self, s: _Stay, itemid: str, display: str, rows: list[_Lab]) -> Question | None:
        """The most recent result at hour N of the stay (N whole hours after the admission, between two result
        times of the stay, chosen by hash), asked at the discharge."""
        assert s.discharge is not None
        groups = [g for g in _by_time([r for r in rows if s.admit <= r.time <= s.discharge])]
        usable = []
        for j in range(len(groups) - 1):
            if not _agreed(groups[j]):
                continue
            mid = groups[j][0].time + (groups[j + 1][0].time - groups[j][0].time) / 2
            hours = int((mid - s.admit).total_seconds() // 3600)
            point = s.admit + timedelta(hours=hours)
            if groups[j][0].time + NEAR <= point and point + NEAR <= groups[j + 1][0].time:
                usable.append((j, hours))
        if not usable:
            return None
        j, hours = usable[_hash(self.seed, "hour", self.patient, s.hadm, itemid) % len(usable)]
        return self.question(
            self.qid("hour_n", f"{s.hadm}:{itemid}"), "hour_n",
            f"What was the most recent {display} value at hour {hours} of this stay?", groups[j][0].answer,
            s.discharge, (r.entry_id for r in groups[j]))

    def billed(self) -> list[_Candidate]:
        """How many diagnoses were billed for the admission, asked at its discharge."""
        out = []
        for s in self.ended_stays():
            rows = self.rows.diagnoses.get(s.hadm, [])
            if rows:
                assert s.discharge is not None
                out.append(self.fixed(self.question(
                    self.qid("billed_diagnoses", s.hadm), "billed_diagnoses",
                    "How many diagnoses were billed for this admission?", str(len(rows)), s.discharge, rows)))
        return out

    def age(self) -> list[_Candidate]:
        """"How old is the patient?" at each admission's start: anchor_age + year(T) - anchor_year (MIMIC gives the
        age in the anchor year; 91 stands for any age over 89, so those patients are not asked)."""
        if self.rows.age is None or self.rows.age[0] >= 91:
            return []
        age, year = self.rows.age
        out = []
        for s in self.rows.stays:
            out.append(self.fixed(self.question(
                self.qid("age", s.hadm), "age", "How old is the patient?", f"{age + s.admit.year - year:g} years",
                s.admit, (f"{SOURCE}:patients:{self.patient}",))))
        return out

    def changed(self) -> list[_Candidate]:
        """Each POE medication order ended by one 'Change': the new order's drug and dosage as published on its
        first pharmacy version(s), asked once that version is published (see the module docstring)."""
        out: list[_Candidate] = []
        for c in self.rows.changes:
            if not c.old_name or not c.new_name or c.old_time > c.time:
                continue
            # The question names the old order by drug and order time: another order of that drug placed at the
            # same time would make it ambiguous.
            if sum(v.rank[0] == 0 and v.active and v.time == c.old_time and v.name.casefold() == c.old_name.casefold()
                   for o in self.rows.orders.orders for v in o.versions) != 1:
                continue
            new = self.rows.doses.get(c.new, [])
            if not new:
                continue
            first = min(d.start for d in new)
            at_first = [d for d in new if d.start == first]
            answers = {f"{d.name} {d.dosage}" for d in at_first if d.name and d.dosage}
            if len(answers) != 1 or len(at_first) != sum(bool(d.name and d.dosage) for d in at_first):
                continue  # no dosage, or versions of the new order that disagree at its first start
            answer = answers.pop()
            # What the old order's own published rows say: a change into one of those (duration, instructions)
            # cannot be told apart from no change; an old order without a dosage leaves the change unverifiable.
            old = {f"{name} {d.dosage}".casefold() for d in self.rows.doses.get(c.old, []) if d.dosage
                   for name in (d.name, c.old_name) if name}
            if not old or answer.casefold() in old:
                continue
            when = max(c.time, first)  # the dosage is in the record from the pharmacy start on
            q = self.question(
                self.qid("order_changed_into", c.old), "order_changed_into",
                f"What was the {c.old_name} order of {_shown(c.old_time)} changed into?", answer, when,
                (f"{SOURCE}:poe:{c.old}", f"{SOURCE}:poe:{c.new}", *sorted({d.entry_id for d in at_first})))
            out.append(self.fixed(q))
        return out

    # admissions

    def admissions(self) -> list[_Candidate]:
        if not self.rows.admissions:
            return []
        qid = self.qid("count_admissions", "all")
        q = self.question(qid, "count", "How many hospital admissions does the patient have?",
                          str(len(self.rows.admissions)), None,
                          (f"{SOURCE}:admissions:{hadm}" for _, hadm in self.rows.admissions))
        return [self.candidate(qid, partial(_same_question, q), first=True)]


def _same_question(q: Question) -> Question:
    return q


def _by_time(rows: list[_Lab]) -> list[list[_Lab]]:
    groups: list[list[_Lab]] = []
    for r in rows:
        if groups and groups[-1][0].time == r.time:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _between(t0: datetime, t1: datetime) -> datetime:
    """The midpoint of two result times, floored to the minute (never before ``t0``)."""
    mid = t0 + (t1 - t0) / 2
    return max(t0, mid.replace(second=0, microsecond=0))


def _inside(t0: datetime, t1: datetime) -> datetime | None:
    """The midpoint of (t0, t1) floored to the minute when it falls strictly inside, else None."""
    mid = (t0 + (t1 - t0) / 2).replace(second=0, microsecond=0)
    return mid if t0 < mid < t1 else None


def _agreed(group: list[_Lab]) -> bool:
    """Results charted at one time that all carry the same number (a tie that cannot be broken is skipped)."""
    return all(r.valuenum for r in group) and len({float(r.valuenum) for r in group}) == 1


def _select(patient: str, cands: dict[str, list[_Candidate]], per_patient: int, seed: int) -> list[Question]:
    """Round robin over the templates (per-patient rotation), each template's candidates in hash order."""
    start = _hash("rotate", str(seed), patient) % len(QTYPES)
    order = [*QTYPES[start:], *QTYPES[:start]]
    queues = {qt: iter(sorted(cands.get(qt, []), key=lambda c: (c[0], c[1]))) for qt in order}
    out: list[Question] = []
    while len(out) < per_patient and queues:
        for qt in order:
            if qt not in queues or len(out) >= per_patient:
                continue
            q = next((q for _, _, make in queues[qt] if (q := make()) is not None), None)
            if q is None:
                del queues[qt]
            else:
                out.append(q)
    return out


def build_questions(root: Path, *, per_patient: int = PER_PATIENT, seed: int = 0,
                    subjects: Iterable[str] | None = None) -> list[Question]:
    """The question set of the MIMIC-IV folder ``root``: patients in ascending subject_id, up to ``per_patient``
    questions each. Same input, same output (everything is ordered explicitly; choices are hashes of the seed)."""
    root = Path(root)
    if not is_mimic_root(root):
        raise SourceError(f"{root} is not a MIMIC-IV folder (no hosp/admissions.csv.gz)")
    wanted = {str(s) for s in subjects} if subjects is not None else None
    patients, displays = _load(root, wanted)
    out: list[Question] = []
    for patient in sorted(patients, key=lambda s: (len(s), s)):
        out.extend(_select(patient, _Templates(patient, patients[patient], displays, seed).all(), per_patient, seed))
    return out


def balanced_sample(questions: Sequence[Question], n: int, *, seed: int = 0) -> list[Question]:
    """``n`` questions with the types in equal shares (as far as each type has questions), each type's in a seeded
    order; returned in the input's order."""
    by_type: dict[str, list[Question]] = defaultdict(list)
    for q in sorted(questions, key=lambda q: _hash(str(seed), "sample", q.question_id)):
        by_type[q.qtype].append(q)
    chosen: set[str] = set()
    queues = {t: iter(v) for t, v in sorted(by_type.items())}
    while len(chosen) < min(n, len(questions)) and queues:
        for t in list(queues):
            if len(chosen) >= n:
                break
            nxt = next(queues[t], None)
            if nxt is None:
                del queues[t]
            else:
                chosen.add(nxt.question_id)
    return [q for q in questions if q.question_id in chosen]


def write_jsonl(questions: Iterable[Question], path: str | Path) -> int:
    """One JSON object a line (evidence as a list); returns the number written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for q in questions:
            fh.write(json.dumps(asdict(q), ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[Question]:
    out: list[Question] = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                d = json.loads(line)
                d["evidence"] = tuple(d["evidence"])
                d["also"] = tuple(d.get("also", ()))
                out.append(Question(**d))
    return out
