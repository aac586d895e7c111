"""Medication orders of MIMIC-IV rows, and when each was active: the gold of MIMIC-QA's order questions.

Computed from the rows (``poe``, ``pharmacy``, ``prescriptions``, ``admissions``), never from STAM. An **order** is
one unit (the loader's source resource): a POE medication order with every pharmacy row of its ``poe_id`` (an IV
therapy order in POE is one too when it has pharmacy rows), a pharmacy order without a POE order, or a prescription
without a pharmacy row. What the rows say, with the loader's reading of them (``stam.sources.mimic``):

- a **pharmacy row** is active from its ``starttime`` (else ``entertime``) to its own end: the ``ordertime`` of the
  POE 'Change'/'D/C' that discontinued its order, unless its ``stoptime`` is more than an hour before that
  (``SAME_ACT``): then the stop is the order's own end and the POE order comes later. A row with a final status
  (``Discontinued``, ``Expired``, ``Inactive (Due to a change order)``...) and no stop time, or discontinued by POE
  before it started, was never active; a row without a final status is active until its stop time, when it has
  one; an order put on hold (``H``) is unclear;
- a **POE medication order without pharmacy rows** is active from its ``ordertime`` until the 'Change'/'D/C' that
  ended it; one with pharmacy rows is unclear between its ``ordertime`` and its first pharmacy start (ordered, not
  yet dispensed), and is then its pharmacy rows;
- **every inpatient order ends no later than its admission's** ``dischtime``.

Each order also has the versions the loader publishes (the POE row, a pharmacy ``:start``/``:stop`` or single
entry), so a question is asked only where the order's latest published version at T says the same as its rows'
intervals (:meth:`Orders.agree`), away from every boundary (a start, an end, a version, a discharge within a
minute of T) and outside every unclear interval of the drug.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from stam.sources.mimic import PHARMACY_STATUS, SAME_ACT, SOURCE

NEAR = timedelta(minutes=1)
_STRENGTH = re.compile(r"\s*\([^()]*\)\s*$")


def drug_key(name: str) -> str:
    """The drug a name names: any spelling (MIMIC writes tall-man letters: "LORazepam" / "Lorazepam"), with or
    without a strength in parentheses ("Oxycodone-Acetaminophen (5mg-325mg)" is Oxycodone-Acetaminophen)."""
    return " ".join(_STRENGTH.sub("", name).split()).casefold()
"""A question's time is at least this far from every boundary of the drug it asks about."""


def entry(table: str, key: str) -> str:
    return f"{SOURCE}:{table}:{key}"


@dataclass(frozen=True)
class Version:
    """One entry the loader publishes for an order: at ``time``, active or not, naming the drug ``name`` ("" for
    none); ``until``: an active version's own end (a pharmacy row with a stop time and no final status expires
    then); ``medication``: a MedicationRequest (not the ServiceRequest of an IV order in POE)."""

    time: datetime
    rank: tuple[int, int]
    active: bool
    name: str
    entry_id: str
    until: datetime | None = None
    medication: bool = True


@dataclass(frozen=True)
class Run:
    """An interval in which the rows say the order is active: ``[start, end)`` (``end`` None: no end of its own),
    naming ``name``, opened by the entry ``opened`` and ended by ``closed`` (None: its own end time, or never)."""

    start: datetime
    end: datetime | None
    name: str
    opened: str
    closed: str | None


@dataclass
class Order:
    """One order unit (``ref``: ``poe:<poe_id>``, ``pharmacy:<pharmacy_id>`` or ``prescription:<key>``)."""

    ref: str
    hadm: str | None
    versions: list[Version] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    unclear: list[tuple[datetime, datetime | None]] = field(default_factory=list)
    ended_at: list[tuple[datetime, str]] = field(default_factory=list)
    """POE 'Change'/'D/C' rows that discontinued it: (ordertime, entry id)."""

    def names(self) -> set[str]:
        return {drug_key(v.name) for v in self.versions if v.name} | {drug_key(r.name) for r in self.runs if r.name}


@dataclass(frozen=True)
class State:
    """An order at a time T: active or not by its rows, and the entries that show it."""

    active: bool
    shown: tuple[str, ...]
    """Active: the entry of its version in effect. Ended: that entry and what ended it (the POE row, the pharmacy
    stop, the discharge), when it ended last."""
    ended: datetime | None = None


