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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import lru_cache

import numpy as np

from schemas import Reason
from stam.read.encounters import Encounters, Stay
from stam.read.intent import Intent
from stam.read.timeline import Timeline, View, from_epoch, words

ORDER_RESOURCES = frozenset({"MedicationRequest", "MedicationStatement", "ServiceRequest"})
LEXICAL_WEIGHT = 0.5
FULL_THREADS = 3
"""Threads filled by the intent when no concept is named."""
MAX_WINDOW = 60
"""Most values of one thread listed for a count/change/history question (the computed fact counts them all)."""
ORDER_KINDS = frozenset({"active", "changed_into", "started", "stopped"})
_STOP = frozenset({
    "a", "an", "the", "of", "and", "or", "in", "on", "at", "to", "for", "by", "with", "from", "as", "is", "was",
    "were", "are", "be", "been", "has", "have", "had", "do", "does", "did", "what", "which", "who", "whose",
    "when", "how", "many", "much", "patient", "patients", "patient's", "value", "values", "result", "results",
    "level", "levels", "recorded", "charted", "most", "recent", "recently", "latest", "last", "first",
    "current", "currently", "earlier", "previous", "before", "after", "since", "until", "highest", "lowest",
    "maximum", "minimum", "any", "all", "ever", "still", "now", "time", "times", "date", "order", "orders",
    "ordered", "medication", "medications", "active", "started", "discontinued", "changed", "stopped", "into",
    "one", "that", "this", "there", "their", "his", "her", "its", "number", "count", "him",
})


def _stem(w: str) -> str:
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w


SALT_WORDS = frozenset({
    "sodium", "potassium", "calcium", "magnesium", "hcl", "hydrochloride", "sulfate", "sulphate", "tartrate",
    "bitartrate", "succinate", "citrate", "phosphate", "acetate", "maleate", "mesylate", "besylate", "fumarate",
    "bromide", "gluconate", "propionate", "dipropionate", "xinafoate", "monohydrate", "trihydrate", "er", "sr",
    "xl", "dr",
})
"""Salt, ester and release-form words: after a drug's first word they do not change which drug it is ("Heparin
Sodium" is what a clinician calls heparin; "Sodium Chloride" keeps both words)."""


@lru_cache(maxsize=65536)
def name_words(display: str) -> tuple[frozenset[str], frozenset[str]]:
    """(all words, core words) of a concept name; the core is what precedes a parenthesis, colon, semicolon or
    comma, without salt words after the first word ("Potassium (Blood)" -> {potassium}, "Heparin Sodium" ->
    {heparin}); stop words and bare numbers are not words here."""
    core_text = re.split(r"[(:;,]", display, maxsplit=1)[0]

    def ws(text: str) -> list[str]:
        return [_stem(w) for w in words(text) if w not in _STOP and not w.replace(".", "").isdigit()]

    all_w = frozenset(ws(display))
    core_l = ws(core_text)
    core = frozenset(core_l[:1] + [w for w in core_l[1:] if w not in SALT_WORDS])
    return all_w, core or all_w


_STRENGTH = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*%")


def strengths(text: str) -> frozenset[str]:
    """The concentrations a name or question gives ("Dextrose 5%" -> {"5.0"}). Bare numbers are not name words, but a
    concentration tells products apart: Dextrose 5% is a maintenance fluid, Dextrose 50% a rescue for
    hypoglycaemia."""
    return frozenset(str(float(m)) for m in _STRENGTH.findall(text))


def same_strength(asked: frozenset[str], display: str) -> bool:
    """Whether ``display`` may be the product a question asked about with concentrations ``asked`` (either gives
    none, or they share one)."""
    if not asked:
        return True
    given = strengths(display)
    return not given or bool(given & asked)


def question_words(question: str) -> frozenset[str]:
    return frozenset(_stem(w) for w in words(question) if w not in _STOP)


def thread_name(tl: Timeline, ms: Sequence[int] | np.ndarray) -> str:
    """A thread's name: its concept's display when every memory shares it, else their common core name."""
    displays = list(dict.fromkeys(tl.display[int(i)] for i in ms))
    if len(displays) == 1:
        return displays[0]
    cores = {re.split(r"[(:;,]", d, maxsplit=1)[0].strip() for d in displays}
    return cores.pop() if len(cores) == 1 else displays[-1]


Name = tuple[frozenset[str], frozenset[str]]
"""(all words, core words) of one concept name."""


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
        ends = np.fromiter((_ends_order(tl, i) for i in range(size)), dtype=bool, count=size)
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
    thread: int
    score: float
    members: list[int] = field(default_factory=list)
    """Memory indices to serve, newest first."""
    roles: dict[int, str] = field(default_factory=dict)
    """Why a memory is served: current, latest, previous, first, highest, lowest, window, order, earlier."""


