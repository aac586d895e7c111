"""The scheduled deletion sweep of an update worker (``STAM_DELETION_GATE`` and ``STAM_DELETION_SWEEP_S``): the
deletion gate (``stam.deletion``) run on a schedule over the patients of this worker's deletions partitions, its
orders sent to the deletions topic, where the update worker's delete agent applies them (``workers.update``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust
from aiokafka.partitioner import DefaultPartitioner

from stam.deletion.gate import Gate
from stam.deletion.sweep import orders, scan
from stam.stage_thread import STAGE_THREAD
from workers.runtime import Runtime
from workers.stage_agent import background_failed, seal, send_bytes

log = logging.getLogger("stam.workers")


class ScheduledSweep:
    """The deletion gate at ``gate_path`` swept every ``every`` seconds (:meth:`scheduled_sweep`, a timer)."""

    def __init__(self, app: faust.App, runtime: Runtime, gate_path: Path, every: float) -> None:
        self.app = app
        self.runtime = runtime
        self.gate_path = gate_path
        self.every = every

    @classmethod
    def configured(cls, app: faust.App, runtime: Runtime) -> ScheduledSweep | None:
        """The sweep the settings ask for: a gate and a positive interval; None otherwise (no sweep)."""
        settings = runtime.settings
        if settings.deletion_gate is None or settings.deletion_sweep_s <= 0:
            return None
        return cls(app, runtime, settings.deletion_gate, settings.deletion_sweep_s)

    def sweep_orders(self) -> tuple[list[tuple[bytes, bytes]], int]:
        """The orders of the patients whose deletions partition this worker holds (each patient is swept by
        exactly one worker), sealed, and how many memories they delete. Blocking: state reads and embeddings."""
        runtime = self.runtime
        gate = Gate.load(self.gate_path)
        deps = runtime.deps
        if gate.spec.encoder != deps.embedder.model_name:
            raise ValueError(f"the gate scores {gate.spec.encoder} embeddings; this worker embeds with "
                             f"{deps.embedder.model_name}")
        topic = runtime.topics.deletions.get_topic_name()
        mine = {tp.partition for tp in self.app.consumer.assignment() if tp.topic == topic}
        parts = list(range(runtime.settings.partitions))
        patients = [p for p in deps.states.patients()
                    if DefaultPartitioner()(runtime.sealer.message_key(p), parts, parts) in mine]
        made = [o for one in scan(deps.states, deps.embedder.embed, gate, patients) for o in orders(one, gate)]
        sealed = [seal(runtime.sealer, o.patient_id, o) for o in made]
        runtime.sealer.durable()
        return sealed, sum(len(o.memory_ids) for o in made)

    async def scheduled_sweep(self) -> None:
        """The deletion gate on a schedule: orders for this worker's patients (swept on the stage thread, never on
        the event loop), applied by the update worker's delete agent."""
        try:
            sealed, memories = await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, self.sweep_orders)
            for key, value in sealed:
                await send_bytes(self.runtime.topics.deletions, key, value, what="DeletionOrder")
        except Exception as exc:  # noqa: BLE001 - the next round tries again; a bug is logged and alerted
            background_failed("deletion_sweep", exc, self.every)
            return
        log.info("scheduled deletion sweep: %d orders, %d memories", len(sealed), memories)
