"""The FHIR REST endpoint of ``stam listen fhir`` (aiohttp, base ``/fhir``).

- ``GET /fhir/metadata``: a CapabilityStatement (R5; the R4B Subscription is read too, see
  :mod:`stam.fhir.subscriptions`);
- ``GET /fhir/SubscriptionTopic`` and ``/fhir/SubscriptionTopic/<id>``: the topics;
- ``POST /fhir/Subscription``: create (``201``, ``Location``); the handshake follows, then events;
- ``GET /fhir/Subscription/<id>``, ``DELETE /fhir/Subscription/<id>``;
- ``GET|POST /fhir/Subscription/<id>/$status``: a searchset of one SubscriptionStatus;
- ``GET|POST /fhir/Subscription/<id>/$events?eventsSinceNumber=&eventsUntilNumber=&content=``: the kept events
  as a notification Bundle of type ``query-event``;
- ``GET /healthz``, ``GET /readyz``.

With ``STAM_FHIR_TOKEN`` set every ``/fhir`` request needs ``Authorization: Bearer <token>``. Errors are
OperationOutcomes. Every answer is ``application/fhir+json``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from stam.errors import SubscriptionRefused
from stam.fhir.bundles import notification, outcome, status_bundle
from stam.fhir.notifier import Notifier, now_iso
from stam.fhir.store import SubscriptionStore
from stam.fhir.subscriptions import FHIR_JSON, parse
from stam.fhir.topics import TOPICS

log = logging.getLogger("stam.fhir")
MAX_BODY = 1024 * 1024


def _fhir(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=FHIR_JSON, headers=headers)


def _error(status: int, code: str, text: str) -> web.Response:
    return _fhir(outcome(code, text), status)


def make_app(*, store: SubscriptionStore, notifier: Notifier | None, base: str, allow_plain_loopback: bool,
             token: str | None = None, readiness: Any = None, max_events: int = 1000) -> web.Application:
    """The endpoint's application: the routes of the module doc over ``store``; ``notifier`` (when running) is told
    of every subscription created or deleted; ``base`` is the server's FHIR base URL."""
    h = _Handlers(store=store, notifier=notifier, base=base, allow_plain_loopback=allow_plain_loopback,
                  readiness=readiness, max_events=max_events)
    app = web.Application(middlewares=[_guard(token)], client_max_size=MAX_BODY)
    app.router.add_get("/fhir/metadata", h.metadata)
    app.router.add_get("/fhir/SubscriptionTopic", h.topics)
    app.router.add_get("/fhir/SubscriptionTopic/{id}", h.topic)
    app.router.add_post("/fhir/Subscription", h.create)
    app.router.add_get("/fhir/Subscription/{id}", h.read)
    app.router.add_delete("/fhir/Subscription/{id}", h.delete)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/fhir/Subscription/{id}/$status", h.status)
        app.router.add_route(method, "/fhir/Subscription/{id}/$events", h.events)
    app.router.add_get("/healthz", h.healthz)
    app.router.add_get("/readyz", h.readyz)
    return app


def _guard(token: str | None) -> Any:
    """The middleware that asks every ``/fhir`` request for the bearer token (when one is set) and answers the
    errors of ``/fhir`` as OperationOutcomes."""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and request.path.startswith("/fhir"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "login", "a bearer token is required (STAM_FHIR_TOKEN)")
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException as exc:
            if exc.status >= 400 and request.path.startswith("/fhir"):
                return _error(exc.status, "not-found" if exc.status == 404 else "processing", exc.reason)
            raise

    return guard


def _capability(base: str) -> dict[str, Any]:
    """The CapabilityStatement: Subscription (create, read, delete, $status, $events) and SubscriptionTopic."""
    return {"resourceType": "CapabilityStatement", "status": "active", "date": now_iso()[:10],
            "kind": "instance", "fhirVersion": "5.0.0", "format": ["json"],
            "software": {"name": "STAM"}, "implementation": {"description": "STAM transitions as topic-based "
                                                                             "Subscriptions", "url": base},
            "rest": [{"mode": "server", "resource": [
                {"type": "Subscription", "interaction": [{"code": "create"}, {"code": "read"},
                                                         {"code": "delete"}],
                 "operation": [{"name": "status", "definition":
                                "http://hl7.org/fhir/OperationDefinition/Subscription-status"},
                               {"name": "events", "definition":
                                "http://hl7.org/fhir/OperationDefinition/Subscription-events"}]},
                {"type": "SubscriptionTopic", "interaction": [{"code": "read"}, {"code": "search-type"}]},
            ]}]}


