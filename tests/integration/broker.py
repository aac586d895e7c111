"""Helpers shared by the tests that run through the real broker: publishing, and collecting transitions
and dead letters from their topics (the worker fixture is in conftest.py)."""

from __future__ import annotations

import json
import time
from typing import Any

from schemas import RecordEntry
from stam.publish import Publisher, PublishSummary
from stam.transport import kafka_consumer, kafka_producer
from tests.conftest import SMALL_PATIENT
from topology import topics as t

_SEALERS: dict[tuple[str, str], Any] = {}


def opened(settings: Any, value: bytes) -> bytes:
    """A topic value as a reader with the deployment's key store reads it (``stam.crypto``: envelopes opened)."""
    from stam.crypto import sealer_for

    k = (str(settings.home), settings.redis_url)
    if k not in _SEALERS:
        _SEALERS[k] = sealer_for(settings)
    return bytes(_SEALERS[k].open(value))


async def _publish(settings: Any, entries: list[RecordEntry], raw: list[bytes] = ()) -> None:  # type: ignore[assignment]
    async with Publisher(settings) as pub:
        if raw:
            producer = kafka_producer(settings)
            await producer.start()
            for value in raw:
                await producer.send_and_wait(t.ENTRIES.name(settings.topic_prefix),
                                             key=SMALL_PATIENT.encode(), value=value)
            await producer.stop()
        await pub.send_entries(entries, PublishSummary())


async def collect_outputs(settings: Any, want_entries: set[str], timeout: float) -> tuple[list[dict], list[dict]]:
    """The transitions and dead letters on the stack's topics (from the start), opened, read until every entry in
    ``want_entries`` has a transition or ``timeout`` seconds pass."""
    consumer = kafka_consumer(settings, t.TRANSITIONS.name(settings.topic_prefix),
                              t.DEAD_LETTERS.name(settings.topic_prefix), auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    transitions: list[dict] = []
    letters: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for tp, recs in (await consumer.getmany(timeout_ms=500)).items():
                target = letters if tp.topic.endswith("deadletter.v1") else transitions
                target.extend(json.loads(opened(settings, r.value)) for r in recs)
            if want_entries <= {x["entry_id"] for x in transitions}:
                break
    finally:
        await consumer.stop()
    return transitions, letters


async def _dead_letters(settings: Any) -> list[dict]:
    consumer = kafka_consumer(settings, t.DEAD_LETTERS.name(settings.topic_prefix), auto_offset_reset="earliest",
                              group_id=None)
    await consumer.start()
    try:
        got = await consumer.getmany(timeout_ms=3000)
        return [json.loads(opened(settings, r.value)) for recs in got.values() for r in recs]
    finally:
        await consumer.stop()


