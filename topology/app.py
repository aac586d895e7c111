"""The Faust application of the write path and its topics, built from Settings."""

from __future__ import annotations

from dataclasses import dataclass

import faust

from schemas.limits import BROKER_MESSAGE_BYTES
from stam.config import Settings
from stam.transport import PRODUCER_BATCH_BYTES, faust_broker_kwargs
from topology import topics as t
from topology.batching import Stream
from topology.fetching import App


@dataclass(frozen=True)
class Topics:
    entries: faust.TopicT
    extracted: faust.TopicT
    linked: faust.TopicT
    impacted: faust.TopicT
    transitions: faust.TopicT
    dead_letters: faust.TopicT
    queries: faust.TopicT
    answers: faust.TopicT
    checkpoints: faust.TopicT
    audit: faust.TopicT
    deletions: faust.TopicT


def _topic(app: faust.App, spec: t.TopicSpec, settings: Settings) -> faust.TopicT:
    config: dict[str, str] = {"retention.ms": "-1"} if spec.retention is None else {}
    return app.topic(
        spec.name(settings.topic_prefix), key_type=bytes, value_type=bytes, key_serializer="raw",
        value_serializer="raw", partitions=settings.partitions, replicas=settings.replication_factor,
        retention=spec.retention, compacting=spec.compacted or None, deleting=not spec.compacted,
        internal=False, config=config or None,
    )


INLINE_COMMIT_NEVER = 2**62
"""Acks after which Faust would commit inline, in its fetch loop (it takes an int, not None): out of reach."""


def create_app(settings: Settings, *, app_id: str | None = None, web_port: int | None = None,
               web_host: str | None = None, client_id: str | None = None) -> tuple[faust.App, Topics]:
    """The app and its topics. Its web server (when ``web_port`` > 0) listens on ``web_host`` only: Faust binds to
    ``web_bind`` (default 0.0.0.0) and merely advertises ``web_host``, so both are set. ``client_id``: its Kafka
    clients' id (None: Faust's, ``faust-<version>``)."""
    port = settings.web_port if web_port is None else web_port
    host = settings.web_host if web_host is None else web_host
    app = App(
        app_id or settings.app_id,
        **({"broker_client_id": client_id} if client_id else {}),
        fetch_wait_ms=settings.consumer_fetch_wait_ms,
        broker=settings.broker_url,
        **faust_broker_kwargs(settings),
        store="memory://",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        consumer_auto_offset_reset="earliest",
        web_enabled=port > 0,
        web_port=port or 6066,
        web_host=host,
        web_bind=host,
        producer_linger_ms=5,
        producer_max_batch_size=PRODUCER_BATCH_BYTES,  # one round trip per partition per batch (stam.transport)
        producer_max_request_size=BROKER_MESSAGE_BYTES,  # stage outputs are checked against it (workers.stage_agent)
        # Offsets are committed by Faust's commit timer only (every broker_commit_interval), never inline: Faust
        # commits inline from its fetch loop after broker_commit_every acks, and a commit first waits out Redis's
        # fsync window (stam.recovery.install; 2 s with appendfsync everysec), so an inline commit every 200 acks
        # stopped all fetching for the window (measured: the fetch loop held there about half the time on the
        # hospital feed, and the write path ran at half its rate).
        broker_commit_every=INLINE_COMMIT_NEVER,
        # Tansu (and Kafka) hold a new group's join for the rebalance timeout when a previous member
        # may return; shorter timeouts make a restarted worker resume sooner.
        broker_session_timeout=settings.session_timeout_s,
        broker_rebalance_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3),
        broker_commit_interval=1.0,
        Stream=Stream,  # take_batches: no timer while an agent has nothing buffered (topology/batching.py)
    )
    topics = Topics(*(_topic(app, spec, settings) for spec in t.ALL))
    return app, topics
