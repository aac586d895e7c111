"""The query consumer: gated reads, separate from the write path (its own Faust app and consumer group).

- Kafka: consumes ``stam.queries.v1`` (QueryRequest, key = patient id; a sealed one is opened) and produces
  ``stam.answers.v1`` (QueryAnswer sealed for the patient, ``stam.crypto``; key = the patient's pseudonym;
  correlated by ``request_id``). A message that is not a valid QueryRequest goes to
  the dead-letter topic with its bytes; the stream goes on. With ``STAM_QUERY_KAFKA_REQUIRE_TOKEN`` a query
  carries ``authorization: Bearer <token>`` as a Kafka header and is answered within that token's scope.
- HTTP: ``POST /v1/query`` with a QueryRequest JSON body (``request_id`` may be omitted) and
  ``Authorization: Bearer <token>`` returns the QueryAnswer. Tokens carry scopes (stam/read/scopes.py): a
  patient the token may not read gets the very answer (404, same body) a patient that does not exist gets.
  Without a configured token the endpoint answers 503 to everyone; a missing or wrong token gets 401; a body
  over 256 KiB 413; anything else malformed 400. ``GET /healthz`` (alive) and ``GET /readyz`` (the broker, Redis,
  Milvus and a configured reader answer: 200, else 503; ``workers.ops``) need no token; ``GET /v1/health`` is
  ``/readyz`` under its old name.
- The timeline page (``stam.read.page``, docs/timeline.md): ``GET /patients/{id}/timeline`` is a shell with no
  patient datum (it asks for a token, kept in the tab's sessionStorage); its script reads
  ``GET /patients/{id}/timeline/data?from=&to=&as_of=&compare=`` with the same bearer token and scopes as
  ``/v1/query`` (401; a patient the token may not read gets the very 404 a patient with no memory gets; 400 for a
  time it cannot read) and asks ``POST /v1/query``. ``GET /static/timeline/{name}`` serves the page's files
  (vis-timeline, vendored). Every answer of the page and its data is ``Cache-Control: no-store``.

A query that cannot be answered still gets a QueryAnswer (``ok=false``, ``error_kind``): over Kafka it is
produced like any answer and the stream goes on; over HTTP the kind sets the status (``HTTP_STATUS``), and a
store outage is a 503 with ``Retry-After``. Packets are built off the event loop (``QueryService.answer``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime
from functools import partial
from typing import Any, cast

import faust
import orjson
import redis
from aiohttp.web import HTTPRequestEntityTooLarge
from pydantic import ValidationError

from schemas.query import ErrorKind, QueryAnswer, QueryRequest
from stam.backends.base import StateStore
from stam.backends.redis_state import RedisStateStore
from stam.compose import build_query_service
from stam.config import Settings
from stam.errors import Erased, PageInputError, SealBroken
from stam.logs import faust_worker
from stam.metrics import QUERIES, QUERY_SECONDS, QUERY_SERVED_TOKENS
from stam.read import page
from stam.read.failures import classify
from stam.read.scopes import NOT_FOUND_MESSAGE, Grant, TokenScopes, concealed_not_found, scopes_of
from stam.read.service import QueryService, TimelineCache, failed_answer
from stam.stage_thread import STAGE_THREAD
from stam.transport import redis_client
from topology.app import Topics, create_app
from workers.ops import Readiness, claim_port, start_metrics
from workers.ops import install as install_ops
from workers.runtime import Runtime
from workers.stage_agent import raw_value, seal

log = logging.getLogger("stam.query")

HTTP_STATUS: dict[ErrorKind, int] = {"not_found": 404, "invalid": 400, "unavailable": 503, "internal": 500}
RETRY_AFTER_S = 5
NO_STORE = {"Cache-Control": "no-store"}
PAGE_HEADERS = {**NO_STORE, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                "frame-ancestors 'none'"}
"""The timeline page's headers: never cached, its scripts only the worker's own files (no inline script)."""
TIMELINE_NOT_FOUND = orjson.dumps({"ok": False, "error_kind": "not_found", "error": NOT_FOUND_MESSAGE})
"""The one body of the timeline data for 'no such patient' and 'not yours to read'."""


def build_service(settings: Settings, runtime: Runtime) -> QueryService:
    """The query service of this process (stam.compose.build_query_service), with its thread pools bounded."""
    if settings.query_threads:
        limit_threads(settings.query_threads)
    return build_query_service(settings, runtime.deps, runtime.sealer)


def limit_threads(n: int) -> None:
    """Torch intra-op and BLAS thread pools of this process to ``n`` (query latency; see Settings)."""
    # deferred: torch, threadpoolctl are slow to import
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(n, user_api="blas")


def observe(answer: QueryAnswer, channel: str) -> None:
    served = "none" if not answer.ok or answer.packet is None else (
        "both" if answer.packet.gate.serve_history else "active")
    outcome = "ok" if answer.ok else (answer.error_kind or "internal")
    QUERIES.labels(channel=channel, outcome=outcome, served=served).inc()
    QUERY_SECONDS.labels(channel=channel).observe(answer.latency_ms / 1000)
    if answer.ok and answer.packet is not None:
        QUERY_SERVED_TOKENS.labels(channel=channel, served=served).observe(answer.packet.tokens)


def http_status(answer: QueryAnswer) -> tuple[int, dict[str, str]]:
    """HTTP status and extra headers of an answer: 200, or the error kind's status."""
    if answer.ok:
        return 200, {}
    status = HTTP_STATUS[answer.error_kind or "internal"]
    return status, ({"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {})


def check_bearer(settings: Settings, header: str | None) -> tuple[int, str] | None:
    """None when the header's token may read some patient, else (HTTP status, reason)."""
    refused = authorize(scopes_of(settings), header)
    return refused if isinstance(refused, tuple) else None


def authorize(scopes: TokenScopes, header: str | None) -> Grant | tuple[int, str]:
    """The header's grant, or (HTTP status, reason) when there is none."""
    if not scopes:
        return 503, "query endpoint disabled: no STAM_QUERY_TOKEN or STAM_QUERY_TOKENS_FILE configured"
    grant = scopes.authenticate(header)
    return grant if grant is not None else (401, "missing or wrong bearer token")


MAX_BODY_BYTES = 256 * 1024
"""Largest query body the HTTP endpoint reads (413 beyond)."""


async def read_query(request: Any) -> QueryRequest | tuple[int, str]:
    """The QueryRequest of an HTTP request, or (4xx status, reason): too large, not UTF-8 JSON, nested too
    deep, not an object, or not a valid query. Never raises for what the caller sent."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return 413, f"query body over {MAX_BODY_BYTES} bytes"
    try:
        raw = await request.read()
    except HTTPRequestEntityTooLarge:
        return 413, f"query body over {MAX_BODY_BYTES} bytes"
    if len(raw) > MAX_BODY_BYTES:
        return 413, f"query body over {MAX_BODY_BYTES} bytes"
    try:
        body = orjson.loads(raw)  # bytes that are not UTF-8, or nesting over 1024 levels: JSONDecodeError
    except orjson.JSONDecodeError as exc:
        return 400, f"invalid query: not JSON ({exc})"[:500]
    if not isinstance(body, dict):
        return 400, "invalid query: the body must be a JSON object"
    body.setdefault("request_id", str(uuid.uuid4()))
    try:
        return QueryRequest.model_validate(body)
    except (ValidationError, ValueError, TypeError, RecursionError) as exc:
        return 400, f"invalid query: {exc}"[:2000]


def kafka_header(event: Any, name: str) -> str | None:
    """A Kafka header of a query as text (None when absent or not ASCII)."""
    headers = event.message.headers or []
    for k, v in headers.items() if isinstance(headers, dict) else headers:
        if k == name and isinstance(v, bytes):
            return v.decode("ascii") if v.isascii() else None
    return None


class _Answers:
    """The query service of this process, built once and off the event loop (model load, store connections; a
    failed build, a store down at start, is tried again by the next query), and the answers it gives."""

    def __init__(self, settings: Settings, runtime: Runtime) -> None:
        self.settings = settings
        self.runtime = runtime
        self.built: QueryService | None = None
        self._building = asyncio.Lock()

    async def service(self) -> QueryService:
        async with self._building:
            if self.built is None:
                self.built = await asyncio.to_thread(build_service, self.settings, self.runtime)
        return self.built

    async def respond(self, req: QueryRequest) -> QueryAnswer:
        started = time.perf_counter()
        try:
            svc = await self.service()
        except Exception as exc:
            return failed_answer(req, exc, started)
        return await svc.answer(req)

    async def scoped(self, req: QueryRequest, grant: Grant | None) -> QueryAnswer:
        """The answer within a token's scope: a patient it may not read gets the very answer a patient that does
        not exist gets (decided before any store is read)."""
        if grant is None:
            return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=False, error_kind="invalid",
                               error="missing or wrong token", answered_at=datetime.now(UTC), latency_ms=0.0)
        if not grant.allows(req.patient_id):
            return concealed_not_found(req)
        answer = await self.respond(req)
        return concealed_not_found(req) if answer.error_kind == "not_found" else answer

    async def sealed_answer(self, req: QueryRequest, answer: QueryAnswer) -> tuple[bytes, bytes]:
        """(key, value) of an answer on the answers topic. An answer with evidence waits for the key store
        (retried while Redis is down, never sent in the clear). A failure answer (no evidence) while the key
        store is unreachable is sent unsealed with the patient's pseudonym in place of its id: the client still
        learns 'unavailable' by its request id, and no patient datum leaves in the clear."""
        runtime = self.runtime
        work = partial(seal, runtime.sealer, req.patient_id, answer)
        if answer.ok:
            return cast(tuple[bytes, bytes], await runtime.off_loop("seal answer", work))
        try:
            return await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, work)
        except (redis.ConnectionError, redis.TimeoutError):
            key = runtime.sealer.message_key(req.patient_id)
            bare = answer.model_copy(update={"patient_id": key.decode(), "packet": None, "answer": None})
            return key, bare.model_dump_json().encode()


def build(settings: Settings) -> tuple[faust.App, Runtime]:
    """The query worker's Faust app: the Kafka agent, the warm-up, the ops endpoints, the HTTP query endpoint and
    the timeline page."""
    app, topics = create_app(settings, app_id=settings.query_app_id, web_port=settings.query_web_port,
                             web_host=settings.query_web_host)
    runtime = Runtime(settings=settings, topics=topics, writes=False)
    scopes = scopes_of(settings)
    answers = _Answers(settings, runtime)
    _install_kafka(app, topics, settings, scopes, answers)

    @app.task
    async def _warm() -> None:
        try:
            svc = await answers.service()
            await asyncio.to_thread(svc.embedder.embed, ["warm-up question for the embedding model"] * 4)
        except Exception as exc:  # a store down at start: queries are answered 'unavailable' until it is back
            log.warning("query worker not ready: %s: %s", type(exc).__name__, " ".join(str(exc).split())[:300])
            return
        log.info("query worker ready")

    readiness = Readiness(settings, model_url=settings.reader_url,
                          model_key=settings.reader_api_key.get_secret_value() if settings.reader_api_key else "")
    install_ops(app, settings, group=settings.query_app_id, readiness=readiness)
    _install_http(app, scopes, answers, readiness)
    _install_timeline(app, settings, scopes, answers)
    return app, runtime


def _install_kafka(app: faust.App, topics: Topics, settings: Settings, scopes: TokenScopes, answers: _Answers) -> None:
    """The agent that answers ``stam.queries.v1`` on ``stam.answers.v1``."""
    runtime = answers.runtime

    @app.agent(topics.queries, name="stam.query")
    async def query(stream: faust.StreamT[Any]) -> None:
        sealer = runtime.sealer
        async for event in stream.events():
            raw = raw_value(event)
            opened: bytes | None = None
            try:  # a client may seal its question for the patient (stam.crypto); a plain one is read as it is
                opened = raw if not sealer.sealed(raw) else await runtime.off_loop("open query",
                                                                                  partial(sealer.open, raw))
                req = QueryRequest.model_validate_json(opened)
            except Erased:
                continue
            except (ValidationError, ValueError, TypeError, SealBroken) as exc:
                await runtime.dead_letter(event, "query", exc, opened)
                continue
            if settings.query_kafka_require_token:
                answer = await answers.scoped(req, scopes.authenticate(kafka_header(event, "authorization")))
            else:
                answer = await answers.respond(req)
            observe(answer, "kafka")
            # Sealed for the patient, keyed by its pseudonym: open with stam.crypto.Sealer (the answers name the
            # patient and carry its evidence; they must be as erasable as the rest).
            key, value = await answers.sealed_answer(req, answer)
            await topics.answers.send(key=key, value=value)


def _install_http(app: faust.App, scopes: TokenScopes, answers: _Answers, readiness: Readiness) -> None:
    """``POST /v1/query`` and the old ``GET /v1/health``."""

    @app.page("/v1/health")
    class Health(faust.web.View):
        """Kept for clients of earlier releases: the readiness of ``/readyz`` (200 or 503) with ``ok``."""

        async def get(self, request: faust.web.Request) -> faust.web.Response:
            body = await readiness.status()
            return self.json({"ok": body["ready"], **body}, status=200 if body["ready"] else 503)

    @app.page("/v1/query")
    class Query(faust.web.View):
        async def post(self, request: faust.web.Request) -> faust.web.Response:
            grant = authorize(scopes, request.headers.get("Authorization"))
            if isinstance(grant, tuple):
                return self.json({"ok": False, "error": grant[1]}, status=grant[0])
            started = time.perf_counter()
            req = await read_query(request)
            if isinstance(req, tuple):
                return self.json({"ok": False, "error_kind": "invalid", "error": req[1]}, status=req[0])
            answer = await answers.scoped(req, grant)
            observe(answer, "http")
            log.debug("http query answered in %.1f ms", (time.perf_counter() - started) * 1000)
            status, headers = http_status(answer)
            return self.json(answer.model_dump(mode="json"), status=status, headers=headers)


def _install_timeline(app: faust.App, settings: Settings, scopes: TokenScopes, answers: _Answers) -> None:
    """The timeline page: its shell, its data within the token's scope, its static files."""
    plain: list[RedisStateStore] = []
    drawn = page.PageTimelines()

    def page_states() -> tuple[StateStore, TimelineCache | None]:
        """The state store the page reads, and the query service's timeline cache once the service is built (the
        page never waits for the embedding model)."""
        svc = answers.built
        if svc is not None:
            return svc.states, svc.cache
        if not plain:
            plain.append(RedisStateStore(redis_client(settings), prefix=settings.collection_prefix))
        return plain[0], None

    @app.page("/patients/{patient_id}/timeline")
    class TimelinePage(faust.web.View):
        """The shell of a patient's timeline page: no patient datum (its script reads the data with a token)."""

        async def get(self, request: faust.web.Request, patient_id: str) -> faust.web.Response:
            return self.html(page.shell(patient_id), headers=dict(PAGE_HEADERS))

    @app.page("/patients/{patient_id}/timeline/data")
    class TimelineData(faust.web.View):
        """One window of a patient's timeline as JSON (stam.read.page.page_data), within the token's scope."""

        async def get(self, request: faust.web.Request, patient_id: str) -> faust.web.Response:
            grant = authorize(scopes, request.headers.get("Authorization"))
            if isinstance(grant, tuple):
                return self.json({"ok": False, "error": grant[1]}, status=grant[0], headers=dict(NO_STORE))
            if not grant.allows(patient_id):
                return self._not_found()
            started = time.perf_counter()
            try:
                window = page.window_of(dict(request.query))
            except PageInputError as exc:
                return self.json({"ok": False, "error_kind": "invalid", "error": str(exc)}, status=400,
                                 headers=dict(NO_STORE))
            try:
                states, cache = page_states()
                data = await asyncio.to_thread(page.patient_data, states, patient_id, window, cache, drawn)
            except Exception as exc:
                kind, message = classify(exc)
                status = HTTP_STATUS[kind]
                if kind == "internal":
                    log.exception("timeline data failed")
                return self.json({"ok": False, "error_kind": kind, "error": message}, status=status,
                                 headers={**NO_STORE, **({"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {})})
            if data is None:
                return self._not_found()
            body = orjson.dumps(data)
            log.debug("timeline data: %d memories, %d bytes in %.1f ms", data["counts"]["shown"], len(body),
                      (time.perf_counter() - started) * 1000)
            return self.bytes(body, content_type="application/json", headers=dict(NO_STORE))

        def _not_found(self) -> faust.web.Response:
            return self.bytes(TIMELINE_NOT_FOUND, content_type="application/json", status=404, headers=dict(NO_STORE))

    @app.page("/static/timeline/{name}")
    class TimelineAsset(faust.web.View):
        """The page's static files (vis-timeline's build and the page's script and style), by name only."""

        async def get(self, request: faust.web.Request, name: str) -> faust.web.Response:
            found = page.asset(name)
            if found is None:
                return self.json({"ok": False, "error": "no such file"}, status=404)
            body, kind = found
            return self.bytes(body, headers={"Content-Type": kind, "Cache-Control": "public, max-age=3600",
                                             "X-Content-Type-Options": "nosniff"})


def run(settings: Settings, loglevel: str = "info") -> None:
    """Run the query worker; a port already taken stops it first with :class:`workers.ops.PortInUse`."""
    claim_port(settings.query_web_host, settings.query_web_port, "STAM_QUERY_WEB_PORT")
    start_metrics(settings)
    app, _ = build(settings)
    faust_worker(app, settings, loglevel).execute_from_commandline()
