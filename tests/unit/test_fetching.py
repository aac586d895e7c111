"""The write path's Kafka consumer waits at most ``Settings.consumer_fetch_wait_ms`` for a fetch
(topology/fetching.py): Faust's driver fixes 1500 ms, which the embedded Tansu broker waits out in full."""

from __future__ import annotations

import asyncio

import pytest

from stam.config import Settings
from topology.app import create_app
from topology.fetching import Transport


def _consumer_wait(settings: Settings) -> tuple[object, int]:
    async def build() -> tuple[object, int]:
        app, _ = create_app(settings, web_port=0)
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        try:
            return app.transport, consumer._fetch_max_wait_ms
        finally:
            await consumer.stop()  # never started: closes its client

    return asyncio.run(build())


def test_the_consumer_gets_the_configured_fetch_wait() -> None:
    transport, wait = _consumer_wait(Settings(broker_url="kafka://127.0.0.1:1", consumer_fetch_wait_ms=37))
    assert isinstance(transport, Transport) and wait == 37
    _, default = _consumer_wait(Settings(broker_url="kafka://127.0.0.1:1"))
    assert default == Settings.model_fields["consumer_fetch_wait_ms"].default == 1500


def test_the_fetch_wait_is_bounded() -> None:
    from pydantic import ValidationError

    for bad in (0, 30_001):
        with pytest.raises(ValidationError):
            Settings(consumer_fetch_wait_ms=bad)


def test_the_fused_worker_waits_100_ms_unless_the_setting_is_given() -> None:
    from workers.main import FUSED_FETCH_WAIT_MS, build

    fused, _ = build(Settings(web_port=0))  # the default
    four, _ = build(Settings(web_port=0), ("extract", "link", "impact", "update"))
    given, _ = build(Settings(web_port=0, consumer_fetch_wait_ms=700), ("fused",))
    assert [a.fetch_wait_ms for a in (fused, four, given)] == [FUSED_FETCH_WAIT_MS, 1500, 700]  # type: ignore[attr-defined]


def test_producers_gather_256_kib_per_partition() -> None:
    """The worker's producer (Faust's) and the publisher's send a partition's batch of up to
    ``PRODUCER_BATCH_BYTES``, not aiokafka's 16 KiB: a producer sends a partition's next batch only after the
    broker answered the last, so with 16 KiB the fused worker handed a batch's transitions on in many round trips
    and fell behind at 80% of its flat-out rate (stam.transport)."""
    from stam.publish import Publisher
    from stam.transport import PRODUCER_BATCH_BYTES

    settings = Settings(broker_url="kafka://127.0.0.1:1")

    async def sizes() -> tuple[int, int]:
        app, _ = create_app(settings, web_port=0)
        producer = Publisher(settings)._producer
        try:
            return app.producer._settings_default()["max_batch_size"], producer._message_accumulator._batch_size
        finally:
            await producer.stop()  # never started: closes its client

    worker, publisher = asyncio.run(sizes())
    assert worker == publisher == PRODUCER_BATCH_BYTES > 16 * 1024
