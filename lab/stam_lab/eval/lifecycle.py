"""``stam eval lifecycle``: does ACTIVE mean true now? ACTIVE medication and order memories against what the raw
tables say is active at a clinical time.

Gold comes from the source rows only, never from STAM's output. An order is one unit, named by the source resource
STAM gives it (``MedicationRequest/poe-<poe_id>``: the POE order and its pharmacy versions are one order):

- **MIMIC-IV** (``mimic_gold``). A POE order (New, Change or Hold; a D/C row is the end of another order) is active
  from its ``ordertime`` (or its pharmacy order's ``starttime`` when that is earlier: pharmacy back-dates a start to
  the first dose) until the first of: its admission's ``dischtime``, the ``ordertime`` of the Change or D/C
  that discontinued it (``discontinue_of_poe_id`` / ``discontinued_by_poe_id``), and the ``stoptime`` of its pharmacy
  order. A pharmacy order without a POE order, and a prescription without a pharmacy order, are active from their
  start until the first of their ``stoptime`` and the discharge. An ICU input with an end time is active inside its
  interval (and its admission). Administrations (``emar``, ICU inputs without an interval) are events: never active.
- **Synthea FHIR R4** (``synthea_gold``). An Encounter is active inside its ``period``. A MedicationRequest with status
  ``active`` is active from ``authoredOn`` on; one with status ``stopped`` or ``completed`` has no stop time in
  Synthea, so it is judged only at the patient's latest time (not active), never at a sampled time in between.

At each patient's latest clinical time and at ``samples`` sampled clinical times (half inside the patient's
admissions or encounters, half anywhere in the record, seeded), the ACTIVE medication and order memories of STAM's
state as of that time (the read path's timeline over the final memory records, the same answers as a replay of
the transition log) are compared with the gold: precision (ACTIVE units the gold holds active), recall (gold
units that are ACTIVE), and the ACTIVE memories that belong to an admission already discharged at that time.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from schemas import Category, TransitionEvent
from stam.read.timeline import Timeline
from stam.rebuild import replay
from stam.sources.fhir_r4 import parse_time
from stam.sources.mimic import iter_table, parse_mimic_time

Interval = tuple[datetime, datetime | None]
UNITS = frozenset({Category.MEDICATION.value, Category.ORDER.value, Category.ENCOUNTER.value})
"""Memory categories compared: orders and medications, and encounters where the gold has them (Synthea's)."""


@dataclass
class Gold:
    """Per patient: each unit's active intervals (empty: an event, never active), the units judged only at the
    latest time, each admission's interval, and the times to sample inside."""

    active: dict[str, dict[str, list[Interval]]] = field(default_factory=lambda: defaultdict(dict))
    latest_only: dict[str, dict[str, bool]] = field(default_factory=lambda: defaultdict(dict))
    """Units whose stop time the source does not give: at the latest time, whether they are active."""
    stays: dict[str, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    ends_with: dict[str, dict[str, datetime]] = field(default_factory=lambda: defaultdict(dict))
    """Per patient, each unit's admission's discharge, from the rows (not from STAM's memories)."""

    def at(self, pid: str, t: datetime) -> set[str]:
        return {u for u, spans in self.active.get(pid, {}).items()
                if any(s <= t and (e is None or t < e) for s, e in spans)}

    def known(self, pid: str) -> set[str]:
        return set(self.active.get(pid, {})) | set(self.latest_only.get(pid, {}))


def _min_end(*ends: datetime | None) -> datetime | None:
    found = [e for e in ends if e is not None]
    return min(found) if found else None


def mimic_gold(root: Path, subjects: Iterable[str] | None = None) -> Gold:
    """What the MIMIC-IV rows say was active when (see the module's notes)."""
    wanted = {str(s) for s in subjects} if subjects is not None else None
    gold = Gold()
    discharge: dict[str, datetime | None] = {}
    for r in iter_table(root, "admissions", wanted):
        start, end = parse_mimic_time(r["admittime"]), parse_mimic_time(r.get("dischtime"))
        discharge[r["hadm_id"]] = end
        if start is not None:
            gold.stays[r["subject_id"]].append((start, end))
    poe = {r["poe_id"]: r for r in iter_table(root, "poe", wanted)}
    ended_at: dict[str, datetime] = {}
    for r in poe.values():
        when = parse_mimic_time(r["ordertime"])
        by = r.get("discontinued_by_poe_id")
        if by and by in poe:
            by_time = parse_mimic_time(poe[by]["ordertime"])
            if by_time is not None:
                ended_at[r["poe_id"]] = min(by_time, ended_at.get(r["poe_id"], by_time))
        target = r.get("discontinue_of_poe_id")
        if target and r["transaction_type"] in ("Change", "D/C") and when is not None:
            ended_at[target] = min(when, ended_at.get(target, when))
    pharmacy_stop: dict[str, datetime] = {}
    pharmacy_start: dict[str, datetime] = {}
    pharmacy_ids: set[str] = set()
    for r in iter_table(root, "pharmacy", wanted):
        pharmacy_ids.add(r["pharmacy_id"])
        start = parse_mimic_time(r.get("starttime") or r.get("entertime"))
        stop = parse_mimic_time(r.get("stoptime"))
        if r.get("poe_id"):
            if stop is not None:
                pharmacy_stop[r["poe_id"]] = max(stop, pharmacy_stop.get(r["poe_id"], stop))
            if start is not None:
                pharmacy_start[r["poe_id"]] = min(start, pharmacy_start.get(r["poe_id"], start))
            continue
        if start is not None:
            unit = f"MedicationRequest/pharmacy-{r['pharmacy_id']}"
            gold.active[r["subject_id"]][unit] = [(start, _min_end(stop, discharge.get(r.get("hadm_id") or "")))]
            _stay(gold, r, unit, discharge)
    for r in poe.values():
        if r["transaction_type"] == "D/C":
            continue
        start = parse_mimic_time(r["ordertime"])
        if start is None:
            continue
        start = min(start, pharmacy_start.get(r["poe_id"], start))
        rtype = "MedicationRequest" if r["order_type"] == "Medications" else "ServiceRequest"
        end = _min_end(discharge.get(r.get("hadm_id") or ""), ended_at.get(r["poe_id"]), pharmacy_stop.get(r["poe_id"]))
        unit = f"{rtype}/poe-{r['poe_id']}"
        gold.active[r["subject_id"]][unit] = [(start, end)] if end is None or end > start else []
        _stay(gold, r, unit, discharge)
    for r in iter_table(root, "prescriptions", wanted):
        if r.get("pharmacy_id") in pharmacy_ids:
            continue
        start, stop = parse_mimic_time(r.get("starttime")), parse_mimic_time(r.get("stoptime"))
        if start is None:
            continue
        key = f"{r.get('pharmacy_id') or 'none'}:{r['drug'].strip().lower()}"
        unit = f"MedicationRequest/prescription-{key}"
        gold.active[r["subject_id"]][unit] = [
            (start, _min_end(stop if stop and stop >= start else None, discharge.get(r.get("hadm_id") or "")))]
        _stay(gold, r, unit, discharge)
    for r in iter_table(root, "emar", wanted):
        unit = f"MedicationAdministration/{r['emar_id']}"
        gold.active[r["subject_id"]][unit] = []
        _stay(gold, r, unit, discharge)
    for table in ("inputevents", "ingredientevents"):
        for r in iter_table(root, table, wanted):
            start, end = parse_mimic_time(r["starttime"]), parse_mimic_time(r.get("endtime"))
            key = f"{r['stay_id']}:{r.get('orderid')}:{r['itemid']}:{r['starttime']}"
            spans: list[Interval] = []
            if start is not None and end is not None and end > start:
                spans = [(start, _min_end(end, discharge.get(r.get("hadm_id") or "")))]
            unit = f"MedicationAdministration/{table}-{key}"
            gold.active[r["subject_id"]][unit] = spans
            _stay(gold, r, unit, discharge)
    return gold


def _stay(gold: Gold, row: dict[str, str], unit: str, discharge: dict[str, datetime | None]) -> None:
    end = discharge.get(row.get("hadm_id") or "")
    if end is not None:
        gold.ends_with[row["subject_id"]][unit] = end


def synthea_gold(bundles: Iterable[dict[str, Any]]) -> Gold:
    """What the Synthea bundles say was active when (see the module's notes)."""
    gold = Gold()
    for raw in bundles:
        resources = [e.get("resource") or {} for e in raw.get("entry", [])]
        pid = next((r.get("id") for r in resources if r.get("resourceType") == "Patient"), None)
        if pid is None:
            continue
        for r in resources:
            ref = f"{r.get('resourceType')}/{r.get('id')}"
            if r.get("resourceType") == "Encounter":
                period = r.get("period") or {}
                start, end = parse_time(period.get("start")), parse_time(period.get("end"))
                if start is not None:
                    gold.active[pid][ref] = [(start, end)] if end is None or end > start else []
                    gold.stays[pid].append((start, end))
            elif r.get("resourceType") == "MedicationRequest":
                start = parse_time(r.get("authoredOn"))
                if r.get("status") == "active" and start is not None:
                    gold.active[pid][ref] = [(start, None)]
                else:
                    gold.latest_only[pid][ref] = r.get("status") == "active"
    return gold


# --- STAM's side ---------------------------------------------------------------------------------------------

@dataclass
class PatientLog:
    """One patient's transitions, folded into the read path's timeline once."""

    pid: str
    timeline: Timeline

    @classmethod
    def of(cls, pid: str, events: Sequence[TransitionEvent]) -> PatientLog:
        state = replay(pid, events)
        return cls(pid, Timeline.from_stored(pid, state.version, state.memories.values()))

    def active_units(self, t: datetime) -> tuple[set[str], list[int]]:
        """Source resources of the ACTIVE medication and order memories at ``t``, and those memories' indexes."""
        view = self.timeline.view(at=t)
        rows = [i for i in range(len(self.timeline)) if view.present[i] and not view.history[i]
                and self.timeline.category[i] in UNITS]
        return {self.timeline.source[i] or self.timeline.ids[i] for i in rows}, rows

    def latest(self) -> datetime | None:
        return self.timeline.latest_time()


def sample_times(stays: Sequence[Interval], first: datetime, last: datetime, n: int, rng: random.Random) -> list[
        datetime]:
    """``n`` clinical times: half inside the stays (uniform within a stay chosen at random), half uniform over the
    record's span, in time order, to the second."""
    def uniform(a: datetime, b: datetime) -> datetime:
        return a + timedelta(seconds=int(rng.random() * max((b - a).total_seconds(), 0)))

    inside = [s for s in stays if s[1] is not None and s[1] > s[0]]
    out = [uniform(*rng.choice(inside)) for _ in range(n // 2)] if inside else []  # type: ignore[arg-type]
    out += [uniform(first, last) for _ in range(n - len(out))]
    return sorted(out)


def _ratio(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


@dataclass
class Tally:
    checks: int = 0
    counts: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    """Resource type -> [ACTIVE units, gold units, both]."""
    from_ended_stay: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, stam: set[str], gold: set[str]) -> None:
        self.checks += 1
        for units, k in ((stam, 0), (gold, 1), (stam & gold, 2)):
            for u in units:
                self.counts[u.split("/", 1)[0]][k] += 1

    def report(self) -> dict[str, Any]:
        s, g, b = (sum(c[k] for c in self.counts.values()) for k in range(3))
        return {"times": self.checks, "active_units": s, "gold_units": g, "precision": _ratio(b, s),
                "recall": _ratio(b, g), "active_from_ended_admission": self.from_ended_stay,
                "by_resource": {r: {"active_units": c[0], "gold_units": c[1], "precision": _ratio(c[2], c[0]),
                                    "recall": _ratio(c[2], c[1])} for r, c in sorted(self.counts.items())},
                "examples": self.examples[:8]}


def evaluate(gold: Gold, events: dict[str, list[TransitionEvent]], *, samples: int = 20, seed: int = 0) -> dict[
        str, Any]:
    """Precision and recall of ACTIVE orders and medications at each patient's latest time and at ``samples``
    sampled times (see the module's notes), and the ACTIVE memories whose admission (by the rows) was discharged by
    then."""
    rng = random.Random(seed)
    latest, sampled = Tally(), Tally()
    for pid in sorted(events):
        ended = gold.ends_with.get(pid, {})
        log = PatientLog.of(pid, events[pid])
        received = set(log.timeline.source)
        known = gold.known(pid) & received  # units the loader published (a table left out, a row it could not read)
        last = log.latest()
        starts = log.timeline.t_start[log.timeline.t_start > float("-inf")]
        if last is None or not starts.size:
            continue
        first = datetime.fromtimestamp(float(starts.min()), last.tzinfo)
        for t, tally in [(last, latest), *((s, sampled) for s in sample_times(gold.stays.get(pid, []), first, last,
                                                                               samples, rng))]:
            stam, rows = log.active_units(t)
            stam &= known
            truth = gold.at(pid, t) & received
            if tally is latest:
                truth |= {u for u, on in gold.latest_only.get(pid, {}).items() if on}
            else:
                stam -= set(gold.latest_only.get(pid, {}))  # no stop time in the source: not judged in between
            tally.add(stam, truth)
            stale = [i for i in rows if (u := log.timeline.source[i] or "") in ended and ended[u] <= t]
            tally.from_ended_stay += len(stale)
            for u in sorted((stam - truth) | (truth - stam))[: 1 if len(tally.examples) < 8 else 0]:
                tally.examples.append({"patient": pid, "at": t.isoformat(), "unit": u,
                                       "stam": "active" if u in stam else "not active",
                                       "gold": "active" if u in truth else "not active"})
    return {"patients": len(events), "samples_per_patient": samples, "seed": seed, "latest": latest.report(),
            "sampled": sampled.report()}


