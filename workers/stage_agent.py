"""The one way every stage agent handles a message: validate, run the stage, send on, or dead-letter.

Every exception a stage raises is sorted into one of three kinds (:func:`classify`):
- the message's fault (:class:`stam.errors.MessageFault`, a payload that violates its wire schema, a store
  refusing one of its values, an output over the broker's message limit): the message goes to the dead-letter
  topic with its bytes and the reason, and the stream goes on;
- an outage (Redis, Milvus, the broker or the language model unreachable, a concurrent writer): the stage
  retries with backoff and holds the partition, because skipping would break per-patient order and
  dead-lettering would blame the message for an outage;
- anything else is a bug: the partition holds too (nothing moves on silently, nothing is dead-lettered),
  ``stam_stage_bug_total{stage,error_type}`` rises and ``stam_partition_stalled{stage}`` stays above 0 while
  it lasts, and the traceback is logged at ERROR. A fixed worker (or a store that comes back) resumes there.

Stage functions are blocking (store round trips, embeddings, model calls that take minutes on a CPU), so
they run on one stage thread, off the event loop: the loop keeps heart-beating to the broker, fetching and
publishing while a stage works. One thread, so stage calls of a process never run concurrently (the
stores' per-batch version pinning is per process, and per-patient order needs no more).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from time import perf_counter
from typing import Any, TypeVar

import faust
import grpc
import redis
from aiokafka.errors import MessageSizeTooLargeError
from pydantic import BaseModel, ValidationError
from pymilvus import exceptions as milvus_errors
from pymilvus.exceptions import MilvusException

from schemas.limits import BROKER_MESSAGE_BYTES
from stam.crypto import Sealer
from stam.errors import Erased, MessageFault, MessageTooLarge, Transient
from stam.metrics import BACKGROUND_FAILURES, HOP_WAIT_SECONDS, MESSAGES, PARTITION_STALLED, STAGE_BUGS, STAGE_SECONDS
from stam.stage_thread import STAGE_THREAD
from stam.stages import Deps
from workers.runtime import Runtime

log = logging.getLogger("stam.workers")

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out")

TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, Transient,
)
"""Outages (a Milvus error is sorted by :func:`classify`, which looks at its code)."""
MESSAGE_FAULTS: tuple[type[BaseException], ...] = (MessageFault, ValidationError)
"""The message's fault: dead-lettered."""
PARSE_FAULTS: tuple[type[BaseException], ...] = (*MESSAGE_FAULTS, ValueError, UnicodeDecodeError, RecursionError)
"""What parsing a message's bytes against its schema can raise for bad bytes."""


class Fault(StrEnum):
    MESSAGE = "message"
    TRANSIENT = "transient"
    BUG = "bug"


_MILVUS_INPUT = (milvus_errors.ParamError, milvus_errors.DataTypeNotMatchException,
                 milvus_errors.DataNotMatchException, milvus_errors.PrimaryKeyException,
                 milvus_errors.PartitionKeyException, milvus_errors.FieldTypeException)
_MILVUS_OUTAGE = (milvus_errors.ConnectError, milvus_errors.MilvusUnavailableException,
                  milvus_errors.ConnectionNotExistException)
# Legacy status codes (milvus-lite answers these): 5 illegal argument, 6 illegal range, 11 illegal row record,
# 12 illegal vector id; 1100 (merr ParameterInvalid) and 1101-1102 from a Milvus 2.4+ server.
_MILVUS_INPUT_CODES = frozenset({5, 6, 11, 12, 1100, 1101, 1102})
_MILVUS_INPUT_TEXT = re.compile(r"exceeds max_length|escape sequence|cannot parse expression|invalid expression"
                                r"|invalid parameter|parse expr|value length", re.I)
# 2 connect failed, 8 rate limited (legacy). Any other code is neither known input nor a known outage: a bug.
_MILVUS_OUTAGE_CODES = frozenset({2, 8})
_MILVUS_OUTAGE_TEXT = re.compile(r"not ready|unavailable|not serviceable|deadline exceeded|fail connecting"
                                 r"|connection refused|rate limit", re.I)


