"""The four write-path stages as plain functions over one deps object.

Workers are thin wrappers around these; tests call them without a broker.

Per-patient order (DESIGN-NOTES): link and impact record the patient state version they read. The
update stage re-reads the state; if the version moved (an earlier entry of the same patient was applied
in between, because the stages pipeline), it redoes link and impact against the current state before
deciding. The commit itself is conditional on the version it read, so no two writers interleave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, TypeVar, cast

import numpy as np
import orjson

from schemas import (
    ENDING_ROLES,
    Archive,
    AtomicMemory,
    Channel,
    DeletionOrder,
    ExtractedEntry,
    ImpactedEntry,
    LinkedEntry,
    RecordEntry,
    RefusedArchive,
    Relation,
    RelationType,
    Store,
    StoredMemory,
    TransitionEvent,
    TransitionKind,
)
from stam import lifecycle
from stam.embedding import Embedder, memory_vectors
from stam.errors import ConcurrentUpdate, EntryIdCollision, ReasoningError
from stam.ids import transition_id
from stam.integrity import archive_refusal, stamp
from stam.reasoning.base import Candidate, Impact, Router
from stam.state import PatientState
from stam.stores.base import Commit, Hit, StateStore, VectorRow, VectorStore

R = TypeVar("R")


def _utcnow() -> datetime:
    return datetime.now(UTC)


class InFlight:
    """Per patient, the state version at which this worker last forwarded an entry from the link stage.

    Every applied entry advances the version by one. If the link stage sees a patient at the same version
    it last forwarded one at, that entry has not been applied yet, so anything computed now is certain to
    be stale when this entry reaches the update stage: the link stage defers the work instead of doing it
    twice. A patient not tracked here (a restart, a rebalance, eviction) simply gets the work done now.
    """

    def __init__(self, max_patients: int = 100_000) -> None:
        self._seen: dict[str, int] = {}
        self._max = max_patients

    def defer(self, patient_id: str, version: int) -> bool:
        stale = self._seen.get(patient_id) == version
        if len(self._seen) >= self._max and patient_id not in self._seen:
            self._seen.clear()
        self._seen[patient_id] = version
        return stale


@dataclass(frozen=True)
class StageParams:
    """The write path's frozen parameters (set from Settings by the composition root, or by an evaluation)."""

    impact_budget: int = 48
    """Semantic top-B of impact retrieval (the paper's 48)."""
    graph_seeds: int = 3
    """ACTIVE neighbours a model memory's graph hop starts from when it has no relation yet."""
    graph_seed_min: float = 0.5
    """Least cosine for such a neighbour."""
    code_history: int = 16
    """HISTORY memories of the same concept the code channel brings, the last recorded (with every ACTIVE one):
    a lab test done 2,000 times would otherwise bring 2,000 candidates to every new value, and the cost of an entry
    would grow with the record. Older values of the concept remain reachable through the semantic channel."""
    impact_channels: frozenset[Channel] = frozenset(Channel)
    """Channels impact retrieval uses; ``{SEMANTIC}`` is the paper's semantic-only ablation (stam eval)."""
    commit_retries: int = 5
    """Recomputations of a batch whose commit met a newer version, before giving up."""
    lifecycle: bool = True
    """The lifecycle's placements and endings (``stam.lifecycle``); off only for the evaluation's baselines that
    accumulate (append-only) or follow the paper's concept rules alone."""


@dataclass
class Deps:
    """What the stages need, in three parts: the services they call (interfaces: any implementation, a
    projection in front of Milvus included), the frozen parameters, and this worker's own state."""

    # interfaces
    router: Router
    embedder: Embedder
    states: StateStore
    vectors: VectorStore
    clock: Callable[[], datetime] = field(default=_utcnow)
    # frozen parameters
    params: StageParams = field(default_factory=StageParams)
    # worker-local state: never shared between processes, safe to lose
    inflight: InFlight = field(default_factory=InFlight)


@dataclass
class UpdateResult:
    transitions: list[TransitionEvent]
    state_version: int
    duplicate: bool = False
    redone: bool = False


# --- extract ---------------------------------------------------------------------------------------

def extract_stage(entry: RecordEntry, deps: Deps) -> ExtractedEntry:
    """Atomic memories of one entry (coded entries exactly; free text by the model when configured)."""
    return _checked(entry, deps.router.extract(entry))


