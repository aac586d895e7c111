"""The topics: the per-patient data keys (crypto-shredding), and the scan of every topic from offset 0.

- **Topics**: every value STAM writes for a patient is sealed under the patient's data key (``stam.crypto``);
  the key is shredded (``KeyStore.shred``, before Redis's files are rewritten, so the key is not left on disk
  either), which makes every copy on every topic unreadable. Values producers outside STAM wrote in the clear
  are not covered by this; the scan finds them and the receipt is then not verified.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from typing import Any

import redis

from stam.config import Settings
from stam.crypto import KeyStore, Sealer, load_master_key
from stam.errors import Erased, KeyConfigError, SealBroken
from stam.transport import kafka_consumer
from topology import topics as t


class Crypto:
    """The deployment's key store (``stam.crypto``): shreds a patient's data key, tells whether it was shredded,
    and scans the topics with it (raw bytes, and every envelope that still opens). A key store that cannot start
    (no master key file) is reported as not covering the topics, never raised."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.keystore: KeyStore | None = None
        self.reason = ""
        try:
            self.keystore = KeyStore(client, load_master_key(settings), prefix=settings.collection_prefix)
        except KeyConfigError as exc:
            self.reason = f"not covered (crypto-shredding unavailable: {exc})"

    @property
    def available(self) -> bool:
        return self.keystore is not None

    def shred(self, patient_id: str) -> bool | None:
        return self.keystore.shred(patient_id) if self.keystore is not None else None

    def erased(self, patient_id: str) -> bool:
        return self.keystore.erased(patient_id) if self.keystore is not None else False

    def scan_topics(self, settings: Settings, needles: list[bytes]) -> list[dict[str, Any]] | None:
        if self.keystore is None:
            return None
        return asyncio.run(raw_topic_scan(settings, needles, Sealer(self.keystore)))


def _contents(value: bytes, sealer: Any, depth: int = 0) -> list[tuple[str, bytes]]:
    """What a reader with the key store could read of ``value``: the raw bytes; the plaintext of an envelope that
    still opens; and, inside a dead letter, its base64 ``value`` (itself perhaps an envelope)."""
    out = [("raw" if depth == 0 else "inner", value)]
    if sealer is None or depth > 2:
        return out
    try:
        plain = sealer.open(value)
    except (Erased, SealBroken):
        return out
    if plain is not value:
        out.append(("opened", plain))
    try:
        inner = json.loads(plain).get("value") if plain[:1] == b"{" else None
    except (ValueError, AttributeError, RecursionError):
        inner = None
    if isinstance(inner, str):
        with contextlib.suppress(ValueError, binascii.Error):
            out += _contents(base64.b64decode(inner, validate=True), sealer, depth + 1)
    return out


async def raw_topic_scan(settings: Settings, needles: list[bytes], sealer: Any = None) -> list[dict[str, Any]]:
    """Every record of every STAM topic from offset 0 to the end at the start of the scan: key, value and header
    bytes, and with ``sealer`` what every envelope that still opens holds (an erased patient's do not)."""
    # Deferred: aiokafka is a heavy import that only the topic scan needs (stam rebuild imports this package for
    # the register alone).
    # deferred: aiokafka is slow to import; topology.admin only on this path
    from aiokafka import TopicPartition

    from topology.admin import read_to_end

    consumer = kafka_consumer(settings, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise
    found: list[dict[str, Any]] = []
    try:
        names = {spec.name(settings.topic_prefix) for spec in t.ALL} & set(await consumer.topics())
        tps = [TopicPartition(n, p) for n in sorted(names) for p in sorted(consumer.partitions_for_topic(n) or ())]
        if not tps:
            return found
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)

        async def scan_all() -> None:
            async for r in read_to_end(consumer, tps):
                parts = [("raw", r.key or b"")] + _contents(r.value or b"", sealer) + [
                    ("raw", v or b"") for _, v in (r.headers or ())]
                for i, needle in enumerate(needles):
                    how = next((kind for kind, p in parts if needle in p), None)
                    if how is not None:
                        found.append({"topic": r.topic, "partition": r.partition, "offset": r.offset,
                                      "needle": i, "where": how})

        try:
            await asyncio.wait_for(scan_all(), timeout=300)
        except TimeoutError as exc:
            raise TimeoutError("topic scan did not reach the end of every partition in 300 s") from exc
    finally:
        await consumer.stop()
    return found
