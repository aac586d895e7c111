"""topology.batching.Stream.take_batches: Faust's batches (full at max_, else within seconds of the first event,
acked after they were consumed), with no timer while nothing is buffered (issue 35: an idle worker is idle)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import faust

from topology.batching import Stream


class CountingStream(Stream):  # type: ignore[misc]
    """Counts the agent's waits: each is a wake-up of the batching loop."""

    waits = 0

    async def wait_for_stopped(self, *args: Any, **kwargs: Any) -> bool:
        type(self).waits += 1
        result: bool = await super().wait_for_stopped(*args, **kwargs)
        return result


def _run(take: Callable[[Any], Any], scenario: Callable[[Any, list[Any]], Any]) -> Any:
    """An agent consuming ``take(stream)`` (test_context: no broker), its batches recorded as
    (values, acked when consumed, monotonic time), driven by ``scenario(agent, batches)``."""
    app = faust.App("stam-batching-test", broker="kafka://127.0.0.1:1", web_enabled=False, Stream=CountingStream)
    batches: list[Any] = []

    @app.agent()
    async def agent(stream: Any) -> None:
        async for events in take(stream):
            batches.append(([e.value for e in events], [e.message.acked for e in events], time.monotonic(),
                            [e.message for e in events]))

    async def main() -> Any:
        async with agent.test_context() as tested:
            return await scenario(tested, batches)

    return asyncio.run(main())


def test_an_idle_agent_does_not_wake() -> None:
    async def idle(agent: Any, batches: list[Any]) -> int:
        await asyncio.sleep(0.1)  # the agent starts and waits
        CountingStream.waits = 0
        await asyncio.sleep(1.0)
        return CountingStream.waits

    assert _run(lambda s: s.take_batches(8, within=0.02), idle) == 0
    # Faust's own take_events on the same stream wakes every 20 ms: the counter sees it.
    assert _run(lambda s: s.take_events(8, within=0.02), idle) >= 25


def test_batches_are_full_at_max_or_within_of_their_first_event() -> None:
    async def burst(agent: Any, batches: list[Any]) -> list[Any]:
        for i in range(10):
            await agent.put(i)
        await asyncio.sleep(0.5)
        put = time.monotonic()
        await agent.put("late")  # alone: yielded `within` after it came, not held for a second event
        await asyncio.sleep(0.6)
        return [put]

    got: list[Any] = []

    async def scenario(agent: Any, batches: list[Any]) -> list[Any]:
        out = await burst(agent, batches)
        got.extend(batches)
        return out

    (put,) = _run(lambda s: s.take_batches(4, within=0.2), scenario)
    assert [values for values, *_ in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], ["late"]]
    assert 0.15 <= got[-1][2] - put <= 0.45
    # acked after the batch was consumed, never while it is
    assert all(not any(acked) for _, acked, *_ in got)
    assert all(m.acked for _, _, _, messages in got[:-1] for m in messages)
