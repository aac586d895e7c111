"""Answers that come from the encounter and the record rather than one concept's thread.

Each is computed from the state at the question's time, with the memories it came from (``Fact.memory_ids``) and
those memories served (a reader can check the statement against the packet):

- **demographics** (``age``, ``sex``): the patient's own record (``Patient`` facts). The age at the question's
  time T is the age the record gives at its anchor year plus the years since (MIMIC: ``anchor_age`` at
  ``anchor_year``), said to be an estimate: the birthday is not recorded;
- **admission facts** (``admission``): when the current stay began and ended and where the patient went, from the
  encounter's own records; a stay with no end recorded is said so;
- **what changed at discharge** (``discharge``): the facts the discharge ended (archived with reason
  ``encounter-ended`` at the discharge's time): medication orders by drug, and how many other orders;
- **lists, counts and the most frequent of a category over an encounter** ("which diagnoses were billed for this
  admission", "how many procedures during the stay", "which medication was given most often during this stay"):
  the category's memories that name the stay (``encounter_id``), within the question's window.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime

import numpy as np

from schemas import Reason
from stam.read.encounters import Encounters, Stay
from stam.read.intent import Intent
from stam.read.select import select_threads
from stam.read.threads import Fact, Pick, Selection, ThreadIndex
from stam.read.timeline import Timeline, View, from_epoch

SEX_CODES = frozenset({"76689-9", "46098-0"})
"""LOINC: sex assigned at birth, sex."""
AGE_CODES = frozenset({"30525-0"})
"""LOINC: age."""
ANCHOR_YEAR = "anchor-year"
MAX_LISTED = 200
"""Most memories one list serves (the statement counts them all)."""
_CATEGORY_LABEL = {"condition": "diagnoses recorded", "procedure": "procedures recorded",
                   "medication": "medication orders", "administration": "medication administrations"}


def _show(t: float) -> str:
    d = from_epoch(t)
    return d.strftime("%Y-%m-%d %H:%M") if d else "an unknown time"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _code(tl: Timeline, i: int) -> str:
    c = tl.concept[i]
    return c.rsplit("|", 1)[-1] if c else ""


def picks_of(tl: Timeline, members: Iterable[int], role: str) -> list[Pick]:
    """Members grouped by thread (threads in order of their newest member), each thread's newest first."""
    by_thread: dict[int, list[int]] = {}
    for i in members:
        by_thread.setdefault(int(tl.thread[i]), []).append(int(i))
    picks = []
    for th, ms in by_thread.items():
        ordered = sorted(ms, key=lambda i: (-tl.t_start[i], tl.ids[i]))
        picks.append(Pick(thread=th, score=0.0, members=ordered, roles=dict.fromkeys(ordered, role)))
    picks.sort(key=lambda p: (-max(tl.t_start[i] for i in p.members), p.thread))
    return picks


def select(tl: Timeline, idx: ThreadIndex, view: View, scores: np.ndarray, question: str, intent: Intent, *,
           serve_history: bool, k_threads: int, k_history: int, joint: bool = True,
           stay: Stay | None = None) -> Selection:
    """What a question is answered from: for a question about the encounter or the record (age, admission,
    discharge, a category over the stay), :func:`record_selection`; else the threads it names
    (:func:`stam.read.select.select_threads`). ``stay``: the encounter current at the question's time."""
    record = record_selection(tl, idx, view, intent, stay, idx.encounters)
    if record is not None:
        return record
    return select_threads(tl, idx, view, scores, question, intent, serve_history=serve_history,
                          k_threads=k_threads, k_history=k_history, joint=joint, stay=stay)


def record_selection(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, stay: Stay | None,
                     encounters: Encounters) -> Selection | None:
    """The selection for a question about the encounter or the record; None when the question is not one."""
    kind = intent.kind
    if kind in ("age", "sex"):
        return _demographics(tl, view, kind)
    if kind == "admission":
        return _admission(tl, view, stay)
    if kind == "discharge":
        return _discharge(tl, idx, view, intent, stay)
    if intent.category is not None and intent.scope is not None and kind in ("current", "history", "count",
                                                                             "most_frequent"):
        return _category(tl, idx, view, intent, stay)
    return None


# --- demographics -----------------------------------------------------------------------------------------------