def extract_signed_batch(items: Sequence[tuple[RecordEntry, str | None]], deps: Deps) -> list[ExtractedEntry]:
    """:func:`extract_batch` over entries whose source identity the worker verified (``None``: unsigned); every
    memory carries its entry's verified source system (``AtomicMemory.source_system``)."""
    out = extract_batch([entry for entry, _ in items], deps)
    return [x.model_copy(update={"memories": stamp(x.memories, source)})
            for x, (_, source) in zip(out, items, strict=True)]


def _checked(entry: RecordEntry, memories: Sequence[AtomicMemory]) -> ExtractedEntry:
    for m in memories:
        if m.patient_id != entry.patient_id or m.entry_id != entry.entry_id:
            raise ReasoningError("extracted memory does not belong to its entry")
    return ExtractedEntry(entry=entry, memories=tuple(_scoped(entry, m) for m in memories))


def _scoped(entry: RecordEntry, memory: AtomicMemory) -> AtomicMemory:
    """The memory with its entry's encounter (a fact the language model read in a note belongs to the note's
    encounter; the coded reasoner sets it, and the lifecycle of the entry's own facts, itself)."""
    if memory.encounter_id is None and entry.encounter is not None:
        return memory.model_copy(update={"encounter_id": entry.encounter})
    return memory


# --- link ------------------------------------------------------------------------------------------

def _link(entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState, deps: Deps) -> list[Relation]:
    return deps.router.link(entry, memories, state)


def extract_batch(entries: Sequence[RecordEntry], deps: Deps) -> list[ExtractedEntry]:
    """:func:`extract_stage` for each entry; the model calls of the batch are in flight together. An
    entry that fails raises, and the worker re-runs the batch one entry at a time (model replies are
    cached, so the others do not pay twice)."""
    out = []
    for entry, result in zip(entries, deps.router.extract_many(entries), strict=True):
        if isinstance(result, BaseException):
            raise result
        out.append(_checked(entry, result))
    return out


def link_batch(items: Sequence[ExtractedEntry], deps: Deps) -> list[LinkedEntry]:
    """:func:`link_stage` for each item, reading every patient's state version in one round trip."""
    with deps.states.pinned_versions({x.entry.patient_id for x in items}):
        return [link_stage(x, deps) for x in items]


def link_stage(x: ExtractedEntry, deps: Deps) -> LinkedEntry:
    """Typed relations from the new memories to the patient's ACTIVE memories."""
    version = deps.states.version(x.entry.patient_id)
    if deps.inflight.defer(x.entry.patient_id, version):
        # Deferred: only the version is needed, not the patient's state.
        return LinkedEntry(entry=x.entry, memories=x.memories, relations=(), state_version=version,
                           deferred=True)
    state = deps.states.load(x.entry.patient_id)
    relations = _link(x.entry, x.memories, state, deps)
    return LinkedEntry(entry=x.entry, memories=x.memories, relations=tuple(relations),
                       state_version=state.version)


# --- impact ----------------------------------------------------------------------------------------

def _semantic(memories: Sequence[AtomicMemory], vectors: np.ndarray, state: PatientState,
              deps: Deps) -> list[list[Hit]]:
    return deps.vectors.nearest(state.patient_id, state.version, vectors, deps.params.impact_budget,
                                exclude={m.memory_id for m in memories})


@lru_cache(maxsize=16)
def _channels(chans: frozenset[Channel]) -> tuple[Channel, ...]:
    return tuple(sorted(chans))  # sorting enums is slow; there are only 7 combinations


EXPLICIT_ROLES = ENDING_ROLES
"""Reference roles that name a source resource the entry ends; its memories are always impact candidates."""