class Orders:
    """One patient's medication orders (see the module doc), with the admissions that bound them."""

    def __init__(self, orders: Iterable[Order], discharge: dict[str, tuple[datetime, str]]) -> None:
        self.orders = sorted(orders, key=lambda o: o.ref)
        self.discharge = discharge
        """hadm_id -> (dischtime, the discharge entry)."""
        self._bounds: dict[str, list[datetime]] = {}
        self.by_name: dict[str, list[Order]] = defaultdict(list)
        for o in self.orders:
            for n in o.names():
                self.by_name[n].append(o)

    # --- one order ------------------------------------------------------------------------------------------

    def _cap(self, o: Order) -> tuple[datetime, str] | None:
        return self.discharge.get(o.hadm or "")

    def run_end(self, o: Order, r: Run) -> tuple[datetime | None, str | None]:
        """When a run ends (its own end or its admission's discharge, the earlier) and the entry that ends it."""
        cap = self._cap(o)
        if cap is not None and (r.end is None or cap[0] < r.end):
            return cap
        return r.end, r.closed

    def rows_active(self, o: Order, t: datetime, name: str | None = None) -> list[Run]:
        out = []
        for r in o.runs:
            end, _ = self.run_end(o, r)
            if r.start <= t and (end is None or t < end) and (name is None or drug_key(r.name) == name):
                out.append(r)
        return out

    def published(self, o: Order, t: datetime, name: str | None = None) -> Version | None:
        """The version in effect at ``t`` when it is active (by the published entries alone), else None."""
        seen = [v for v in o.versions if v.time <= t]
        if not seen:
            return None
        last = seen[-1]
        cap = self._cap(o)
        if (not last.active or (name is not None and drug_key(last.name) != name)
                or any(last.time <= e <= t for e, _ in o.ended_at) or (cap is not None and cap[0] <= t)
                or (last.until is not None and last.until <= t)):
            return None
        return last

    def boundaries(self, o: Order) -> list[datetime]:
        """Every time the order's state changes: its versions, starts, ends, discontinuations, its discharge."""
        got = self._bounds.get(o.ref)
        if got is None:
            got = self._bounds[o.ref] = self._boundaries(o)
        return got

    def _boundaries(self, o: Order) -> list[datetime]:
        out = [v.time for v in o.versions] + [e for e, _ in o.ended_at] + [v.until for v in o.versions if v.until]
        for r in o.runs:
            out.append(r.start)
            end, _ = self.run_end(o, r)
            if end is not None:
                out.append(end)
        cap = self._cap(o)
        if cap is not None:
            out.append(cap[0])
        return out

    # --- a drug ---------------------------------------------------------------------------------------------

    def clear(self, name: str, t: datetime, orders: Iterable[Order] | None = None) -> bool:
        """Nothing about the drug's orders makes ``t`` unclear: no boundary within :data:`NEAR`, no unclear
        interval, and each order's rows agree with its published versions."""
        for o in self.by_name.get(name, []) if orders is None else orders:
            if any(abs(b - t) < NEAR for b in self.boundaries(o)):
                return False
            if any(a <= t and (b is None or t < b) for a, b in o.unclear):
                return False
            if bool(self.rows_active(o, t, name)) != (self.published(o, t, name) is not None):
                return False
        return True

    def state(self, name: str, t: datetime) -> State | None:
        """Whether an order of the drug is active at ``t`` and its evidence; None when unclear (see :meth:`clear`)
        or when no order of the drug had started by ``t``."""
        orders = self.by_name.get(name, [])
        if not self.clear(name, t, orders):
            return None
        active = [(o, v) for o in orders if (v := self.published(o, t, name)) is not None]
        if active:
            return State(True, tuple(sorted({v.entry_id for _, v in active})))
        ended: list[tuple[datetime, str, tuple[str, ...]]] = []
        for o in orders:
            for r in o.runs:
                if drug_key(r.name) != name:
                    continue
                end, closed = self.run_end(o, r)
                if end is not None and end < t and r.start < end:
                    ended.append((end, o.ref, (r.opened, *([closed] if closed else []))))
        if not ended:
            return None
        last = max(e for e, _, _ in ended)
        # Which order ended last must read the same from the published versions (a one-dose order dispensed and
        # stopped at the same minute has no interval in the rows, but its versions end later than the others).
        published = {o.ref: e for o in orders if (e := self.published_end(o, t)) is not None}
        latest = max(published.values(), default=None)
        if latest != last or {ref for ref, e in published.items() if e == latest} != \
                {ref for e, ref, _ in ended if e == last}:
            return None
        return State(False, tuple(sorted({x for e, _, shown in ended if e == last for x in shown})), last)

    def published_end(self, o: Order, t: datetime) -> datetime | None:
        """When the order's published versions stopped holding it active, by ``t`` (None: never active by then,
        or still active)."""
        seen = [v for v in o.versions if v.time <= t]
        cap = self._cap(o)
        end: datetime | None = None
        for k, v in enumerate(seen):
            if not v.active:
                continue
            stops = [x.time for x in seen[k + 1:]] + [e for e, _ in o.ended_at if e >= v.time]
            stops += [x for x in (v.until, cap[0] if cap else None) if x is not None]
            due = [x for x in stops if x <= t]
            if not due:
                return None  # still active at t
            end = max(end, min(due)) if end is not None else min(due)
        return end

    def spans(self, name: str) -> list[tuple[datetime, datetime | None, Order]]:
        """The drug's active intervals by the rows (capped by the discharge), with their orders."""
        out = []
        for o in self.by_name.get(name, []):
            for r in o.runs:
                if drug_key(r.name) == name:
                    end, _ = self.run_end(o, r)
                    if end is None or r.start < end:
                        out.append((r.start, end, o))
        return sorted(out, key=lambda x: (x[0], x[2].ref))

    def starts(self, name: str) -> list[datetime]:
        """When the drug's orders begin, active or unclear (an order placed, not yet dispensed)."""
        out = {s for s, _, _ in self.spans(name)}
        out |= {a for o in self.by_name.get(name, []) for a, _ in o.unclear}
        return sorted(out)

    def active_at(self, t: datetime) -> list[tuple[Order, Version]]:
        """Every order active at ``t`` by its published version (see :meth:`published`)."""
        return [(o, v) for o in self.orders if (v := self.published(o, t)) is not None]


