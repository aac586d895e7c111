"""How far the extract stage of a four-stage worker runs ahead of its update stage, bounded.

Extract is the cheapest stage (about 0.06 ms an entry on the hospital feed), so on a backlog it would take its
whole topic long before link, impact and update follow (they share one stage thread), filling the intermediate
topics. With the bound, extract waits while ``run_ahead_entries`` of the entries it handed on have not left the
pipeline yet (applied, or dead-lettered or dropped on the way): a backlog is worked through in order, and the
state version link and impact read stays within what the updater's change log reaches (``stam.stages.reads``),
so their work is reused instead of redone. The bound must leave the pipeline its rate times its latency in flight:
512 cut the four stages' flat-out rate by more than half on the hospital feed (the broker's log in memory); 4,096
(the default) about a tenth.
On that feed the bound does not bring the first transitions out sooner: the four hops set when they come out.

The count is the process's own: it bounds a worker that runs extract and update both (``--stages all``, the card's
topology in one process). A worker that runs extract without update has no update to wait for, and is not bounded
here. The wait is also bounded (``max_wait_s``): a count that drifts (a message settled that this process did not
forward, after a restart or a rebalance) costs at most that wait, never a stalled stream.
"""

from __future__ import annotations

import asyncio
import time

from stam.metrics import RUN_AHEAD

PASSING = frozenset({"link", "impact"})
"""Stages an entry passes through between extract and update: an entry one of them does not hand on has left."""


class RunAhead:
    """Entries the extract stage handed on that have not left the pipeline, and the wait that bounds them."""

    def __init__(self, bound: int, max_wait_s: float = 2.0) -> None:
        self.bound = bound
        self.max_wait_s = max_wait_s
        self.ahead = 0
        self._moved = asyncio.Event()

    def outcome(self, stage: str, outcome: str, n: int = 1) -> None:
        """``n`` messages of ``stage`` had ``outcome`` (ok, dead_letter, erased): extract's handed on are ahead;
        update's of any outcome, and link's or impact's not handed on, have left."""
        if stage == "extract":
            if outcome == "ok":
                self.ahead += n
        elif stage == "update" or (stage in PASSING and outcome != "ok"):
            self.ahead = max(0, self.ahead - n)
            self._moved.set()
        RUN_AHEAD.set(self.ahead)

    async def room(self) -> float:
        """Wait until fewer than ``bound`` entries are ahead (or ``max_wait_s`` passed); the seconds waited."""
        started = time.monotonic()
        while self.ahead >= self.bound:
            left = self.max_wait_s - (time.monotonic() - started)
            if left <= 0:
                break
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), timeout=left)
            except TimeoutError:
                break
        return time.monotonic() - started
