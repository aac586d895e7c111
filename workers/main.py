"""Worker entry point: one process running the four write-path agents (scale out by running more)."""

from __future__ import annotations

import asyncio
import logging

import faust
from prometheus_client import start_http_server

from stam.config import Settings
from topology.app import create_app
from workers import extract, impact, link, update
from workers.common import STAGE_THREAD
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
        await asyncio.get_running_loop().run_in_executor(
            STAGE_THREAD, lambda: runtime.deps.embedder.embed(["warm-up sentence for the embedding model"] * 8))
        log.info("write-path worker ready (stores and embedding model loaded)")

    if settings.milvus_flush_s > 0:
        @app.timer(interval=settings.milvus_flush_s)
        async def _seal_segments() -> None:
            # Milvus Lite searches unsealed segments slowly; sealing keeps read-path searches fast.
            await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, lambda: runtime.deps.vectors.flush())

    return app, runtime


def run(settings: Settings, loglevel: str = "info") -> None:
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="127.0.0.1")
    app, _ = build(settings)
    worker = faust.Worker(app, loglevel=loglevel)
    worker.execute_from_commandline()
