"""What the workers share: settings, stores, the embedder and the reasoner router, built once."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import faust
import redis

from schemas import DeadLetter
from stam.compose import build_deps
from stam.config import Settings
from stam.crypto import Sealer, sealer_for
from stam.deadletter_payload import bounded_key, bounded_value
from stam.deadletters import gap_of, letter_id, subject
from stam.metrics import DEAD_LETTERS
from stam.recovery import Durability
from stam.stage_thread import STAGE_THREAD
from stam.stages import Deps
from topology.app import Topics
from workers.run_ahead import RunAhead

log = logging.getLogger("stam.workers")


@dataclass
class Runtime:
    settings: Settings
    topics: Topics
    _deps: Deps | None = field(default=None)
    _sealer: Sealer | None = field(default=None)
    writes: bool = True
    """This process runs the write path: its deps say at start how free text will be decomposed (a query
    process decomposes nothing, so it says nothing of the language model)."""
    durability: Durability = field(init=False)
    run_ahead: RunAhead | None = None
    """How far extract runs ahead of update, when this process runs both (``--stages all``)."""

    def __post_init__(self) -> None:
        self.durability = Durability(self.settings, lambda: self.deps)

    @property
    def deps(self) -> Deps:
        if self._deps is None:
            self._deps = build_deps(self.settings, announce=self.writes)
        return self._deps

    @property
    def sealer(self) -> Sealer:
        """Seals and opens the patients' messages (``stam.crypto``), on the deployment's Redis and master key."""
        if self._sealer is None:
            self._sealer = sealer_for(self.settings)
        return self._sealer

    async def dead_letter(self, event: faust.EventT[Any], stage: str, exc: BaseException,
                          opened: bytes | None = None) -> None:
        """Publish the message (or a bounded excerpt, digest and size: ``stam.deadletter_payload``) with the stage, the
        error and where the message is (topic/partition/offset); log where it came from (no patient ids).

        ``opened``: the message's plaintext when its envelope was opened. The letter then holds the plaintext,
        so an operator can read and replay it, and the whole letter is sealed for the patient and keyed by its
        pseudonym, like the message was. A letter of no known patient is sent as it is (it names nobody)."""
        msg = event.message
        raw_value = msg.value if isinstance(msg.value, bytes) else str(msg.value).encode()
        was_sealed = self.sealer.sealed(raw_value)
        # A pseudonym key names nobody: the letter keeps the original key only when it was a plain one.
        key_field, send_key = bounded_key(msg.key if isinstance(msg.key, bytes) and not was_sealed else None)
        letter = DeadLetter(
            stage=stage, topic=msg.topic, partition=msg.partition, offset=msg.offset, key=key_field,
            error_type=type(exc).__name__, error=str(exc)[:4000], failed_at=datetime.now(UTC),
            **bounded_value(opened if opened is not None else raw_value),
        )
        DEAD_LETTERS.labels(stage=stage, error_type=type(exc).__name__).inc()
        log.warning("dead-lettered stage=%s topic=%s partition=%s offset=%s error=%s",
                    stage, msg.topic, msg.partition, msg.offset, type(exc).__name__)
        value = letter.model_dump_json().encode()
        patient = subject(letter)[0]
        if patient is not None:
            def sealed() -> tuple[bytes, bytes]:
                out = self.sealer.message_key(patient), self.sealer.seal(patient, value)
                self.sealer.durable()
                return out

            send_key, value = await self.off_loop("seal dead letter", sealed)
        elif was_sealed:
            send_key = msg.key if isinstance(msg.key, bytes) else None  # the pseudonym: same partition as before
        sent = await self.topics.dead_letters.send(key=send_key, value=value)
        await self._record_gap(letter, sent)

    async def off_loop(self, what: str, fn: Any) -> Any:
        """Run ``fn`` on the stage thread, retrying while Redis is unreachable (never skipped)."""
        delay = 0.5
        while True:
            try:
                return await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, fn)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("%s failed (%s); retrying in %.1fs", what, type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _record_gap(self, letter: DeadLetter, sent: Any) -> None:
        """Once the broker has the dead letter, the patient's record carries a gap for it (``stam.deadletters``).
        Redis unreachable: retried (holding the partition) until it is back; the gap is never skipped."""
        if gap_of(letter, "0:0") is None:  # no patient to carry a gap (a query, no patient id)
            return
        try:
            md = await sent
        except Exception as exc:  # noqa: BLE001 - not delivered: there is no dead letter for a gap to point at
            log.error("dead letter not delivered (%s); no record gap recorded", type(exc).__name__)
            return
        found = gap_of(letter, letter_id(md.partition, md.offset))
        assert found is not None
        patient_id, gap = found
        await self.off_loop("record gap", lambda: self.deps.states.record_gap(patient_id, gap))
