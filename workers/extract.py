"""Extraction agent: entries topic -> extracted topic.

Each entry's source signature is verified here (stam/integrity.py): the verified source system is stamped on
its memories; an entry that fails verification is dead-lettered with the reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import faust
from pydantic import BaseModel, ConfigDict

from schemas import ExtractedEntry, RecordEntry
from stam.integrity import source_keys
from stam.stages import Deps, extract_signed_batch
from workers.runtime import Runtime
from workers.stage_agent import forward_batches


class VerifiedEntry(BaseModel):
    """An entry with the source system its signature proved (None: unsigned). In-process only."""

    model_config = ConfigDict(frozen=True)
    entry: RecordEntry
    source_system: str | None


def extract_verified(items: list[VerifiedEntry], deps: Deps) -> list[ExtractedEntry]:
    """The extract stage on entries whose source identity was verified (the four-stage and the fused path)."""
    return extract_signed_batch([(x.entry, x.source_system) for x in items], deps)


def verifier(runtime: Runtime) -> Callable[[faust.EventT[Any], bytes], VerifiedEntry]:
    """The parse of an entries-topic message: its source signature verified against the deployment's keys (an
    entry that fails raises, and is dead-lettered with the reason)."""
    keys = source_keys(runtime.settings)

    def verified(event: faust.EventT[Any], value: bytes) -> VerifiedEntry:
        # ``value`` is the opened entry: a signature covers the plaintext (``stam publish`` signs, then seals).
        source = keys.verify(event.message.headers, value)
        return VerifiedEntry(entry=RecordEntry.model_validate_json(value), source_system=source)

    return verified


def register(app: faust.App, runtime: Runtime) -> Any:
    topics = runtime.topics

    @app.agent(topics.entries, name="stam.extract")
    async def extract(stream: faust.StreamT[Any]) -> None:
        await forward_batches(stream, stage="extract", model=VerifiedEntry, fn=extract_verified, runtime=runtime,
                              dest=topics.extracted, parse=verifier(runtime))

    return extract
