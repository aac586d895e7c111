"""Impact-retrieval agent: linked topic -> impacted topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import LinkedEntry
from stam.stages import impact_batch
from workers.runtime import Runtime
from workers.stage_agent import forward_batches


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.linked, name="stam.impact")
    async def impact(stream: faust.StreamT[Any]) -> None:
        await forward_batches(stream, stage="impact", model=LinkedEntry, fn=impact_batch, runtime=runtime,
                              dest=topics.impacted)

    return impact
