"""State-update agent: impacted topic -> transitions topic.

One agent instance per partition processes messages one at a time, so two entries of one patient are
never applied concurrently; the versioned commit in the state store guards the rest (rebalances, a second
worker). Transitions are committed to Redis in an outbox together with the state, then published and
confirmed, then the outbox is cleared: a crash in between republishes the same transition ids.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import faust

from schemas import ImpactedEntry
from stam.metrics import MESSAGES, REDONE, TRANSITIONS
from stam.stages import UpdateResult, update_stage
from workers.common import run_stage
from workers.runtime import Runtime

log = logging.getLogger("stam.workers")


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.impacted, name="stam.update")
    async def update(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            key = event.message.key

            async def publish(out: UpdateResult, key: bytes | None = key) -> None:
                if out.redone:
                    REDONE.inc()
                if out.duplicate:
                    MESSAGES.labels(stage="update", outcome="duplicate").inc()
                futures = [await topics.transitions.send(key=key, value=t.model_dump_json().encode())
                           for t in out.transitions]
                if futures:
                    await asyncio.gather(*futures)
                for t in out.transitions:
                    if not out.duplicate:
                        TRANSITIONS.labels(kind=t.kind.value, reason=t.reason.value if t.reason else "").inc()
                if out.transitions:
                    first = out.transitions[0]
                    runtime.deps.states.clear_outbox(first.patient_id, first.entry_id)

            await run_stage(event, stage="update", model=ImpactedEntry, fn=update_stage,
                            runtime=runtime, on_result=publish)

    return update
