"""State-update agent: impacted topic -> transitions topic.

One agent instance per partition processes messages one at a time, so two entries of one patient are
never applied concurrently; the versioned commit in the state store guards the rest (rebalances, a second
worker). Transitions are committed to Redis in an outbox together with the state, then published; the
outbox is cleared once the broker confirms delivery. The agent does not wait for that confirmation before
taking the next entry (the producer keeps per-partition order); an outbox left by a crash is republished,
with the same transition ids, when a worker starts (``republish_pending``) or when the entry is redelivered.
The outboxes' clearing and republication are in ``workers.outbox``; the scheduled deletion sweep, whose orders
the delete agent here applies, in ``workers.sweep``.

:func:`register` builds the units (:class:`Applier` on the stage thread, :class:`Publisher` on the event loop,
the outboxes, the sweep) and registers the agents, timers and tasks with Faust. Every blocking Redis, Milvus or
embedding call runs on the stage thread (``stam.stage_thread``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any, TypeVar

import faust
from pydantic import BaseModel

from schemas import DeletionOrder, ImpactedEntry
from stam.errors import MessageTooLarge, StateRolledBack
from stam.metrics import ARCHIVE_REFUSED, DELETIONS_SKIPPED, MESSAGES, READS, REDONE, TRANSITIONS
from stam.stage_thread import STAGE_THREAD
from stam.stages import DeletionResult, Deps, UpdateResult, deferred_to_update, delete_batch, update_batch
from workers.extract import VerifiedEntry, extract_verified, verifier
from workers.outbox import DeliveredOutboxes, Republisher
from workers.runtime import Runtime
from workers.stage_agent import OUTPUT_LIMIT, background_failed, run_batch, seal, send_bytes
from workers.sweep import ScheduledSweep

log = logging.getLogger("stam.workers")
In = TypeVar("In")
M = TypeVar("M", bound=BaseModel)
Res = TypeVar("Res", bound=UpdateResult)

Done = tuple[UpdateResult, list[tuple[bytes, bytes]], tuple[str, str]]
"""An applied entry or order: its result, its transitions sealed (key, value), and (patient id, entry id)."""


class Applier:
    """The stage functions the agents run on the stage thread (through ``run_batch``): apply a batch, recover
    the store when it lost writes, seal the transitions."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def recovering(self, fn: Callable[[list[In], Deps], list[Res]], items: list[In], deps: Deps) -> list[Res]:
        """``fn(items, deps)``; a store that lost writes while this worker ran is rebuilt first."""
        try:
            return fn(items, deps)
        except StateRolledBack:
            # The store lost writes while this worker ran: rebuild from the log, then apply on top of that.
            self.runtime.durability.recover_blocking()
            return fn(items, deps)

    def apply(self, items: list[ImpactedEntry], deps: Deps) -> list[Done]:
        results = self.recovering(update_batch, items, deps)
        return self._sealed(results, [(item.entry.patient_id, item.entry.entry_id) for item in items])

    def apply_entries(self, items: list[VerifiedEntry], deps: Deps) -> list[Done]:
        """The one-hop write path: extract the entries, then apply them, linking and impact done by the update
        (:func:`stam.stages.deferred_to_update`)."""
        return self.apply(deferred_to_update(extract_verified(items, deps)), deps)

    def apply_deletions(self, orders: list[DeletionOrder], deps: Deps) -> list[Done]:
        results = self.recovering(delete_batch, orders, deps)
        for r in results:  # the state moved since the sweep: counted by why, never with ids
            for why in r.skipped.values():
                DELETIONS_SKIPPED.labels(why=why).inc()
        return self._sealed(list(results), [(o.patient_id, o.order_id) for o in orders])

    def _sealed(self, results: list[UpdateResult], ids: list[tuple[str, str]]) -> list[Done]:
        # Sealed here, on the stage thread (the patient's data key may be read from Redis).
        sealer = self.runtime.sealer
        done = [(r, [seal(sealer, t.patient_id, t) for t in r.transitions], i)
                for r, i in zip(results, ids, strict=True)]
        sealer.durable()
        return done


