"""The bound on how far a four-stage worker's extract runs ahead of its update (workers.run_ahead)."""

from __future__ import annotations

import asyncio

from workers.run_ahead import RunAhead


def test_extract_waits_until_the_update_stage_takes_entries_off() -> None:
    async def scenario() -> tuple[float, float, int]:
        ahead = RunAhead(bound=3, max_wait_s=5.0)
        for _ in range(3):
            ahead.outcome("extract", "ok")
        ahead.outcome("extract", "dead_letter")  # not handed on: not ahead
        waiting = asyncio.ensure_future(ahead.room())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # three ahead: at the bound
        ahead.outcome("link", "ok")  # passing through: still ahead
        ahead.outcome("impact", "ok")
        await asyncio.sleep(0.05)
        assert not waiting.done()
        ahead.outcome("update", "ok")
        waited = await asyncio.wait_for(waiting, 1.0)
        free = await ahead.room()
        return waited, free, ahead.ahead

    waited, free, left = asyncio.run(scenario())
    assert 0.05 <= waited < 1.0 and free < 0.01 and left == 2


def test_an_entry_dropped_on_the_way_has_left_and_the_count_never_goes_below_zero() -> None:
    ahead = RunAhead(bound=2)
    ahead.outcome("extract", "ok")
    ahead.outcome("extract", "ok")
    ahead.outcome("impact", "dead_letter")
    ahead.outcome("link", "erased")
    assert ahead.ahead == 0
    ahead.outcome("update", "ok")  # settled without being handed on here (a restart): not below zero
    assert ahead.ahead == 0


def test_a_count_that_drifted_costs_at_most_the_wait() -> None:
    async def scenario() -> float:
        ahead = RunAhead(bound=1, max_wait_s=0.2)
        ahead.outcome("extract", "ok")  # its update never comes (it was settled by another process)
        return await ahead.room()

    waited = asyncio.run(scenario())
    assert 0.2 <= waited < 1.0
