"""Choosing the evidence: concept threads ranked, each filled by what the question asks of time.

Given a patient's :class:`~stam.read.timeline.Timeline`, a :class:`~stam.read.timeline.View` (the state at the
question's time, within its visibility), the question's cosine with every memory and its
:class:`~stam.read.intent.Intent`:

1. **Threads are ranked**, not memories: a thread's score is the best cosine of its memories in the view plus a
   lexical match of its concept name with the question (a coded lab's values share one vector, so cosine alone
   cannot tell "Potassium (Blood)" from "Potassium, Whole Blood"; the words can).
2. **The named concept**: a thread every word of whose name is in the question (the longest such name), or whose
   core name (before a parenthesis or comma) is, when no other concept in view shares that core; the orders of
   one drug share a name and are named together.
3. **Each thread is filled by the intent**: the current value (and the values recorded at the same time); the one
   before it; the first; the highest or lowest (every value equal to it); every value in a window (count,
   change, history); then, when HISTORY is served, earlier values newest first up to ``k_history``. The named
   thread (or, when none is named, the first few) get the intent; the others their current value only.
4. **Orders as a category** ("which order was started / discontinued or changed most recently", "what
   medications is the patient on") rank medication-order threads by when their current order started, or by when
   an order was discontinued or changed into another (a new version of the same order, e.g. the pharmacy's start
   of a POE order, is neither).
5. **Computed facts** (:class:`Fact`): for a named concept or an order category, a short statement computed from
   the state (the most recent value and its time, the previous one, the first, the extreme, the count, the change;
   the order started or ended most recently; whether an order of the drug is active; what an order was changed
   into), citing the memories it came from. Nothing named, nothing computed.

Here: the ranking and the named concept (1, 2). The thread index, what is served of a thread and how a thread is
filled (3) are :mod:`stam.read.threads`; the words of names :mod:`stam.read.names`; the orders (4)
:mod:`stam.read.orders`; the computed facts (5) :mod:`stam.read.facts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from stam.read.encounters import Stay
from stam.read.facts import order_fact, value_fact
from stam.read.intent import Intent
from stam.read.names import Name, question_words, same_strength, strengths
from stam.read.orders import changed_into, is_current, order_window, orders_by_time
from stam.read.threads import ORDER_KINDS, Fact, Pick, Selection, ThreadIndex, fill
from stam.read.timeline import Timeline, View

LEXICAL_WEIGHT = 0.5
FULL_THREADS = 3
"""Threads filled by the intent when no concept is named."""


@dataclass(frozen=True)
class _Ranked:
    score: float
    thread: int
    full: frozenset[str] | None
    """The longest of the thread's names whose every word is in the question."""
    core: frozenset[str] | None
    """The longest of its core names whose every word is in the question."""
    current: bool


def _match(q: frozenset[str], names: Sequence[Name]) -> tuple[float, frozenset[str] | None, frozenset[str] | None]:
    cov = 0.0
    full = core = None
    for all_w, core_w in names:
        hit = len(all_w & q)
        cov = max(cov, hit / len(all_w))
        if hit == len(all_w) and (full is None or len(all_w) > len(full)):
            full = all_w
        if core_w and core_w <= q and (core is None or len(core_w) > len(core)):
            core = core_w
    return cov, full, core


Matched = dict[int, tuple[frozenset[str] | None, frozenset[str] | None]]
"""Per thread a question's words hit: its longest full name and core name wholly in the question (or None)."""


def _add_lexical(idx: ThreadIndex, q: frozenset[str], live: np.ndarray, seg_of: dict[int, int],
                 total: np.ndarray) -> Matched:
    """Adds to ``total`` (per thread run) the lexical match of each live thread's names with the question's words
    ``q``; returns the names of those threads the question holds whole."""
    matched: Matched = {}
    for th in set().union(*(idx.by_word.get(w, ()) for w in q)) if q else set():
        k = seg_of[th]
        if not live[k]:
            continue
        cov, full, core = _match(q, idx.names[th])
        total[k] += LEXICAL_WEIGHT * cov
        matched[th] = (full, core)
    return matched


def _same_drug(idx: ThreadIndex, named: list[int], name: frozenset[str],
               matched: Matched) -> tuple[list[int], frozenset[frozenset[str]]]:
    """The named threads widened to every order of the same drug, and the names its orders go by."""
    # An order goes by the drug's name and more ("LR (IV therapy: IV fluids)", "HYDROmorphone (Dilaudid)"): the
    # threads whose core name is the name the question used, or its core, are the same drug's.
    cores = {core for th in named for full, core in idx.names[th] if name in (full, core)}
    named = named + [th for th, (full, core) in matched.items() if th not in named
                     and (core == name or full == name or core in cores)]
    return named, frozenset({name, *cores})