class Publisher:
    """Hands each applied entry or order on, on the event loop: its transitions to the transitions topic (their
    outbox cleared once delivered), the metrics, and the gap closed of an entry that was already applied."""

    def __init__(self, runtime: Runtime, outboxes: DeliveredOutboxes, *, count_redone: bool = True) -> None:
        self.runtime = runtime
        self.outboxes = outboxes
        self.count_redone = count_redone
        """``stam_update_reads_total`` and ``stam_stale_redo_total``: what became of the link and impact work of
        the stages before (the one-hop path has no such stage: it links once, at the update)."""

    async def publish(self, event: faust.EventT[Any], done: Done) -> None:
        out, sealed, ids = done
        if self.count_redone and not out.duplicate and not isinstance(out, DeletionResult):
            READS.labels(reads=out.reads.value).inc()
            if out.redone:
                REDONE.inc()
        if out.duplicate:
            MESSAGES.labels(stage="update", outcome="duplicate").inc()
            await self.close_gap(ids)
        over = [len(v) for k, v in sealed if len(v) + len(k) > OUTPUT_LIMIT]
        if over:
            # The state change is committed with its outbox; the outbox stays in Redis (the record of what
            # was applied) and the entry is dead-lettered so the gap is visible. The stream goes on.
            log.error("a transition is over the broker's message limit; its entry is dead-lettered, the "
                      "applied state and its outbox kept")
            raise MessageTooLarge(f"a transition would be {max(over):,} bytes, over the broker's message limit; "
                                  "the entry's state change is applied, its transitions are kept in the Redis "
                                  "outbox and were not published")
        transitions = self.runtime.topics.transitions
        handed = perf_counter()
        futures = [await send_bytes(transitions, k, v, what="transition") for k, v in sealed]
        if not out.duplicate:
            for t in out.transitions:
                TRANSITIONS.labels(kind=t.kind.value, reason=t.reason.value if t.reason else "").inc()
                for r in t.refused:
                    ARCHIVE_REFUSED.labels(reason=r.reason.value).inc()
                    # No ids in the log (MIMIC-IV entry and memory ids carry subject ids): the transition
                    # records which memory and why (`refused`), under the patient's key.
                    log.warning("archival refused by the source-identity rule: reason=%s (recorded on the "
                                "transition)", r.reason.value)
        if futures:
            first = out.transitions[0]
            self.outboxes.after_delivery(futures, first.patient_id, first.entry_id, handed)

    async def close_gap(self, ids: tuple[str, str]) -> None:
        # An entry already applied (a replay of a dead letter whose entry got in another way) has no gap.
        await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, self._clear_gap, *ids)

    def _clear_gap(self, patient_id: str, entry_id: str) -> None:
        self.runtime.deps.states.clear_gap(patient_id, entry_id)


async def ready(runtime: Runtime) -> None:
    """Nothing is applied before the store has been checked against its last durable checkpoint: wait for that
    check (an outage is waited out)."""
    delay = 0.5
    while True:
        try:
            await runtime.durability.ready()
            return
        except Exception as exc:  # noqa: BLE001 - an outage is waited out; a bug is logged and alerted
            background_failed("durability_check", exc, delay)
            runtime.durability.reset()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


async def watch_state_store(runtime: Runtime) -> None:
    """A store that lost writes is rebuilt from the log as soon as it is back, not at the next entry."""
    if not runtime.durability.checked:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, runtime.durability.watch_blocking)
    except Exception as exc:  # noqa: BLE001 - still down: the next round (or the next entry) tries again
        background_failed("watch_state_store", exc, runtime.settings.state_watch_s)


async def apply_batches(stream: faust.StreamT[Any], runtime: Runtime, stage: str, model: type[M],
                        fn: Callable[[list[M], Deps], list[Done]], publisher: Publisher,
                        parse: Callable[[faust.EventT[Any], bytes], M] | None = None) -> None:
    """An agent's loop: batches of whatever is waiting (up to update_batch, at most 20 ms apart), one Milvus
    upsert per patient and one Redis transaction per batch instead of per entry, each applied once the store
    is checked (:func:`ready`) and its results published."""
    async for events in stream.take_batches(  # type: ignore[attr-defined]  # topology.batching.Stream
            runtime.settings.update_batch, within=0.02):
        await ready(runtime)
        await run_batch(events, stage=stage, model=model, fn=fn, runtime=runtime, on_result=publisher.publish,
                        parse=parse)


def register(app: faust.App, runtime: Runtime, *, fused: bool = False) -> Any:
    """The update worker's agents (update; delete: the deletion gate's orders), its tasks (delivered outboxes
    cleared, undelivered ones republished at start) and timers (the state-store watch, the scheduled deletion
    sweep when configured) on ``app``; returns the update agent.

    ``fused``: the one-hop write path (``stam worker --stages fused``). The update agent reads the entries topic
    and extracts, links, finds the impact and applies in one stage call (:meth:`Applier.apply_entries`); the
    extracted, linked and impacted topics are not used."""
    outboxes = DeliveredOutboxes(runtime)
    applier, publisher = Applier(runtime), Publisher(runtime, outboxes, count_redone=not fused)
    app.task(outboxes.clear_delivered_outboxes)
    app.task(Republisher(runtime).republish_pending)

    @app.timer(interval=runtime.settings.state_watch_s)
    async def state_watch() -> None:
        await watch_state_store(runtime)

    if fused:
        parse = verifier(runtime)

        @app.agent(runtime.topics.entries, name="stam.fused")
        async def update(stream: faust.StreamT[Any]) -> None:
            await apply_batches(stream, runtime, "fused", VerifiedEntry, applier.apply_entries, publisher, parse)
    else:
        @app.agent(runtime.topics.impacted, name="stam.update")
        async def update(stream: faust.StreamT[Any]) -> None:
            await apply_batches(stream, runtime, "update", ImpactedEntry, applier.apply, publisher)

    sweep = ScheduledSweep.configured(app, runtime)
    if sweep is not None:
        app.timer(interval=sweep.every)(sweep.scheduled_sweep)

    @app.agent(runtime.topics.deletions, name="stam.delete")
    async def delete(stream: faust.StreamT[Any]) -> None:
        """The deletion gate's orders (``stam deletion sweep``), applied by this stage, the single writer of
        patient state, as ``deleted`` transitions on the same outbox and topic as every other transition."""
        await apply_batches(stream, runtime, "delete", DeletionOrder, applier.apply_deletions, publisher)

    return update
