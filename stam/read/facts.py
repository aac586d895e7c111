"""Computed facts: short statements computed from the state about a named concept's values or its orders, each
citing the memories it came from (the last step of :mod:`stam.read.select`), and the value and time formats they
are written in."""

from __future__ import annotations

import math
from collections.abc import Sequence

from stam.read.intent import Intent
from stam.read.names import name_words, thread_name
from stam.read.threads import MAX_WINDOW, ORDER_RESOURCES, Fact, Pick, discontinued, end_time
from stam.read.timeline import Timeline, View, from_epoch


def fmt_value(tl: Timeline, i: int) -> str | None:
    """Memory ``i``'s value with its unit; None when it has no value."""
    v = tl.value[i]
    if math.isnan(v):
        return None
    unit = tl.unit[i]
    return f"{v:g} {unit}".strip() if unit else f"{v:g}"


def fmt_time(t: float) -> str:
    """An epoch time as facts write it (``%Y-%m-%d %H:%M``)."""
    d = from_epoch(t)
    return d.strftime("%Y-%m-%d %H:%M") if d else "an unknown time"


def fmt_at(tl: Timeline, i: int) -> str:
    """When memory ``i`` was recorded (its clinical start), as :func:`fmt_time` writes it."""
    return fmt_time(float(tl.t_start[i]))


def _one_value(tl: Timeline, ms: Sequence[int]) -> str | None:
    """The value of simultaneous results, when they agree."""
    vals = {fmt_value(tl, i) for i in ms}
    return vals.pop() if len(vals) == 1 else None


def value_fact(tl: Timeline, view: View, pick: Pick, intent: Intent) -> Fact | None:
    """What the intent asks of a named thread's values, computed from its pick (the most recent value, the one
    before, the first, the extreme, the count, the change); None when the served values cannot say it."""
    roles = pick.roles

    def by(*role: str) -> list[int]:
        return [i for i in pick.members if roles.get(i) in role]

    name = thread_name(tl, pick.members)
    if intent.stay:
        name = f"{name} ({intent.stay})"
    cur = by("current", "latest")
    kind = intent.kind
    upto = f" up to {fmt_time(view.at)}" if math.isfinite(view.at) else ""
    if kind == "count":
        window = by("window", "current", "latest")
        if len(window) >= MAX_WINDOW:
            return None  # more than were listed: the count would not be checkable against the packet
        # Versions of one source resource are one thing recorded (an admission and its discharge, an order and its
        # pharmacy versions); each result or order is its own resource.
        things = {tl.source[i] or tl.ids[i] for i in window}
        return Fact(kind, f"Number of {name} records{upto}: {len(things)}", tuple(tl.ids[i] for i in window))
    if not cur:
        return None
    cur_v = _one_value(tl, cur)
    if cur_v is None:
        return None
    cited = list(cur)
    if kind == "previous":
        prev = by("previous")
        prev_v = _one_value(tl, prev) if prev else None
        if prev_v is None:
            return None
        text = f"{name}, value before the most recent one (at {fmt_at(tl, prev[0])}): {prev_v}"
        cited += prev
    elif kind == "first":
        first = by("first")
        first_v = _one_value(tl, first) if first else None
        if first_v is None:
            return None
        text = f"{name}, first value (at {fmt_at(tl, first[0])}): {first_v}"
        cited = first
    elif kind in ("highest", "lowest"):
        # The extreme keeps the current value's role when the current value is it.
        ext = [i for i in by(kind, "current", "latest") if not math.isnan(tl.value[i])]
        if ext:
            target = (max if kind == "highest" else min)(tl.value[i] for i in ext)
            ext = [i for i in ext if tl.value[i] == target]
        ext_v = _one_value(tl, ext) if ext else None
        if ext_v is None:
            return None
        times = f"at {fmt_at(tl, ext[0])}" if len(ext) == 1 else f"{len(ext)} times, the latest at {fmt_at(tl, ext[0])}"
        text = f"{name}, {kind} value ({times}): {ext_v}"
        cited = ext
    elif kind == "change":
        first = by("first")
        first_v = _one_value(tl, first) if first else None
        if first_v is None:
            return None
        if tl.unit[first[0]] == tl.unit[cur[0]]:
            # The change first, with its unit beside it: put after the times, the 1.5B reader copied the number
            # and dropped the unit (2 of 12 held-out questions, docs/read-path.md).
            delta = tl.value[cur[0]] - tl.value[first[0]]
            unit = tl.unit[cur[0]]
            text = f"{name}, change since the first value: {delta:+.4g}{' ' + unit if unit else ''} " \
                   f"({first_v} at {fmt_at(tl, first[0])} to {cur_v} at {fmt_at(tl, cur[0])}, the most recent)"
        else:
            text = f"{name}, from the first value (at {fmt_at(tl, first[0])}) to the most recent " \
                   f"(at {fmt_at(tl, cur[0])}): {first_v} to {cur_v}"
        cited = first + cited
    else:
        label = "most recent value" if roles.get(cur[0]) == "current" else "last value recorded"
        text = f"{name}, {label} (at {fmt_at(tl, cur[0])}): {cur_v}"
    return Fact(kind, text, tuple(dict.fromkeys(tl.ids[i] for i in cited)))


def order_fact(tl: Timeline, view: View, picks: Sequence[Pick], intent: Intent,
                name_words_: frozenset[str] | None) -> Fact | None:
    """About the orders of the named drug only (a thread may hold the order it was changed into): the current order's
    start, or when one was last discontinued or changed ("is X active" and "what was X changed into" have their own
    selections: :func:`~stam.read.orders.is_current`, :func:`~stam.read.orders.changed_into`)."""
    members = [i for p in picks for i in p.members]
    orders = [i for i in members if tl.category[i] == "medication" and tl.resource[i] in ORDER_RESOURCES
              and (name_words_ is None or name_words_ in name_words(tl.display[i]))]
    if not orders:
        return None
    name = thread_name(tl, orders)
    if intent.kind == "started":
        active = [i for i in orders if not view.history[i]]
        if not active:
            return None
        latest = max(active, key=lambda i: tl.t_start[i])
        return Fact("started", f"{name}, current order started: {fmt_at(tl, latest)}", (tl.ids[latest],))
    ended = [i for i in orders if discontinued(tl, view, i)]
    if not ended:
        return None
    last = max(ended, key=lambda i: end_time(tl, i))
    return Fact("stopped", f"{name}, last discontinued or changed ({tl.reason[last]}): {fmt_time(end_time(tl, last))}",
                (tl.ids[last],))
