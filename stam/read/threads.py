"""Concept threads: the per-timeline index of threads (:class:`ThreadIndex`), what a selection serves of them
(:class:`Pick`, :class:`Fact`, :class:`Selection`), how one thread is filled by what the question asks of time
(:func:`fill`), and the order-version predicates the index and the order selections share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas import Reason
from stam.read.encounters import Encounters
from stam.read.intent import Intent
from stam.read.names import Name, name_words
from stam.read.timeline import Timeline, View

ORDER_RESOURCES = frozenset({"MedicationRequest", "MedicationStatement", "ServiceRequest"})
"""The resources that, of the medication category, are order versions."""
MAX_WINDOW = 60
"""Most values of one thread listed for a count/change/history question (the computed fact counts them all)."""
ORDER_KINDS = frozenset({"active", "changed_into", "started", "stopped"})
"""The intents about orders: a thread is filled with its order versions, and the fact is about the orders."""


@dataclass
class ThreadIndex:
    """Per timeline: each thread's members (ascending clinical time), the words of its concept names (a thread
    may hold several: an order changed into another drug), and arrays for scoring every thread at once:
    ``order`` lists memory indices thread by thread, ``starts`` where each thread's run begins, ``seg_thread``
    the thread of each run."""

    members: dict[int, np.ndarray]
    names: dict[int, tuple[Name, ...]]
    by_core: dict[frozenset[str], tuple[int, ...]]
    order: np.ndarray
    starts: np.ndarray
    seg_thread: np.ndarray
    by_word: dict[str, tuple[int, ...]]
    """Threads whose names hold a word."""
    is_order: np.ndarray
    """Per memory: a medication order version (MedicationRequest/Statement, or a ServiceRequest of category
    medication such as an IV therapy order)."""
    ends_order: np.ndarray
    """Per memory: when in HISTORY, the order version was discontinued or changed into another order (see
    :func:`discontinued`)."""
    encounters: Encounters = field(default_factory=lambda: Encounters({}))
    """Each encounter's own records (:mod:`stam.read.encounters`)."""

    @classmethod
    def build(cls, tl: Timeline) -> ThreadIndex:
        order = np.argsort(tl.thread, kind="stable")  # the timeline is in clinical order: kept within a thread
        ths = tl.thread[order]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(ths)) + 1]).astype(np.int64) if len(order) else \
            np.zeros(0, dtype=np.int64)
        bounds = [*starts.tolist(), len(order)]
        members = {int(ths[a]): order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)}
        names: dict[int, list[Name]] = {}
        by_core: dict[frozenset[str], list[int]] = {}
        by_word: dict[str, set[int]] = {}
        for th, ms in members.items():
            displays = dict.fromkeys(tl.display[i] for i in ms[::-1][:16] if tl.concept[i] is not None)
            names[th] = [n for d in displays if (n := name_words(d))[0]]
            for all_w, core in names[th]:
                if th not in by_core.setdefault(core, []):
                    by_core[core].append(th)
                for w in all_w:
                    by_word.setdefault(w, set()).add(th)
        size = len(tl)
        is_order = np.fromiter((tl.category[i] == "medication" and tl.resource[i] in ORDER_RESOURCES
                                for i in range(size)), dtype=bool, count=size)
        ends = np.fromiter((ends_order(tl, i) for i in range(size)), dtype=bool, count=size)
        # Tuples, not lists and sets: the garbage collector stops tracking tuples of ints, so the indexes a query
        # process keeps cost its full collections little.
        return cls(members=members, names={th: tuple(ns) for th, ns in names.items()},
                   by_core={c: tuple(ths_) for c, ths_ in by_core.items()}, order=order, starts=starts,
                   seg_thread=ths[starts] if len(order) else np.zeros(0, dtype=np.int32),
                   by_word={w: tuple(sorted(ths_)) for w, ths_ in by_word.items()},
                   is_order=is_order, ends_order=ends, encounters=Encounters.build(tl))

    def best(self, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Per thread run, the largest of ``values`` over its members where ``mask`` (``-inf`` where none)."""
        if not len(self.order):
            return np.zeros(0)
        v = np.where(mask[self.order], values[self.order], -np.inf)
        return np.maximum.reduceat(v, self.starts)


@dataclass
class Fact:
    """A statement computed from the state, with the memories it came from."""

    kind: str
    text: str
    memory_ids: tuple[str, ...]


@dataclass
class Pick:
    """One thread served: its memories, newest first, and why each is served."""

    thread: int
    score: float
    members: list[int] = field(default_factory=list)
    """Memory indices to serve, newest first."""
    roles: dict[int, str] = field(default_factory=dict)
    """Why a memory is served: current, latest, previous, first, highest, lowest, window, order, earlier."""


@dataclass
class Selection:
    """What a question selects: the threads served, the facts computed over them, the threads it names."""

    picks: list[Pick]
    facts: list[Fact]
    named: list[int]
    """The threads the question names (one concept; or every order of one drug)."""



def picks_by_thread(tl: Timeline, members: Sequence[int], role: str) -> list[Pick]:
    """Members grouped by thread (threads by their newest member), each thread's newest first."""
    by_thread: dict[int, list[int]] = {}
    for i in members:
        by_thread.setdefault(int(tl.thread[i]), []).append(int(i))
    picks = [Pick(thread=th, score=0.0, members=sorted(ms, key=lambda i: (-tl.t_start[i], tl.ids[i])),
                  roles=dict.fromkeys(ms, role)) for th, ms in by_thread.items()]
    picks.sort(key=lambda p: (-max(tl.t_start[i] for i in p.members), p.thread))
    return picks



def _groups(tl: Timeline, ms: np.ndarray) -> list[np.ndarray]:
    """Members split into groups recorded at the same clinical time (ascending)."""
    if ms.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(tl.t_start[ms])) + 1
    return list(np.split(ms, cuts))