def _demographics(tl: Timeline, view: View, kind: str) -> Selection:
    mine = [i for i in range(len(tl)) if tl.resource[i] == "Patient" and view.present[i] and not view.history[i]]
    sex = [i for i in mine if _code(tl, i) in SEX_CODES and tl.value_text[i]]
    age = [i for i in mine if _code(tl, i) in AGE_CODES and not math.isnan(tl.value[i])]
    anchor = [i for i in mine if _code(tl, i) == ANCHOR_YEAR and not math.isnan(tl.value[i])]
    picks = picks_of(tl, sex + age + anchor, "current")
    facts: list[Fact] = []
    if kind == "sex" and sex:
        facts.append(Fact("sex", f"the patient's sex, as the record gives it: {tl.value_text[sex[0]]}",
                          (tl.ids[sex[0]],)))
    elif kind == "age" and age:
        when = view.at if math.isfinite(view.at) else _latest(tl)
        shown = from_epoch(when)
        a = float(tl.value[age[0]])
        if anchor and shown is not None:
            year = float(tl.value[anchor[0]])
            years = a + shown.year - year
            facts.append(Fact("age", f"the patient's age as of {shown.strftime('%Y-%m-%d')}: {years:g} years (an "
                              f"estimate: the record gives {a:g} years in {year:g}, its anchor year, and no birthday, "
                              f"so it may be one year less)", (tl.ids[age[0]], tl.ids[anchor[0]])))
        else:
            start = tl.t_start[age[0]]
            at = f" (recorded {_show(start)})" if math.isfinite(start) else ""
            facts.append(Fact("age", f"the patient's age as the record gives it{at}: {a:g} {tl.unit[age[0]] or ''}"
                              .strip(), (tl.ids[age[0]],)))
    return Selection(picks, facts, [])


def _latest(tl: Timeline) -> float:
    t = tl.latest_time()
    return t.timestamp() if t is not None else math.inf


# --- the encounter ----------------------------------------------------------------------------------------------


def _no_stay(view: View) -> Selection:
    upto = f" as of {_show(view.at)}" if math.isfinite(view.at) else ""
    return Selection([], [Fact("admission", f"no admission recorded{upto}", ())], [])


def _admission(tl: Timeline, view: View, stay: Stay | None) -> Selection:
    if stay is None:
        return _no_stay(view)
    first = stay.records[0]
    text = f"{stay.label()}: admitted {_show(stay.start)} ({tl.display[first]})"
    if stay.ended:
        where = stay.discharged_to()
        text += f"; discharged {_show(stay.end)}" + (f" to {where}" if where else "")
        text += f"; length of stay {(stay.end - stay.start) / 86400:.1f} days"
    else:
        text += "; no discharge recorded" + (f" as of {_show(view.at)}" if math.isfinite(view.at) else "")
    return Selection(picks_of(tl, stay.records, "encounter"), [Fact("admission", text,
                                                                     tuple(tl.ids[i] for i in stay.records))], [])


def _discharge(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, stay: Stay | None) -> Selection:
    if stay is None:
        return _no_stay(view)
    if not stay.ended or stay.ended_by is None:
        upto = f" as of {_show(view.at)}" if math.isfinite(view.at) else ""
        return Selection(picks_of(tl, stay.records, "encounter"),
                         [Fact("discharge", f"{stay.label()}: no discharge recorded{upto}",
                               tuple(tl.ids[i] for i in stay.records))], [])
    own = set(stay.records)
    ended = [i for i in np.flatnonzero(view.present & view.history).tolist()
             if tl.reason[i] == Reason.ENCOUNTER_ENDED and tl.encounter[i] == stay.encounter_id and i not in own
             and abs(float(tl.t_ended[i]) - stay.end) < 1.0]
    meds = [i for i in ended if idx.is_order[i]]
    others = {tl.source[i] or tl.ids[i] for i in ended if not idx.is_order[i]}
    chosen = meds if intent.medications or intent.category == "medication" else ended
    units: dict[str, list[int]] = {}
    for i in meds:
        units.setdefault(tl.source[i] or tl.ids[i], []).append(i)
    names = sorted({tl.display[max(ms, key=lambda i: (tl.t_start[i], tl.ids[i]))] for ms in units.values()},
                   key=str.casefold)
    where = stay.discharged_to()
    head = f"at the discharge from {stay.label()}" + (f" (discharged to {where})" if where else "")
    # The other orders first and the number of medication orders last, named as the question names it: a small
    # reader answered "how many medication orders" with the last number it read (docs/lifecycle.md).
    ended_what = []
    if others:
        ended_what.append(f"{_n(len(others), 'order')} and care item{'s' if len(others) != 1 else ''} other than "
                          f"medication orders")
    if units:
        ended_what.append(f"medication orders for {_n(len(names), 'drug')}: {'; '.join(names)}")
    text = f"{head}, the discharge ended {', and '.join(ended_what) if ended_what else 'no order'}; number of " \
           f"medication orders the discharge ended: {len(units)}"
    assert stay.ended_by is not None
    cited = [stay.ended_by, *sorted(chosen, key=lambda i: (tl.t_start[i], tl.ids[i]))]
    picks = picks_of(tl, [stay.ended_by], "discharge") + picks_of(tl, chosen[:MAX_LISTED], "ended")
    return Selection(picks, [Fact("discharge", text, tuple(dict.fromkeys(tl.ids[i] for i in cited)))], [])


