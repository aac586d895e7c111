"""Create the STAM topics on a broker (idempotent)."""

from __future__ import annotations

import contextlib

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from stam.config import Settings
from topology import topics as t


def bootstrap(settings: Settings) -> str:
    return ",".join(u.split("://", 1)[-1] for u in settings.broker_url.split(";"))


async def ensure_topics(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap(settings))
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
