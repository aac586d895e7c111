"""The Kafka transport of the STAM apps: Faust's aiokafka driver with the consumer's fetch wait set by STAM.

faust-streaming 0.15.3 builds its worker consumer with ``fetch_max_wait_ms=1500``, fixed. Against Kafka the wait
only bounds an empty fetch: a fetch returns as soon as one byte is there (``fetch_min_bytes=1``). The Tansu broker
of the embedded stack answers a fetch when the wait ends, whatever arrives meanwhile. Measured with aiokafka
against Tansu, one message every 0.2-1.1 s: delivery p50 465-470 ms at 1500 ms, 95 ms at 500, 25 ms at 100, 9 ms
at 20. On the write path that is once per hop (four hops, then the transitions topic): at 60 entries/s of the
hospital feed each hop's wait (``stam_hop_wait_seconds``) was 380-444 ms p50 at 1500 ms, 140-231 ms at 100.

Under load the same wait is how much each fetch gathers: flat out on 2 cores, one worker applied 127-134
entries/s at 1500 ms and 93-94 at 100 or 500 (more fetches, each with less, and more broker and object-store CPU
per entry). So ``Settings.consumer_fetch_wait_ms`` keeps Faust's 1500 by default and lets a deployment on Tansu
trade throughput for latency at low load (at 50 and 20 ms the feed got slower, not faster: 2.3 and 2.0 s p50 at
60 entries/s, with multi-second stalls).

The value is given to the aiokafka consumer Faust creates, before it starts (its ``_fetch_max_wait_ms``, which
``AIOKafkaConsumer.start`` hands to its fetcher); a consumer without that attribute (another aiokafka) stops the
worker at start rather than running with the fixed wait.
"""

from __future__ import annotations

from typing import Any

import faust
from faust.transport.drivers import aiokafka as driver

_ATTRIBUTE = "_fetch_max_wait_ms"


class ConsumerThread(driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        if not hasattr(consumer, _ATTRIBUTE):
            raise RuntimeError(f"aiokafka's consumer has no {_ATTRIBUTE}: topology/fetching.py was written "
                               "for aiokafka 0.14; this one keeps its fetch wait elsewhere")
        setattr(consumer, _ATTRIBUTE, transport.fetch_wait_ms)
        return consumer


class Consumer(driver.Consumer):
    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(driver.Transport):
    Consumer = Consumer
    fetch_wait_ms: int = 1500


class App(faust.App):
    """``faust.App`` whose Kafka consumer waits at most ``fetch_wait_ms`` for a fetch (other URL schemes, such as
    Faust's in-memory transport for unit tests, are Faust's own)."""

    def __init__(self, *args: Any, fetch_wait_ms: int, **kwargs: Any) -> None:
        self.fetch_wait_ms = fetch_wait_ms
        super().__init__(*args, **kwargs)

    def _new_transport(self) -> Any:
        url = self.conf.broker_consumer[0]
        if url.scheme not in ("kafka", "aiokafka"):
            return super()._new_transport()
        made = Transport(self.conf.broker_consumer, self)
        made.fetch_wait_ms = self.fetch_wait_ms
        return made