@dataclass
class _Handlers:
    """The endpoint's handlers, over the subscription store."""

    store: SubscriptionStore
    notifier: Notifier | None
    base: str
    allow_plain_loopback: bool
    readiness: Any
    max_events: int

    async def metadata(self, _: web.Request) -> web.Response:
        return _fhir(_capability(self.base))

    async def topics(self, _: web.Request) -> web.Response:
        entries = [{"fullUrl": f"{self.base}/SubscriptionTopic/{t.id}", "resource": t.resource("R5"),
                    "search": {"mode": "match"}} for t in TOPICS.values()]
        return _fhir({"resourceType": "Bundle", "type": "searchset", "total": len(entries), "entry": entries})

    async def topic(self, request: web.Request) -> web.Response:
        t = TOPICS.get(request.match_info["id"])
        if t is None:
            return _error(404, "not-found", "no such SubscriptionTopic")
        return _fhir(t.resource("R5"))

    async def create(self, request: web.Request) -> web.Response:
        if request.content_length and request.content_length > MAX_BODY:
            return _error(413, "too-costly", "the Subscription is too large")
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "structure", "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "structure", "a Subscription resource is expected")
        sub_id = str(uuid.uuid4())
        try:
            sub = parse(body, sub_id, allow_plain_loopback=self.allow_plain_loopback, now=now_iso())
        except SubscriptionRefused as exc:
            return _error(422 if "https" in str(exc) else 400, "invalid" if "https" not in str(exc) else "security",
                          str(exc))
        await asyncio.to_thread(self.store.create, sub)
        log.info("subscription %s created (%s, topic %s, content %s)", sub.id, sub.version, sub.topic, sub.content)
        if self.notifier is not None:
            self.notifier.changed(sub.id)
        return _fhir(sub.as_resource(), 201, {"Location": f"{self.base}/Subscription/{sub.id}"})

    async def _sub(self, request: web.Request) -> Any:
        sub = await asyncio.to_thread(self.store.get, request.match_info["id"])
        if sub is None:
            raise web.HTTPNotFound(reason="no such Subscription")
        return sub

    async def read(self, request: web.Request) -> web.Response:
        return _fhir((await self._sub(request)).as_resource())

    async def delete(self, request: web.Request) -> web.Response:
        sub_id = request.match_info["id"]
        if not await asyncio.to_thread(self.store.delete, sub_id):
            return _error(404, "not-found", "no such Subscription")
        log.info("subscription %s deleted", sub_id)
        if self.notifier is not None:
            self.notifier.changed(sub_id)
        return _fhir(outcome("informational", f"Subscription/{sub_id} deleted", "information"))

    async def status(self, request: web.Request) -> web.Response:
        sub = await self._sub(request)
        since = await asyncio.to_thread(self.store.events_since_start, sub.id)
        return _fhir(status_bundle(sub, since, self.base, now_iso()))

    async def events(self, request: web.Request) -> web.Response:
        sub = await self._sub(request)
        params = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            try:
                body = json.loads(await request.read())
                params.update({p["name"]: str(next(v for k, v in p.items() if k.startswith("value")))
                               for p in body.get("parameter") or () if "name" in p})
            except (ValueError, StopIteration, AttributeError):
                return _error(400, "structure", "a Parameters resource is expected")
        try:
            since_start = await asyncio.to_thread(self.store.events_since_start, sub.id)
            lo = int(params.get("eventsSinceNumber") or 1)
            hi = int(params.get("eventsUntilNumber") or since_start)
        except ValueError:
            return _error(400, "value", "eventsSinceNumber and eventsUntilNumber are integers")
        content = params.get("content") or sub.content
        if content not in ("empty", "id-only", "full-resource"):
            return _error(400, "value", "content: empty, id-only or full-resource")
        if content == "full-resource" and sub.content != "full-resource":
            return _error(403, "security", "full-resource needs a full-resource subscription (its endpoint's TLS)")
        if hi < lo:
            return _error(400, "value", "eventsUntilNumber is before eventsSinceNumber")
        found, _ = await asyncio.to_thread(self.store.events, sub.id, max(1, lo), hi, self.max_events)
        return _fhir(notification(sub, "query-event", since_start, found, self.base, now_iso(), content=content))

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, _: web.Request) -> web.Response:
        body = await self.readiness.status() if self.readiness is not None else {"ready": True}
        if self.notifier is not None and not self.notifier.assigned:
            body = dict(body, ready=False, consumer="no partitions assigned yet")
        return web.json_response(body, status=200 if body["ready"] else 503)
