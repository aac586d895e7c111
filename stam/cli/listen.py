"""``stam listen mllp``: a live HL7 v2 MLLP listener that acknowledges a message once it is on a topic."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from typing import Any

from stam.cli.context import load_settings
from stam.errors import PortInUse, SourceConfigError


async def _serve(listener: Any, settings: Any, announce: bool) -> None:
    # deferred: workers.ops pulls in redis, prometheus_client (kept off `stam --help`)
    from workers.ops import Readiness

    await listener.start()
    web = None
    readiness = Readiness(settings)
    readiness.checks.pop("milvus", None)  # the listener uses the broker and Redis only
    if settings.mllp_web_port:
        web = await _web(settings, readiness)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        scheme = "MLLP over TLS" if listener.tls else "MLLP"
        print(f"stam listen mllp: {scheme} on {settings.mllp_host}:{listener.port}", file=sys.stderr, flush=True)
    logging.getLogger("stam.mllp").info("listening on %s:%s", settings.mllp_host, listener.port)
    try:
        await stop.wait()
    finally:
        if web is not None:
            await web.cleanup()
        await readiness.aclose()
        await listener.close()


async def _web(settings: Any, readiness: Any) -> Any:
    """GET /healthz (the loop answers) and /readyz (the broker and Redis answer) on STAM_WEB_HOST:STAM_MLLP_WEB_PORT."""
    # deferred: aiohttp is slow to import (kept off `stam --help`)
    from aiohttp import web

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(_: web.Request) -> web.Response:
        body = await readiness.status()
        return web.json_response(body, status=200 if body["ready"] else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.web_host, settings.mllp_web_port).start()
    return runner


def cmd_listen_mllp(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker", "redis"))
    overrides = {k: v for k, v in (("mllp_host", args.host), ("mllp_port", args.port)) if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)


    # deferred: stam.mllp, workers.ops pull in redis, prometheus_client (kept off `stam --help`)
    from stam.mllp import MllpListener
    from workers.ops import claim_port, start_metrics

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an outage is answered AR and counted, not logged
    logging.getLogger("stam.mllp").setLevel(getattr(logging, args.loglevel.upper(), logging.INFO))
    try:
        if settings.mllp_port:
            claim_port(settings.mllp_host, settings.mllp_port, "STAM_MLLP_PORT")
        if settings.mllp_web_port:
            claim_port(settings.web_host, settings.mllp_web_port, "STAM_MLLP_WEB_PORT")
        start_metrics(settings)
        listener = MllpListener(settings, source_system=args.source_system)
    except (PortInUse, SourceConfigError) as exc:
        print(f"stam listen mllp: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # TLS files that cannot be read or do not match
        print(f"stam listen mllp: TLS (STAM_MLLP_TLS_*): {exc}", file=sys.stderr)
        return 2
    return _run("mllp", _serve(listener, settings, announce=not args.quiet))


async def _serve_fhir(settings: Any, port: int, announce: bool) -> None:
    # deferred: aiohttp is slow to import; stam.backends.redis_state and others pull in igraph (kept off `stam --help`)
    from aiohttp import web

    from stam.backends.redis_state import RedisStateStore
    from stam.crypto import sealer_for
    from stam.fhir.notifier import Notifier, base_url
    from stam.fhir.server import make_app
    from stam.fhir.store import SubscriptionStore
    from stam.transport import redis_client
    from workers.ops import Readiness

    client = redis_client(settings)
    sealer = sealer_for(settings, client)
    store = SubscriptionStore(client, sealer, prefix=settings.collection_prefix, kept=settings.fhir_events_kept,
                              ttl_s=settings.fhir_events_ttl_s)
    tls = None
    if settings.fhir_tls_certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(str(settings.fhir_tls_certfile), str(settings.fhir_tls_keyfile))
    readiness = Readiness(settings)
    readiness.checks.pop("milvus", None)  # the notifier uses the broker and Redis only
    runner = None
    notifier = None
    try:
        # The port first (0: any free one), so the base URL in notifications is the one subscribers reach.
        placeholder = web.AppRunner(web.Application(), access_log=None)
        await placeholder.setup()
        site = web.TCPSite(placeholder, settings.fhir_host, port, ssl_context=tls, reuse_address=True)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await placeholder.cleanup()
        base = base_url(settings, port, tls is not None)
        notifier = Notifier(settings, store, RedisStateStore(client, prefix=settings.collection_prefix), sealer, base)
        await notifier.start()
        token = settings.fhir_token.get_secret_value() if settings.fhir_token else None
        app = make_app(store=store, notifier=notifier, base=base, allow_plain_loopback=settings.fhir_allow_plain_loopback,
                       token=token, readiness=readiness, max_events=settings.fhir_events_kept)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, settings.fhir_host, port, ssl_context=tls, reuse_address=True).start()
        if announce:
            print(f"stam listen fhir: FHIR Subscriptions on {base}", file=sys.stderr, flush=True)
        logging.getLogger("stam.fhir").info("FHIR endpoint on %s", base)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        work = asyncio.create_task(notifier.run())
        halt = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({work, halt}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()  # the notifier died: its error, not a silent stop
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
    finally:
        if runner is not None:
            await runner.cleanup()
        if notifier is not None:
            await notifier.close()
        await readiness.aclose()


def cmd_listen_fhir(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker", "redis"))
    overrides = {k: v for k, v in (("fhir_host", args.host), ("fhir_port", args.port)) if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)


    # deferred: workers.ops pulls in redis, prometheus_client (kept off `stam --help`)
    from workers.ops import claim_port, start_metrics

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("stam.fhir").setLevel(getattr(logging, args.loglevel.upper(), logging.INFO))
    try:
        if settings.fhir_port:
            claim_port(settings.fhir_host, settings.fhir_port, "STAM_FHIR_PORT")
        start_metrics(settings)
    except PortInUse as exc:
        print(f"stam listen fhir: {exc}", file=sys.stderr)
        return 2
    return _run("fhir", _serve_fhir(settings, settings.fhir_port, announce=not args.quiet),
                tls="STAM_FHIR_TLS_*" if settings.fhir_tls_certfile else None)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("listen", help="live interfaces: HL7 v2 over MLLP in, FHIR Subscriptions out",
                       description="Live feeds into the entries topic, and transitions out as FHIR notifications.")
    kinds = p.add_subparsers(dest="listener", required=True)
    m = kinds.add_parser("mllp", help="HL7 v2 over MLLP, acknowledged once durable (AA/AE/AR; CA/CE/CR)",
                         description="Accepts HL7 v2 messages over MLLP (persistent connections, one message in "
                         "flight per connection) and acknowledges each on the same socket only after its entries "
                         "are on the entries topic (acks=all): AA; or after it is on the dead-letter topic with its "
                         "bytes and reason (malformed or not mappable): AE with an ERR segment; AR when the broker "
                         "or Redis is unavailable (send it again), the message is over STAM_MLLP_MAX_MESSAGE_BYTES "
                         "or its sender is not on STAM_MLLP_ALLOWED_SENDERS. MSH-15/16 select enhanced mode "
                         "(CA/CE/CR). A resend of the same (MSH-3, MSH-4, MSH-10) gets the stored acknowledgement "
                         "and is not ingested again. Settings: STAM_MLLP_* (docs/mllp.md); metrics on "
                         "STAM_METRICS_PORT, /healthz and /readyz on STAM_MLLP_WEB_PORT. Stops on SIGINT/SIGTERM.")
    m.add_argument("--host", default=None, help="bind address (default: STAM_MLLP_HOST, 127.0.0.1)")
    m.add_argument("--port", type=int, default=None, help="TCP port (default: STAM_MLLP_PORT, 2575; 0: any free)")
    m.add_argument("--source-system", default=None, help="sign every entry as this source system (its secret from "
                   "STAM_SOURCES / STAM_SOURCES_FILE), as `stam publish --source-system`")
    m.add_argument("--loglevel", default="info", help="debug, info, warning or error (default: info)")
    m.add_argument("--quiet", action="store_true", help="do not print the listening address")
    m.set_defaults(fn=cmd_listen_mllp)
    f = kinds.add_parser("fhir", help="transitions out as FHIR R4B/R5 topic-based Subscription notifications",
                         description="Serves a FHIR endpoint (base /fhir: SubscriptionTopic, Subscription create/"
                         "read/delete, $status, $events) and notifies rest-hook subscribers of the transitions on "
                         "the transitions topic (a consumer group): a fact superseded, a condition resolved, an "
                         "encounter ended, a memory archived; filterable by patient and category. R4B (Subscriptions "
                         "Backport IG: history Bundles) and R5 (subscription-notification); handshake, heartbeat, "
                         "headers; content empty, id-only or full-resource (https endpoints only). Subscriptions and "
                         "events are kept in Redis. Nothing is sent for an erased patient. Settings: STAM_FHIR_* "
                         "(docs/fhir-subscriptions.md); metrics on STAM_METRICS_PORT. Stops on SIGINT/SIGTERM.")
    f.add_argument("--host", default=None, help="bind address (default: STAM_FHIR_HOST, 127.0.0.1)")
    f.add_argument("--port", type=int, default=None, help="TCP port (default: STAM_FHIR_PORT, 8090; 0: any free)")
    f.add_argument("--loglevel", default="info", help="debug, info, warning or error (default: info)")
    f.add_argument("--quiet", action="store_true", help="do not print the endpoint's base URL")
    f.set_defaults(fn=cmd_listen_fhir)


def _run(name: str, main: Any, tls: str | None = None) -> int:
    """Run a listener's loop to its end. What stops it from starting (the broker or Redis unreachable, a port, TLS
    files that do not load where ``tls`` names their settings) is one line; SIGINT is a stop, not an error."""
    # deferred: aiokafka is slow to import (kept off `stam --help`)
    from aiokafka.errors import KafkaError

    try:
        asyncio.run(main)
    except (KafkaError, OSError) as exc:
        if tls and isinstance(exc, OSError) and "ssl" in type(exc).__module__.lower():
            print(f"stam listen {name}: TLS ({tls}): {exc}", file=sys.stderr)
            return 2
        print(f"stam listen {name}: cannot start: {type(exc).__name__}: {' '.join(str(exc).split())[:200]} (is the "
              f"stack up: `stam stack status`, or the STAM_* URLs?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            print(f"stam listen {name}: stopped", file=sys.stderr)
    return 0
