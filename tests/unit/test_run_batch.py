"""workers.common.run_batch: a failing message inside a batch is dead-lettered alone, in order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from schemas import RecordEntry
from stam.errors import ReasoningError
from workers.common import run_batch


def _event(value: bytes, offset: int) -> Any:
    return SimpleNamespace(value=value, message=SimpleNamespace(topic="stam.entries.v1", partition=0,
                                                               offset=offset, key=b"p"))


def _entry(entry_id: str) -> bytes:
    return RecordEntry(patient_id="p", entry_id=entry_id, source="test", text="note").model_dump_json().encode()


class _Runtime:
    deps = None

    def __init__(self) -> None:
        self.letters: list[tuple[int, str, str]] = []

    async def dead_letter(self, event: Any, stage: str, exc: BaseException) -> None:
        self.letters.append((event.message.offset, stage, type(exc).__name__))


async def test_bad_message_in_batch_is_dead_lettered_alone_and_order_is_kept() -> None:
    runtime = _Runtime()
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
