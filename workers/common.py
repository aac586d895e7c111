"""The one way every stage agent handles a message: validate, run the stage, send on, or dead-letter.

Errors are split in two:
- the message's fault (schema violation, a source the reasoner cannot read, any bug surfacing as a
  ValueError/TypeError/KeyError): the message goes to the dead-letter topic with its bytes and the stream
  goes on;
- the infrastructure's fault (Redis, Milvus or the broker unreachable): the stage retries with backoff and
  holds the partition, because skipping would break per-patient order and dead-lettering would blame the
  message for an outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
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


async def run_stage(event: faust.EventT[Any], *, stage: str, model: type[In],
                    fn: Callable[[In, Deps], Out], runtime: Runtime,
                    on_result: Callable[[Out], Awaitable[None]]) -> None:
    delay = 0.5
    while True:
        started = perf_counter()
        try:
            value = event.value
            payload = model.model_validate_json(value if isinstance(value, bytes | str) else bytes(value))
            result = fn(payload, runtime.deps)
            STAGE_SECONDS.labels(stage=stage).observe(perf_counter() - started)
            await on_result(result)
            MESSAGES.labels(stage=stage, outcome="ok").inc()
            return
        except TRANSIENT as exc:
            log.warning("stage=%s transient failure %s; retrying in %.1fs (topic=%s partition=%s offset=%s)",
                        stage, type(exc).__name__, delay, event.message.topic, event.message.partition,
                        event.message.offset)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        except MESSAGE_FAULTS as exc:
            MESSAGES.labels(stage=stage, outcome="dead_letter").inc()
            await runtime.dead_letter(event, stage, exc)
            return


async def send(topic: faust.TopicT, key: bytes | None, payload: BaseModel) -> None:
    await topic.send(key=key, value=payload.model_dump_json().encode())