def select_threads(tl: Timeline, idx: ThreadIndex, view: View, scores: np.ndarray, question: str, intent: Intent,
                   *, serve_history: bool, k_threads: int, k_history: int, joint: bool = True,
                   stay: Stay | None = None) -> Selection:
    """The threads a question names and the facts computed over them (a question about the encounter or the
    record as a whole is :func:`stam.read.aggregate.select`'s). ``stay``: the encounter current at the question's
    time (``intent`` already resolved against it)."""
    if intent.kind == "active":
        serve_history = True  # whether X is current is answered by what ended it when nothing current is left
    present = view.present
    served = present if serve_history else present & ~view.history
    q = question_words(question)
    best = idx.best(scores.astype(np.float64), served)
    live = np.isfinite(best)
    current = np.isfinite(idx.best(scores.astype(np.float64), served & ~view.history))
    total = best.copy()
    seg_of = {int(th): k for k, th in enumerate(idx.seg_thread)}
    matched = _add_lexical(idx, q, live, seg_of, total)
    cands = np.flatnonzero(live)

    def ranked_at(k: int) -> _Ranked:
        th = int(idx.seg_thread[k])
        full, core = matched.get(th, (None, None))
        return _Ranked(float(total[k]), th, full, core, bool(current[k]))

    asked = strengths(question)

    def of_strength(th: int) -> bool:
        """Whether a thread may be the product of the concentration the question asked for (if it gave one)."""
        return not asked or any(same_strength(asked, tl.display[int(i)]) for i in idx.members[th] if served[int(i)])

    named, name = _named([ranked_at(seg_of[th]) for th in matched if of_strength(th)], idx, served, of_strength)
    accepted: frozenset[frozenset[str]] = frozenset({name}) if name is not None else frozenset()
    if named and name is not None and intent.kind in ("active", "changed_into"):
        named, accepted = _same_drug(idx, named, name, matched)
    # "Dextrose 5%" names neither Dextrose 50% nor its orders, though their core names are the same
    named = [th for th in named if of_strength(th)]
    if not named and (intent.kind in ("started", "stopped") or (intent.kind == "active" and intent.medications)):
        return orders_by_time(tl, idx, view, intent, k_threads)
    if named and intent.kind == "active":
        # "Is X current": the named concept's threads at T; when none of them holds a current fact, HISTORY is
        # opened whatever the gate said, to show when and why the last one ended.
        return is_current(tl, idx, view, intent, named, accepted, asked)
    if named and intent.kind == "changed_into":
        chosen = changed_into(tl, idx, view, intent, named, accepted, asked)
        if chosen is not None:
            return chosen
    if named and intent.scope == "first" and intent.scope_of == "order":
        intent = order_window(tl, idx, view, intent, named, name, asked)
    first = set(named)
    n_full = len(named) if named else FULL_THREADS
    # A named concept is the answer's thread; a few others stay beside it as context (k_active // 4).
    n_threads = k_threads if not named else max(len(named), min(k_threads, len(named) + k_threads // 4))
    key = total[cands] if joint else total[cands] + 1e6 * current[cands]
    top = cands[np.argsort(-key, kind="stable")][: n_threads + len(first)]
    ranked = [ranked_at(seg_of[th]) for th in named] + [ranked_at(int(k)) for k in top
                                                          if int(idx.seg_thread[k]) not in first]
    picks: list[Pick] = []
    for n, r in enumerate(ranked[:n_threads]):
        ms = idx.members[r.thread]
        pick = Pick(thread=r.thread, score=r.score)
        if n < n_full:
            fill(tl, view, ms[served[ms]], intent, pick, serve_history, k_history)
        else:
            fill(tl, view, ms[served[ms]], None, pick, False, 0)
        if pick.members:
            picks.append(pick)
    facts: list[Fact] = []
    if named and picks and (intent.kind in ORDER_KINDS or picks[0].thread in first):
        # (a named thread with nothing in the question's window has no pick: no statement about another thread)
        fact = (order_fact(tl, view, [p for p in picks if p.thread in first], intent, name)
                if intent.kind in ORDER_KINDS else value_fact(tl, view, picks[0], intent))
        if fact is not None:
            facts.append(fact)
    return Selection(picks, facts, named)


def _named(ranked: Sequence[_Ranked], idx: ThreadIndex, served: np.ndarray,
           of_strength: Callable[[int], bool] = lambda th: True) -> tuple[list[int], frozenset[str] | None]:
    """The threads the question names (see the module doc) and the words of the name it names them by; nothing
    when no concept is named, or the name is ambiguous. ``of_strength``: whether a thread may be the product of the
    concentration the question gave (its namesakes of other strengths are other products, not a second name)."""
    full = [r for r in ranked if r.full is not None]
    if full:
        longest = max(len(r.full) for r in full if r.full is not None)
        names = {r.full for r in full if r.full is not None and len(r.full) == longest}
        if len(names) > 1:
            return [], None
        best = [r for r in full if r.full in names]
        (name,) = names
    else:
        core = [r for r in ranked if r.core is not None]
        if not core:
            return [], None
        longest = max(len(r.core) for r in core if r.core is not None)
        cores = {r.core for r in core if r.core is not None and len(r.core) == longest}
        if len(cores) > 1:
            return [], None
        (the_core,) = cores
        best = [r for r in core if r.core == the_core]
        # Every thread in view with that core must go by the same names (one concept, or the orders of one drug):
        # a core that several concepts share ("potassium": Potassium (Blood), Potassium, Whole Blood) names none.
        # One thread may hold several names with it (each admission names its type and origin).
        holders = {th: frozenset(n for n, c in idx.names[th] if c == the_core)
                   for th in idx.by_core.get(the_core, ()) if served[idx.members[th]].any() and of_strength(th)}
        if len(set(holders.values())) > 1:
            return [], None
        name = the_core
    return [r.thread for r in sorted(best, key=lambda r: -r.score)], name