def classify(exc: BaseException) -> Fault:
    """Whose fault ``exc`` is: the message's (dead-letter it), an outage's (retry), or a bug (hold, alert)."""
    if isinstance(exc, MESSAGE_FAULTS):
        return Fault.MESSAGE
    if isinstance(exc, MilvusException):
        return _milvus(exc)
    if isinstance(exc, redis.ResponseError) and not isinstance(exc, redis.ConnectionError):
        # WRONGTYPE is about one key (the message's patient); OOM, MISCONF, READONLY... are the server's state.
        return Fault.MESSAGE if str(exc).startswith("WRONGTYPE") else Fault.TRANSIENT
    if isinstance(exc, TRANSIENT):
        return Fault.TRANSIENT
    if type(exc).__module__.startswith(("aiokafka", "kafka", "faust")):
        return Fault.TRANSIENT
    return Fault.BUG


def _milvus(exc: MilvusException) -> Fault:
    code = exc.code
    if (isinstance(exc, _MILVUS_OUTAGE) or exc.retriable or isinstance(code, grpc.StatusCode)
            or (isinstance(code, int) and code in _MILVUS_OUTAGE_CODES) or _MILVUS_OUTAGE_TEXT.search(str(exc.message))):
        return Fault.TRANSIENT
    if exc.is_input_error or isinstance(exc, _MILVUS_INPUT) or _MILVUS_INPUT_TEXT.search(str(exc.message)):
        return Fault.MESSAGE
    if isinstance(code, int) and code in _MILVUS_INPUT_CODES:
        return Fault.MESSAGE
    return Fault.BUG


def background_failed(task: str, exc: BaseException, delay: float | None = None) -> None:
    """A worker's timer or background task failed: counted in ``stam_background_failures_total{task,error_type}``;
    an outage (:func:`classify`) logged at WARNING in one line, anything else (a bug) at ERROR with its traceback.
    ``delay``: it retries in that many seconds; None: it is not retried, the worker goes on."""
    BACKGROUND_FAILURES.labels(task=task, error_type=type(exc).__name__).inc()
    then = f"retrying in {delay:.0f}s" if delay is not None else "the worker goes on"
    if classify(exc) is Fault.TRANSIENT:
        log.warning("%s failed (%s); %s", task, type(exc).__name__, then)
    else:
        log.error("%s failed; %s", task, then, exc_info=exc)


def raw_value(event: faust.EventT[Any]) -> bytes:
    value: Any = event.message.value
    if value is None:
        return b""
    return value if isinstance(value, bytes) else value.encode() if isinstance(value, str) else bytes(value)


def _parse(model: type[In], event: faust.EventT[Any], value: bytes) -> In:
    return model.model_validate_json(value)


def waited_for(stage: str, events: Sequence[faust.EventT[Any]]) -> None:
    """``stam_hop_wait_seconds``: each message's wait from its produce to this stage starting on it."""
    now = time.time()
    hop = HOP_WAIT_SECONDS.labels(stage=stage)
    for event in events:
        produced = event.message.timestamp  # seconds (Faust's Message; the record's CreateTime)
        if produced:
            hop.observe(max(0.0, now - produced))