def _impact(memories: Sequence[AtomicMemory], relations: Sequence[Relation], state: PatientState,
            deps: Deps, entry: RecordEntry | None = None) -> dict[str, list[Impact]]:
    """Semantic top-B over ACTIVE+HISTORY, exact-concept matches, resources the entry explicitly replaces or
    discontinues, and one graph hop, per new memory."""
    channels = deps.params.impact_channels
    explicit = ([r.target for r in (entry.references if entry else ()) if r.role in EXPLICIT_ROLES]
                if Channel.CODE in channels else [])
    vectors = memory_vectors(memories, deps.embedder)
    semantic = _semantic(memories, vectors, state, deps)
    known = state.memories
    new_ids = {m.memory_id for m in memories}
    out: dict[str, list[Impact]] = {}
    for m, hits in zip(memories, semantic, strict=True):
        # memory id -> [channels, best score, strongest graph relation (weight, type)]
        found: dict[str, list[Any]] = {}

        def note(mid: str, channel: Channel, score: float, rel: tuple[float, RelationType] | None = None,
                 found: dict[str, list[Any]] = found) -> None:
            if mid in new_ids or mid not in known:
                return
            slot = found.get(mid)
            if slot is None:
                found[mid] = [{channel}, score, rel]
                return
            slot[0].add(channel)
            slot[1] = max(slot[1], score)
            if rel is not None and (slot[2] is None or rel[0] > slot[2][0]):
                slot[2] = rel

        for h in hits if Channel.SEMANTIC in channels else ():
            note(h.memory_id, Channel.SEMANTIC, h.score)
        if m.concept_key and Channel.CODE in channels:
            for s in state.recent_by_concept(m.concept_key, deps.params.code_history):
                note(s.memory.memory_id, Channel.CODE, 1.0)
        for ref in ([m.source_ref] if m.source_ref and Channel.CODE in channels else []) + explicit:
            for s in state.by_source(ref):
                note(s.memory.memory_id, Channel.CODE, 1.0)
        # Graph channel: the memories this entry links ``m`` to, and one hop from each of them in the
        # stored graph; a neighbour is scored by its strongest relation on that path.
        seeds: list[tuple[str, float, RelationType | None]] = [
            (r.target_id if r.source_id == m.memory_id else r.source_id, r.weight, r.type)
                 for r in relations if m.memory_id in (r.source_id, r.target_id)]
        if not seeds and deps.router.links_at_update(m):
            # Relations of a model memory are decided with its update (one call), so the hop starts from
            # its closest ACTIVE neighbours in meaning, the memories it would most likely be linked to.
            seeds = [(h.memory_id, h.score, cast(RelationType | None, None)) for h in hits
                     if h.score >= deps.params.graph_seed_min and h.memory_id in known
                     and known[h.memory_id].store is Store.ACTIVE][: deps.params.graph_seeds]
        for linked, weight, rtype0 in seeds if Channel.GRAPH in channels else ():
            if rtype0 is not None:
                note(linked, Channel.GRAPH, weight, (weight, rtype0))
            for nb, rtype, w in state.neighbours(linked):
                score = min(weight, w)
                note(nb, Channel.GRAPH, score, (score, rtype))
        ranked = sorted(found.items(), key=lambda kv: -kv[1][1])
        out[m.memory_id] = [
            Impact(mid, known[mid].store, _channels(frozenset(chans)), round(score, 6), rel[1] if rel else None)
            for mid, (chans, score, rel) in ranked
        ]
    return out


def impact_batch(items: Sequence[LinkedEntry], deps: Deps) -> list[ImpactedEntry]:
    """:func:`impact_stage` for each item; the batch's new texts are embedded in one model call and
    every patient's state version is read in one round trip."""
    memory_vectors([m for x in items for m in x.memories], deps.embedder)
    with deps.states.pinned_versions({x.entry.patient_id for x in items}):
        return [impact_stage(x, deps) for x in items]


def impact_stage(x: LinkedEntry, deps: Deps) -> ImpactedEntry:
    """Prior memories (both stores) whose validity the new memories may affect."""
    if x.deferred:
        return ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={},
                             state_version=x.state_version, deferred=True)
    state = deps.states.load(x.entry.patient_id)
    relations: Sequence[Relation] = x.relations
    if state.version != x.state_version:
        relations = _link(x.entry, x.memories, state, deps)
    candidates = _impact(x.memories, relations, state, deps, x.entry)
    return ImpactedEntry(entry=x.entry, memories=x.memories, relations=tuple(relations),
                         candidates={k: tuple(c.to_wire() for c in v) for k, v in candidates.items()},
                         state_version=state.version)


def deferred_to_update(items: Sequence[ExtractedEntry]) -> list[ImpactedEntry]:
    """Extracted entries handed straight to :func:`update_batch` (the one-hop write path, ``stam worker --stages
    fused``): their linking and impact retrieval are done there, each on the working copy of its patient's state
    with every earlier entry of the batch applied, the way the update stage redoes an entry whose link and impact
    went stale. The version is not read (a deferred entry's is never compared)."""
    return [ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={}, state_version=0,
                          deferred=True) for x in items]


# --- update ----------------------------------------------------------------------------------------

def decode_outbox(raw: bytes) -> list[TransitionEvent]:
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
    return _committed(lambda: _update_batch_once(items, deps), {x.entry.patient_id for x in items}, deps)


