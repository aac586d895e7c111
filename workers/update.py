"""State-update agent: impacted topic -> transitions topic.

One agent instance per partition processes messages one at a time, so two entries of one patient are
never applied concurrently; the versioned commit in the state store guards the rest (rebalances, a second
worker). Transitions are committed to Redis in an outbox together with the state, then published; the
outbox is cleared once the broker confirms delivery. The agent does not wait for that confirmation before
taking the next entry (the producer keeps per-partition order); an outbox left by a crash is republished,
with the same transition ids, when a worker starts (``republish_pending``) or when the entry is redelivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import faust

from schemas import DeletionOrder, ImpactedEntry
from stam.errors import MessageTooLarge, StateRolledBack
from stam.metrics import ARCHIVE_REFUSED, BACKGROUND_FAILURES, DELETIONS_SKIPPED, MESSAGES, REDONE, TRANSITIONS
from stam.stage_thread import STAGE_THREAD
from stam.stages import Deps, UpdateResult, decode_outbox, delete_batch, update_batch
from workers.common import OUTPUT_LIMIT, TRANSIENT, run_batch, seal, send_bytes
from workers.runtime import Runtime

log = logging.getLogger("stam.workers")
In = TypeVar("In")
Res = TypeVar("Res", bound=UpdateResult)


OUTBOX_CLEAR_S = 0.2
"""How long delivered outboxes gather before they are cleared (one Redis round trip for all of them)."""


def _failed(task: str, exc: BaseException, delay: float) -> None:
    BACKGROUND_FAILURES.labels(task=task, error_type=type(exc).__name__).inc()
    if isinstance(exc, TRANSIENT) or type(exc).__module__.startswith(("aiokafka", "kafka")):
        log.warning("%s failed (%s); retrying in %.0fs", task, type(exc).__name__, delay)
    else:
        log.error("%s failed; retrying in %.0fs", task, delay, exc_info=exc)


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics
    pending: set[asyncio.Future[None]] = set()
    delivered: list[tuple[str, str]] = []  # outboxes whose transitions the broker confirmed, cleared in batches
    to_clear = asyncio.Event()  # set while `delivered` holds outboxes

    async def _clear_when_delivered(futures: list[Any], patient_id: str, entry_id: str) -> None:
        try:
            await asyncio.gather(*futures)
        except Exception:  # delivery failed: keep the outbox; it is republished on restart or redelivery
            log.warning("transition delivery failed; outbox kept for republication")
            return
        delivered.append((patient_id, entry_id))
        to_clear.set()

    @app.task
    async def clear_delivered_outboxes() -> None:
        """Delete the outboxes of delivered transitions, many per Redis round trip (those delivered within
        OUTBOX_CLEAR_S of the first), on the stage thread (never a blocking Redis call on the event loop); with
        none delivered it sleeps (no timer: an idle worker does not wake). Redis unreachable: kept for the next
        round; a worker stopped before a round leaves them to be republished at its next start (same transition
        ids: consumers de-duplicate)."""
        while True:
            await to_clear.wait()
            await asyncio.sleep(OUTBOX_CLEAR_S)
            to_clear.clear()
            batch = delivered[:]
            del delivered[:len(batch)]
            if not batch:
                continue
            try:
                await asyncio.get_running_loop().run_in_executor(
                    STAGE_THREAD, runtime.deps.states.clear_outboxes, batch)
            except Exception as exc:  # noqa: BLE001 - the next round tries again; a bug is logged and alerted
                delivered[:0] = batch
                to_clear.set()
                _failed("clear_outboxes", exc, OUTBOX_CLEAR_S)

    @app.task
    async def republish_pending() -> None:
        """Publish outboxes a previous worker left undelivered (same ids: consumers de-duplicate).
        A store outage at start-up is waited out, never fatal."""
        delay = 0.5
        while True:
            try:
                await runtime.durability.ready()
                count = await _republish()
            except Exception as exc:  # noqa: BLE001 - an outage is waited out; a bug is logged and alerted
                _failed("republish_pending", exc, delay)
                runtime.durability.reset()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            if count:
                log.warning("republished %d undelivered transition outboxes", count)
            return

    async def _republish() -> int:
        states = runtime.deps.states
        count = 0
        for patient_id, entry_id, raw in states.pending_outboxes():
            try:
                sealed = [seal(runtime.sealer, patient_id, t) for t in decode_outbox(raw)]
                runtime.sealer.durable()
                futures = [await send_bytes(topics.transitions, k, v, what="transition") for k, v in sealed]
            except MessageTooLarge:  # cannot ever be published: kept in Redis, not retried at every start
                log.error("an outbox holds a transition over the broker's message limit; left in Redis")
                continue
            await asyncio.gather(*futures)
            states.clear_outbox(patient_id, entry_id)
            count += 1
        return count

    @app.timer(interval=runtime.settings.state_watch_s)
    async def watch_state_store() -> None:
        """A store that lost writes is rebuilt from the log as soon as it is back, not at the next entry."""
        if not runtime.durability.checked:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, runtime.durability.watch_blocking)
        except Exception as exc:  # noqa: BLE001 - still down: the next round (or the next entry) tries again
            _failed("watch_state_store", exc, runtime.settings.state_watch_s)

    Done = tuple[UpdateResult, list[tuple[bytes, bytes]], tuple[str, str]]

    def recovering(fn: Callable[[list[In], Deps], list[Res]], items: list[In], deps: Deps) -> list[Res]:
        try:
            return fn(items, deps)
        except StateRolledBack:
            # The store lost writes while this worker ran: rebuild from the log, then apply on top of that.
            runtime.durability.recover_blocking()
            return fn(items, deps)

    def apply(items: list[ImpactedEntry], deps: Deps) -> list[Done]:
        results = recovering(update_batch, items, deps)
        return _sealed(results, [(item.entry.patient_id, item.entry.entry_id) for item in items])

    def apply_deletions(orders: list[DeletionOrder], deps: Deps) -> list[Done]:
        results = recovering(delete_batch, orders, deps)
        for r in results:  # the state moved since the sweep: counted by why, never with ids
            for why in r.skipped.values():
                DELETIONS_SKIPPED.labels(why=why).inc()
        return _sealed(list(results), [(o.patient_id, o.order_id) for o in orders])

    def _sealed(results: list[UpdateResult], ids: list[tuple[str, str]]) -> list[Done]:
        # Sealed here, on the stage thread (the patient's data key may be read from Redis).
        done = [(r, [seal(runtime.sealer, t.patient_id, t) for t in r.transitions], i)
                for r, i in zip(results, ids, strict=True)]
        runtime.sealer.durable()
        return done

    async def publish(event: faust.EventT[Any], done: Done) -> None:
        out, sealed, ids = done
        if out.redone:
            REDONE.inc()
        if out.duplicate:
            MESSAGES.labels(stage="update", outcome="duplicate").inc()
            await _close_gap(ids)
        over = [len(v) for k, v in sealed if len(v) + len(k) > OUTPUT_LIMIT]
        if over:
            # The state change is committed with its outbox; the outbox stays in Redis (the record of what
            # was applied) and the entry is dead-lettered so the gap is visible. The stream goes on.
            log.error("a transition is over the broker's message limit; its entry is dead-lettered, the "
                      "applied state and its outbox kept")
            raise MessageTooLarge(f"a transition would be {max(over):,} bytes, over the broker's message limit; "
                                  "the entry's state change is applied, its transitions are kept in the Redis "
                                  "outbox and were not published")
        futures = [await send_bytes(topics.transitions, k, v, what="transition") for k, v in sealed]
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
            task = asyncio.ensure_future(_clear_when_delivered(futures, first.patient_id, first.entry_id))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def _close_gap(ids: tuple[str, str]) -> None:
        # An entry already applied (a replay of a dead letter whose entry got in another way) has no gap.
        await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, runtime.deps.states.clear_gap, *ids)

    @app.agent(topics.impacted, name="stam.update")
    async def update(stream: faust.StreamT[Any]) -> None:
        # Batches of whatever is waiting (up to update_batch, at most 20 ms apart): one Milvus upsert
        # per patient and one Redis transaction per batch instead of per entry.
        async for events in stream.take_batches(  # type: ignore[attr-defined]  # topology.batching.Stream
                runtime.settings.update_batch, within=0.02):
            await _ready()
            await run_batch(events, stage="update", model=ImpactedEntry, fn=apply,
                            runtime=runtime, on_result=publish)

    settings = runtime.settings
    if settings.deletion_gate is not None and settings.deletion_sweep_s > 0:
        gate_path, every = settings.deletion_gate, settings.deletion_sweep_s

        def sweep_orders() -> tuple[list[tuple[bytes, bytes]], int]:
            """The orders of the patients whose deletions partition this worker holds (each patient is swept by
            exactly one worker). Blocking: state reads and embeddings."""
            from aiokafka.partitioner import DefaultPartitioner

            from stam.deletion.gate import Gate
            from stam.deletion.sweep import orders, scan

            gate = Gate.load(gate_path)
            if gate.spec.encoder != runtime.deps.embedder.model_name:
                raise ValueError(f"the gate scores {gate.spec.encoder} embeddings; this worker embeds with "
                                 f"{runtime.deps.embedder.model_name}")
            topic = topics.deletions.get_topic_name()
            mine = {tp.partition for tp in app.consumer.assignment() if tp.topic == topic}
            parts = list(range(settings.partitions))
            patients = [p for p in runtime.deps.states.patients()
                        if DefaultPartitioner()(runtime.sealer.message_key(p), parts, parts) in mine]
            made = [o for one in scan(runtime.deps.states, runtime.deps.embedder.embed, gate, patients)
                    for o in orders(one, gate)]
            sealed = [seal(runtime.sealer, o.patient_id, o) for o in made]
            runtime.sealer.durable()
            return sealed, sum(len(o.memory_ids) for o in made)

        @app.timer(interval=every)
        async def scheduled_sweep() -> None:
            """The deletion gate on a schedule: orders for this worker's patients, applied by the agent below."""
            try:
                sealed, memories = await asyncio.get_running_loop().run_in_executor(None, sweep_orders)
                for key, value in sealed:
                    await send_bytes(topics.deletions, key, value, what="DeletionOrder")
            except Exception as exc:  # noqa: BLE001 - the next round tries again; a bug is logged and alerted
                _failed("deletion_sweep", exc, every)
                return
            log.info("scheduled deletion sweep: %d orders, %d memories", len(sealed), memories)

    @app.agent(topics.deletions, name="stam.delete")
    async def delete(stream: faust.StreamT[Any]) -> None:
        """The deletion gate's orders (``stam deletion sweep``), applied by this stage, the single writer of
        patient state, as ``deleted`` transitions on the same outbox and topic as every other transition."""
        async for events in stream.take_batches(  # type: ignore[attr-defined]  # topology.batching.Stream
                runtime.settings.update_batch, within=0.02):
            await _ready()
            await run_batch(events, stage="delete", model=DeletionOrder, fn=apply_deletions,
                            runtime=runtime, on_result=publish)

    async def _ready() -> None:
        # Nothing is applied before the store has been checked against its last durable checkpoint.
        delay = 0.5
        while True:
            try:
                await runtime.durability.ready()
                return
            except Exception as exc:  # noqa: BLE001 - an outage is waited out; a bug is logged and alerted
                _failed("durability_check", exc, delay)
                runtime.durability.reset()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    return update