@dataclass
class Selection:
    picks: list[Pick]
    facts: list[Fact]
    named: list[int]
    """The threads the question names (one concept; or every order of one drug)."""


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
    matched: dict[int, tuple[frozenset[str] | None, frozenset[str] | None]] = {}
    for th in set().union(*(idx.by_word.get(w, ()) for w in q)) if q else set():
        k = seg_of[th]
        if not live[k]:
            continue
        cov, full, core = _match(q, idx.names[th])
        total[k] += LEXICAL_WEIGHT * cov
        matched[th] = (full, core)
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
        # An order goes by the drug's name and more ("LR (IV therapy: IV fluids)", "HYDROmorphone (Dilaudid)"): the
        # threads whose core name is the name the question used, or its core, are the same drug's.
        cores = {core for th in named for full, core in idx.names[th] if name in (full, core)}
        named += [th for th, (full, core) in matched.items() if th not in named
                  and (core == name or full == name or core in cores)]
        accepted = frozenset({name, *cores})
    # "Dextrose 5%" names neither Dextrose 50% nor its orders, though their core names are the same
    named = [th for th in named if of_strength(th)]
    if not named and (intent.kind in ("started", "stopped") or (intent.kind == "active" and intent.medications)):
        return _orders_by_time(tl, idx, view, intent, k_threads)
    if named and intent.kind == "active":
        # "Is X current": the named concept's threads at T; when none of them holds a current fact, HISTORY is
        # opened whatever the gate said, to show when and why the last one ended.
        return _is_current(tl, idx, view, intent, named, accepted, asked)
    if named and intent.kind == "changed_into":
        chosen = _changed_into(tl, idx, view, intent, named, accepted, asked)
        if chosen is not None:
            return chosen
    if named and intent.scope == "first" and intent.scope_of == "order":
        intent = _order_window(tl, idx, view, intent, named, name, asked)
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
            _fill(tl, view, ms[served[ms]], intent, pick, serve_history, k_history)
        else:
            _fill(tl, view, ms[served[ms]], None, pick, False, 0)
        if pick.members:
            picks.append(pick)
    facts: list[Fact] = []
    if named and picks and (intent.kind in ORDER_KINDS or picks[0].thread in first):
        # (a named thread with nothing in the question's window has no pick: no statement about another thread)
        fact = (_order_fact(tl, view, [p for p in picks if p.thread in first], intent, name)
                if intent.kind in ORDER_KINDS else _value_fact(tl, view, picks[0], intent))
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


def _groups(tl: Timeline, ms: np.ndarray) -> list[np.ndarray]:
    """Members split into groups recorded at the same clinical time (ascending)."""
    if ms.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(tl.t_start[ms])) + 1
    return list(np.split(ms, cuts))