def _committed(attempt: Callable[[], list[R]], patients: set[str], deps: Deps) -> list[R]:
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
class _PatientWork:
    base_version: int
    state: PatientState
    changed: dict[str, StoredMemory] = field(default_factory=dict)
    rows: dict[str, VectorRow] = field(default_factory=dict)
    outboxes: dict[str, bytes] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def _update_batch_once(items: Sequence[ImpactedEntry], deps: Deps) -> list[UpdateResult]:
    work: dict[str, _PatientWork] = {}
    results: list[UpdateResult] = []
    for x in items:
        pid = x.entry.patient_id
        w = work.get(pid)
        if w is None:
            current = deps.states.load(pid)
            w = work[pid] = _PatientWork(base_version=current.version, state=current.copy())
        state = w.state
        if x.memories and all(state.get(m.memory_id) for m in x.memories):
            if any(state.memories[m.memory_id].memory.source_system != m.source_system for m in x.memories):
                # Not a redelivery: another source system (or an unsigned producer) used this entry id first.
                raise EntryIdCollision("entry id already applied from another source system; not applied "
                                       "(a forged entry may have taken the id first)")
            pending = None if x.entry.entry_id in w.outboxes else deps.states.pending_outbox(pid, x.entry.entry_id)
            results.append(UpdateResult(decode_outbox(pending) if pending else [], state.version, duplicate=True))
            continue
        redone = x.deferred or state.version != x.state_version
        relations: Sequence[Relation] = x.relations
        candidates = {k: [Impact.from_wire(c) for c in v] for k, v in x.candidates.items()}
        if redone:
            relations = _link(x.entry, x.memories, state, deps)
            candidates = _impact(x.memories, relations, state, deps, x.entry)
        events, changed = _apply(x, relations, candidates, state, deps)
        rows = [VectorRow(mid, vec, changed[mid].store) for mid, vec in zip(
            changed, memory_vectors([c.memory for c in changed.values()], deps.embedder), strict=True)]
        deps.vectors.committed(pid, state.version - 1, state.version, rows)
        w.changed.update(changed)
        w.rows.update((r.memory_id, r) for r in rows)
        w.outboxes[x.entry.entry_id] = orjson.dumps([e.model_dump(mode="json") for e in events])
        if x.entry.text and x.entry.text.strip():
            w.sources[x.entry.entry_id] = x.entry.text
        results.append(UpdateResult(events, state.version, redone=redone))

    commits = [Commit(patient_id=pid, expected_version=w.base_version, state=w.state,
                      changed=list(w.changed.values()), outboxes=w.outboxes, sources=w.sources)
               for pid, w in work.items() if w.outboxes]
    try:
        for c in commits:
            deps.vectors.place(c.patient_id, list(work[c.patient_id].rows.values()))
        if commits:
            deps.states.commit_many(commits)
    except BaseException:
        for pid in work:
            deps.vectors.forget(pid)
        raise
    return results


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

    events: list[TransitionEvent] = []
    changed: dict[str, StoredMemory] = {}
    new_ids = {m.memory_id for m in x.memories}

    def emit(kind: TransitionKind, stored: StoredMemory, from_store: Store | None,
             evidence: AtomicMemory | None, memory: AtomicMemory | None = None,
             refused: tuple[RefusedArchive, ...] = (), evidence_id: str | None = None,
             clinical_time: datetime | None = None) -> None:
        """``evidence``: the memory whose arrival caused it (its clinical time is the transition's); a lifecycle
        ending gives its own ``clinical_time`` and ``evidence_id`` instead."""
        if evidence is not None:
            evidence_id = evidence.memory_id if kind is not TransitionKind.ADDED else None
            clinical_time = evidence.effective_end or evidence.effective_start
        events.append(TransitionEvent(
            transition_id=transition_id(entry.entry_id, stored.memory.memory_id, kind.value),
            patient_id=entry.patient_id, entry_id=entry.entry_id, sequence=len(events), kind=kind,
            memory_id=stored.memory.memory_id, from_store=from_store,
            to_store=stored.store if kind is not TransitionKind.DELETE_PROPOSED else None,
            reason=stored.reason, successor_id=stored.successor_id,
            evidence_id=evidence_id if kind in (TransitionKind.ARCHIVED, TransitionKind.RESTORED) else None,
            clinical_time=clinical_time,
            recorded_at=now, state_version=new_version, memory=memory,
            relations=tuple(added_relations.get(memory.memory_id, ())) if memory else (),
            refused=refused,
        ))

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
        allowed: list[Archive] = []
        refused: list[RefusedArchive] = []
        for a in decision.archive:
            target = state.get(a.memory_id)
            if (target is None or target.store is not Store.ACTIVE or a.memory_id in new_ids
                    or any(a.memory_id == b.memory_id for b in allowed)):
                continue
            why = archive_refusal(entry, m, target.memory, a)
            if why is None:
                allowed.append(a)
            else:
                refused.append(RefusedArchive(memory_id=a.memory_id, reason=a.reason, why=why))
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
    return events, changed


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


