"""Orders: medication-order threads ranked as a category, by when their current order started or when an order
was discontinued or changed; and the selections about one named drug's orders (whether one is active, what it was
changed into, the window from its start)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

import numpy as np

from schemas import Reason
from stam.read.facts import fmt_at, fmt_time
from stam.read.intent import Intent
from stam.read.names import name_words, same_strength, thread_name
from stam.read.threads import Fact, Pick, Selection, ThreadIndex, end_time, fill, picks_by_thread
from stam.read.timeline import Timeline, View, from_epoch

# --- orders as a category ---------------------------------------------------------------------------------------


def _ended_time(tl: Timeline, i: int) -> float:
    """When a memory stopped holding: its end, and no later than its encounter's end when it ends with it (a
    pharmacy stop recorded after the discharge did not hold past the discharge)."""
    return min(end_time(tl, i), float(tl.enc_end[i]))


def orders_by_time(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, k_threads: int) -> Selection:
    """Medication-order threads by when their current order started (``started``, ``active``) or by when an order
    was discontinued or changed (``stopped``), at the view's time."""
    orders = view.present & idx.is_order
    if intent.kind in ("started", "active"):
        mask, when = orders & ~view.history, tl.t_start
    else:
        mask = orders & view.history & idx.ends_order
        when = np.where(np.isfinite(tl.t_ended), tl.t_ended, tl.t_start)
    best = idx.best(when, mask)
    segs = np.flatnonzero(np.isfinite(best))
    segs = segs[np.lexsort((idx.seg_thread[segs], -best[segs]))]
    if intent.kind == "active":  # "what medications is the patient on": the current orders, newest first
        k_threads = max(k_threads, 16)
    picks: list[Pick] = []
    for k in segs[:k_threads]:
        th = int(idx.seg_thread[k])
        ms = idx.members[th]
        pick = Pick(thread=th, score=0.0)
        live = ms[view.present[ms]]
        if intent.kind != "stopped":
            # Started / active: the orders that are current, with their versions (a pharmacy start a later POE
            # row of the same order replaced); not the earlier orders of the lineage that ended.
            current = {tl.source[int(i)] for i in live if not view.history[i]}
            live = live[np.fromiter((tl.source[int(i)] in current for i in live), dtype=bool, count=live.size)]
        fill(tl, view, live, Intent(kind=intent.kind), pick, False, 0)
        picks.append(pick)
    if not segs.size or intent.kind == "active":
        return Selection(picks, [], [])
    top_t = float(best[segs[0]])
    tops = [int(k) for k in segs if best[k] == top_t]
    cited: list[str] = []
    names: set[str] = set()
    for k in tops:
        ms = idx.members[int(idx.seg_thread[k])]
        for i in ms[mask[ms] & (when[ms] == top_t)]:
            names.add(tl.display[int(i)])
            cited.append(tl.ids[int(i)])
            if intent.kind == "stopped" and tl.succ[i] >= 0:
                cited.append(tl.ids[int(tl.succ[i])])
    shown = fmt_time(top_t)
    listed = " / ".join(sorted(names))
    if intent.kind == "started":
        text = f"active medication order started most recently (started {shown}): {listed}"
    else:
        text = f"medication order discontinued or changed most recently (at {shown}): {listed}"
    return Selection(picks, [Fact(intent.kind, text, tuple(dict.fromkeys(cited)))], [])

# --- one named order ---------------------------------------------------------------------------------------------


def _named_orders(tl: Timeline, idx: ThreadIndex, view: View, named: Sequence[int],
                  names: frozenset[frozenset[str]], asked: frozenset[str] = frozenset()) -> list[int]:
    """The present medication-order versions of the named threads that go by one of ``names`` (the question's
    name, or its core: a thread may hold the order it was changed into, under another name), of the concentration
    the question ``asked`` for, if it gave one."""
    return [int(i) for th in named for i in idx.members[th] if view.present[i] and idx.is_order[i]
            and any(n in names for n in name_words(tl.display[int(i)])) and same_strength(asked, tl.display[int(i)])]


def _versions(tl: Timeline, view: View, members: Sequence[int] | np.ndarray, sources: set[str]) -> list[int]:
    """The present memories of ``members`` that are versions of one of ``sources``."""
    return [int(i) for i in members if view.present[i] and (tl.source[int(i)] or tl.ids[int(i)]) in sources]


