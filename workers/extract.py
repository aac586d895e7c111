"""Extraction agent: entries topic -> extracted topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import ExtractedEntry, RecordEntry
from stam.stages import extract_stage
from workers.common import run_stage, send
from workers.runtime import Runtime


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.entries, name="stam.extract")
    async def extract(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            async def forward(out: ExtractedEntry, key: bytes | None = event.message.key) -> None:
                await send(topics.extracted, key or out.entry.patient_id.encode(), out)

            await run_stage(event, stage="extract", model=RecordEntry, fn=extract_stage,
                            runtime=runtime, on_result=forward)

    return extract
