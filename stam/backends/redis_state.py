"""Patient state in Redis: the igraph snapshot, the memory records and the version, committed atomically.

Keys (the ``{patient}`` hash tag keeps one patient's keys in one Redis Cluster slot):

- ``<prefix>:{<patient>}:ver``     integer version, incremented by every applied entry
- ``<prefix>:{<patient>}:graph``   igraph snapshot (JSON: vertex names, typed weighted edges)
- ``<prefix>:{<patient>}:glog``    list of the graph changes made after that snapshot (JSON each: add a vertex,
                                    add an edge, remove a vertex); a commit appends its changes, and folds the
                                    log into a new snapshot when the log is longer than that snapshot
                                    (:data:`COMPACT_MIN`), so a commit's cost does not grow with the patient
- ``<prefix>:{<patient>}:mem``     hash memory_id -> StoredMemory JSON
- ``<prefix>:{<patient>}:src``     hash entry_id -> entry text, for entries that carry text (source spans
                                    at read time; not in the transition log, so a rebuild does not restore it)
- ``<prefix>:{<patient>}:outbox:<entry>``  transitions of an applied entry not yet confirmed delivered
- ``<prefix>:{<patient>}:gaps``    hash gap field -> RecordGap JSON: dead-lettered entries not applied (the
                                    field is the entry id, or ``dl:<dead letter id>`` when the entry id is
                                    unknown); a commit that applies an entry removes its gap in the same
                                    transaction
- ``<prefix>:{<patient>}:gaplog``  hash dead letter id -> JSON: what an operator did with it (replayed,
                                    dismissed: who, when, why)
- ``<prefix>:deadletters:log``     the same, for dead letters of no known patient
- ``<prefix>:patients``            set of patient ids (for erasure and export tooling)
- ``<prefix>:epoch``, ``<prefix>:wseq``  durability marks: an id set once when the store is first written,
                                    and a counter every commit increments. A store that lost writes shows a
                                    lower counter (or another epoch) than a writer has seen or checkpointed.

``<patient>`` and ``<entry>`` are percent-escaped (:func:`key_part`): every character outside
``A-Z a-z 0-9 - . _ ~ / @ + =`` becomes ``%XX`` (UTF-8), so an id can hold neither the hash-tag braces, nor
``:outbox:``, nor a glob character; UUIDs and numeric ids are unchanged. Scans parse keys back with
:func:`unkey_part` and only accept keys of this exact shape.

A commit uses WATCH/MULTI on the version key, so two writers cannot silently overwrite each other; it also
watches the durability marks and refuses (``StateRolledBack``) to write on a store that went backwards.
A warm per-process cache of :class:`PatientState` is checked against the version key on every load.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from threading import Lock
from typing import Any
from urllib.parse import quote, unquote

import orjson
import redis

from schemas import StoredMemory
from schemas.query import RecordGap
from stam.backends import rows
from stam.backends.base import Commit, StateStore
from stam.backends.redis_cache import as_bytes
from stam.cache import LRU
from stam.errors import ConcurrentUpdate, StateRolledBack
from stam.patient_state import PatientState

log = logging.getLogger("stam.backends")

_SAFE = "-._~/@+="

COMPACT_MIN = 1024
"""A patient's graph log is folded into a new snapshot once it holds this many changes and more than the stored
snapshot has vertices and edges: writing a snapshot (linear in the graph) then happens once per as many changes as
the graph had, so its cost per change stays bounded, and a load reads at most about twice the graph."""


def key_part(value: str) -> str:
    """An id as it appears inside a key: percent-escaped outside ``A-Za-z0-9-._~/@+=``."""
    return quote(value, safe=_SAFE)


def unkey_part(value: str) -> str:
    return unquote(value)


def glob_escape(value: str) -> str:
    """``value`` as a literal inside a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", value)


