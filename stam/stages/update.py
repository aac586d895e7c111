"""The update stage, the single writer of patient state: each entry's decisions applied to a working copy of its
patient's state (link and impact looked up again when what they read changed), then one versioned commit for the
batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

import orjson

from schemas import (
    Archive,
    AtomicMemory,
    ImpactedEntry,
    RecordEntry,
    RefusedArchive,
    Relation,
    Store,
    StoredMemory,
    TransitionEvent,
    TransitionKind,
)
from stam import lifecycle
from stam.backends.base import Commit, VectorRow
from stam.embedding import memory_vectors
from stam.errors import ConcurrentUpdate, EntryIdCollision, ReasoningError
from stam.ids import transition_id
from stam.integrity import archive_refusal
from stam.metrics import COMMIT_SECONDS
from stam.patient_state import PatientState
from stam.reasoning.base import Candidate, Impact
from stam.stages.changelog import VersionChange
from stam.stages.deps import Deps, UpdateResult
from stam.stages.extract import extract_stage
from stam.stages.impact import impact_stage
from stam.stages.link import link_stage
from stam.stages.reads import reads_for_update

R = TypeVar("R")


def decode_outbox(raw: bytes) -> list[TransitionEvent]:
    """The transitions of an outbox as the update stage wrote it (a JSON list)."""
    return [TransitionEvent.model_validate(e) for e in orjson.loads(raw)]


def update_stage(x: ImpactedEntry, deps: Deps) -> UpdateResult:
    """Decide and apply the transitions of one entry; idempotent under redelivery and replay."""
    return update_batch([x], deps)[0]


def update_batch(items: Sequence[ImpactedEntry], deps: Deps) -> list[UpdateResult]:
    """Apply entries in their order, each against the state its predecessors left.

    Results are the same as applying them one by one; the writes are grouped: one Milvus upsert per
    patient and one Redis transaction for the whole batch (versions checked for every patient in it).
    On a version conflict the whole batch is recomputed from the stored state.
    """
    return committed(lambda: _update_batch_once(items, deps), {x.entry.patient_id for x in items}, deps)


def committed(attempt: Callable[[], list[R]], patients: set[str], deps: Deps) -> list[R]:
    """``attempt`` (which reads the patients' states and commits with a version check) again from the stored
    state after a conflicting commit, up to ``commit_retries`` times."""
    for _attempt in range(deps.params.commit_retries):
        try:
            with deps.states.pinned_versions(patients):
                return attempt()
        except ConcurrentUpdate:
            continue
    raise ConcurrentUpdate(f"gave up after {deps.params.commit_retries} conflicting commits")


@dataclass
class PatientWork:
    """One patient's part of a batch: the state it was read at, its working copy, and what the commit writes."""

    base_version: int
    state: PatientState
    changed: dict[str, StoredMemory] = field(default_factory=dict)
    rows: dict[str, VectorRow] = field(default_factory=dict)
    outboxes: dict[str, bytes] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    log: list[VersionChange] = field(default_factory=list)
    """What each entry applied to the working copy changed, in version order (recorded once committed)."""


def _update_batch_once(items: Sequence[ImpactedEntry], deps: Deps) -> list[UpdateResult]:
    work: dict[str, PatientWork] = {}
    results: list[UpdateResult] = []
    for x in items:
        pid = x.entry.patient_id
        w = work.get(pid)
        if w is None:
            current = deps.states.load(pid)
            w = work[pid] = PatientWork(base_version=current.version, state=current.copy())
        state = w.state
        if x.memories and all(state.get(m.memory_id) for m in x.memories):
            if any(state.memories[m.memory_id].memory.source_system != m.source_system for m in x.memories):
                # Not a redelivery: another source system (or an unsigned producer) used this entry id first.
                raise EntryIdCollision("entry id already applied from another source system; not applied "
                                       "(a forged entry may have taken the id first)")
            pending = None if x.entry.entry_id in w.outboxes else deps.states.pending_outbox(pid, x.entry.entry_id)
            results.append(UpdateResult(decode_outbox(pending) if pending else [], state.version, duplicate=True))
            continue
        changes = (None if x.deferred or state.version == x.state_version
                   else deps.changes.since(pid, x.state_version, w.base_version, w.log))
        relations, candidates, reads = reads_for_update(x, state, changes, deps)
        events, changed = _apply(x, relations, candidates, state, deps)
        if not x.deferred:  # the one-hop path links at the update: it never reads the log, so it keeps none
            w.log.append(VersionChange.of(state.version, list(changed), events, x.memories))
        rows = [VectorRow(mid, vec, changed[mid].store) for mid, vec in zip(
            changed, memory_vectors([c.memory for c in changed.values()], deps.embedder), strict=True)]
        deps.vectors.committed(pid, state.version - 1, state.version, rows)
        w.changed.update(changed)
        w.rows.update((r.memory_id, r) for r in rows)
        w.outboxes[x.entry.entry_id] = orjson.dumps([e.model_dump(mode="json") for e in events])
        if x.entry.text and x.entry.text.strip():
            w.sources[x.entry.entry_id] = x.entry.text
        results.append(UpdateResult(events, state.version, reads=reads))

    commits = [Commit(patient_id=pid, expected_version=w.base_version, state=w.state,
                      changed=list(w.changed.values()), outboxes=w.outboxes, sources=w.sources)
               for pid, w in work.items() if w.outboxes]
    try:
        if commits:
            with COMMIT_SECONDS.labels(store="milvus").time():
                for c in commits:
                    deps.vectors.place(c.patient_id, list(work[c.patient_id].rows.values()))
            with COMMIT_SECONDS.labels(store="redis").time():
                deps.states.commit_many(commits)
    except BaseException:
        for pid in work:
            deps.vectors.forget(pid)
        raise
    for pid, w in work.items():
        deps.changes.record(pid, w.log)
    return results


@dataclass
class _Transitions:
    """The transitions one entry makes, in the order they are emitted."""

    entry: RecordEntry
    now: datetime
    version: int
    """The state version the entry leaves."""
    added_relations: dict[str, list[Relation]]
    """The relations the entry added, by source memory (more are added while its decisions are applied)."""
    events: list[TransitionEvent] = field(default_factory=list)

    def emit(self, kind: TransitionKind, stored: StoredMemory, from_store: Store | None,
             evidence: AtomicMemory | None, memory: AtomicMemory | None = None,
             refused: tuple[RefusedArchive, ...] = (), evidence_id: str | None = None,
             clinical_time: datetime | None = None) -> None:
        """``evidence``: the memory whose arrival caused it (its clinical time is the transition's); a lifecycle
        ending gives its own ``clinical_time`` and ``evidence_id`` instead."""
        if evidence is not None:
            evidence_id = evidence.memory_id if kind is not TransitionKind.ADDED else None
            clinical_time = evidence.effective_end or evidence.effective_start
        entry = self.entry
        self.events.append(TransitionEvent(
            transition_id=transition_id(entry.entry_id, stored.memory.memory_id, kind.value),
            patient_id=entry.patient_id, entry_id=entry.entry_id, sequence=len(self.events), kind=kind,
            memory_id=stored.memory.memory_id, from_store=from_store,
            to_store=stored.store if kind is not TransitionKind.DELETE_PROPOSED else None,
            reason=stored.reason, successor_id=stored.successor_id,
            evidence_id=evidence_id if kind in (TransitionKind.ARCHIVED, TransitionKind.RESTORED) else None,
            clinical_time=clinical_time,
            recorded_at=self.now, state_version=self.version, memory=memory,
            relations=tuple(self.added_relations.get(memory.memory_id, ())) if memory else (),
            refused=refused,
        ))


def _archives(entry: RecordEntry, m: AtomicMemory, asked: Sequence[Archive], state: PatientState,
              new_ids: set[str]) -> tuple[list[Archive], list[RefusedArchive]]:
    """The archives a decision about ``m`` asked for that may be made (of ACTIVE prior memories, once each), and
    those the integrity rules refuse (:func:`stam.integrity.archive_refusal`)."""
    allowed: list[Archive] = []
    refused: list[RefusedArchive] = []
    for a in asked:
        target = state.get(a.memory_id)
        if (target is None or target.store is not Store.ACTIVE or a.memory_id in new_ids
                or any(a.memory_id == b.memory_id for b in allowed)):
            continue
        why = archive_refusal(entry, m, target.memory, a)
        if why is None:
            allowed.append(a)
        else:
            refused.append(RefusedArchive(memory_id=a.memory_id, reason=a.reason, why=why))
    return allowed, refused


def _apply(x: ImpactedEntry, relations: Sequence[Relation],
           candidates: dict[str, list[Impact]], state: PatientState,
           deps: Deps) -> tuple[list[TransitionEvent], dict[str, StoredMemory]]:
    """Apply one entry to ``state`` in place (a working copy); its version advances by one."""
    entry = x.entry
    now = deps.clock()
    new_version = state.version + 1
    ended_before = lifecycle.ended_encounters(state, x.memories)  # before this entry's records open any again

    for m in x.memories:
        state.add(m, Store.ACTIVE)
    added_relations: dict[str, list[Relation]] = {}
    for r in relations:
        if state.relate(r):
            added_relations.setdefault(r.source_id, []).append(r)

    changed: dict[str, StoredMemory] = {}
    new_ids = {m.memory_id for m in x.memories}
    out = _Transitions(entry, now, new_version, added_relations)
    emit = out.emit

    proposed: set[str] = set()
    # Candidates are prior memories only (never this entry's), so the decisions of the entry's memories
    # are independent and are asked for together; they are applied in order.
    decisions = deps.router.update_many(entry, [
        (m, [Candidate(state.memories[c.memory_id], c) for c in candidates.get(m.memory_id, ())
             if c.memory_id in state.memories and c.memory_id not in new_ids])
        for m in x.memories])
    for m, decision in zip(x.memories, decisions, strict=True):
        if decision.memory_id != m.memory_id:
            raise ReasoningError("update decision names another memory")
        for r in decision.relations:
            if r.source_id != m.memory_id:
                raise ReasoningError("a relation of an update decision must start at its memory")
            if state.relate(r):
                added_relations.setdefault(r.source_id, []).append(r)
        # An event, or an encounter's record saying it ended: HISTORY whatever the reasoner said.
        forced = lifecycle.placement(m) if deps.params.lifecycle else None
        if decision.placement is Store.HISTORY:
            if decision.placement_reason is None:
                raise ReasoningError("a memory placed in HISTORY needs a reason")
            stored = state.archive(m.memory_id, reason=decision.placement_reason,
                                   successor_id=decision.successor_id, evidence_id=None,
                                   entry_id=entry.entry_id, at=now)
        elif forced is not None:
            stored = state.archive(m.memory_id, reason=forced, successor_id=None, evidence_id=None,
                                   entry_id=entry.entry_id, at=now)
        else:
            stored = state.memories[m.memory_id]
        changed[m.memory_id] = stored
        allowed, refused = _archives(entry, m, decision.archive, state, new_ids)
        emit(TransitionKind.ADDED, stored, None, m, memory=m, refused=tuple(refused))
        for a in allowed:
            moved = state.archive(a.memory_id, reason=a.reason, successor_id=a.successor_id,
                                  evidence_id=m.memory_id, entry_id=entry.entry_id, at=now)
            changed[a.memory_id] = moved
            emit(TransitionKind.ARCHIVED, moved, Store.ACTIVE, m)
        for d in decision.delete_proposals:
            target = state.get(d)
            if target is not None and target.store is Store.HISTORY and d not in proposed:
                proposed.add(d)  # one proposal per memory and entry: transition ids stay unique
                emit(TransitionKind.DELETE_PROPOSED, target, Store.HISTORY, m)
    # The lifecycle, after the judgements and on the clock they moved: a cancelled end first, then what is over.
    if deps.params.lifecycle:
        _lifecycle(state, x, ended_before, changed, emit, now)
    state.version = new_version
    return out.events, changed


def _lifecycle(state: PatientState, x: ImpactedEntry, ended_before: dict[str, bool],
               changed: dict[str, StoredMemory], emit: Callable[..., None], now: datetime) -> None:
    for mid, evidence_id in lifecycle.reopened(state, x.memories, ended_before):
        back = state.reinstate(mid)
        changed[mid] = back
        cancelling = state.memories[evidence_id].memory  # when the cancellation was recorded, else its own time
        emit(TransitionKind.RESTORED, back, Store.HISTORY, None, evidence_id=evidence_id,
             clinical_time=cancelling.recorded_at or cancelling.effective_start)
    for ending in lifecycle.endings(state):
        moved = state.archive(ending.memory_id, reason=ending.reason, successor_id=None,
                              evidence_id=ending.evidence_id, entry_id=x.entry.entry_id, at=now,
                              ended_at=ending.ended_at)
        changed[ending.memory_id] = moved
        emit(TransitionKind.ARCHIVED, moved, Store.ACTIVE, None, evidence_id=ending.evidence_id,
             clinical_time=ending.ended_at)


def process_entry(entry: RecordEntry, deps: Deps) -> UpdateResult:
    """All four stages in sequence for one entry (tests, tools, and the reference for the workers)."""
    return update_stage(impact_stage(link_stage(extract_stage(entry, deps), deps), deps), deps)
