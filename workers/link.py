"""Relation-linking agent: extracted topic -> linked topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import ExtractedEntry, LinkedEntry
from stam.stages import link_stage
from workers.common import run_stage, send
from workers.runtime import Runtime


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.extracted, name="stam.link")
    async def link(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            async def forward(out: LinkedEntry, key: bytes | None = event.message.key) -> None:
                await send(topics.linked, key, out)

            await run_stage(event, stage="link", model=ExtractedEntry, fn=link_stage,
                            runtime=runtime, on_result=forward)

    return link
