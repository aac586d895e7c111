"""workers.ops.LagMonitor: the lag of each held partition every STAM_LAG_INTERVAL_S while there is work, and less
often while the worker is idle (issue 35: an idle stack is idle), back to every interval at the first message."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from stam.config import Settings
from workers.ops import IDLE_LAG_MAX_S, LagMonitor

HELD = [TopicPartition("stam.entries.v1", p) for p in range(4)]


class Broker:
    """End offsets, committed offsets and log starts, and the calls made for them."""

    def __init__(self) -> None:
        self.ends = {tp: 0 for tp in HELD}
        self.committed: dict[TopicPartition, int] = {}
        self.calls: list[str] = []

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.calls.append("end")
        return {tp: self.ends[tp] for tp in tps}

    async def list_consumer_group_offsets(self, group: str, partitions: list[TopicPartition]) -> dict[Any, Any]:
        self.calls.append("committed")
        return {tp: SimpleNamespace(offset=self.committed[tp]) for tp in partitions if tp in self.committed}

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.calls.append(f"start {len(tps)}")
        return {tp: 0 for tp in tps}


def _monitor(broker: Broker) -> tuple[LagMonitor, Any]:
    app = SimpleNamespace(consumer=SimpleNamespace(assignment=lambda: set(HELD)),
                          monitor=SimpleNamespace(messages_received_total=0))
    monitor = LagMonitor(app, Settings(lag_interval_s=5), "stam-write")

    async def clients() -> tuple[Any, Any]:
        return broker, broker

    monitor._clients = clients  # type: ignore[method-assign]
    return monitor, app


def _rounds(monitor: LagMonitor, broker: Broker, ticks: range, step: float = 5.0) -> list[float]:
    """Times (seconds) of the ticks at which the broker was asked."""
    asked = []
    for i in ticks:
        before = len(broker.calls)
        asyncio.run(monitor.update(now=i * step))
        if len(broker.calls) > before:
            asked.append(i * step)
    return asked


def test_an_idle_worker_asks_less_often_and_at_once_when_a_message_comes() -> None:
    broker = Broker()
    monitor, app = _monitor(broker)
    asked = _rounds(monitor, broker, range(0, 400))  # 2,000 s of 5 s ticks, nothing happening
    assert asked[:5] == [0, 5, 15, 35, 75]
    gaps = [b - a for a, b in zip(asked, asked[1:], strict=False)]
    assert max(gaps) == IDLE_LAG_MAX_S and len(asked) <= 12  # 400 rounds at every tick before
    # nothing written yet: the log start is never asked (the lag of an empty partition is 0)
    assert not any(c.startswith("start") for c in broker.calls)

    app.monitor.messages_received_total += 3  # messages came: asked at the next tick, then every tick
    broker.ends[HELD[0]] = 3
    t0 = asked[-1] + 5
    lags = asyncio.run(monitor.update(now=t0))
    assert lags[(HELD[0].topic, 0)] == 3 and "start 1" in broker.calls  # nothing committed: end - start
    assert _rounds(monitor, broker, range(int(t0 / 5) + 1, int(t0 / 5) + 4)) == [t0 + 5, t0 + 10, t0 + 15]

    broker.committed = {tp: broker.ends[tp] for tp in HELD}  # caught up: quiet again, the waits grow
    later = _rounds(monitor, broker, range(int(t0 / 5) + 4, int(t0 / 5) + 30))
    assert [b - a for a, b in zip(later, later[1:4], strict=False)] == [10, 20, 40]


def test_a_worker_with_lag_asks_every_interval() -> None:
    broker = Broker()
    broker.ends = {tp: 10 for tp in HELD}
    broker.committed = {tp: 4 for tp in HELD}  # held back (an outage holds the partition): lag stays 6
    monitor, _ = _monitor(broker)
    assert _rounds(monitor, broker, range(0, 12)) == [i * 5.0 for i in range(12)]
    assert asyncio.run(monitor.update(now=60.0)) == {(tp.topic, tp.partition): 6 for tp in HELD}
