"""Deletion: the deletion gate's orders applied by the single writer of patient state, like entries (a versioned
commit, the transitions in an outbox, the vectors removed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from schemas import DeletionOrder, Store, TransitionEvent, TransitionKind
from stam.backends.base import Commit
from stam.deletion.candidates import keep_now
from stam.ids import transition_id
from stam.stages.deps import Deps, UpdateResult
from stam.stages.update import PatientWork, committed, decode_outbox


@dataclass
class DeletionResult(UpdateResult):
    skipped: dict[str, str] = field(default_factory=dict)
    """Memory id -> why the order's memory was not deleted (gone already, or kept by a rule now)."""


def delete_batch(orders: Sequence[DeletionOrder], deps: Deps) -> list[DeletionResult]:
    """Apply the deletion gate's orders in their order, like entries: versioned commit, transitions in an outbox,
    vectors removed. Idempotent: a replayed order finds its memories gone (and its outbox, if undelivered)."""
    return committed(lambda: _delete_batch_once(orders, deps), {o.patient_id for o in orders}, deps)


def _delete_batch_once(orders: Sequence[DeletionOrder], deps: Deps) -> list[DeletionResult]:
    work: dict[str, PatientWork] = {}
    deleted: dict[str, list[str]] = {}
    entries: dict[str, set[str]] = {}
    absent: dict[str, list[str]] = {}  # memories already gone: their vectors are removed again (a crash after commit)
    results: list[DeletionResult] = []
    for o in orders:
        pid = o.patient_id
        w = work.get(pid)
        if w is None:
            current = deps.states.load(pid)
            w = work[pid] = PatientWork(base_version=current.version, state=current.copy())
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