def _ended_by(tl: Timeline, view: View, members: Sequence[int]) -> list[int]:
    """What ended each of ``members`` that is not one of them: the record whose arrival ended it (an encounter's
    discharge) and what replaced or discontinued it, where those exist at the view."""
    have = set(members)
    out: list[int] = []
    for i in members:
        if not view.history[i]:
            continue
        for j in (int(tl.evid[i]), int(tl.succ[i])):
            if j >= 0 and view.present[j] and j not in have and j not in out:
                out.append(j)
    return out


def _why(tl: Timeline, view: View, i: int, stay_of_end: str | None) -> str:
    """Why an order version ended, in words."""
    reason = tl.reason[i]
    if reason == Reason.ENCOUNTER_ENDED:
        return " when its admission ended at discharge" + (f" ({stay_of_end})" if stay_of_end else "")
    if reason == Reason.EXPIRED:
        return ", at its own end time (expired)"
    j = int(tl.succ[i])
    if j >= 0 and view.present[j] and tl.source[j] != tl.source[i]:
        return f", {reason}: {'changed into' if reason == Reason.SUPERSEDED else 'by'} {tl.display[j]}"
    return f", {reason}" if reason else ""


def is_current(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
                names: frozenset[frozenset[str]], asked: frozenset[str] = frozenset()) -> Selection:
    """Is the named concept current at the view: its orders (or, when it has none, its facts that are not events).
    Yes: the current ones with their versions. No: the one(s) that ended last, with what ended them (the discharge
    record, the order that discontinued or replaced them)."""
    members = [int(i) for th in named for i in idx.members[th] if view.present[i]]
    cands = _named_orders(tl, idx, view, named, names, asked)
    if not cands:
        cands = [i for i in members if tl.reason[i] != Reason.EVENT and same_strength(asked, tl.display[i])]
    if not cands:
        return Selection([], [], list(named))
    name = thread_name(tl, cands)
    upto = f" as of {fmt_time(view.at)}" if math.isfinite(view.at) else ""
    active = [i for i in cands if not view.history[i]]
    if active:
        units = {tl.source[i] or tl.ids[i] for i in active}
        served = _versions(tl, view, members, units)
        latest = max(active, key=lambda i: (tl.t_start[i], tl.ids[i]))
        open_end = "" if (math.isfinite(tl.t_end[latest]) or tl.encounter[latest]) else "; no end recorded"
        fact = Fact("active", f"{name}{upto}: yes, an active order, being received (one started "
                    f"{fmt_at(tl, latest)}{open_end}).",
                    (tl.ids[latest],))
        return Selection(picks_by_thread(tl, served, "order"), [fact], list(named))
    last_t = max(_ended_time(tl, i) for i in cands)
    lasts = [i for i in cands if _ended_time(tl, i) == last_t]
    units = {tl.source[i] or tl.ids[i] for i in lasts}
    served = _versions(tl, view, members, units)
    enders = _ended_by(tl, view, lasts)
    # What ended the last one: the lifecycle's record (a discharge) when it ended it, else its newest version.
    last = max(lasts, key=lambda i: (tl.reason[i] == Reason.ENCOUNTER_ENDED, tl.t_start[i], tl.ids[i]))
    first = min(served, key=lambda i: (tl.t_start[i], tl.ids[i]))
    stay_end = None
    if tl.reason[last] == Reason.ENCOUNTER_ENDED and tl.encounter[last]:
        stay = idx.encounters.stay(tl, view, tl.encounter[last] or "")
        stay_end = stay.label("the admission") if stay is not None else None
    # The answer first: a small reader took "X, an order active as of T (the last one, ...): no" for a yes
    # (docs/lifecycle.md, "What the reader makes of it").
    text = (f"{name}{upto}: no, not an active order and not being received; its last order (from "
            f"{fmt_at(tl, first)}, ended {fmt_time(last_t)}{_why(tl, view, last, stay_end)}) had ended.")
    cited = tuple(dict.fromkeys(tl.ids[i] for i in [first, last, *enders]))
    picks = picks_by_thread(tl, served, "order")
    extra = picks_by_thread(tl, enders, "ended-by")
    return Selection(picks + extra, [Fact("active", text, cited)], list(named))