def _fill(tl: Timeline, view: View, live: np.ndarray, intent: Intent | None, pick: Pick, serve_history: bool,
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


# --- orders as a category ---------------------------------------------------------------------------------------


def _ends_order(tl: Timeline, i: int) -> bool:
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
    return bool(view.history[i]) and _ends_order(tl, i)


def _end_time(tl: Timeline, i: int) -> float:
    return float(tl.t_ended[i]) if math.isfinite(tl.t_ended[i]) else float(tl.t_start[i])


def _ended_time(tl: Timeline, i: int) -> float:
    """When a memory stopped holding: its end, and no later than its encounter's end when it ends with it (a
    pharmacy stop recorded after the discharge did not hold past the discharge)."""
    return min(_end_time(tl, i), float(tl.enc_end[i]))


def _orders_by_time(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, k_threads: int) -> Selection:
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
        _fill(tl, view, live, Intent(kind=intent.kind), pick, False, 0)
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
    shown = _time(top_t)
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


def _is_current(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
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
    upto = f" as of {_time(view.at)}" if math.isfinite(view.at) else ""
    active = [i for i in cands if not view.history[i]]
    if active:
        units = {tl.source[i] or tl.ids[i] for i in active}
        served = _versions(tl, view, members, units)
        latest = max(active, key=lambda i: (tl.t_start[i], tl.ids[i]))
        open_end = "" if (math.isfinite(tl.t_end[latest]) or tl.encounter[latest]) else "; no end recorded"
        fact = Fact("active", f"{name}{upto}: yes, an active order, being received (one started "
                    f"{_at(tl, latest)}{open_end}).",
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
            f"{_at(tl, first)}, ended {_time(last_t)}{_why(tl, view, last, stay_end)}) had ended.")
    cited = tuple(dict.fromkeys(tl.ids[i] for i in [first, last, *enders]))
    picks = picks_by_thread(tl, served, "order")
    extra = picks_by_thread(tl, enders, "ended-by")
    return Selection(picks + extra, [Fact("active", text, cited)], list(named))


def picks_by_thread(tl: Timeline, members: Sequence[int], role: str) -> list[Pick]:
    """Members grouped by thread (threads by their newest member), each thread's newest first."""
    by_thread: dict[int, list[int]] = {}
    for i in members:
        by_thread.setdefault(int(tl.thread[i]), []).append(int(i))
    picks = [Pick(thread=th, score=0.0, members=sorted(ms, key=lambda i: (-tl.t_start[i], tl.ids[i])),
                  roles=dict.fromkeys(ms, role)) for th, ms in by_thread.items()]
    picks.sort(key=lambda p: (-max(tl.t_start[i] for i in p.members), p.thread))
    return picks


def _changed_into(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
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
        last = max(old, key=lambda i: (_end_time(tl, i), tl.ids[i]))
        state = (f"ended {_time(_end_time(tl, last))}{_why(tl, view, last, None)}" if view.history[last]
                 else "still active")
        of = _time(intent.about.timestamp()) if intent.about is not None else _at(tl, first)
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
    of = _time(intent.about.timestamp()) if intent.about is not None else _at(tl, first)
    text = f"the {tl.display[i]}{was} order of {of} was changed (at {_at(tl, j)}) into: {into}"
    picks = picks_by_thread(tl, list(dict.fromkeys(old + new)), "order")
    return Selection(picks, [Fact("changed_into", text, cited)], list(named))


def _order_window(tl: Timeline, idx: ThreadIndex, view: View, intent: Intent, named: Sequence[int],
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
                   f"{_time(start)}, to {end.strftime('%Y-%m-%d %H:%M')}")


# --- computed facts ---------------------------------------------------------------------------------------------


def fmt_value(tl: Timeline, i: int) -> str | None:
    v = tl.value[i]
    if math.isnan(v):
        return None
    unit = tl.unit[i]
    return f"{v:g} {unit}".strip() if unit else f"{v:g}"


def _time(t: float) -> str:
    d = from_epoch(t)
    return d.strftime("%Y-%m-%d %H:%M") if d else "an unknown time"


def _at(tl: Timeline, i: int) -> str:
    return _time(float(tl.t_start[i]))


def _one_value(tl: Timeline, ms: Sequence[int]) -> str | None:
    """The value of simultaneous results, when they agree."""
    vals = {fmt_value(tl, i) for i in ms}
    return vals.pop() if len(vals) == 1 else None


def _value_fact(tl: Timeline, view: View, pick: Pick, intent: Intent) -> Fact | None:
    roles = pick.roles

    def by(*role: str) -> list[int]:
        return [i for i in pick.members if roles.get(i) in role]

    name = thread_name(tl, pick.members)
    if intent.stay:
        name = f"{name} ({intent.stay})"
    cur = by("current", "latest")
    kind = intent.kind
    upto = f" up to {_time(view.at)}" if math.isfinite(view.at) else ""
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
        text = f"{name}, value before the most recent one (at {_at(tl, prev[0])}): {prev_v}"
        cited += prev
    elif kind == "first":
        first = by("first")
        first_v = _one_value(tl, first) if first else None
        if first_v is None:
            return None
        text = f"{name}, first value (at {_at(tl, first[0])}): {first_v}"
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
        times = f"at {_at(tl, ext[0])}" if len(ext) == 1 else f"{len(ext)} times, the latest at {_at(tl, ext[0])}"
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
                   f"({first_v} at {_at(tl, first[0])} to {cur_v} at {_at(tl, cur[0])}, the most recent)"
        else:
            text = f"{name}, from the first value (at {_at(tl, first[0])}) to the most recent " \
                   f"(at {_at(tl, cur[0])}): {first_v} to {cur_v}"
        cited = first + cited
    else:
        label = "most recent value" if roles.get(cur[0]) == "current" else "last value recorded"
        text = f"{name}, {label} (at {_at(tl, cur[0])}): {cur_v}"
    return Fact(kind, text, tuple(dict.fromkeys(tl.ids[i] for i in cited)))


def _order_fact(tl: Timeline, view: View, picks: Sequence[Pick], intent: Intent,
                name_words_: frozenset[str] | None) -> Fact | None:
    """About the orders of the named drug only (a thread may hold the order it was changed into): the current order's
    start, or when one was last discontinued or changed ("is X active" and "what was X changed into" have their own
    selections: :func:`_is_current`, :func:`_changed_into`)."""
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
        return Fact("started", f"{name}, current order started: {_at(tl, latest)}", (tl.ids[latest],))
    ended = [i for i in orders if discontinued(tl, view, i)]
    if not ended:
        return None
    last = max(ended, key=lambda i: _end_time(tl, i))
    return Fact("stopped", f"{name}, last discontinued or changed ({tl.reason[last]}): {_time(_end_time(tl, last))}",
                (tl.ids[last],))