class RedisStateStore(StateStore):
    def __init__(self, client: redis.Redis, *, prefix: str = "stam", cache_size: int = 2000) -> None:
        self._r = client
        self._prefix = prefix
        self._cache: LRU[str, PatientState] = LRU(cache_size)
        self._lock = Lock()
        self._pinned: dict[str, int] = {}
        self._seen: tuple[str | None, int] = (None, 0)
        """The highest durability marks (epoch, write counter) this process has written or checked."""

    def marks(self) -> tuple[str | None, int]:
        """The store's durability marks now: (epoch or None for an empty store, write counter)."""
        epoch, wseq = self._r.mget([f"{self._prefix}:epoch", f"{self._prefix}:wseq"])
        return (epoch.decode() if isinstance(epoch, bytes) else epoch), int(wseq or 0)

    def seen_marks(self) -> tuple[str | None, int]:
        return self._seen

    def expect_marks(self, epoch: str | None, wseq: int) -> None:
        """From now on refuse to commit on a store whose marks are behind these (a checkpoint, a recovery)."""
        self._seen = (epoch, wseq)

    def ensure_marks(self, at_least: int = 0) -> tuple[str, int]:
        """Give an empty (or recovered) store an epoch and a counter of at least ``at_least``."""
        self._r.set(f"{self._prefix}:epoch", uuid.uuid4().hex, nx=True)
        wseq = int(self._r.get(f"{self._prefix}:wseq") or 0)
        if wseq < at_least:
            wseq = int(self._r.incrby(f"{self._prefix}:wseq", at_least - wseq))
        epoch, wseq = self.marks()
        assert epoch is not None
        self._seen = (epoch, wseq)
        return epoch, wseq

    def _check_marks(self, epoch: bytes | str | None, wseq: bytes | str | None) -> None:
        seen_epoch, seen_wseq = self._seen
        now_epoch = epoch.decode() if isinstance(epoch, bytes) else epoch
        if seen_epoch is not None and (now_epoch != seen_epoch or int(wseq or 0) < seen_wseq):
            raise StateRolledBack(f"state store went backwards: write counter {int(wseq or 0)} < {seen_wseq} "
                                  f"or epoch changed ({now_epoch != seen_epoch})")

    def _key(self, patient_id: str, part: str) -> str:
        return f"{self._prefix}:{{{key_part(patient_id)}}}:{part}"

    def _outbox_key(self, patient_id: str, entry_id: str) -> str:
        return self._key(patient_id, f"outbox:{key_part(entry_id)}")

    def version(self, patient_id: str) -> int:
        pinned = self._pinned.get(patient_id)
        if pinned is not None:
            return pinned
        raw = self._r.get(self._key(patient_id, "ver"))
        return int(raw) if raw is not None else 0

    def version_and_erasures(self, patient_id: str) -> tuple[int, int]:
        ver, erasures = self._r.mget([self._key(patient_id, "ver"), f"{self._prefix}:erasures"])
        return int(ver or 0), int(erasures or 0)

    @contextmanager
    def pinned_versions(self, patient_ids: Iterable[str]) -> Iterator[None]:
        ids = list(patient_ids)
        raw = self._r.mget([self._key(p, "ver") for p in ids]) if ids else []
        self._pinned = {p: int(v) if v is not None else 0 for p, v in zip(ids, raw, strict=True)}
        try:
            yield
        finally:
            self._pinned = {}

    def load(self, patient_id: str) -> PatientState:
        version = self.version(patient_id)
        with self._lock:
            cached = self._cache.get(patient_id)
            if cached is not None and cached.version == version:
                return cached
        pipe = self._r.pipeline(transaction=True)
        pipe.get(self._key(patient_id, "ver"))
        pipe.get(self._key(patient_id, "graph"))
        pipe.hvals(self._key(patient_id, "mem"))
        pipe.lrange(self._key(patient_id, "glog"), 0, -1)
        ver, graph, mems, glog = pipe.execute()
        state = PatientState.restore(patient_id, int(ver or 0), graph, mems, glog)
        self._remember(state)
        return state

    def _remember(self, state: PatientState) -> None:
        with self._lock:
            self._cache.put(state.patient_id, state)

    def commit_many(self, commits: Sequence[Commit]) -> None:
        ver_keys = [self._key(c.patient_id, "ver") for c in commits]
        mark_keys = [f"{self._prefix}:epoch", f"{self._prefix}:wseq"]
        with self._r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(*ver_keys, *mark_keys)  # type: ignore[no-untyped-call]  # redis-py leaves watch untyped
                *stored, epoch, wseq = pipe.mget(ver_keys + mark_keys)
                self._check_marks(epoch, wseq)
                for c, current in zip(commits, stored, strict=True):
                    if int(current or 0) != c.expected_version:
                        raise ConcurrentUpdate(
                            f"state version moved from {c.expected_version} to {int(current or 0)}")
                pipe.multi()
                logged: list[tuple[int, int]] = []
                for c in commits:
                    pid = c.patient_id
                    pipe.set(self._key(pid, "ver"), c.state.version)
                    logged.append(self._graph_changes(pipe, c.state))
                    if c.changed:
                        pipe.hset(self._key(pid, "mem"), mapping={
                            s.memory.memory_id: s.model_dump_json() for s in c.changed})
                        pipe.hset(self._key(pid, "tl"), mapping={s.memory.memory_id: rows.encode(s) for s in c.changed})
                    if c.sources:
                        pipe.hset(self._key(pid, "src"), mapping={k: v for k, v in c.sources.items()})
                    if c.deleted:
                        pipe.hdel(self._key(pid, "mem"), *c.deleted)
                        pipe.hdel(self._key(pid, "tl"), *c.deleted)
                    if c.dropped_sources:
                        pipe.hdel(self._key(pid, "src"), *c.dropped_sources)
                    for entry_id, outbox in c.outboxes.items():
                        pipe.set(self._outbox_key(pid, entry_id), outbox)
                    if c.outboxes:  # an applied entry closes its record gap (a replayed dead letter)
                        pipe.hdel(self._key(pid, "gaps"), *c.outboxes)
                    pipe.sadd(f"{self._prefix}:patients", pid)
                if epoch is None:
                    pipe.set(mark_keys[0], uuid.uuid4().hex, nx=True)
                pipe.incr(mark_keys[1])
                pipe.mget(mark_keys)
                *_, (new_epoch, new_wseq) = pipe.execute()
                self._seen = (new_epoch.decode() if isinstance(new_epoch, bytes) else new_epoch, int(new_wseq))
                for c, (length, base) in zip(commits, logged, strict=True):
                    c.state.persisted(length, base)
            except (redis.WatchError, ConcurrentUpdate) as exc:
                for c in commits:
                    self._forget(c.patient_id)
                if isinstance(exc, ConcurrentUpdate):
                    raise
                raise ConcurrentUpdate("state changed during commit") from exc
        for c in commits:
            self._remember(c.state)

    def _graph_changes(self, pipe: Any, state: PatientState) -> tuple[int, int]:
        """Queue the state's unpersisted graph changes on ``pipe``: appended to the log, or the log folded into a
        new snapshot when it has grown past the stored one. Returns the log's length and the snapshot's size
        (vertices plus edges) after the commit."""
        ops = state.graph_ops
        if not ops:
            return state.graph_log, state.graph_base
        length = state.graph_log + len(ops)
        if length >= COMPACT_MIN and length > state.graph_base:
            pipe.set(self._key(state.patient_id, "graph"), state.graph_snapshot())
            pipe.delete(self._key(state.patient_id, "glog"))
            return 0, state.graph_size()
        if state.graph_log == 0:  # a log that does not start right after this snapshot must not survive
            pipe.delete(self._key(state.patient_id, "glog"))
        pipe.rpush(self._key(state.patient_id, "glog"), *(orjson.dumps(op) for op in ops))
        return length, state.graph_base

    def _forget(self, patient_id: str) -> None:
        with self._lock:
            self._cache.pop(patient_id)

    def pending_outbox(self, patient_id: str, entry_id: str) -> bytes | None:
        return as_bytes(self._r.get(self._outbox_key(patient_id, entry_id)))

    def pending_outboxes(self) -> list[tuple[str, str, bytes]]:
        """Outboxes left behind, as (patient id, entry id, payload). A key that only looks like an outbox
        (not of the exact escaped shape, or not a string) is skipped with a warning: it is not ours to
        republish, and it must not stop a worker from starting."""
        found = []
        shape = re.compile(rf"^{re.escape(self._prefix)}:\{{([^{{}}:]+)\}}:outbox:(.+)$")
        for key in self._r.scan_iter(match=f"{glob_escape(self._prefix)}:{{*}}:outbox:*", count=1000):
            name = key.decode(errors="replace") if isinstance(key, bytes) else key
            m = shape.match(name)
            if m is None:
                log.warning("skipped a key that is not an outbox of this store's shape")
                continue
            try:
                raw = as_bytes(self._r.get(key))
            except redis.ResponseError as exc:  # e.g. WRONGTYPE: not a string, so not an outbox
                log.warning("skipped an outbox key Redis refused to read: %s", str(exc)[:80])
                continue
            if raw is not None:
                found.append((unkey_part(m.group(1)), unkey_part(m.group(2)), raw))
        return found

    def clear_outbox(self, patient_id: str, entry_id: str) -> None:
        self._r.delete(self._outbox_key(patient_id, entry_id))

    def clear_outboxes(self, delivered: Sequence[tuple[str, str]]) -> None:
        # One round trip, one DEL per key (keys of different patients are in different cluster slots).
        pipe = self._r.pipeline(transaction=False)
        for patient_id, entry_id in delivered:
            pipe.delete(self._outbox_key(patient_id, entry_id))
        pipe.execute()

    def patients(self) -> list[str]:
        return sorted(p.decode() if isinstance(p, bytes) else p
                      for p in self._r.smembers(f"{self._prefix}:patients"))

    def memories(self, patient_id: str, memory_ids: Sequence[str]) -> dict[str, StoredMemory]:
        if not memory_ids:
            return {}
        raw = self._r.hmget(self._key(patient_id, "mem"), list(memory_ids))
        return {m: StoredMemory.model_validate_json(r) for m, r in zip(memory_ids, raw, strict=True) if r is not None}

    def timeline_rows(self, patient_id: str) -> tuple[int, list[list[Any]]] | None:
        pipe = self._r.pipeline(transaction=True)
        pipe.get(self._key(patient_id, "ver"))
        pipe.hlen(self._key(patient_id, "mem"))
        pipe.hvals(self._key(patient_id, "tl"))
        ver, n_records, raw = pipe.execute()
        if len(raw) != n_records:  # records written before rows were kept: the caller reads the records
            return None
        decoded = rows.decode_many([r if isinstance(r, bytes) else r.encode() for r in raw])
        return (int(ver or 0), decoded) if decoded is not None else None

    def records(self, patient_id: str) -> tuple[int, list[bytes]]:
        pipe = self._r.pipeline(transaction=True)
        pipe.get(self._key(patient_id, "ver"))
        pipe.hvals(self._key(patient_id, "mem"))
        ver, mems = pipe.execute()
        return int(ver or 0), [m if isinstance(m, bytes) else m.encode() for m in mems]

    def source_text(self, patient_id: str, entry_id: str) -> str | None:
        raw = self._r.hget(self._key(patient_id, "src"), entry_id)
        return raw.decode() if isinstance(raw, bytes) else raw

    # --- record gaps (dead-lettered entries not applied) --------------------------------------------------

    def gaps(self, patient_id: str) -> list[RecordGap]:
        """The patient's record gaps, oldest first (one HGETALL)."""
        raw = self._r.hgetall(self._key(patient_id, "gaps"))
        found = [RecordGap.model_validate_json(v) for v in raw.values()]
        return sorted(found, key=lambda g: (g.failed_at, g.dead_letter))

    def record_gap(self, patient_id: str, gap: RecordGap) -> None:
        """Record (or refresh) a gap; a gap already open for the same entry keeps its first failure time."""
        key = self._key(patient_id, "gaps")
        field = gap_field(gap)
        old = self._r.hget(key, field)
        if old is not None:
            first = RecordGap.model_validate_json(old).failed_at
            gap = gap.model_copy(update={"failed_at": min(first, gap.failed_at)})
        self._r.hset(key, field, gap.model_dump_json())

    def clear_gap(self, patient_id: str, entry_id: str) -> None:
        self._r.hdel(self._key(patient_id, "gaps"), entry_id)

    def gap_replayed(self, patient_id: str, dead_letter: str, entry_id: str | None, log: str) -> RecordGap | None:
        """Mark the gap of this dead letter replayed (it stays until the entry is applied) and keep ``log``. A gap
        of an unknown entry is filed under the replayed entry's id, so applying that entry closes it."""
        found = next((g for g in self.gaps(patient_id) if g.dead_letter == dead_letter), None)
        pipe = self._r.pipeline(transaction=True)
        if found is not None:
            pipe.hdel(self._key(patient_id, "gaps"), gap_field(found))
            found = found.model_copy(update={"replayed_at": datetime.now(UTC),
                                             "entry_id": found.entry_id or entry_id})
            pipe.hset(self._key(patient_id, "gaps"), gap_field(found), found.model_dump_json())
        pipe.hset(self._key(patient_id, "gaplog"), dead_letter, log)
        pipe.execute()
        return found

    def dismiss_gap(self, patient_id: str | None, dead_letter: str, log: str) -> RecordGap | None:
        """Remove the gap of this dead letter (if open) and keep ``log`` (who, when, why), in one transaction.
        ``patient_id`` None: a dead letter of no known patient; only the log is kept."""
        if patient_id is None:
            self._r.hset(f"{self._prefix}:deadletters:log", dead_letter, log)
            return None
        found = next((g for g in self.gaps(patient_id) if g.dead_letter == dead_letter), None)
        pipe = self._r.pipeline(transaction=True)
        if found is not None:
            pipe.hdel(self._key(patient_id, "gaps"), gap_field(found))
        pipe.hset(self._key(patient_id, "gaplog"), dead_letter, log)
        pipe.execute()
        return found

    def gap_log(self, patient_id: str | None) -> dict[str, str]:
        """What operators did with dead letters (dead letter id -> JSON), of one patient or of no patient."""
        key = self._key(patient_id, "gaplog") if patient_id is not None else f"{self._prefix}:deadletters:log"
        return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in self._r.hgetall(key).items()}

    def erase_patient(self, patient_id: str) -> int:
        """Delete exactly this patient's keys: the escaped id cannot hold a glob character, and a key is only
        deleted when it starts with this patient's exact key prefix."""
        head = self._key(patient_id, "")
        keys = [k for k in self._r.scan_iter(match=glob_escape(head) + "*", count=1000)
                if (k.decode(errors="replace") if isinstance(k, bytes) else k).startswith(head)]
        removed = self._r.delete(*keys) if keys else 0
        self._r.srem(f"{self._prefix}:patients", patient_id)
        self._forget(patient_id)
        return int(removed)


def gap_field(gap: RecordGap) -> str:
    """A gap's field in the patient's gaps hash: its entry id, or its dead letter's id when the entry is unknown."""
    return gap.entry_id if gap.entry_id else f"dl:{gap.dead_letter}"
