"""Create the STAM topics on a broker (idempotent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from stam.config import Settings
from stam.transport import bootstrap, kafka_client_kwargs
from topology import topics as t

__all__ = ["bootstrap", "ensure_topics", "kafka_client_kwargs", "producer", "read_to_end"]


@contextlib.asynccontextmanager
async def producer(settings: Settings) -> AsyncIterator[Any]:
    """A started aiokafka producer that waits for every in-sync replica (``acks=all``), stopped on the way out;
    stopped too when it fails to start (aiokafka leaves its connections open otherwise)."""
    from aiokafka import AIOKafkaProducer

    made = AIOKafkaProducer(**kafka_client_kwargs(settings), acks="all")
    try:
        await made.start()
        yield made
    finally:
        await made.stop()


async def ensure_topics(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = []
        for spec in t.ALL:
            name = spec.name(settings.topic_prefix)
            if name in existing:
                continue
            config = {"retention.ms": str(int(spec.retention.total_seconds() * 1000))
                      if spec.retention else "-1",
                      "cleanup.policy": "compact" if spec.compacted else "delete"}
            new.append(NewTopic(name, settings.partitions, settings.replication_factor, topic_configs=config))
        if new:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(new)
        return [n.name for n in new]
    finally:
        await admin.close()


async def read_to_end(consumer: Any, tps: list[Any], *, max_records: int = 5000) -> AsyncIterator[Any]:
    """Every record of ``tps`` from the consumer's positions to their ends.

    A broker's reported end offset can lag records it already serves (Tansu on S3 answered ListOffsets with a
    stale end now and then, measured here), so reaching the reported end is not the end: one more fetch must
    come back empty, with the end offsets asked again, before the read stops."""
    while True:
        ends = await consumer.end_offsets(tps)
        pending = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
        batch = await consumer.getmany(*(pending or tps), timeout_ms=1000 if pending else 300,
                                       max_records=max_records)
        records = [r for recs in batch.values() for r in recs]
        if not pending and not records:
            return
        for r in records:
            yield r