def fill(tl: Timeline, view: View, live: np.ndarray, intent: Intent | None, pick: Pick, serve_history: bool,
          k_history: int) -> None:
    """The members of one thread to serve: what the intent needs, then earlier context."""
    roles: dict[int, str] = {}

    def take(ms: Sequence[int] | np.ndarray, role: str) -> None:
        for i in ms:
            roles.setdefault(int(i), role)

    window = live
    if intent is not None and (intent.start is not None or intent.end is not None):
        lo = intent.start.timestamp() if intent.start else -math.inf
        hi = intent.end.timestamp() if intent.end else math.inf
        window = live[(tl.t_start[live] >= lo) & (tl.t_start[live] < hi)]
    groups = _groups(tl, window)
    current = window[~view.history[window]]
    if current.size:
        cur_group = window[tl.t_start[window] == tl.t_start[current].max()]
        take(cur_group, "current")
    elif groups:
        take(groups[-1], "latest")
    kind = intent.kind if intent is not None else "current"
    if kind == "previous" and len(groups) >= 2:
        pos = next((k for k, g in enumerate(groups) if int(g[0]) in roles), len(groups) - 1)
        if pos >= 1:
            take(groups[pos - 1], "previous")
    elif kind in ("first", "change") and groups:
        take(groups[0], "first")
    elif kind in ("highest", "lowest"):
        vals = tl.value[window]
        ok = ~np.isnan(vals)
        if ok.any():
            target = np.nanmax(vals) if kind == "highest" else np.nanmin(vals)
            take(window[ok & (vals == target)], kind)
    if kind in ("count", "history", "change"):
        take(window[::-1][:MAX_WINDOW], "window")
    elif kind in ORDER_KINDS:
        take(window[::-1][:MAX_WINDOW], "order")
    if intent is not None and serve_history and k_history > 0:
        take([int(i) for i in window[::-1] if int(i) not in roles][:k_history], "earlier")
    pick.roles = roles
    pick.members = sorted(roles, key=lambda i: (-tl.t_start[i], tl.ids[i]))



# --- order versions ------------------------------------------------------------------------------------------


def ends_order(tl: Timeline, i: int) -> bool:
    """An order version that, once in HISTORY, was discontinued, or changed into another order (not replaced by
    a newer version of itself, such as the pharmacy's start of a POE order)."""
    reason = tl.reason[i]  # the Reason's value (a StrEnum compares equal to it)
    if reason in (Reason.STOPPED, Reason.CANCELLED):
        return True
    if reason == Reason.SUPERSEDED and tl.succ[i] >= 0:
        return tl.source[i] != tl.source[int(tl.succ[i])]
    return False


def discontinued(tl: Timeline, view: View, i: int) -> bool:
    """In HISTORY at the view because the order was discontinued or changed into another."""
    return bool(view.history[i]) and ends_order(tl, i)


def end_time(tl: Timeline, i: int) -> float:
    """When a memory ended: its recorded end, else its start."""
    return float(tl.t_ended[i]) if math.isfinite(tl.t_ended[i]) else float(tl.t_start[i])