# --- a category over an encounter -------------------------------------------------------------------------------


def _of_category(tl: Timeline, idx: ThreadIndex, category: str) -> np.ndarray:
    n = len(tl)
    if category == "medication":
        return idx.is_order.copy()
    if category == "administration":
        return np.fromiter((tl.resource[i] == "MedicationAdministration" for i in range(n)), dtype=bool, count=n)
    return np.fromiter((tl.category[i] == category for i in range(n)), dtype=bool, count=n)


def _category(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, stay: Stay | None) -> Selection:
    assert intent.category is not None
    if stay is None:
        return _no_stay(view)
    mask = view.present & _of_category(tl, idx, intent.category)
    lo = intent.start.timestamp() if intent.start is not None else -math.inf
    hi = intent.end.timestamp() if intent.end is not None else math.inf
    found = [i for i in np.flatnonzero(mask).tolist() if tl.encounter[i] == stay.encounter_id
             and (intent.start is None and intent.end is None or lo <= tl.t_start[i] < hi)]
    things: dict[str, list[int]] = {}
    for i in found:
        things.setdefault(tl.source[i] or tl.ids[i], []).append(i)
    # One line per thing recorded (its newest version), in clinical order.
    newest = sorted((max(ms, key=lambda i: (tl.t_start[i], tl.ids[i])) for ms in things.values()),
                    key=lambda i: (tl.t_start[i], tl.ids[i]))
    label = _CATEGORY_LABEL.get(intent.category, intent.category)
    scope = intent.stay or stay.label()
    cited = tuple(tl.ids[i] for i in found)
    if intent.kind == "most_frequent":
        counts = Counter(tl.display[i] for i in newest)
        if not counts:
            text = f"{label} in {scope}: none"
        else:
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0].casefold()))
            top = [n for n, c in ranked if c == ranked[0][1]]
            text = f"most frequent of the {label} in {scope}: {' / '.join(top)} ({ranked[0][1]} times)"
            if len(ranked) > len(top):
                text += "; next: " + "; ".join(f"{n} ({c})" for n, c in ranked[len(top):len(top) + 3])
        fact = Fact("most_frequent", text, cited)
    else:
        names = _listed(tl, newest)
        if intent.kind == "count":
            # The names first and the number last, with no time just before it: a small reader took the "2" of
            # "22 (Peripheral vascular ...)", and of "... to 2176-06-08 18:30: 22" (docs/lifecycle.md, "What the
            # reader makes of it").
            text = (f"{label} in {scope}: {names}; number of {label} in {scope.split(',')[0]}: {len(things)}"
                    if names else f"number of {label} in {scope}: {len(things)}")
        else:
            text = f"{label} in {scope} ({len(things)}): {names or 'none'}"
        fact = Fact(intent.kind, text, cited)
    return Selection(picks_of(tl, newest[:MAX_LISTED], "listed"), [fact], [])


def _listed(tl: Timeline, members: Sequence[int]) -> str:
    shown: list[str] = []
    for i in members:
        name = tl.display[i]
        if name not in shown:
            shown.append(name)
    return "; ".join(shown)


def stay_of(tl: Timeline, encounters: Encounters, view: View, at: datetime | None) -> Stay | None:
    """The stay current at ``at`` (None: the view's time) in ``view``."""
    return encounters.at(tl, view, at.timestamp() if at is not None else None)
