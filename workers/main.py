"""Worker entry point: one process running the write-path agents (scale out by running more).

By default the fused write path: one agent from the entries topic to the transitions topic in one hop (``stam
worker``). ``stages`` runs the four stages over their topics instead (``stam worker --stages all``) or a subset
(``--stages extract,link``): each stage reads its own topic and writes the next, so a deployment may run each stage
group in processes of its own; give each group its own consumer group (``STAM_APP_ID``). Impact and update in one
process keep the impact projection warm (stam/backends/projection.py); apart, the impact process reloads a patient's
vectors from Milvus when the state moved (same results, slower).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import faust

from stam.config import Settings
from stam.errors import UnknownStage
from stam.logs import faust_worker
from stam.recovery import install
from stam.stage_thread import STAGE_THREAD
from topology.app import create_app
from workers import extract, impact, link, update
from workers.handoff import FUSED_CLIENT_ID, check_fused_start
from workers.ops import Readiness, claim_port, start_metrics
from workers.ops import install as install_ops
from workers.run_ahead import RunAhead
from workers.runtime import Runtime
from workers.stage_agent import background_failed

log = logging.getLogger("stam.workers")

STAGES = {"extract": extract, "link": link, "impact": impact, "update": update}
"""The write path's stages, in the order entries flow through them."""
FUSED = "fused"
"""``--stages fused``, the default: the whole write path in one agent, entries topic to transitions topic in one hop
(``workers.update.register(fused=True)``)."""
DEFAULT_STAGES = (FUSED,)
"""What ``stam worker`` runs without ``--stages``: the fused write path (on the hospital feed 1.7 times the four
stages' flat-out rate at half their CPU per entry; docs/operations.md)."""
SEAL_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stam-seal")
"""Where the worker's periodic Milvus seal runs: not on the stage thread. A seal takes Milvus Lite hundreds of
milliseconds on the hospital feed, and on the stage thread every entry waited it out; the stage's writes go on
meanwhile (Milvus Lite's inserts do not wait for a seal: ``stam.backends.milvus``)."""
FUSED_FETCH_WAIT_MS = 100
"""The fused worker's fetch wait unless ``STAM_CONSUMER_FETCH_WAIT_MS`` is set. On the embedded broker (which answers
a fetch when its wait ends) the one hop waits about half of it at low load; on the hospital feed the fused worker's
flat-out rate at 100 ms was within 5% of its rate at Faust's 1500 (162.5 and 170.3 entries/s), where the four
stages over their topics lost 26% (70.4 and 95.1)."""


def parse_stages(text: str | None) -> tuple[str, ...]:
    """``"extract,link"`` -> ``("extract", "link")`` in pipeline order; "all": the four stages; None or "": the
    default, the fused write path (:data:`DEFAULT_STAGES`). Unknown names: :class:`UnknownStage` with one line naming
    them and the known ones."""
    if text is None or not text.strip():
        return DEFAULT_STAGES
    if text.strip().lower() == "all":
        return tuple(STAGES)
    asked = [s.strip().lower() for s in text.split(",") if s.strip()]
    if FUSED in asked:
        if len(set(asked)) > 1:
            raise UnknownStage("--stages fused runs the whole write path in one agent: it takes no other stage")
        return (FUSED,)
    unknown = [s for s in asked if s not in STAGES]
    if unknown or not asked:
        raise UnknownStage(f"unknown stage{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"--stages takes a comma-separated subset of {','.join(STAGES)}, all, or {FUSED}")
    return tuple(s for s in STAGES if s in asked)


def build(settings: Settings, stages: Sequence[str] = DEFAULT_STAGES) -> tuple[faust.App, Runtime]:
    """The worker's app and runtime with the agents of ``stages`` (:func:`parse_stages`'s answer)."""
    fused = tuple(stages) == (FUSED,)
    if fused and "consumer_fetch_wait_ms" not in settings.model_fields_set:
        settings = settings.model_copy(update={"consumer_fetch_wait_ms": FUSED_FETCH_WAIT_MS})
    # The fused worker's client id names it to the check of the next fused worker that joins (workers.handoff).
    app, topics = create_app(settings, client_id=FUSED_CLIENT_ID if fused else None)
    runtime = Runtime(settings=settings, topics=topics)
    if fused:
        update.register(app, runtime, fused=True)
    else:
        if {"extract", "update"} <= set(stages) and settings.run_ahead_entries:
            runtime.run_ahead = RunAhead(settings.run_ahead_entries)
        for name in stages:
            STAGES[name].register(app, runtime)

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
            background_failed("warm_up", exc)
            return
        log.info("write-path worker ready (stores and embedding model loaded; stages %s, consumer group %s)",
                 ",".join(stages), settings.app_id)

    if settings.milvus_flush_s > 0 and {"update", FUSED} & set(stages):  # the update stage writes Milvus
        @app.timer(interval=settings.milvus_flush_s)
        async def _seal_segments() -> None:
            # Milvus Lite searches unsealed segments slowly; sealing keeps read-path searches fast. Only what this
            # worker wrote since (an idle worker calls nothing), on SEAL_THREAD. A Milvus outage skips a round; the
            # timer never dies (a dead timer would stop the worker).
            try:
                await asyncio.get_running_loop().run_in_executor(
                    SEAL_THREAD, lambda: runtime.deps.vectors.flush_own_writes())
            except Exception as exc:  # noqa: BLE001
                background_failed("seal_segments", exc)

    install(app, runtime.topics, runtime.durability)
    install_ops(app, settings, group=settings.app_id, readiness=Readiness(
        settings, model_url=settings.llm_url,
        model_key=settings.llm_api_key.get_secret_value() if settings.llm_api_key else ""))

    return app, runtime


def run(settings: Settings, loglevel: str = "info", stages: Sequence[str] = DEFAULT_STAGES) -> None:
    """Run the worker; a port already taken stops it first with :class:`workers.ops.PortInUse` (one line), and a
    fused worker whose group has four-stage workers alive (:class:`stam.errors.FourStagesRunning`) or work left on
    the four stages' topics (:class:`stam.errors.StagesBacklog`) too (:func:`workers.handoff.check_fused_start`)."""
    claim_port(settings.web_host, settings.web_port, "STAM_WEB_PORT")
    start_metrics(settings)  # a taken metrics port is said at once too, not after the check waited for a broker
    if tuple(stages) == (FUSED,):
        check_fused_start(settings)
    app, _ = build(settings, stages)
    faust_worker(app, settings, loglevel).execute_from_commandline()
