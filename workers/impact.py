"""Impact-retrieval agent: linked topic -> impacted topic."""

from __future__ import annotations

from typing import Any

import faust

from schemas import ImpactedEntry, LinkedEntry
from stam.stages import impact_batch
from workers.runtime import Runtime
from workers.stage_agent import forward_batches


def without_reads(x: ImpactedEntry) -> ImpactedEntry | None:
    """An impacted entry over the broker's limit, without the record of what its semantic channel read: the update
    stage then searches again for it (``stam.stages.reads``) instead of the entry being dead-lettered."""
    return x.model_copy(update={"semantic": None}) if x.semantic else None


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.linked, name="stam.impact")
    async def impact(stream: faust.StreamT[Any]) -> None:
        await forward_batches(stream, stage="impact", model=LinkedEntry, fn=impact_batch, runtime=runtime,
                              dest=topics.impacted, shrink=without_reads)

    return impact
