"""The update worker's units one at a time (``workers.update``, ``workers.outbox``, ``workers.sweep``), on fakes
of the stores, the sealer and the topics: outboxes cleared in batches once delivered, a failed delivery keeps its
outbox, undelivered outboxes republished at start, an applied entry's gap closed, the store's check and watch, the
scheduled sweep; and every state-store, sealer and stage call of them on the stage thread (``stam.stage_thread``),
never on the event loop's. The update agent is driven through ``agent.test_context()`` with its stage function
replaced (the real stage on a real store: tests/unit/test_agents.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import faust
import orjson
import pytest
from aiokafka.partitioner import DefaultPartitioner
from faust.types import TP
from prometheus_client import REGISTRY

from schemas import DeletionOrder, DeletionVerdict, ImpactedEntry, RecordEntry, Store, TransitionEvent, TransitionKind
from stam.config import Settings
from stam.stage_thread import STAGE_THREAD
from stam.stages import Deps, UpdateResult
from topology.app import Topics
from topology.batching import Stream as BatchingStream
from workers import sweep as sweep_module
from workers import update
from workers.outbox import DeliveredOutboxes, Republisher
from workers.runtime import Runtime
from workers.stage_agent import OUTPUT_LIMIT
from workers.sweep import ScheduledSweep
from workers.update import Publisher

Call = tuple[str, tuple[Any, ...], threading.Thread]


class Recorder:
    """Records each call with the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args, threading.current_thread()))

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args, _ in self.calls if n == name]


class FakeStates(Recorder):
    """The state-store calls the units make (a blocking Redis round trip each, in production)."""

    def __init__(self, pending: list[tuple[str, str, bytes]] | None = None, patients: list[str] | None = None) -> None:
        super().__init__()
        self.pending = pending or []
        self.patient_ids = patients or []
        self.fail_clears = 0
        """How many clear_outboxes calls fail (Redis unreachable) before they succeed."""

    def pending_outboxes(self) -> list[tuple[str, str, bytes]]:
        self.record("pending_outboxes")
        return list(self.pending)

    def clear_outbox(self, patient_id: str, entry_id: str) -> None:
        self.record("clear_outbox", patient_id, entry_id)

    def clear_outboxes(self, delivered: list[tuple[str, str]]) -> None:
        self.record("clear_outboxes", list(delivered))
        if self.fail_clears:
            self.fail_clears -= 1
            raise ConnectionError("redis unreachable")

    def clear_gap(self, patient_id: str, entry_id: str) -> None:
        self.record("clear_gap", patient_id, entry_id)

    def patients(self) -> list[str]:
        self.record("patients")
        return list(self.patient_ids)


class FakeSealer(Recorder):
    """Keys are ``k:<patient>``, values sealed as they are; a value holding ``too-big`` seals over the limit."""

    def message_key(self, patient_id: str) -> bytes:
        return f"k:{patient_id}".encode()

    def seal(self, patient_id: str, value: bytes) -> bytes:
        self.record("seal", patient_id)
        return b"x" * (OUTPUT_LIMIT + 1) if b"too-big" in value else value

    def durable(self) -> None:
        self.record("durable")

    def sealed(self, raw: bytes) -> bool:
        return False

    def open(self, raw: bytes) -> bytes:
        return raw


class FakeTopic:
    """A topic whose sends are confirmed by the test (``deliver``) or at once (``auto``)."""

    def __init__(self, name: str = "stam.test.v1", auto: bool = True) -> None:
        self.name = name
        self.auto = auto
        self.sent: list[tuple[bytes | None, bytes]] = []
        self.futures: list[asyncio.Future[None]] = []

    async def send(self, key: bytes | None = None, value: bytes = b"") -> asyncio.Future[None]:
        self.sent.append((key, value))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.auto:
            future.set_result(None)
        self.futures.append(future)
        return future

    def get_topic_name(self) -> str:
        return self.name


