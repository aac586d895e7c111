"""The query consumer: gated reads, separate from the write path (its own Faust app and consumer group).

- Kafka: consumes ``stam.queries.v1`` (QueryRequest, key = patient id) and produces ``stam.answers.v1``
  (QueryAnswer, same key, correlated by ``request_id``). A message that is not a valid QueryRequest goes to
  the dead-letter topic with its bytes; the stream goes on.
- HTTP: ``POST /v1/query`` with a QueryRequest JSON body (``request_id`` may be omitted) and
  ``Authorization: Bearer <STAM_QUERY_TOKEN>`` returns the QueryAnswer. Without a configured token the
  endpoint answers 503 to everyone; a missing or wrong token gets 401. ``GET /v1/health`` needs no token.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any

import faust
from prometheus_client import start_http_server
from pydantic import ValidationError

from schemas.query import QueryAnswer, QueryRequest
from stam.config import Settings
from stam.metrics import QUERIES, QUERY_SECONDS
from stam.read.service import QueryService
from topology.app import create_app
from workers.runtime import Runtime

log = logging.getLogger("stam.query")


def build_service(settings: Settings, runtime: Runtime) -> QueryService:
    from stam.read.asof import read_patient_transitions
    from stam.read.gate import load_gate
    from stam.read.reader import OpenAIReader
    from stam.read.tokens import load_tokenizer
    from stam.stores.projection import VectorProjection

    if settings.query_threads:
        limit_threads(settings.query_threads)
    deps = runtime.deps
    reader = None
    if settings.reader_url:
        reader = OpenAIReader(settings.reader_url, settings.reader_model or "default",
                              api_key=settings.reader_api_key.get_secret_value() if settings.reader_api_key else "",
                              timeout_s=settings.reader_timeout_s)

    async def transitions(patient_id: str) -> list[Any]:
        return await read_patient_transitions(settings, patient_id)

    return QueryService(states=deps.states, vectors=deps.vectors, embedder=deps.embedder,
                        tokenizer=load_tokenizer(settings.tokenizer or settings.embedding_model),
                        gate=load_gate(settings.resolved_gate_file(), settings.gate_threshold),
                        projection=VectorProjection(deps.vectors, max_vectors=settings.projection_max_vectors),
                        reader=reader, transitions=transitions)


def limit_threads(n: int) -> None:
    """Torch intra-op and BLAS thread pools of this process to ``n`` (query latency; see Settings)."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(n, user_api="blas")


def observe(answer: QueryAnswer, channel: str) -> None:
    served = "error" if not answer.ok or answer.packet is None else (
        "both" if answer.packet.gate.serve_history else "active")
    QUERIES.labels(channel=channel, served=served).inc()
    QUERY_SECONDS.labels(channel=channel).observe(answer.latency_ms / 1000)


def check_bearer(settings: Settings, header: str | None) -> tuple[int, str] | None:
    """None when the request may be answered, else (HTTP status, reason)."""
    if settings.query_token is None or not settings.query_token.get_secret_value():
        return 503, "query endpoint disabled: no STAM_QUERY_TOKEN configured"
    expected = "Bearer " + settings.query_token.get_secret_value()
    if not header or not hmac.compare_digest(header.encode(), expected.encode()):
        return 401, "missing or wrong bearer token"
    return None


def build(settings: Settings) -> tuple[faust.App, Runtime]:
    app, topics = create_app(settings, app_id=settings.query_app_id, web_port=settings.query_web_port,
                             web_host=settings.query_web_host)
    runtime = Runtime(settings=settings, topics=topics)
    holder: dict[str, QueryService] = {}

    def service() -> QueryService:
        if "svc" not in holder:
            holder["svc"] = build_service(settings, runtime)
        return holder["svc"]

    @app.agent(topics.queries, name="stam.query")
    async def query(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            try:
                req = QueryRequest.model_validate_json(event.value)
            except (ValidationError, ValueError, TypeError) as exc:
                await runtime.dead_letter(event, "query", exc)
                continue
            answer = await service().answer(req)
            observe(answer, "kafka")
            await topics.answers.send(key=req.patient_id.encode(), value=answer.model_dump_json().encode())

    @app.task
    async def _warm() -> None:
        service().embedder.embed(["warm-up question for the embedding model"] * 4)
        log.info("query worker ready")

    @app.page("/v1/health")
    class Health(faust.web.View):
        async def get(self, request: faust.web.Request) -> faust.web.Response:
            return self.json({"ok": True})

    @app.page("/v1/query")
    class Query(faust.web.View):
        async def post(self, request: faust.web.Request) -> faust.web.Response:
            refused = check_bearer(settings, request.headers.get("Authorization"))
            if refused is not None:
                return self.json({"ok": False, "error": refused[1]}, status=refused[0])
            started = time.perf_counter()
            try:
                body = json.loads(await request.read())
                if isinstance(body, dict):
                    body.setdefault("request_id", str(uuid.uuid4()))
                req = QueryRequest.model_validate(body)
            except (ValidationError, ValueError) as exc:
                return self.json({"ok": False, "error": f"invalid query: {exc}"[:2000]}, status=400)
            answer = await service().answer(req)
            observe(answer, "http")
            log.debug("http query answered in %.1f ms", (time.perf_counter() - started) * 1000)
            return self.json(answer.model_dump(mode="json"), status=200 if answer.ok else 404)

    return app, runtime


def run(settings: Settings, loglevel: str = "info") -> None:
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="127.0.0.1")
    app, _ = build(settings)
    faust.Worker(app, loglevel=loglevel).execute_from_commandline()