async def run_batch(events: Sequence[faust.EventT[Any]], *, stage: str, model: type[In],
                    fn: Callable[[list[In], Deps], list[Out]], runtime: Runtime,
                    on_result: Callable[[faust.EventT[Any], Out], Awaitable[None]],
                    parse: Callable[[faust.EventT[Any], bytes], In] | None = None) -> None:
    """Open each event's envelope (``stam.crypto``), validate it, run the stage on the valid ones in order, hand
    each result on. ``parse`` replaces the plain schema validation of the opened value (the extract stage
    verifies the source signature there).

    An envelope whose data key was shredded (the patient was erased while it was in flight) is dropped:
    its content is gone by design, it is nobody's fault. One that does not open is the message's fault.

    A batch that fails for a message's fault is re-run one message at a time, so only the faulty
    message is dead-lettered. A result that cannot be handed on for the message's fault (over the broker's
    message limit) dead-letters its message and the next result goes on. ``stam_stage_seconds`` records the
    batch time divided by its size.
    """
    waited_for(stage, events)
    parsed: list[tuple[faust.EventT[Any], In]] = []
    opened: dict[int, bytes] = {}  # id(event) -> its plaintext, which a dead letter keeps (sealed again)
    sealer = runtime.sealer
    raws = [raw_value(e) for e in events]
    if any(sealer.sealed(r) for r in raws):  # the patients' keys, fetched off the loop (an outage is retried)
        def prefetch() -> list[None]:
            sealer.prefetch(raws)
            return []

        await _with_retry(stage, events[0], prefetch, timed=False)
    for event, raw in zip(events, raws, strict=True):
        try:
            value = opened[id(event)] = sealer.open(raw)
            parsed.append((event, parse(event, value) if parse is not None else _parse(model, event, value)))
        except Erased:
            _counted(runtime, stage, "erased")
            continue
        except PARSE_FAULTS as exc:
            _counted(runtime, stage, "dead_letter")
            await runtime.dead_letter(event, stage, exc, opened.get(id(event)))
    if not parsed:
        return
    try:
        results = await _with_retry(stage, parsed[0][0], lambda: fn([p for _, p in parsed], runtime.deps))
    except MESSAGE_FAULTS as exc:
        if len(parsed) == 1:
            _counted(runtime, stage, "dead_letter")
            await runtime.dead_letter(parsed[0][0], stage, exc, opened.get(id(parsed[0][0])))
            return
        for event, _ in parsed:
            await run_batch([event], stage=stage, model=model, fn=fn, runtime=runtime, on_result=on_result,
                            parse=parse)
        return
    for (event, _), result in zip(parsed, results, strict=True):
        try:
            await on_result(event, result)
        except MessageTooLarge as exc:
            _counted(runtime, stage, "dead_letter")
            await runtime.dead_letter(event, stage, exc, opened.get(id(event)))
            continue
        _counted(runtime, stage, "ok")


def _counted(runtime: Runtime, stage: str, outcome: str) -> None:
    """``stam_messages_total`` for one message of ``stage``, and the run-ahead count (:mod:`workers.run_ahead`)."""
    MESSAGES.labels(stage=stage, outcome=outcome).inc()
    if runtime.run_ahead is not None:
        runtime.run_ahead.outcome(stage, outcome)


