"""Encounters on the read path: which stay a question's time falls in, and what its own records say of it.

An encounter's own records are the memories of category ``encounter`` whose source resource is the encounter
itself (``source_ref == encounter_id``: MIMIC's admission entry at admittime and its discharge entry at
dischtime; a FHIR Encounter; an HL7 visit). Facts recorded during it name it (``AtomicMemory.encounter_id``).

At a view (a clinical time T, within a visibility boundary) the **current stay** is the encounter of the latest
own record whose start is at or before T. Its start is the earliest start of its records; its end is the end a
record of its own states (a discharge), once that record exists at T; a record of its own that is current again
after that end (a cancelled discharge) leaves it open. An encounter with no end recorded by T is open, and is
said so ("no discharge recorded"): nothing is guessed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import numpy as np

from stam.read.intent import Intent
from stam.read.timeline import Timeline, View, from_epoch


def _show(t: float) -> str:
    d = from_epoch(t)
    return d.strftime("%Y-%m-%d %H:%M") if d else "an unknown time"


@dataclass(frozen=True)
class Stay:
    """One encounter as a view sees it."""

    encounter_id: str
    start: float
    """Clinical time it began (seconds since the epoch)."""
    end: float
    """Clinical time its own record says it ended; ``inf`` while no end is recorded at the view."""
    records: tuple[int, ...]
    """Its own records present in the view (timeline indices, in clinical order)."""
    ended_by: int | None
    """The record that says it ended (a discharge), when one does."""
    display: str
    """The newest record's name (MIMIC: its type and origin, and where the patient was discharged to)."""

    @property
    def ended(self) -> bool:
        return math.isfinite(self.end)

    def span(self) -> str:
        if self.ended:
            return f"{_show(self.start)} to {_show(self.end)}"
        return f"from {_show(self.start)}, no discharge recorded"

    def label(self, what: str = "this admission") -> str:
        """How a computed fact names the encounter it covers: "this admission, 2145-07-03 14:00 to 2145-07-10
        12:00"."""
        return f"{what}, {self.span()}"

    def discharged_to(self) -> str | None:
        """Where the patient went, as the discharge record says it (MIMIC: "discharged to HOME")."""
        m = re.search(r"discharged to ([^;)]+)", self.display)
        return m.group(1).strip() if m else None


@dataclass
class Encounters:
    """Per timeline: each encounter's own records (indices in clinical order)."""

    records: dict[str, np.ndarray]

    @classmethod
    def build(cls, tl: Timeline) -> Encounters:
        found: dict[str, list[int]] = {}
        for i, enc in enumerate(tl.encounter):
            if enc is not None and tl.category[i] == "encounter" and tl.source[i] == enc:
                found.setdefault(enc, []).append(i)
        return cls({e: np.array(ix, dtype=np.int64) for e, ix in found.items()})

    def __len__(self) -> int:
        return len(self.records)

    def stay(self, tl: Timeline, view: View, encounter_id: str) -> Stay | None:
        """The encounter as the view sees it (None: none of its records exists in the view)."""
        ix = self.records.get(encounter_id)
        if ix is None:
            return None
        here = ix[view.present[ix]]
        if not here.size:
            return None
        starts = tl.t_start[here]
        finite = starts[np.isfinite(starts)]
        start = float(finite.min()) if finite.size else float(tl.t_add[here].min())
        end, ended_by = math.inf, None
        closing = [int(i) for i in here if math.isfinite(tl.t_end[i]) and tl.t_end[i] >= start]
        if closing:
            last = max(closing, key=lambda i: (tl.t_add[i], tl.t_end[i]))
            # A record of its own that is current again after the end (a cancelled discharge) reopens it.
            reopened = any(not view.history[i] and not math.isfinite(tl.t_end[i]) and tl.t_add[i] > tl.t_add[last]
                           for i in here)
            if not reopened:
                end, ended_by = float(tl.t_end[last]), last
        newest = max((int(i) for i in here), key=lambda i: (tl.t_add[i], i))
        return Stay(encounter_id, start, end, tuple(int(i) for i in here), ended_by, tl.display[newest])

    def stays(self, tl: Timeline, view: View) -> list[Stay]:
        """Every encounter in the view, by start."""
        out = [s for e in self.records if (s := self.stay(tl, view, e)) is not None]
        return sorted(out, key=lambda s: (s.start, s.encounter_id))

    def at(self, tl: Timeline, view: View, t: float | None = None) -> Stay | None:
        """The current stay at clinical time ``t`` (default: the view's): the encounter of the latest record of
        its own that started at or before then."""
        when = view.at if t is None else t
        best: Stay | None = None
        for s in self.stays(tl, view):
            if s.start <= when and (best is None or s.start >= best.start):
                best = s
        return best


def _dt(t: float) -> datetime:
    d = from_epoch(t)
    assert d is not None
    return d


def _hours(h: float) -> str:
    if h % 24 == 0:
        days = int(h // 24)
        return "day" if days == 1 else f"{days} days"
    return f"{h:g} hour" + ("s" if h != 1 else "")


def resolve(intent: Intent, stay: Stay | None) -> Intent:
    """The intent with its encounter scope resolved against ``stay`` (the stay current at the question's time):
    the window or point in time the scope names, and how the facts name the encounter (``stay``). A scope with no
    stay to resolve against is left as it is (the facts say no admission is recorded); a ``first`` scope counted
    from an order is resolved by the selection, which knows the named order."""
    if intent.scope is None or stay is None:
        return intent
    start = _dt(stay.start)
    end = _dt(stay.end) + timedelta(seconds=1) if stay.ended else None
    label = stay.label()
    if intent.scope == "stay":
        return replace(intent, start=max(intent.start, start) if intent.start else start,
                       end=min(intent.end, end) if intent.end and end else (intent.end or end), stay=label)
    if intent.scope == "first" and intent.scope_of == "admission":
        span = timedelta(hours=intent.hours or 24.0)
        return replace(intent, start=start, end=start + span,
                       stay=f"the first {_hours(intent.hours or 24.0)} of {label} (to {(start + span).strftime(_F)})")
    if intent.scope == "hour" and intent.hours is not None:
        point = start + timedelta(hours=intent.hours)
        return replace(intent, at=point, start=start, end=None,
                       stay=f"hour {intent.hours:g} of {label} ({point.strftime(_F)})")
    if intent.scope == "discharge":
        if not stay.ended:
            return replace(intent, stay=label)
        return replace(intent, at=_dt(stay.end), stay=f"the discharge from {label}")
    if intent.scope == "admission":
        return replace(intent, at=start, stay=f"the admission of {label}")
    return replace(intent, stay=label)


_F = "%Y-%m-%d %H:%M"
