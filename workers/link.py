"""Relation-linking agent: extracted topic -> linked topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import ExtractedEntry
from stam.stages import link_batch
from workers.runtime import Runtime
from workers.stage_agent import forward_batches


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.extracted, name="stam.link")
    async def link(stream: faust.StreamT[Any]) -> None:
        await forward_batches(stream, stage="link", model=ExtractedEntry, fn=link_batch, runtime=runtime,
                              dest=topics.linked)

    return link