async def _with_retry(stage: str, event: faust.EventT[Any], call: Callable[[], list[Out]], *,
                      timed: bool = True) -> list[Out]:
    """Run ``call`` on the stage thread until it returns or fails for the message's fault (raised).

    An outage is retried with backoff (WARNING); a bug is retried too, so the partition holds rather than
    moves on, with the alert metrics and the traceback at ERROR."""
    delay = 0.5
    stalled = False
    try:
        while True:
            started = perf_counter()
            try:
                results = await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, call)
            except Exception as exc:  # noqa: BLE001 - sorted below: the message's fault, an outage, or a bug
                kind = classify(exc)
                if kind is Fault.MESSAGE:
                    raise
                where = (event.message.topic, event.message.partition, event.message.offset)
                if kind is Fault.TRANSIENT:
                    log.warning("stage=%s transient failure %s; retrying in %.1fs (topic=%s partition=%s "
                                "offset=%s)", stage, type(exc).__name__, delay, *where)
                else:
                    STAGE_BUGS.labels(stage=stage, error_type=type(exc).__name__).inc()
                    if not stalled:
                        stalled = True
                        PARTITION_STALLED.labels(stage=stage).inc()
                    log.error("stage=%s unexpected %s (a bug, not the message's fault): partition held, retrying "
                              "in %.1fs (topic=%s partition=%s offset=%s)", stage, type(exc).__name__, delay,
                              *where, exc_info=exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            if timed:
                per_entry = (perf_counter() - started) / max(len(results), 1)
                hist = STAGE_SECONDS.labels(stage=stage)
                for _ in results:
                    hist.observe(per_entry)
            return results
    finally:
        if stalled:
            PARTITION_STALLED.labels(stage=stage).dec()


OUTPUT_LIMIT = BROKER_MESSAGE_BYTES - 4096
"""Largest value a stage sends on (the producer's limit, less room for the key and the record overhead)."""


def seal(sealer: Sealer, patient_id: str, payload: BaseModel | bytes) -> tuple[bytes, bytes]:
    """(message key, value) of a payload for one patient: its pseudonym, and the payload sealed under its data
    key (``stam.crypto``). Blocking (the key may be read from Redis): call it on the stage thread."""
    value = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
    return sealer.message_key(patient_id), sealer.seal(patient_id, value)


async def send(topic: faust.TopicT, key: bytes | None, payload: BaseModel) -> Any:
    """Send ``payload`` keyed by ``key`` as it is (no patient data: sealed values go through :func:`send_bytes`).
    An output over the broker's message limit raises :class:`MessageTooLarge` (the input message's fault)
    instead of failing the agent."""
    value = payload.model_dump_json().encode()
    return await send_bytes(topic, key, value, what=type(payload).__name__)


async def send_bytes(topic: faust.TopicT, key: bytes | None, value: bytes, *, what: str = "output") -> Any:
    if len(value) + len(key or b"") > OUTPUT_LIMIT:
        raise MessageTooLarge(f"{what} would be {len(value):,} bytes; the broker's message limit is "
                              f"{BROKER_MESSAGE_BYTES:,}")
    try:
        return await topic.send(key=key, value=value)
    except MessageSizeTooLargeError as exc:
        raise MessageTooLarge(f"{what} of {len(value):,} bytes refused by the producer: {exc}") from exc
    except Exception as exc:
        if isinstance(exc.__cause__, MessageSizeTooLargeError):  # faust's ProducerSendError wraps it
            raise MessageTooLarge(f"{what} of {len(value):,} bytes refused by the producer: {exc}") from exc
        raise


def seal_within_limit(sealer: Sealer, patient_id: str, payload: BaseModel,
                      shrink: Callable[[Any], BaseModel | None] | None = None) -> tuple[bytes, bytes]:
    """:func:`seal`, and when the sealed value is over the broker's limit, ``shrink``'s smaller form of the payload
    instead (what it leaves out only costs the next stage work: the impact stage's record of what it read). Still
    over, or nothing to leave out: the value as it is, which :func:`send_bytes` refuses with a clear error."""
    key, value = seal(sealer, patient_id, payload)
    if len(value) + len(key) > OUTPUT_LIMIT and shrink is not None:
        smaller = shrink(payload)
        if smaller is not None:
            key, value = seal(sealer, patient_id, smaller)
    return key, value


async def forward_batches(stream: faust.StreamT[Any], *, stage: str, model: type[In],
                          fn: Callable[[list[In], Deps], list[Out]], runtime: Runtime,
                          dest: faust.TopicT, parse: Callable[[faust.EventT[Any], bytes], In] | None = None,
                          shrink: Callable[[Any], BaseModel | None] | None = None) -> None:
    """Consume in batches of whatever is waiting (at most ``stage_batch``, 20 ms apart), run the batch
    stage function, send each result on sealed for its patient and keyed by the patient's pseudonym (in the form
    ``shrink`` gives when it is over the broker's limit: :func:`seal_within_limit`)."""
    sealer = runtime.sealer

    def sealed_fn(items: list[In], deps: Deps) -> list[tuple[bytes, bytes, str]]:
        # Sealed on the stage thread, with the stage: a key-store outage is retried like any store's.
        out = []
        for result in fn(items, deps):
            payload: Any = result
            key, value = seal_within_limit(sealer, payload.entry.patient_id, payload, shrink)
            out.append((key, value, type(result).__name__))
        sealer.durable()  # a key made just now is on Redis's disk before anything sealed under it leaves
        return out

    async def hand_on(event: faust.EventT[Any], out: tuple[bytes, bytes, str]) -> None:
        await send_bytes(dest, out[0], out[1], what=out[2])

    # take_batches: topology.batching.Stream, the apps' stream class (not on faust's StreamT).
    async for events in stream.take_batches(runtime.settings.stage_batch, within=0.02):  # type: ignore[attr-defined]
        if stage == "extract" and runtime.run_ahead is not None:
            await runtime.run_ahead.room()  # a backlog goes through the stages in order (workers.run_ahead)
        await run_batch(events, stage=stage, model=model, fn=sealed_fn, runtime=runtime, on_result=hand_on,
                        parse=parse)
