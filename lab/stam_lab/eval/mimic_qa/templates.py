"""MIMIC-QA's templates (:class:`Templates`): one patient's candidate questions by qtype, each computed from the
rows alone (:mod:`stam_lab.eval.mimic_qa.rows`); the rules of each are in :mod:`stam_lab.eval.mimic_qa`'s docstring."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from stam.sources.mimic import SOURCE
from stam_lab.eval.mimic_orders import NEAR, drug_key
from stam_lab.eval.mimic_qa.question import Question, split_of, stable_hash
from stam_lab.eval.mimic_qa.rows import Lab, PatientRows, Stay, compact, iso, shown

_Make = Callable[[], "Question | None"]
Candidate = tuple[int, str, _Make]
"""A candidate question: (order key, question id, what builds the question, or None when it is ambiguous)."""


class Templates:
    """The candidate questions of one patient, by qtype."""

    def __init__(self, patient: str, rows: PatientRows, displays: dict[str, str], seed: int) -> None:
        self.patient = patient
        self.rows = rows
        self.displays = displays
        self.seed = str(seed)

    def qid(self, template: str, params: str) -> str:
        return f"mimic-qa:{template}:{self.patient}:{params}"

    def question(self, qid: str, qtype: str, text: str, answer: str, as_of: datetime | None,
                 evidence: Iterable[str], also: tuple[str, ...] = ()) -> Question:
        return Question(qid, self.patient, qtype, text, answer, iso(as_of) if as_of else None,
                        tuple(evidence), split_of(self.patient), also)

    def candidate(self, qid: str, make: _Make, first: bool = False) -> Candidate:
        return (-1 if first else stable_hash(self.seed, qid), qid, make)

    def fixed(self, q: Question) -> Candidate:
        return self.candidate(q.question_id, partial(_same_question, q))

    def all(self) -> dict[str, list[Candidate]]:
        out: dict[str, list[Candidate]] = defaultdict(list)
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

    def lab(self, itemid: str, rows: list[Lab]) -> Iterator[tuple[str, Candidate]]:
        """first/last/min/max/value_at_time need >= 3 numeric results in one unit; count needs two result times."""
        display = self.displays[itemid]
        groups = _by_time(rows)
        if len(groups) >= 2:
            pick = 1 + stable_hash(self.seed, "count", self.patient, itemid) % (min(len(groups), 12) - 1)
            upto = [r for g in groups[: pick + 1] for r in g]
            when = groups[pick][0].time
            qid = self.qid("count_lab", f"{itemid}@{compact(when)}")
            yield "count", self.fixed(self.question(
                qid, "count", f"How many {display} results had been charted for the patient as of {shown(when)}?",
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
            i = usable[stable_hash(self.seed, "at", self.patient, itemid) % len(usable)]
            when = _between(groups[i][0].time, groups[i + 1][0].time)
            qid = self.qid("value_at_time", f"{itemid}@{compact(when)}")
            yield "value_at_time", self.fixed(self.question(
                qid, "value_at_time", f"As of {shown(when)}, what was the patient's most recent {display} value?",
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

    def previous(self, itemid: str, display: str, groups: list[list[Lab]]) -> Question | None:
        """The result before the latest one: of the whole record, or as of a time between two later results
        (half the items, by hash, ask at a time; each falls back to the other form when its own has no pair of
        agreed groups)."""
        whole = len(groups) >= 2 and _agreed(groups[-2]) and _agreed(groups[-1])
        # as of a time between group j and j + 1 (so group j is the latest then and j - 1 the one before)
        usable = [j for j in range(1, len(groups) - 1) if _agreed(groups[j - 1]) and _agreed(groups[j])]
        timed = stable_hash(self.seed, "previous", self.patient, itemid) % 2 == 1
        if usable and (timed or not whole):
            j = usable[stable_hash(self.seed, "previous-at", self.patient, itemid) % len(usable)]
            when = _between(groups[j][0].time, groups[j + 1][0].time)
            return self.question(
                self.qid("previous_value", f"{itemid}@{compact(when)}"), "previous_value",
                f"As of {shown(when)}, what was the {display} value before the most recent one?",
                groups[j - 1][0].answer, when, (r.entry_id for r in (*groups[j - 1], *groups[j])))
        if whole:
            return self.question(
                self.qid("previous_value", itemid), "previous_value",
                f"What was the {display} value before the most recent one?", groups[-2][0].answer, None,
                (r.entry_id for r in (*groups[-2], *groups[-1])))
        return None

    # medications

    def current(self) -> list[Candidate]:
        """At each time an order's active interval ended (its own end or its admission's discharge)."""
        orders = self.rows.orders
        ends = sorted({e for name in orders.by_name for _, e, _ in orders.spans(name) if e is not None})
        return [self.candidate(self.qid("current_medication", compact(t)), partial(self.current_at, t)) for t in ends]

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
            self.qid("current_medication", compact(when)), "current_medication",
            f"As of {shown(when)}, which of the patient's active medication orders was started most recently?",
            names.pop(), when, sorted({v.entry_id for v in top}))

    def discontinued(self) -> list[Candidate]:
        times = sorted({s.time for s in self.rows.stops})
        return [self.candidate(self.qid("discontinued_medication", compact(t)), partial(self.discontinued_at, t))
                for t in times]

    def discontinued_at(self, when: datetime) -> Question | None:
        last = [s for s in self.rows.stops if s.time == when]
        names = {s.name for s in last}
        if len(names) != 1 or "" in names:
            return None
        return self.question(
            self.qid("discontinued_medication", compact(when)), "discontinued_medication",
            f"As of {shown(when)}, which medication order was most recently discontinued or changed?",
            names.pop(), when, sorted({e for s in last for e in s.evidence}))

    def _yes_no(self, qtype: str, times: Callable[[str, list[tuple[datetime, datetime | None, Any]]],
                                                   list[datetime]], text: str) -> list[Candidate]:
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
            named = next(r.name for o in orders.by_name[key] for r in o.runs if drug_key(r.name) == key)
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
                    self.qid(qtype, f"{slug}@{compact(when)}"), qtype, text.format(t=shown(when), drug=named),
                    answer, when, state.shown))
        for qs in answers.values():
            qs.sort(key=lambda q: (stable_hash(self.seed, q.question_id), q.question_id))
        first, second = answers["yes"], answers["no"]
        if stable_hash(self.seed, qtype, self.patient) % 2:
            first, second = second, first
        out: list[Candidate] = []
        for i in range(max(len(first), len(second))):
            for qs in (first, second):
                if i < len(qs):
                    out.append((len(out), qs[i].question_id, partial(_same_question, qs[i])))
        return out

    def drug_active(self) -> list[Candidate]:
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

    def receiving(self) -> list[Candidate]:
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

    def stay_at(self, when: datetime) -> Stay | None:
        """The admission current at ``when``: the latest that began at or before it."""
        return max((s for s in self.rows.stays if s.admit <= when), key=lambda s: (s.admit, s.hadm), default=None)

    def ended_stays(self) -> list[Stay]:
        """Admissions with a discharge, each the only one current from its admission to its discharge (no other
        admission begins in between)."""
        out = []
        for s in self.rows.stays:
            if s.discharge is not None and self.stay_at(s.discharge) == s and s.discharge > s.admit:
                out.append(s)
        return out

    def discharge_changes(self) -> list[Candidate]:
        out = []
        for s in self.ended_stays():
            qid = self.qid("discharge_changes", s.hadm)
            out.append(self.candidate(qid, partial(self.discharge_changes_of, s)))
        return out

    def discharge_changes_of(self, stay: Stay) -> Question | None:
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

    def encounter_labs(self) -> Iterator[tuple[str, Candidate]]:
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

    def first_day(self, s: Stay, itemid: str, display: str, rows: list[Lab]) -> Question | None:
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

    def hour_n(self, s: Stay, itemid: str, display: str, rows: list[Lab]) -> Question | None:
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
        j, hours = usable[stable_hash(self.seed, "hour", self.patient, s.hadm, itemid) % len(usable)]
        return self.question(
            self.qid("hour_n", f"{s.hadm}:{itemid}"), "hour_n",
            f"What was the most recent {display} value at hour {hours} of this stay?", groups[j][0].answer,
            s.discharge, (r.entry_id for r in groups[j]))

    def billed(self) -> list[Candidate]:
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

    def age(self) -> list[Candidate]:
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

    def changed(self) -> list[Candidate]:
        """Each POE medication order ended by one 'Change': the new order's drug and dosage as published on its
        first pharmacy version(s), asked once that version is published (see the module docstring)."""
        out: list[Candidate] = []
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
                f"What was the {c.old_name} order of {shown(c.old_time)} changed into?", answer, when,
                (f"{SOURCE}:poe:{c.old}", f"{SOURCE}:poe:{c.new}", *sorted({d.entry_id for d in at_first})))
            out.append(self.fixed(q))
        return out

    # admissions

    def admissions(self) -> list[Candidate]:
        if not self.rows.admissions:
            return []
        qid = self.qid("count_admissions", "all")
        q = self.question(qid, "count", "How many hospital admissions does the patient have?",
                          str(len(self.rows.admissions)), None,
                          (f"{SOURCE}:admissions:{hadm}" for _, hadm in self.rows.admissions))
        return [self.candidate(qid, partial(_same_question, q), first=True)]


def _difference(first: Lab, latest: Lab) -> tuple[str, ...]:
    """The change as a signed difference with its unit ("+0.4 mg/dL"), written as the read path's computed fact
    writes it; none when the units differ or a value is not a number."""
    try:
        delta = float(latest.valuenum) - float(first.valuenum)
    except ValueError:
        return ()
    if first.unit != latest.unit:
        return ()
    return (f"{delta:+.4g} {latest.unit}".strip(),)


def _same_question(q: Question) -> Question:
    return q


def _by_time(rows: list[Lab]) -> list[list[Lab]]:
    groups: list[list[Lab]] = []
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


def _agreed(group: list[Lab]) -> bool:
    """Results charted at one time that all carry the same number (a tie that cannot be broken is skipped)."""
    return all(r.valuenum for r in group) and len({float(r.valuenum) for r in group}) == 1
