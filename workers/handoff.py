"""The fused worker's checks before it joins its consumer group: no four-stage worker alive in the group, and no work
of the group left on the four stages' own topics (extracted, linked, impacted).

A fused worker reads only the entries topic (and the deletions'). In one consumer group with four-stage workers it
would take partitions whose entries the other kind's agents wait for, and what four-stage workers left between stages
would never be applied; so it refuses to start, with one line saying what to do (docs/operations.md, "Switching a
deployment to the fused write path")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from aiokafka.errors import KafkaError

from stam.config import Settings
from stam.errors import FourStagesRunning, StagesBacklog
from topology import topics as t
from topology.admin import unprocessed
from topology.groups import GroupMember, group_members

log = logging.getLogger("stam.workers")

FUSED_CLIENT_ID = "stam-fused"
"""The fused worker's Kafka client id. A broker that sends no member subscriptions (Tansu) still names each member by
its client id (its member id starts with it), so a member with this one is known to be fused."""
STAGE_TOPICS = (t.EXTRACTED, t.LINKED, t.IMPACTED)
"""The topics only the four stages read: each stage's input but the first's."""
SWITCH = "docs/operations.md, \"Switching a deployment to the fused write path\""

T = TypeVar("T")


def four_stage_members(members: Iterable[GroupMember], stage_topics: Iterable[str]) -> list[GroupMember]:
    """The members that read a four-stage topic: those whose subscription holds one of ``stage_topics``; where the
    broker did not send the subscription, every member whose client id is not the fused worker's (not known to be
    fused, so possibly a four-stage worker)."""
    names = set(stage_topics)
    return [m for m in members
            if (names & set(m.subscription) if m.subscription is not None else m.client != FUSED_CLIENT_ID)]


def _until_reached(what: str, ask: Callable[[], T]) -> T:
    """``ask()``, retried while the broker cannot be reached (not up yet: waited for, as the worker would wait)."""
    delay = 1.0
    while True:
        try:
            return ask()
        except (KafkaError, OSError) as exc:
            log.warning("the check for %s could not reach the broker (%s); retrying in %.0fs", what,
                        type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


def check_no_four_stage_members(settings: Settings) -> None:
    """:class:`FourStagesRunning` when a live member of the worker's consumer group reads a four-stage topic (or,
    on a broker that sends no subscriptions, is not known to be fused)."""
    members = _until_reached("four-stage workers in the consumer group",
                             lambda: asyncio.run(group_members(settings, settings.app_id)))
    running = four_stage_members(members, (spec.name(settings.topic_prefix) for spec in STAGE_TOPICS))
    if running:
        n = len(running)
        raise FourStagesRunning(
            f"consumer group {settings.app_id} has {n} live member{'s' if n > 1 else ''} that "
            f"{'read' if n > 1 else 'reads'} the four stages' topics or {'are' if n > 1 else 'is'} not known to be "
            "fused (four-stage workers); a fused worker must not share a group with them: stop them, drain the "
            f"stages' topics with `stam worker --stages link,impact,update`, then start it ({SWITCH})")


def check_no_stage_backlog(settings: Settings) -> None:
    """:class:`StagesBacklog` when the extracted, linked or impacted topic holds messages the group has not processed
    (four-stage workers of the same group stopped with work in flight)."""
    left = _until_reached("work left on the four stages' topics",
                          lambda: asyncio.run(unprocessed(settings, settings.app_id, STAGE_TOPICS)))
    if left:
        held = ", ".join(f"{name} {n:,}" for name, n in sorted(left.items()))
        raise StagesBacklog(f"consumer group {settings.app_id} has messages no stage has processed ({held}); the fused "
                            "worker does not read those topics: run `stam worker --stages link,impact,update` until "
                            "they are processed, then start it")


def check_fused_start(settings: Settings) -> None:
    """Both checks, before a fused worker joins its group: first no four-stage worker alive in it (their work in
    flight would count as left behind), then no work of the group left on the four stages' topics."""
    check_no_four_stage_members(settings)
    check_no_stage_backlog(settings)
