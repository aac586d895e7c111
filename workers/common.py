"""The one way every stage agent handles a message: validate, run the stage, send on, or dead-letter.

Errors are split in two:
- the message's fault (schema violation, a source the reasoner cannot read, any bug surfacing as a
  ValueError/TypeError/KeyError): the message goes to the dead-letter topic with its bytes and the stream
  goes on;
- the infrastructure's fault (Redis, Milvus, the broker or the language model unreachable): the stage
  retries with backoff and holds the partition, because skipping would break per-patient order and
  dead-lettering would blame the message for an outage.

Stage functions are blocking (store round trips, embeddings, model calls that take minutes on a CPU), so
they run on one stage thread, off the event loop: the loop keeps heart-beating to the broker, fetching and
publishing while a stage works. One thread, so stage calls of a process never run concurrently (the
stores' per-batch version pinning is per process, and per-patient order needs no more).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import Any, TypeVar

import faust
import redis
from pydantic import BaseModel, ValidationError
from pymilvus.exceptions import MilvusException

from stam.errors import ConcurrentUpdate, StamError
from stam.metrics import MESSAGES, STAGE_SECONDS
from stam.stages import Deps
from workers.runtime import Runtime

log = logging.getLogger("stam.workers")

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out")

TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, MilvusException, ConnectionError, TimeoutError,
    ConcurrentUpdate,
)
MESSAGE_FAULTS: tuple[type[BaseException], ...] = (
    ValidationError, StamError, ValueError, TypeError, KeyError, UnicodeDecodeError,
)


STAGE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stam-stage")


def _parse(model: type[In], event: faust.EventT[Any]) -> In:
    value = event.value
    return model.model_validate_json(value if isinstance(value, bytes | str) else bytes(value))


async def run_batch(events: Sequence[faust.EventT[Any]], *, stage: str, model: type[In],
                    fn: Callable[[list[In], Deps], list[Out]], runtime: Runtime,
                    on_result: Callable[[faust.EventT[Any], Out], Awaitable[None]],
                    parse: Callable[[faust.EventT[Any]], In] | None = None) -> None:
    """Validate each event, run the stage on the valid ones in order, hand each result on.
    ``parse`` replaces the plain schema validation (the extract stage verifies the source signature there).

    A batch that fails for a message's fault is re-run one message at a time, so only the faulty
    message is dead-lettered. ``stam_stage_seconds`` records the batch time divided by its size.
    """
    parsed: list[tuple[faust.EventT[Any], In]] = []
    for event in events:
        try:
            parsed.append((event, parse(event) if parse is not None else _parse(model, event)))
        except MESSAGE_FAULTS as exc:
            MESSAGES.labels(stage=stage, outcome="dead_letter").inc()
            await runtime.dead_letter(event, stage, exc)
    if not parsed:
        return
    try:
        results = await _with_retry(stage, parsed[0][0], lambda: fn([p for _, p in parsed], runtime.deps))
    except MESSAGE_FAULTS:
        if len(parsed) == 1:
            MESSAGES.labels(stage=stage, outcome="dead_letter").inc()
            await runtime.dead_letter(parsed[0][0], stage, await _last_fault(fn, parsed[0][1], runtime))
            return
        for event, _ in parsed:
            await run_batch([event], stage=stage, model=model, fn=fn, runtime=runtime, on_result=on_result,
                            parse=parse)
        return
    for (event, _), result in zip(parsed, results, strict=True):
        await on_result(event, result)
        MESSAGES.labels(stage=stage, outcome="ok").inc()


async def _last_fault(fn: Callable[[list[In], Deps], list[Out]], payload: In, runtime: Runtime) -> BaseException:
    def again() -> BaseException:
        try:
            fn([payload], runtime.deps)
        except MESSAGE_FAULTS as exc:
            return exc
        return RuntimeError("stage failed once and then succeeded; dead-lettered to keep order")

    return await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, again)


async def _with_retry(stage: str, event: faust.EventT[Any], call: Callable[[], list[Out]]) -> list[Out]:
    delay = 0.5
    while True:
        started = perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, call)
        except TRANSIENT as exc:
            log.warning("stage=%s transient failure %s; retrying in %.1fs (topic=%s partition=%s offset=%s)",
                        stage, type(exc).__name__, delay, event.message.topic, event.message.partition,
                        event.message.offset)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
            continue
        per_entry = (perf_counter() - started) / max(len(results), 1)
        hist = STAGE_SECONDS.labels(stage=stage)
        for _ in results:
            hist.observe(per_entry)
        return results


async def send(topic: faust.TopicT, key: bytes | None, payload: BaseModel) -> None:
    await topic.send(key=key, value=payload.model_dump_json().encode())


async def forward_batches(stream: faust.StreamT[Any], *, stage: str, model: type[In],
                          fn: Callable[[list[In], Deps], list[Out]], runtime: Runtime,
                          dest: faust.TopicT, parse: Callable[[faust.EventT[Any]], In] | None = None) -> None:
    """Consume in batches of whatever is waiting (at most ``stage_batch``, 20 ms apart), run the batch
    stage function, send each result on keyed as it came (the patient id)."""

    async def hand_on(event: faust.EventT[Any], out: Any) -> None:
        await send(dest, event.message.key, out)

    # take_events exists on faust-streaming streams but is missing from its StreamT stub.
    async for events in stream.take_events(runtime.settings.stage_batch, within=0.02):  # type: ignore[attr-defined]
        await run_batch(events, stage=stage, model=model, fn=fn, runtime=runtime, on_result=hand_on, parse=parse)