# --- from the rows ----------------------------------------------------------------------------------------------


@dataclass
class RowsIn:
    """The columns of the tables the orders are read from (file order), as :func:`build` takes them."""

    poe: dict[str, tuple[str, ...]]
    """poe_id -> (poe_id, subject_id, ordertime, order_type, transaction_type, discontinue_of_poe_id,
    discontinued_by_poe_id, hadm_id)."""
    pharmacy: list[tuple[str, ...]]
    """(subject_id, pharmacy_id, poe_id, starttime, entertime, stoptime, status, medication, route, frequency,
    hadm_id) in file order."""
    pharmacy_name: dict[str, str]
    """pharmacy_id -> the drug the loader names its order by."""
    poe_name: dict[str, str]
    """poe_id -> the drug the loader names the POE order by ("" for none)."""
    orphans: list[tuple[str, str, str, str, str, str]]
    """Prescriptions without a pharmacy row: (subject_id, key, drug, starttime, stoptime, hadm_id)."""


def _t(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if value else None
    except ValueError:
        return None


def ended_by(poe: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Which POE row discontinued which order (the loader's rule: ``discontinued_by_poe_id``, overridden by the
    ``discontinue_of_poe_id`` of each Change / D/C row in file order)."""
    out: dict[str, str] = {}
    for pid, *_, by, _hadm in poe.values():
        if by and by in poe:
            out.setdefault(pid, by)
    for pid, _, _, _, tx, of, _, _ in poe.values():
        if of and tx in ("Change", "D/C"):
            out[of] = pid
    return out


def build(rows: RowsIn, discharge: dict[str, dict[str, tuple[datetime, str]]]) -> dict[str, Orders]:
    """Each patient's orders (``discharge``: per patient, hadm_id -> (dischtime, discharge entry))."""
    ender = ended_by(rows.poe)
    units = _Units()
    first_start = _from_pharmacy(rows, ender, units)
    _from_poe(rows, ender, units, first_start)
    for subject, key, drug, starttime, stoptime, hadm in rows.orphans:
        start, stop = _t(starttime), _t(stoptime)
        if start is None:
            continue
        ref = f"prescription:{key}"
        o = units.unit(subject, ref, hadm)
        until = stop if stop is not None and stop >= start else None
        e = entry("prescriptions", key)
        o.versions.append(Version(start, (2, len(o.versions)), True, drug.strip(), e, until))
        o.runs.append(Run(start, until, drug.strip(), e, None))
    out: dict[str, Orders] = {}
    for subject, mine in units.by_subject.items():
        for o in mine.values():
            o.versions.sort(key=lambda v: (v.time, v.rank))
            o.ended_at.sort()
        out[subject] = Orders(mine.values(), discharge.get(subject, {}))
    return out


class _Units:
    """The orders being built, per patient and order reference (``poe:<id>``, ``pharmacy:<id>``...)."""

    def __init__(self) -> None:
        self.by_subject: dict[str, dict[str, Order]] = defaultdict(dict)

    def unit(self, subject: str, ref: str, hadm: str | None) -> Order:
        got = self.by_subject[subject].get(ref)
        if got is None:
            got = self.by_subject[subject][ref] = Order(ref, hadm or None)
        return got


def _from_pharmacy(rows: RowsIn, ender: dict[str, str], units: _Units) -> dict[str, datetime]:
    """The versions and runs the pharmacy rows publish; returns each POE order's first pharmacy start."""
    poe = rows.poe
    first_start: dict[str, datetime] = {}
    for n, (subject, pid, poe_id, starttime, entertime, stoptime, status, _med, _r, _f, hadm) in enumerate(
            rows.pharmacy):
        start, stop = _t(starttime or entertime), _t(stoptime) if stoptime else None
        if start is None or (stoptime and stop is None):
            continue  # a row the loader cannot read
        name = rows.pharmacy_name.get(pid, "")
        o = units.unit(subject, f"poe:{poe_id}" if poe_id else f"pharmacy:{pid}", hadm)
        if poe_id:
            first_start[poe_id] = min(start, first_start.get(poe_id, start))
        final = PHARMACY_STATUS.get(status)
        by = ender.get(poe_id) if poe_id else None
        by_time = _t(poe[by][2]) if by else None
        single, begun = entry("pharmacy", pid), entry("pharmacy", f"{pid}:start")
        rank = (1, 2 * n)
        if by is not None and by_time is not None and (stop is None or stop > by_time - SAME_ACT):
            if by_time <= start:  # discontinued before it started: one stopped entry, never active
                o.versions.append(Version(start, rank, False, name, single))
                continue
            o.versions.append(Version(start, rank, True, name, begun))
            o.runs.append(Run(start, by_time, name, begun, entry("poe", by)))
            continue
        if stop is None or final is None:
            if final == "on-hold" or (final is None and status):
                o.versions.append(Version(start, rank, final is None, name, single))
                o.unclear.append((start, None))  # on hold, or a status the loader does not know
                continue
            if final is not None:  # a final status and no stop time: one entry that never was active
                o.versions.append(Version(start, rank, False, name, single))
                continue
            until = stop if stop is not None and stop > start else None
            o.versions.append(Version(start, rank, True, name, single, until))
            end = until if until is not None else by_time
            o.runs.append(Run(start, end, name, single, None if until is not None or by is None else
                              entry("poe", by)))
            continue
        stop = max(stop, start)
        o.versions.append(Version(start, rank, True, name, begun))
        o.versions.append(Version(stop, (1, 2 * n + 1), False, name, entry("pharmacy", f"{pid}:stop")))
        if final == "on-hold":
            o.unclear.append((start, None))
        elif stop > start:
            o.runs.append(Run(start, stop, name, begun, entry("pharmacy", f"{pid}:stop")))
    return first_start


def _from_poe(rows: RowsIn, ender: dict[str, str], units: _Units, first_start: dict[str, datetime]) -> None:
    """The versions, runs and endings the POE rows publish (medication orders, and orders with pharmacy rows)."""
    poe = rows.poe
    with_pharmacy = {r[2] for r in rows.pharmacy if r[2]}
    for n, (pid, subject, ordertime, order_type, tx, of, _by, hadm) in enumerate(poe.values()):
        when = _t(ordertime)
        if when is None:
            continue
        if tx in ("Change", "D/C") and of:
            target = units.by_subject[subject].get(f"poe:{of}")
            if target is None and (poe.get(of, ("",) * 4)[3] == "Medications" or of in with_pharmacy):
                target = units.unit(subject, f"poe:{of}", poe[of][7] if of in poe else hadm)
            if target is not None:
                target.ended_at.append((when, entry("poe", pid)))
        if tx not in ("New", "Change", "H") or not (order_type == "Medications" or pid in with_pharmacy):
            continue
        o = units.unit(subject, f"poe:{pid}", hadm)
        name = rows.poe_name.get(pid, "") if order_type == "Medications" else ""
        o.versions.append(Version(when, (0, n), tx != "H", name, entry("poe", pid),
                                  medication=order_type == "Medications"))
        by = ender.get(pid)
        by_time = _t(poe[by][2]) if by else None
        if tx == "H":
            o.unclear.append((when, None))
        elif pid in with_pharmacy:
            if pid in first_start and when < first_start[pid]:
                o.unclear.append((when, first_start[pid]))  # ordered, not yet dispensed
        elif order_type == "Medications" and (by_time is None or by_time > when):
            o.runs.append(Run(when, by_time, name, entry("poe", pid), entry("poe", by) if by else None))
