"""Impact-retrieval agent: linked topic -> impacted topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import ImpactedEntry, LinkedEntry
from stam.stages import impact_stage
from workers.common import run_stage, send
from workers.runtime import Runtime


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.linked, name="stam.impact")
    async def impact(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            async def forward(out: ImpactedEntry, key: bytes | None = event.message.key) -> None:
                await send(topics.impacted, key, out)

            await run_stage(event, stage="impact", model=LinkedEntry, fn=impact_stage,
                            runtime=runtime, on_result=forward)

    return impact
