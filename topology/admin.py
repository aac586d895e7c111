"""Create the STAM topics on a broker (idempotent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from stam.config import Settings
from stam.transport import kafka_admin, kafka_consumer, kafka_producer
from topology import topics as t

__all__ = ["ensure_topics", "producer", "read_to_end", "unprocessed"]


@contextlib.asynccontextmanager
async def producer(settings: Settings) -> AsyncIterator[Any]:
    """A started aiokafka producer that waits for every in-sync replica (``acks=all``), stopped on the way out;
    stopped too when it fails to start (aiokafka leaves its connections open otherwise)."""
    made = kafka_producer(settings, acks="all")
    try:
        await made.start()
        yield made
    finally:
        await made.stop()


async def ensure_topics(settings: Settings) -> list[str]:
    admin = kafka_admin(settings)
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


async def unprocessed(settings: Settings, group: str, specs: tuple[t.TopicSpec, ...]) -> dict[str, int]:
    """Messages of ``specs``' topics that consumer group ``group`` has not committed past, per topic (those with any):
    a partition with no committed offset counts from its first message. A topic that does not exist holds none."""
    consumer = kafka_consumer(settings, group_id=group, enable_auto_commit=False)
    try:  # stopped too when it fails to start (aiokafka leaves its connections open otherwise)
        await consumer.start()
        existing = await consumer.topics()
        names = [spec.name(settings.topic_prefix) for spec in specs]
        tps = [TopicPartition(n, p) for n in names if n in existing
               for p in sorted(consumer.partitions_for_topic(n) or ())]
        if not tps:
            return {}
        first, end = await consumer.beginning_offsets(tps), await consumer.end_offsets(tps)
        left: dict[str, int] = {}
        for tp in tps:
            done = await consumer.committed(tp)
            behind = end[tp] - max(first[tp], done if done is not None else first[tp])
            if behind > 0:
                left[tp.topic] = left.get(tp.topic, 0) + behind
        return left
    finally:
        await consumer.stop()
