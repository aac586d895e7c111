"""Worker entry point: one process running the four write-path agents (scale out by running more)."""

from __future__ import annotations

import asyncio
import logging

import faust
from prometheus_client import start_http_server

from stam.config import Settings
from stam.metrics import BACKGROUND_FAILURES
from stam.recovery import install
from topology.app import create_app
from workers import extract, impact, link, update
from workers.common import STAGE_THREAD, TRANSIENT
from workers.runtime import Runtime

log = logging.getLogger("stam.workers")


def build(settings: Settings) -> tuple[faust.App, Runtime]:
    app, topics = create_app(settings)
    runtime = Runtime(settings=settings, topics=topics)
    for module in (extract, link, impact, update):
        module.register(app, runtime)

    @app.task
    async def _warm() -> None:
        # Load the embedding model and open the stores before the first message arrives.
        # The model's first forward passes are several times slower than later ones (kernel set-up):
        # pay that before the first message, not inside it.
        # On the stage thread, like every store and model call (never two at once, never on the loop).
        try:
            await asyncio.get_running_loop().run_in_executor(
                STAGE_THREAD, lambda: runtime.deps.embedder.embed(["warm-up sentence for the embedding model"] * 8))
        except Exception as exc:  # noqa: BLE001 - a store outage at start: the stages wait it out themselves
            _background_failed("warm_up", exc)
            return
        log.info("write-path worker ready (stores and embedding model loaded)")

    if settings.milvus_flush_s > 0:
        @app.timer(interval=settings.milvus_flush_s)
        async def _seal_segments() -> None:
            # Milvus Lite searches unsealed segments slowly; sealing keeps read-path searches fast.
            # A Milvus outage skips a round; the timer never dies (a dead timer would stop the worker).
            try:
                await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, lambda: runtime.deps.vectors.flush())
            except Exception as exc:  # noqa: BLE001
                _background_failed("seal_segments", exc)

    install(app, runtime.topics, runtime.durability)

    return app, runtime


def _background_failed(task: str, exc: BaseException) -> None:
    BACKGROUND_FAILURES.labels(task=task, error_type=type(exc).__name__).inc()
    if isinstance(exc, TRANSIENT):
        log.warning("%s failed (%s); the worker goes on", task, type(exc).__name__)
    else:
        log.error("%s failed; the worker goes on", task, exc_info=exc)


def run(settings: Settings, loglevel: str = "info") -> None:
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="127.0.0.1")
    app, _ = build(settings)
    worker = faust.Worker(app, loglevel=loglevel)
    worker.execute_from_commandline()
