"""``stam transitions``: follow the transitions and dead-letter topics (also the demos' live view)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

from schemas.vocabulary import LIFECYCLE_REASONS
from stam.cli.context import load_settings
from stam.config import Settings
from stam.errors import Erased, SealBroken


def _describe(t: dict[str, Any], texts: dict[str, str]) -> str:
    what = texts.get(t["memory_id"], t["memory_id"])
    if t["kind"] == "archived":
        succ = texts.get(t.get("successor_id") or "", "")
        when = f"  (ended {t['clinical_time'][:16].replace('T', ' ')})" if t["reason"] in LIFECYCLE_REASONS and t.get(
            "clinical_time") else ""
        return f"ACTIVE -> HISTORY [{t['reason']}] {what}" + (f"  (successor: {succ})" if succ else "") + when
    if t["kind"] == "restored":
        return f"HISTORY -> ACTIVE [what ended it was cancelled] {what}"
    if t["kind"] == "added" and t["to_store"] == "history":
        return f"new -> HISTORY [{t['reason']}] {what}"
    if t["kind"] == "delete_proposed":
        return f"DELETE proposed (not executed) {what}"
    if t["kind"] == "deleted":
        g = t.get("gate") or {}
        return (f"HISTORY -> deleted by the gate (score {g.get('score', 0):.3f} >= tau {g.get('tau', 0):.3f}, "
                f"{g.get('calibration_id', '?')}) {what}")
    return f"new -> ACTIVE {what}"


async def consume_transitions(settings: Settings, *, until_entries: set[str] | None, timeout: float,
                               show: bool, show_added: bool = False,
                               show_entries: set[str] | None = None) -> dict[str, int]:
    """Follow the transitions and dead-letter topics; print them (``show_entries``: only those entries').
    Sealed values are opened; those of erased patients are skipped."""
    # deferred: stam.crypto, stam.transport and others pull in redis, cryptography (kept off `stam --help`)
    from stam.crypto import sealer_for
    from stam.transport import kafka_consumer
    from topology import topics as t

    sealer = sealer_for(settings)
    consumer = kafka_consumer(
        settings, t.TRANSITIONS.name(settings.topic_prefix), t.DEAD_LETTERS.name(settings.topic_prefix),
        auto_offset_reset="earliest", enable_auto_commit=False, group_id=None)
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()  # an unreachable broker: no "Unclosed AIOKafkaConsumer" at exit
        raise
    counts: dict[str, int] = {"transitions": 0, "dead_letters": 0, "entries_done": 0}
    texts: dict[str, str] = {}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for rec in records:
                    try:
                        data = json.loads(sealer.open(rec.value))
                    except Erased:
                        continue
                    except SealBroken:
                        data = {"stage": "?", "error_type": "SealBroken", "error": "a sealed value that does not open"}
                    if tp.topic.endswith("deadletter.v1"):
                        counts["dead_letters"] += 1
                        if show:
                            print(f"  DEAD LETTER stage={data['stage']} {data['error_type']}: {data['error'][:120]}")
                        continue
                    counts["transitions"] += 1
                    if data.get("memory"):
                        texts[data["memory_id"]] = data["memory"]["text"]
                    seen.add(data["entry_id"])
                    key = f"{data['kind']}:{data.get('reason') or ''}"
                    counts[key] = counts.get(key, 0) + 1
                    if show_entries is not None:
                        if data["entry_id"] in show_entries:
                            rels = "".join(f"\n        {r['type']} -> {texts.get(r['target_id'], r['target_id'])}"
                                           for r in data.get("relations") or ())
                            print("  " + _describe(data, texts) + rels)
                    elif show and (show_added or data["kind"] != "added" or data["to_store"] == "history"):
                        print("  " + _describe(data, texts))
            if until_entries is not None:
                counts["entries_done"] = len(until_entries & seen)
                if until_entries <= seen:
                    break
    finally:
        await consumer.stop()
    return counts


def cmd_transitions(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker",))
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an unreachable broker is said in one line (stam.cli)
    counts = asyncio.run(consume_transitions(settings, until_entries=None, timeout=args.seconds,
                                              show=True, show_added=True))
    print(json.dumps(counts))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("transitions", help="print transitions from the transitions topic")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to listen")
    p.set_defaults(fn=cmd_transitions)
