"""The stream class of the STAM apps: Faust's, with batches that cost nothing while no message comes.

Faust's ``Stream.take_events(max_, within)`` waits for a full buffer with a timeout of ``within`` in a loop, empty
buffer or not: an idle agent wakes every ``within`` (20 ms here) to find nothing, which is three tasks created and
cancelled each time, 50 times a second per agent. The write worker's five agents spent about 4% of a core so while
no message came (``make bench-idle``). :meth:`Stream.take_batches` is the same batching with the timer started by
the first message of a batch: while the buffer is empty it waits for a message and nothing else.

What a batch is does not change: the events buffered when ``max_`` is reached, or ``within`` seconds after the
first of them arrived (Faust: at the first ``within`` tick after it, so 0 to ``within``); events are acked after
the batch's consumer has run (never before), and the buffer takes no event while a batch is being consumed.
The body follows faust-streaming 0.15.3's ``take_events`` (pinned in pyproject.toml), which
``tests/unit/test_batching.py`` runs against.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any, cast

import faust
from faust.streams import _tracks_buffer_agen  # registers the generator for cleanup when the stream stops
from faust.types import ChannelT, EventT
from mode.utils.aiter import aiter
from mode.utils.futures import notify

# mode annotates the waitables of ``Service.wait``/``wait_for_stopped`` as its own ``Event``; Faust's take_events
# passes asyncio.Events too (they have the awaitable ``.wait()`` mode calls): hence the arg-type ignores below.


class Stream(faust.Stream[Any]):
    @_tracks_buffer_agen
    async def take_batches(self, max_: int, within: float) -> AsyncGenerator[Sequence[EventT[Any]], None]:
        """Batches of at most ``max_`` events, each yielded when full or ``within`` seconds after its first event
        arrived; while no event is buffered, no timer runs. Events are acked when the consumer asks for the next
        batch (after it processed this one)."""
        buffer: list[Any] = []
        events: list[EventT[Any]] = []
        buffer_full = asyncio.Event()  # max_ events buffered
        buffer_consumed = asyncio.Event()  # a full buffer was yielded: the next event may be added
        buffer_started = asyncio.Event()  # the buffer holds an event (its batch's timer runs)
        stream_enable_acks: bool = self.enable_acks
        buffer_consuming: asyncio.Future[None] | None = None  # set while a batch is consumed: nothing is added

        channel_it = aiter(self.channel)

        async def add_to_buffer(value: Any) -> Any:
            try:
                nonlocal buffer_consuming
                if buffer_consuming is not None:
                    try:
                        await buffer_consuming
                    finally:
                        buffer_consuming = None
                buffer.append(value)
                event = self.current_event
                if event is None:
                    raise RuntimeError("Take buffer found current_event is None")
                events.append(event)
                buffer_started.set()
                if len(buffer) >= max_:
                    buffer_full.set()
                    buffer_consumed.clear()  # never more than max_ events in a batch
                    await self.wait(buffer_consumed)  # type: ignore[arg-type]
            except asyncio.CancelledError:  # pragma: no cover
                raise
            except Exception as exc:
                self.log.exception("Error adding to take buffer: %r", exc)
                await self.crash(exc)
            return value

        # The events are acked here, after their batch was consumed.
        self.enable_acks = False
        self.add_processor(add_to_buffer)
        self._enable_passive(cast(ChannelT[Any], channel_it))
        try:
            while not self.should_stop:
                if not buffer:
                    # idle: no timer, only the first event (or the stream stopping) wakes us
                    await self.wait_for_stopped(buffer_started)  # type: ignore[arg-type]
                    continue
                await self.wait_for_stopped(buffer_full, timeout=within)  # type: ignore[arg-type]
                if buffer:
                    buffer_consuming = self.loop.create_future()
                    try:
                        yield list(events)
                    finally:
                        buffer.clear()
                        for event in events:
                            await self.ack(event)
                        events.clear()
                        buffer_started.clear()  # before the next event may be added
                        notify(buffer_consuming)
                        buffer_full.clear()
                        buffer_consumed.set()
        finally:
            self.enable_acks = stream_enable_acks
            self._processors.remove(add_to_buffer)
