"""The update stage's transition outboxes after their commit (``workers.update``).

Transitions are committed to Redis in an outbox together with the state, then published. The outbox is
cleared once the broker confirms delivery (:class:`DeliveredOutboxes`, many per Redis round trip); the update
agent does not wait for that confirmation before taking the next entry. An outbox left by a crash is
republished, with the same transition ids, when a worker starts (:class:`Republisher`) or when its entry is
redelivered. Every Redis call here runs on the stage thread (``stam.stage_thread``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from time import perf_counter
from typing import Any

from stam.errors import MessageTooLarge
from stam.metrics import DELIVERY_SECONDS
from stam.stage_thread import STAGE_THREAD
from stam.stages import decode_outbox
from workers.runtime import Runtime
from workers.stage_agent import background_failed, seal, send_bytes

log = logging.getLogger("stam.workers")

OUTBOX_CLEAR_S = 0.2
"""How long delivered outboxes gather before they are cleared (one Redis round trip for all of them)."""


class DeliveredOutboxes:
    """The outboxes of published transitions: each is cleared once the broker confirmed all its transitions,
    in batches (:meth:`clear_delivered_outboxes`, the worker's task); a failed delivery keeps its outbox."""

    def __init__(self, runtime: Runtime, wait_s: float = OUTBOX_CLEAR_S) -> None:
        self.runtime = runtime
        self.wait_s = wait_s
        """How long delivered outboxes gather before a round clears them (``OUTBOX_CLEAR_S``)."""
        self.pending: set[asyncio.Future[None]] = set()
        """The waits on deliveries in flight (held here so that they are not garbage-collected)."""
        self.delivered: list[tuple[str, str]] = []
        """(patient id, entry id) of outboxes whose transitions the broker confirmed, cleared in batches."""
        self.to_clear = asyncio.Event()
        """Set while ``delivered`` holds outboxes."""

    def after_delivery(self, futures: Sequence[Any], patient_id: str, entry_id: str,
                       handed: float | None = None) -> None:
        """Clear the outbox of the entry once the broker has confirmed every one of ``futures`` (its sends);
        ``stam_delivery_seconds`` from ``handed`` (``perf_counter()`` before the first send; default: now)."""
        task = asyncio.ensure_future(self._clear_when_delivered(
            futures, patient_id, entry_id, perf_counter() if handed is None else handed))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _clear_when_delivered(self, futures: Sequence[Any], patient_id: str, entry_id: str,
                                    handed: float) -> None:
        try:
            await asyncio.gather(*futures)
        except Exception:  # delivery failed: keep the outbox; it is republished on restart or redelivery
            log.warning("transition delivery failed; outbox kept for republication")
            return
        DELIVERY_SECONDS.observe(perf_counter() - handed)
        self.delivered.append((patient_id, entry_id))
        self.to_clear.set()

    async def clear_delivered_outboxes(self) -> None:
        """Delete the outboxes of delivered transitions, many per Redis round trip (those delivered within
        OUTBOX_CLEAR_S of the first), on the stage thread (never a blocking Redis call on the event loop); with
        none delivered it sleeps (no timer: an idle worker does not wake). Redis unreachable: kept for the next
        round; a worker stopped before a round leaves them to be republished at its next start (same transition
        ids: consumers de-duplicate)."""
        while True:
            await self.to_clear.wait()
            await asyncio.sleep(self.wait_s)
            await self.clear_round()

    async def clear_round(self) -> None:
        """One round of :meth:`clear_delivered_outboxes`: every outbox delivered so far, in one Redis call."""
        self.to_clear.clear()
        batch = self.delivered[:]
        del self.delivered[:len(batch)]
        if not batch:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, self._clear, batch)
        except Exception as exc:  # noqa: BLE001 - the next round tries again; a bug is logged and alerted
            self.delivered[:0] = batch
            self.to_clear.set()
            background_failed("clear_outboxes", exc, self.wait_s)

    def _clear(self, batch: list[tuple[str, str]]) -> None:
        self.runtime.deps.states.clear_outboxes(batch)


class Republisher:
    """Publishes, when a worker starts, the outboxes a previous worker left undelivered."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def republish_pending(self) -> None:
        """Publish outboxes a previous worker left undelivered (same ids: consumers de-duplicate).
        A store outage at start-up is waited out, never fatal."""
        delay = 0.5
        while True:
            try:
                await self.runtime.durability.ready()
                count = await self.republish()
            except Exception as exc:  # noqa: BLE001 - an outage is waited out; a bug is logged and alerted
                background_failed("republish_pending", exc, delay)
                self.runtime.durability.reset()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            if count:
                log.warning("republished %d undelivered transition outboxes", count)
            return

    async def republish(self) -> int:
        """Publish every pending outbox, wait for the broker's confirmation, clear it; how many were. Reading,
        sealing and clearing run on the stage thread. An outbox holding a transition over the broker's message
        limit can never be published: it is left in Redis (logged), not retried at every start."""
        loop = asyncio.get_running_loop()
        transitions = self.runtime.topics.transitions
        count = 0
        for patient_id, entry_id, raw in await loop.run_in_executor(STAGE_THREAD, self._pending):
            try:
                sealed = await loop.run_in_executor(STAGE_THREAD, self._sealed, patient_id, raw)
                futures = [await send_bytes(transitions, k, v, what="transition") for k, v in sealed]
            except MessageTooLarge:  # cannot ever be published: kept in Redis, not retried at every start
                log.error("an outbox holds a transition over the broker's message limit; left in Redis")
                continue
            await asyncio.gather(*futures)
            await loop.run_in_executor(STAGE_THREAD, self._clear, patient_id, entry_id)
            count += 1
        return count

    def _pending(self) -> list[tuple[str, str, bytes]]:
        return self.runtime.deps.states.pending_outboxes()

    def _sealed(self, patient_id: str, raw: bytes) -> list[tuple[bytes, bytes]]:
        sealer = self.runtime.sealer
        sealed = [seal(sealer, patient_id, t) for t in decode_outbox(raw)]
        sealer.durable()  # a key made just now is on Redis's disk before anything sealed under it leaves
        return sealed

    def _clear(self, patient_id: str, entry_id: str) -> None:
        self.runtime.deps.states.clear_outbox(patient_id, entry_id)
