"""Extraction agent: entries topic -> extracted topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import RecordEntry
from stam.stages import extract_batch
from workers.common import forward_batches
from workers.runtime import Runtime


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.entries, name="stam.extract")
    async def extract(stream: faust.StreamT[Any]) -> None:
        await forward_batches(stream, stage="extract", model=RecordEntry, fn=extract_batch, runtime=runtime,
                              dest=topics.extracted)

    return extract