def changed_into(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
                  names: frozenset[frozenset[str]], asked: frozenset[str] = frozenset()) -> Selection | None:
    """What the named order was changed into: the order the question names (by its time: "the X order of <T>";
    else the one changed most recently), followed along its own successor link; None when the named threads hold
    no order."""
    orders = _named_orders(tl, idx, view, named, names, asked)
    if not orders:
        return None
    members = [int(i) for th in named for i in idx.members[th]]

    def change_of(i: int) -> bool:
        j = int(tl.succ[i])
        return bool(view.history[i]) and tl.reason[i] == Reason.SUPERSEDED and j >= 0 and bool(view.present[j]) \
            and tl.source[j] != tl.source[i]

    if intent.about is not None:
        t = intent.about.timestamp()
        exact = [i for i in orders if tl.t_start[i] == t]
        pool = exact or [i for i in orders if tl.t_start[i] <= t]
        if not pool:
            return None
        top = max(tl.t_start[i] for i in pool)
        sources = {tl.source[i] or tl.ids[i] for i in pool if tl.t_start[i] == top}
    else:
        changed_any = [i for i in orders if change_of(i)]
        if not changed_any:
            return None
        newest = max(changed_any, key=lambda i: (tl.t_start[i], tl.ids[i]))
        sources = {tl.source[newest] or tl.ids[newest]}
    old = _versions(tl, view, members, sources)
    changed = sorted((i for i in old if change_of(i)), key=lambda i: (tl.t_start[i], tl.ids[i]))
    first = min(old, key=lambda i: (tl.t_start[i], tl.ids[i]))
    if not changed:
        last = max(old, key=lambda i: (end_time(tl, i), tl.ids[i]))
        state = (f"ended {fmt_time(end_time(tl, last))}{_why(tl, view, last, None)}" if view.history[last]
                 else "still active")
        of = fmt_time(intent.about.timestamp()) if intent.about is not None else fmt_at(tl, first)
        text = f"the {tl.display[first]} order of {of} was not changed into another order ({state})"
        return Selection(picks_by_thread(tl, old, "order"), [Fact("changed_into", text, (tl.ids[last],))],
                         list(named))
    i = changed[-1]
    j = int(tl.succ[i])
    new = [k for k in range(len(tl)) if view.present[k] and tl.source[k] == tl.source[j]]
    # The new order's first version that says its dose (a POE change names the drug; its pharmacy start the dose,
    # route and frequency).
    dosed_all = [k for k in new if tl.dosage[k]]
    dosed = min(dosed_all, key=lambda k: (tl.t_start[k], tl.ids[k])) if dosed_all else None
    into = f"{tl.display[j]} {tl.dosage[dosed]}" if dosed is not None else tl.display[j]
    was = f" {tl.dosage[i]}" if tl.dosage[i] else ""
    cited = (tl.ids[i], tl.ids[j]) + ((tl.ids[dosed],) if dosed is not None else ())
    of = fmt_time(intent.about.timestamp()) if intent.about is not None else fmt_at(tl, first)
    text = f"the {tl.display[i]}{was} order of {of} was changed (at {fmt_at(tl, j)}) into: {into}"
    picks = picks_by_thread(tl, list(dict.fromkeys(old + new)), "order")
    return Selection(picks, [Fact("changed_into", text, cited)], list(named))


def order_window(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
                  name_words_: frozenset[str] | None, asked: frozenset[str] = frozenset()) -> Intent:
    """"Within the first day of the prescription": the window from the named drug's latest order's start."""
    orders = [i for i in _named_orders(tl, idx, view, named, frozenset({name_words_}) if name_words_ else
                                       frozenset(), asked) if tl.t_start[i] <= view.at]
    if not orders:
        return intent
    latest = max(orders, key=lambda i: (tl.t_start[i], tl.ids[i]))
    unit = [i for i in orders if tl.source[i] == tl.source[latest]] or [latest]
    start = min(float(tl.t_start[i]) for i in unit)
    begin = from_epoch(start)
    if begin is None:
        return intent
    hours = intent.hours or 24.0
    end = begin + timedelta(hours=hours)
    span = "day" if hours == 24 else f"{hours:g} hours"
    return replace(intent, start=begin, end=end, stay=f"the first {span} of the {tl.display[latest]} order started "
                   f"{fmt_time(start)}, to {end.strftime('%Y-%m-%d %H:%M')}")