class FakeDurability(Recorder):
    """Checked and sound, unless ``outages`` says how many checks fail first (the store unreachable)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = True
        self.resets = 0
        self.outages = 0

    async def ready(self) -> None:
        if self.outages:
            self.outages -= 1
            raise ConnectionError("redis unreachable")

    def reset(self) -> None:
        self.resets += 1

    def watch_blocking(self) -> bool:
        self.record("watch_blocking")
        if self.outages:
            raise ConnectionError("redis unreachable")
        return False

    def recover_blocking(self) -> None:
        raise AssertionError("no recovery expected")


def runtime_with(tmp_path: Path, states: FakeStates, sealer: FakeSealer | None = None,
                 **settings: Any) -> Runtime:
    app = faust.App("stam-update-units", broker="kafka://127.0.0.1:1", web_enabled=False, Stream=BatchingStream)
    topics = Topics(**{**{f.name: app.channel() for f in fields(Topics)},
                       "transitions": FakeTopic("stam.transitions.v1"), "deletions": FakeTopic("stam.deletions.v1")})
    embedder = SimpleNamespace(model_name="enc", embed=lambda texts: texts)
    deps = Deps(router=cast(Any, None), embedder=cast(Any, embedder), states=cast(Any, states),
                vectors=cast(Any, None))
    rt = Runtime(settings=Settings(home=tmp_path, **settings), topics=topics, _deps=deps,
                 _sealer=cast(Any, sealer or FakeSealer()))
    rt.durability = cast(Any, FakeDurability())
    return rt


def sent_to(rt: Runtime, topic: str) -> FakeTopic:
    return cast(FakeTopic, getattr(rt.topics, topic))


async def stage_thread() -> threading.Thread:
    return await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, threading.current_thread)


async def assert_on_stage_thread(*recorders: Recorder) -> None:
    """Every recorded call ran on the stage thread (a Redis call on the event loop's thread fails here)."""
    stage = await stage_thread()
    loop_thread = threading.current_thread()
    calls = [c for r in recorders for c in r.calls]
    assert calls
    assert [(name, t.name) for name, _, t in calls if t is not stage] == [], \
        f"blocking calls off the stage thread (the event loop runs on {loop_thread.name})"


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def failures(task: str, error_type: str) -> float:
    return REGISTRY.get_sample_value("stam_background_failures_total",
                                     {"task": task, "error_type": error_type}) or 0.0


def transition(entry_id: str, tid: str = "t1", patient_id: str = "p1") -> TransitionEvent:
    return TransitionEvent(transition_id=tid, patient_id=patient_id, entry_id=entry_id, sequence=0,
                           kind=TransitionKind.DELETED, memory_id="m1", from_store=Store.HISTORY, to_store=None,
                           recorded_at=datetime(2024, 1, 1, tzinfo=UTC), state_version=1)


def outbox(*events: TransitionEvent) -> bytes:
    return orjson.dumps([e.model_dump(mode="json") for e in events])


# --- delivered outboxes ---------------------------------------------------------------------------------

async def test_delivered_outboxes_are_cleared_in_batches_on_the_stage_thread(tmp_path: Path) -> None:
    states = FakeStates()
    outboxes = DeliveredOutboxes(runtime_with(tmp_path, states), wait_s=0.05)
    clearing = asyncio.ensure_future(outboxes.clear_delivered_outboxes())
    loop = asyncio.get_running_loop()
    first, second, late = (loop.create_future() for _ in range(3))
    try:
        outboxes.after_delivery([first], "p1", "e1")
        outboxes.after_delivery([second], "p1", "e2")
        outboxes.after_delivery([late], "p2", "e3")
        await asyncio.sleep(0.1)
        assert states.calls == []  # nothing confirmed, nothing cleared
        first.set_result(None)
        second.set_result(None)
        await until(lambda: bool(states.calls))
        assert states.named("clear_outboxes") == [([("p1", "e1"), ("p1", "e2")],)]  # one round trip for both
        late.set_result(None)
        await until(lambda: len(states.calls) == 2)
        assert states.named("clear_outboxes")[1] == ([("p2", "e3")],)
        await assert_on_stage_thread(states)
        assert outboxes.delivered == [] and outboxes.pending == set()
    finally:
        clearing.cancel()


async def test_a_failed_delivery_keeps_its_outbox(tmp_path: Path) -> None:
    states = FakeStates()
    outboxes = DeliveredOutboxes(runtime_with(tmp_path, states), wait_s=0.01)
    loop = asyncio.get_running_loop()
    ok, failed = loop.create_future(), loop.create_future()
    timed = _delivery_seconds()
    outboxes.after_delivery([ok, failed], "p1", "e1")  # one of the entry's transitions not delivered
    ok.set_result(None)
    failed.set_exception(ConnectionError("broker gone"))
    await until(lambda: not outboxes.pending)
    assert outboxes.delivered == [] and not outboxes.to_clear.is_set()
    assert _delivery_seconds() == timed  # not delivered: no delivery time
    await outboxes.clear_round()
    assert states.calls == []


def _delivery_seconds() -> tuple[float, float]:
    from prometheus_client import REGISTRY

    return (REGISTRY.get_sample_value("stam_delivery_seconds_count") or 0.0,
            REGISTRY.get_sample_value("stam_delivery_seconds_sum") or 0.0)


async def test_the_delivery_time_runs_from_the_hand_over_to_the_last_acknowledgement(tmp_path: Path) -> None:
    outboxes = DeliveredOutboxes(runtime_with(tmp_path, FakeStates()), wait_s=0.01)
    loop = asyncio.get_running_loop()
    first, last = loop.create_future(), loop.create_future()
    count, total = _delivery_seconds()
    outboxes.after_delivery([first, last], "p1", "e1", time.perf_counter() - 0.2)  # handed over 200 ms ago
    first.set_result(None)
    await asyncio.sleep(0.1)
    assert _delivery_seconds() == (count, total)  # one of the two still unacknowledged
    last.set_result(None)
    await until(lambda: not outboxes.pending)
    now_count, now_total = _delivery_seconds()
    assert now_count == count + 1 and 0.3 <= now_total - total < 5


async def test_an_unreachable_store_keeps_the_batch_for_the_next_round(tmp_path: Path) -> None:
    states = FakeStates()
    states.fail_clears = 1
    outboxes = DeliveredOutboxes(runtime_with(tmp_path, states), wait_s=0.01)
    before = failures("clear_outboxes", "ConnectionError")
    outboxes.delivered[:] = [("p1", "e1")]
    await outboxes.clear_round()
    assert outboxes.delivered == [("p1", "e1")] and outboxes.to_clear.is_set()  # put back, another round asked
    assert failures("clear_outboxes", "ConnectionError") == before + 1
    outboxes.delivered.append(("p1", "e2"))
    await outboxes.clear_round()
    assert states.named("clear_outboxes") == [([("p1", "e1")],), ([("p1", "e1"), ("p1", "e2")],)]
    assert outboxes.delivered == []
    await assert_on_stage_thread(states)


# --- republication at start -------------------------------------------------------------------------------

async def test_republish_publishes_counts_and_clears_each_pending_outbox_off_the_loop(tmp_path: Path) -> None:
    one, two = transition("e1", "t1"), transition("e2", "t2")
    states = FakeStates(pending=[("p1", "e1", outbox(one)), ("p1", "e2", outbox(two))])
    sealer = FakeSealer()
    rt = runtime_with(tmp_path, states, sealer)
    assert await Republisher(rt).republish() == 2
    sent = [TransitionEvent.model_validate_json(v) for _, v in sent_to(rt, "transitions").sent]
    assert sent == [one, two]  # the same transitions, the same ids
    assert {k for k, _ in sent_to(rt, "transitions").sent} == {b"k:p1"}
    assert states.named("clear_outbox") == [("p1", "e1"), ("p1", "e2")]
    assert [n for n, _, _ in states.calls] == ["pending_outboxes", "clear_outbox", "clear_outbox"]
    assert sealer.named("durable") and sealer.named("seal") == [("p1",), ("p1",)]
    await assert_on_stage_thread(states, sealer)


async def test_an_outbox_over_the_message_limit_is_left_in_redis(tmp_path: Path) -> None:
    states = FakeStates(pending=[("p1", "e1", outbox(transition("e1", "too-big"))),
                                 ("p1", "e2", outbox(transition("e2", "t2")))])
    rt = runtime_with(tmp_path, states)
    assert await Republisher(rt).republish() == 1
    assert states.named("clear_outbox") == [("p1", "e2")]
    assert len(sent_to(rt, "transitions").sent) == 1


async def test_republish_pending_waits_out_a_store_outage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of the pending outboxes fails (Redis unreachable): counted, retried 0.5 s later."""
    states = FakeStates(pending=[("p1", "e1", outbox(transition("e1")))])
    rt = runtime_with(tmp_path, states)
    real = states.pending_outboxes
    outage = [ConnectionError("redis unreachable")]

    def pending_outboxes() -> list[tuple[str, str, bytes]]:
        if outage:
            states.record("pending_outboxes")
            raise outage.pop()
        return real()

    monkeypatch.setattr(states, "pending_outboxes", pending_outboxes)
    before = failures("republish_pending", "ConnectionError")
    await asyncio.wait_for(Republisher(rt).republish_pending(), 5)
    assert failures("republish_pending", "ConnectionError") == before + 1
    assert cast(FakeDurability, rt.durability).resets == 1
    assert states.named("clear_outbox") == [("p1", "e1")]
    await assert_on_stage_thread(states)


# --- publishing: the gap closed, the outbox cleared after delivery ------------------------------------------

async def test_a_duplicate_closes_its_gap_on_the_stage_thread_and_republishes_its_outbox(tmp_path: Path) -> None:
    states = FakeStates()
    rt = runtime_with(tmp_path, states)
    outboxes = DeliveredOutboxes(rt, wait_s=0.01)
    t = transition("e1")
    done = (UpdateResult([t], 1, duplicate=True), [(b"k:p1", t.model_dump_json().encode())], ("p1", "e1"))
    await Publisher(rt, outboxes).publish(cast(Any, None), done)
    assert states.named("clear_gap") == [("p1", "e1")]
    assert len(sent_to(rt, "transitions").sent) == 1
    await until(lambda: outboxes.delivered == [("p1", "e1")])  # cleared by the next round
    await assert_on_stage_thread(states)


async def test_the_update_agent_applies_seals_and_closes_gaps_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent driven through ``test_context()``: the stage function, the sealing and the gap's close on the
    stage thread; the transitions of a redelivered entry published again (its outbox pending)."""
    states, sealer = FakeStates(), FakeSealer()
    rt = runtime_with(tmp_path, states, sealer)
    applied = Recorder()
    t = transition("e1")

    def update_batch(items: list[ImpactedEntry], deps: Deps) -> list[UpdateResult]:
        applied.record("update_batch", [x.entry.entry_id for x in items])
        return [UpdateResult([t], 1, duplicate=True) for _ in items]

    monkeypatch.setattr(update, "update_batch", update_batch)
    app = faust.App("stam-update-units-agent", broker="kafka://127.0.0.1:1", web_enabled=False,
                    Stream=BatchingStream)
    agent = update.register(app, rt)
    entry = RecordEntry(patient_id="p1", entry_id="e1", source="fhir-r4", text="a note",
                        effective_at=datetime(2024, 1, 1, tzinfo=UTC))
    item = ImpactedEntry(entry=entry, memories=(), relations=(), candidates={}, state_version=0)
    async with agent.test_context() as ctx:
        await ctx.put(item.model_dump_json().encode(), key=b"k:p1", wait=True)
        await until(lambda: bool(sent_to(rt, "transitions").sent))
    assert applied.named("update_batch") == [(["e1"],)]
    assert states.named("clear_gap") == [("p1", "e1")]
    assert [TransitionEvent.model_validate_json(v) for _, v in sent_to(rt, "transitions").sent] == [t]
    await assert_on_stage_thread(states, sealer, applied)


# --- the store's check and watch ------------------------------------------------------------------------------

async def test_ready_waits_out_an_unreachable_store(tmp_path: Path) -> None:
    rt = runtime_with(tmp_path, FakeStates())
    durability = cast(FakeDurability, rt.durability)
    durability.outages = 1
    before = failures("durability_check", "ConnectionError")
    await asyncio.wait_for(update.ready(rt), 5)
    assert failures("durability_check", "ConnectionError") == before + 1 and durability.resets == 1


async def test_the_state_watch_runs_on_the_stage_thread_once_the_store_is_checked(tmp_path: Path) -> None:
    rt = runtime_with(tmp_path, FakeStates())
    durability = cast(FakeDurability, rt.durability)
    durability.checked = False
    await update.watch_state_store(rt)
    assert durability.calls == []  # not checked yet: the first entry's check comes first
    durability.checked = True
    await update.watch_state_store(rt)
    durability.outages = 1
    before = failures("watch_state_store", "ConnectionError")
    await update.watch_state_store(rt)  # still down: counted, the next round tries again
    assert failures("watch_state_store", "ConnectionError") == before + 1
    assert len(durability.named("watch_blocking")) == 2
    await assert_on_stage_thread(durability)


# --- the scheduled sweep ------------------------------------------------------------------------------------

def test_the_sweep_runs_only_when_configured(tmp_path: Path) -> None:
    app = cast(faust.App, SimpleNamespace())
    assert ScheduledSweep.configured(app, runtime_with(tmp_path, FakeStates())) is None
    rt = runtime_with(tmp_path, FakeStates(), deletion_gate=tmp_path, deletion_sweep_s=0)
    assert ScheduledSweep.configured(app, rt) is None
    rt = runtime_with(tmp_path, FakeStates(), deletion_gate=tmp_path, deletion_sweep_s=60)
    sweep = ScheduledSweep.configured(app, rt)
    assert sweep is not None and sweep.every == 60 and sweep.gate_path == tmp_path


async def test_the_scheduled_sweep_sweeps_this_workers_patients_on_the_stage_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patients = [f"p{i}" for i in range(12)]
    states, sealer = FakeStates(patients=patients), FakeSealer()
    rt = runtime_with(tmp_path, states, sealer, partitions=8)
    scanned = Recorder()
    gate = SimpleNamespace(spec=SimpleNamespace(encoder="enc"))

    def scan(st: Any, embed: Any, g: Any, swept: list[str]) -> list[str]:
        scanned.record("scan", list(swept))
        return swept

    def orders(patient: str, g: Any) -> list[DeletionOrder]:
        verdict = DeletionVerdict(score=0.9, tau=0.5, alpha=0.1, calibration_id="c")
        return [DeletionOrder(order_id=f"o-{patient}", patient_id=patient, memory_ids=("m1", "m2"),
                              verdicts=(verdict, verdict), ordered_at=datetime(2024, 1, 1, tzinfo=UTC))]

    monkeypatch.setattr(sweep_module, "Gate", SimpleNamespace(load=lambda path: gate))
    monkeypatch.setattr(sweep_module, "scan", scan)
    monkeypatch.setattr(sweep_module, "orders", orders)
    mine = {0, 3, 5}
    assignment = {TP("stam.deletions.v1", p) for p in mine} | {TP("stam.impacted.v1", 1)}
    app = cast(faust.App, SimpleNamespace(consumer=SimpleNamespace(assignment=lambda: assignment)))
    await ScheduledSweep(app, rt, tmp_path, 60).scheduled_sweep()
    parts = list(range(8))
    expected = [p for p in patients if DefaultPartitioner()(f"k:{p}".encode(), parts, parts) in mine]
    assert expected and expected != patients
    assert scanned.named("scan") == [(expected,)]
    sent = [DeletionOrder.model_validate_json(v) for _, v in sent_to(rt, "deletions").sent]
    assert [o.patient_id for o in sent] == expected
    await assert_on_stage_thread(states, sealer, scanned)


async def test_a_failed_sweep_is_counted_and_waits_for_the_next_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime_with(tmp_path, FakeStates())
    monkeypatch.setattr(sweep_module, "Gate",
                        SimpleNamespace(load=lambda path: SimpleNamespace(spec=SimpleNamespace(encoder="other"))))
    before = failures("deletion_sweep", "ValueError")
    await ScheduledSweep(cast(faust.App, SimpleNamespace()), rt, tmp_path, 60).scheduled_sweep()
    assert failures("deletion_sweep", "ValueError") == before + 1
    assert sent_to(rt, "deletions").sent == []