# --- deletion (the gate's orders, applied by the single writer) ------------------------------------------

@dataclass
class DeletionResult(UpdateResult):
    skipped: dict[str, str] = field(default_factory=dict)
    """Memory id -> why the order's memory was not deleted (gone already, or kept by a rule now)."""


def delete_batch(orders: Sequence[DeletionOrder], deps: Deps) -> list[DeletionResult]:
    """Apply the deletion gate's orders in their order, like entries: versioned commit, transitions in an outbox,
    vectors removed. Idempotent: a replayed order finds its memories gone (and its outbox, if undelivered)."""
    return _committed(lambda: _delete_batch_once(orders, deps), {o.patient_id for o in orders}, deps)


def _delete_batch_once(orders: Sequence[DeletionOrder], deps: Deps) -> list[DeletionResult]:
    from stam.deletion.candidates import keep_now

    work: dict[str, _PatientWork] = {}
    deleted: dict[str, list[str]] = {}
    entries: dict[str, set[str]] = {}
    absent: dict[str, list[str]] = {}  # memories already gone: their vectors are removed again (a crash after commit)
    results: list[DeletionResult] = []
    for o in orders:
        pid = o.patient_id
        w = work.get(pid)
        if w is None:
            current = deps.states.load(pid)
            w = work[pid] = _PatientWork(base_version=current.version, state=current.copy())
        state = w.state
        pending = None if o.order_id in w.outboxes else deps.states.pending_outbox(pid, o.order_id)
        if pending:
            results.append(DeletionResult(decode_outbox(pending), state.version, duplicate=True))
            continue
        now = deps.clock()
        events: list[TransitionEvent] = []
        skipped: dict[str, str] = {}
        for mid, verdict in zip(o.memory_ids, o.verdicts, strict=True):
            stored = state.get(mid)
            why = ("gone" if stored is None else "active" if stored.store is Store.ACTIVE
                   else (keep_now(state, mid) or None))
            if why is not None:
                skipped[mid] = str(why)
                if stored is None:
                    absent.setdefault(pid, []).append(mid)
                continue
            assert stored is not None
            entries.setdefault(pid, set()).add(stored.memory.entry_id)
            for moved in state.delete(mid):
                w.changed[moved.memory.memory_id] = moved
            w.changed.pop(mid, None)
            deleted.setdefault(pid, []).append(mid)
            events.append(TransitionEvent(
                transition_id=transition_id(o.order_id, mid, TransitionKind.DELETED.value), patient_id=pid,
                entry_id=o.order_id, sequence=len(events), kind=TransitionKind.DELETED, memory_id=mid,
                from_store=Store.HISTORY, to_store=None, reason=stored.reason, successor_id=stored.successor_id,
                recorded_at=now, state_version=state.version + 1, gate=verdict))
        if not events:
            results.append(DeletionResult([], state.version, skipped=skipped))
            continue
        state.version += 1
        deps.vectors.forget(pid)
        w.outboxes[o.order_id] = orjson.dumps([e.model_dump(mode="json") for e in events])
        results.append(DeletionResult(events, state.version, skipped=skipped))

    commits = []
    for pid, w in work.items():
        if not w.outboxes:
            continue
        gone = deleted.get(pid, [])
        cited = {s.memory.entry_id for s in w.state.memories.values()}
        dropped = sorted(entries.get(pid, set()) - cited)  # an entry's text goes with its last memory
        commits.append(Commit(patient_id=pid, expected_version=w.base_version, state=w.state,
                              changed=list(w.changed.values()), outboxes=w.outboxes, deleted=gone,
                              dropped_sources=dropped))
    try:
        if commits:
            deps.states.commit_many(commits)
    except BaseException:
        for pid in work:
            deps.vectors.forget(pid)
        raise
    # After the record: a vector left by a crash here is removed when the order is replayed (``absent``).
    for pid in work:
        ids = deleted.get(pid, []) + absent.get(pid, [])
        if ids:
            deps.vectors.delete(pid, ids)
    return results
