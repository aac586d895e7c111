"""A crash loses nothing: offsets are committed after the state is durable, and a state store that lost
writes is rebuilt from the transition log before anything is applied on top of it.

The write path's promise rests on three facts:

1. **Transitions reach the log before offsets are committed.** Faust flushes the producer before it commits
   consumer offsets, so every entry whose offset is committed has its transitions on the transitions topic
   (acks=all). Entries whose offsets are not committed are delivered again after a crash; the update stage
   recognises an applied entry and republishes its outbox with the same transition ids.
2. **The state store's durability is checked, not assumed.** Before each offset commit the worker waits for
   the store's fsync window (``appendfsync everysec``: 2 s; ``always``: none) and writes a **checkpoint**
   (the store's epoch and write counter, :mod:`stam.backends.redis_state`) to the checkpoints topic.
3. **A store that went backwards is detected and rebuilt.** A store that lost writes (no append-only file, a
   restore from an older backup, an asynchronous failover) shows a lower write counter or another epoch than
   the last checkpoint, or than the worker itself saw: commits refuse (``StateRolledBack``), and the worker
   rebuilds every patient whose state version is behind the transition log from the log, then goes on.

Recovery reads the whole transitions topic: minutes for a large record, rare by design (it runs only after a
store lost acknowledged writes). Source texts (``:src``) are not in the log; a rebuilt patient serves its
memories without source spans for entries applied before the loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from aiokafka import TopicPartition

from schemas import TransitionEvent
from stam.config import Settings
from stam.crypto import Sealer, redis_fsync_window, sealer_for
from stam.errors import Erased, SealBroken
from stam.metrics import RECOVERED_PATIENTS, RECOVERIES, UNREADABLE
from stam.stage_thread import STAGE_THREAD
from stam.transport import kafka_consumer
from topology import topics as t
from topology.admin import read_to_end

if TYPE_CHECKING:
    from stam.stages import Deps

log = logging.getLogger("stam.recovery")

CHECKPOINT_KEY = b"state-store"


@dataclass(frozen=True)
class Checkpoint:
    epoch: str
    wseq: int
    at: str

    def encode(self) -> bytes:
        return orjson.dumps({"schema_version": 1, "epoch": self.epoch, "wseq": self.wseq, "at": self.at})

    @classmethod
    def decode(cls, raw: bytes) -> Checkpoint:
        data = orjson.loads(raw)
        return cls(epoch=str(data["epoch"]), wseq=int(data["wseq"]), at=str(data.get("at", "")))


@dataclass
class RecoveryReport:
    patients_in_log: int = 0
    rebuilt: int = 0
    unreadable_patients: int = 0
    transitions: int = 0
    seconds: float = 0.0


def behind(checkpoint: Checkpoint | None, marks: tuple[str | None, int]) -> bool:
    """True when the store holds less than the checkpoint says was durable."""
    if checkpoint is None:
        return False
    epoch, wseq = marks
    return epoch != checkpoint.epoch or wseq < checkpoint.wseq


async def _consumer(settings: Settings) -> Any:
    consumer = kafka_consumer(settings, enable_auto_commit=False, group_id=None)
    await consumer.start()
    return consumer


async def read_checkpoint(settings: Settings) -> Checkpoint | None:
    """The checkpoint with the highest write counter among the last ones written (None: never written)."""
    topic = t.CHECKPOINTS.name(settings.topic_prefix)
    consumer = await _consumer(settings)
    try:
        if topic not in await consumer.topics():
            return None
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        start = (await consumer.beginning_offsets([tp]))[tp]
        consumer.seek(tp, max(start, end - 64))  # the last ones (a stale end only means reading a few more)
        best: Checkpoint | None = None
        async for r in read_to_end(consumer, [tp]):
            if r.key != CHECKPOINT_KEY or r.value is None:
                continue
            cp = Checkpoint.decode(r.value)
            # The last epoch wins (a recovered store starts a new one); within it, the highest counter.
            if best is None or cp.epoch != best.epoch or cp.wseq > best.wseq:
                best = cp
        return best
    finally:
        await consumer.stop()


async def read_log(settings: Settings, sealer: Any = None,
                   unreadable: dict[str, int] | None = None) -> dict[str, list[TransitionEvent]]:
    """Every transition on the transitions topic, per patient, in log order (opened: ``stam.crypto``; an erased
    patient's are unreadable by design and left out). ``unreadable``: filled with the count of transitions per
    pseudonym that do not open although not erased (their data key is missing from the key store)."""
    sealer = sealer or sealer_for(settings)

    topic = t.TRANSITIONS.name(settings.topic_prefix)
    consumer = await _consumer(settings)
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or [])
        if not parts:
            await consumer.topics()
            parts = sorted(consumer.partitions_for_topic(topic) or [])
        tps = [TopicPartition(topic, p) for p in parts]
        if not tps:
            return {}
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        by_patient: dict[str, list[TransitionEvent]] = defaultdict(list)
        async for r in read_to_end(consumer, tps):
            try:
                ev = TransitionEvent.model_validate_json(sealer.open(r.value))
            except Erased:
                continue
            except SealBroken:
                if unreadable is not None:
                    p = Sealer.pseudonym_of(r.value) or "?"
                    unreadable[p] = unreadable.get(p, 0) + 1
                continue
            by_patient[ev.patient_id].append(ev)
        return dict(by_patient)
    finally:
        await consumer.stop()


def recover(settings: Settings, deps: Deps, *, at_least: int = 0) -> RecoveryReport:
    """Rebuild every patient whose stored version is behind the transition log; then give the store fresh
    durability marks above ``at_least`` (the checkpoint's counter), so its next checkpoint is not behind.

    Blocking (runs the log read on its own event loop): call it on the stage thread."""
    # deferred: stam.rebuild pulls in igraph, numpy, immutables
    from stam.rebuild import rebuild

    started = time.monotonic()
    report = RecoveryReport()
    deps.states.expect_marks(None, 0)  # the store is known to be behind: let the rebuild write
    unreadable: dict[str, int] = {}
    logged = asyncio.run(read_log(settings, unreadable=unreadable))
    if unreadable:
        # The data keys are the one part of Redis the log cannot rebuild (stam/crypto.py): a store restored
        # without them leaves these patients' records sealed. Said loudly, never skipped in silence.
        UNREADABLE.inc(sum(unreadable.values()))
        log.error("%d transitions of %d patients cannot be opened: their data keys are missing from the key store "
                  "(%s:datakeys); restore it from its backup, then the worker rebuilds them", sum(unreadable.values()),
                  len(unreadable), settings.collection_prefix)
    report.unreadable_patients = len(unreadable)
    report.patients_in_log = len(logged)
    register = _erasure_register(settings, deps)
    for patient_id, events in logged.items():
        report.transitions += len(events)
        log_version = max(e.state_version for e in events)
        if deps.states.version(patient_id) >= log_version:
            continue
        if register is not None and register.erased(patient_id):
            continue  # erased (stam erase): its transitions are still in the log, it must not come back
        deps.states.erase_patient(patient_id)
        deps.vectors.erase_patient(patient_id)  # a projection in front of Milvus forgets the patient too
        rebuild(patient_id, events, deps)
        report.rebuilt += 1
    deps.states.ensure_marks(at_least=at_least + 1)
    report.seconds = round(time.monotonic() - started, 3)
    RECOVERIES.inc()
    RECOVERED_PATIENTS.inc(report.rebuilt)
    log.warning("state store recovered from the transition log: %d of %d patients rebuilt (%d transitions, "
                "%.1fs)", report.rebuilt, report.patients_in_log, report.transitions, report.seconds)
    return report


def _erasure_register(settings: Settings, deps: Deps) -> Any:
    # deferred: stam.erase pulls in igraph, numpy, immutables
    from stam.erase import ErasureRegister

    client = getattr(deps.states, "_r", None)
    return ErasureRegister(settings, client) if client is not None else None


class Durability:
    """The worker's side of the promise: a start-up check, and a barrier plus checkpoint before every
    offset commit (installed on the Faust consumer by :func:`install`)."""

    def __init__(self, settings: Settings, deps_factory: Any) -> None:
        self.settings = settings
        self._deps_factory = deps_factory
        self._checked: asyncio.Future[None] | None = None
        self._last_checkpoint: tuple[str | None, int] = (None, -1)
        self.fsync_window_s: float | None = settings.redis_fsync_window_s
        self.last_report: RecoveryReport | None = None

    @property
    def deps(self) -> Deps:
        deps: Deps = self._deps_factory()
        return deps

    def _probe_fsync_window(self) -> float:
        """2 s when the store fsyncs every second, 0 when it fsyncs every write or keeps no append-only file
        (then only the checkpoint and recovery protect the state); a setting overrides the probe."""
        if self.fsync_window_s is not None:
            return self.fsync_window_s

        client = getattr(self.deps.states, "_r", None)
        window = 0.0
        if client is not None:
            try:
                found = redis_fsync_window(client)
                if found is None:
                    log.warning("the state store keeps no append-only file: a crash of it loses recent writes, "
                                "which the worker then rebuilds from the transition log (slow); turn on "
                                "appendonly")
                else:
                    window = found
            except Exception as exc:  # noqa: BLE001 - CONFIG is often disabled on managed Redis
                log.info("cannot read the state store's persistence settings (%s); set "
                         "STAM_REDIS_FSYNC_WINDOW_S to its fsync window", type(exc).__name__)
        self.fsync_window_s = window
        return window

    def check_blocking(self) -> None:
        """Compare the store with the last checkpoint; recover first if it is behind. Stage thread."""
        deps = self.deps
        self._probe_fsync_window()
        checkpoint = asyncio.run(read_checkpoint(self.settings))
        marks = deps.states.marks()
        if behind(checkpoint, marks):
            assert checkpoint is not None
            log.warning("state store is behind its last durable checkpoint (write counter %d < %d, or a new "
                        "epoch): rebuilding from the transition log", marks[1], checkpoint.wseq)
            self.last_report = recover(self.settings, deps, at_least=max(checkpoint.wseq, marks[1]))
        else:
            deps.states.ensure_marks(at_least=marks[1])

    def watch_blocking(self) -> bool:
        """Between entries: has the store gone backwards since this worker last wrote? Then recover now,
        not at the next entry. Stage thread."""
        states = self.deps.states
        seen = states.seen_marks()
        if seen[0] is None or not behind(Checkpoint(epoch=seen[0], wseq=seen[1], at=""), states.marks()):
            return False
        log.warning("state store went backwards while the worker ran: rebuilding from the transition log")
        self.recover_blocking()
        return True

    def recover_blocking(self) -> None:
        """After a commit was refused (``StateRolledBack``): rebuild from the log. Stage thread."""
        deps = self.deps
        checkpoint = asyncio.run(read_checkpoint(self.settings))
        _, seen = deps.states.seen_marks()
        self.last_report = recover(self.settings, deps,
                                   at_least=max(seen, checkpoint.wseq if checkpoint else 0))

    @property
    def checked(self) -> bool:
        return self._checked is not None and self._checked.done() and self._checked.exception() is None

    def reset(self) -> None:
        """Forget a failed start-up check, so the next ``ready`` runs it again."""
        if self._checked is not None and self._checked.done():
            self._checked = None

    async def ready(self) -> None:
        """Run the start-up check once; every caller waits for it."""
        if self._checked is None:
            self._checked = asyncio.ensure_future(
                asyncio.get_running_loop().run_in_executor(STAGE_THREAD, self.check_blocking))
        await self._checked

    async def before_commit(self, send_checkpoint: Any) -> None:
        """Wait out the store's fsync window, then checkpoint its marks (only when they moved)."""
        if self._checked is None or not self._checked.done():
            return  # nothing applied yet
        window = self.fsync_window_s or 0.0
        if window > 0:
            await asyncio.sleep(window)
        marks = await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, self.deps.states.marks)
        if marks[0] is None or marks == self._last_checkpoint:
            return
        cp = Checkpoint(epoch=marks[0], wseq=marks[1], at=datetime.now(UTC).isoformat())
        await send_checkpoint(cp)
        self._last_checkpoint = marks


def install(app: Any, topics: Any, durability: Durability) -> None:
    """Wrap the Faust consumer's offset commit: barrier and checkpoint first, then commit.

    Faust flushes its producer before calling ``_commit``, so the transitions of every acknowledged entry
    are on the broker by then. The wrapper holds back only the commit, never the processing, as long as Faust
    commits from its commit timer alone: a commit from its fetch loop (``broker_commit_every``) would stop all
    fetching for the fsync window, so ``topology.app`` puts that out of reach."""
    consumer = app.consumer
    original = consumer._commit

    async def send_checkpoint(cp: Checkpoint) -> None:
        fut = await topics.checkpoints.send(key=CHECKPOINT_KEY, value=cp.encode(), partition=0)
        await fut

    async def durable_commit(offsets: Any) -> bool:
        try:
            await durability.before_commit(send_checkpoint)
        except Exception as exc:  # noqa: BLE001 - a store or broker outage: do not commit, try next time
            log.warning("offset commit postponed: durability checkpoint failed (%s)", type(exc).__name__)
            return False
        result: bool = await original(offsets)
        return result

    consumer._commit = durable_commit
