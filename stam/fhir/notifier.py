"""From the transitions topic to numbered events, and from events to rest-hook notifications.

Routing. A consumer group (``STAM_FHIR_GROUP``) reads the transitions topic. Each value is opened with the
deployment's key store; one whose patient was erased does not open (``Erased``) and nothing is made of it. A
transition that moved a memory into HISTORY is matched against the topics (:mod:`stam.fhir.topics`) and against
each live Subscription's filters; for each match the memories it names are read from the state store, and the
event is numbered for that Subscription and kept, sealed, in Redis (:class:`stam.fhir.store.SubscriptionStore`).
Offsets are committed after the events are kept, so a crash re-reads the batch and a re-read transition keeps its
number (at least once in, exactly one number per transition and Subscription). A Subscription sees only
transitions applied after it was created.

Delivery. One task per Subscription (under a Redis lease, so one process of several sends it) sends its events in
number order, up to ``maxCount`` per Bundle, after the handshake has succeeded. A POST that fails (a connection
error, a timeout, a non-2xx answer) is tried ``STAM_FHIR_DELIVERY_ATTEMPTS`` times with a doubling wait; then the
events are left for ``$events``, the Subscription's status becomes ``error`` and the next events go on (a
subscriber sees the gap in the event numbers and recovers it). A success sets the status back to ``active``. With
nothing to send for ``heartbeatPeriod`` seconds, a heartbeat is sent. An event whose patient was erased after it
was numbered is never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from schemas import Store, StoredMemory, TransitionEvent, TransitionKind
from stam.config import Settings
from stam.errors import Erased, SealBroken, SubscriberUnreachable
from stam.fhir.bundles import notification
from stam.fhir.resources import from_fhir, patient_id_for
from stam.fhir.store import SubscriptionStore
from stam.fhir.subscriptions import FHIR_JSON, Subscription
from stam.fhir.topics import matching
from stam.metrics import FHIR_DELIVERY_SECONDS, FHIR_EVENTS, FHIR_NOTIFICATIONS, FHIR_SUBSCRIPTIONS
from topology import topics as t

log = logging.getLogger("stam.fhir")

LEASE_MS = 15_000
LIVE = ("requested", "active", "error")
KEPT = "are kept for $events"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def base_url(settings: Settings, port: int, tls: bool) -> str:
    return settings.fhir_base_url.rstrip("/") or f"{'https' if tls else 'http'}://{settings.fhir_host}:{port}/fhir"


def _matches_filters(sub: Subscription, transition: TransitionEvent, stored: StoredMemory) -> bool:
    if sub.category is not None and stored.memory.category.value != sub.category:
        return False
    if sub.patient is not None:
        pid = transition.patient_id
        return sub.patient in (pid, patient_id_for(pid, from_fhir(stored.memory.entry_id)))
    return True


class Notifier:
    """The router (transitions -> events) and the deliverers (events -> notifications) of one process."""

    def __init__(self, settings: Settings, store: SubscriptionStore, states: Any, sealer: Any, base: str) -> None:
        self.settings = settings
        self.store = store
        self.states = states
        self.sealer = sealer
        self.base = base
        self.owner = uuid.uuid4().hex
        self._subs: list[Subscription] = []
        self._subs_at = 0.0
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: Any = None
        self._consumer: Any = None
        self._stopping = False
        self.assigned = False
        """The consumer has its partitions (readiness)."""

    # --- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        # deferred: aiohttp is slow to import; stam.transport pulls in redis
        import aiohttp

        from stam.transport import kafka_consumer

        ctx = ssl.create_default_context(cafile=str(self.settings.fhir_endpoint_cafile)
                                         if self.settings.fhir_endpoint_cafile else None)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
        self._consumer = kafka_consumer(
            self.settings, t.TRANSITIONS.name(self.settings.topic_prefix),
            group_id=self.settings.fhir_group, enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=int(self.settings.session_timeout_s * 1000))
        try:
            await self._consumer.start()
        except BaseException:
            await self._consumer.stop()
            await self._session.close()
            raise

    async def run(self) -> None:
        await asyncio.gather(self._route_forever(), self._supervise_forever())

    async def close(self) -> None:
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._consumer is not None:
            await self._consumer.stop()
        if self._session is not None:
            await self._session.close()

    def changed(self, sub_id: str | None = None) -> None:
        """A Subscription was created, changed or deleted here: re-read them now."""
        self._subs_at = 0.0
        if sub_id in self._wake:
            self._wake[sub_id].set()

    # --- routing --------------------------------------------------------------------------------------------------
    async def _route_forever(self) -> None:
        while not self._stopping:
            batch = await self._consumer.getmany(timeout_ms=500, max_records=500)
            self.assigned = bool(self._consumer.assignment())
            records = [r for recs in batch.values() for r in recs]
            if not records:
                continue
            woken = await asyncio.to_thread(self.route, [r.value for r in records])
            await self._consumer.commit()
            for sub_id in woken:
                if sub_id in self._wake:
                    self._wake[sub_id].set()

    def _live(self) -> list[Subscription]:
        if time.monotonic() - self._subs_at > 2.0:
            self._subs = [s for s in self.store.all() if s.status in LIVE]
            self._subs_at = time.monotonic()
        return self._subs

    def route(self, values: list[bytes]) -> set[str]:
        """Number and keep the events of these transitions (blocking: Redis). The subscriptions to wake."""
        woken: set[str] = set()
        subs = self._live()
        if not subs:
            return woken
        self.sealer.prefetch(values)
        for value in values:
            try:
                data = json.loads(self.sealer.open(value))
            except Erased:
                FHIR_EVENTS.labels("-", "erased").inc()
                continue
            except SealBroken:
                log.warning("a transition that does not open under its patient's key was skipped")
                continue
            if data.get("to_store") != Store.HISTORY.value or data.get("kind") not in ("archived", "added"):
                continue
            transition = TransitionEvent.model_validate(data)
            woken |= self._route_one(transition, subs)
        return woken

    def _route_one(self, transition: TransitionEvent, subs: list[Subscription]) -> set[str]:
        if transition.kind is TransitionKind.ADDED:
            if transition.memory is None:
                return set()
            stored = {transition.memory_id: StoredMemory(memory=transition.memory, store=Store.HISTORY,
                                                         reason=transition.reason)}
        else:
            ids = [i for i in (transition.memory_id, transition.successor_id, transition.evidence_id) if i]
            stored = self.states.memories(transition.patient_id, ids)
        mine = stored.get(transition.memory_id)
        if mine is None:  # deleted since (the deletion gate): nothing to render
            return set()
        topics = matching(transition, mine)
        if not topics:
            return set()
        woken: set[str] = set()
        event: dict[str, Any] | None = None
        for sub in subs:
            topic = next((t for t in topics if t.id == sub.topic), None)
            if topic is None or transition.recorded_at < datetime.fromisoformat(sub.created):
                continue
            if not _matches_filters(sub, transition, mine):
                continue
            if event is None:
                event = {"ts": now_iso(), "transition": transition.model_dump(mode="json"),
                         "memories": {k: v.model_dump(mode="json") for k, v in stored.items()}}
            _, new = self.store.number(sub.id, transition.transition_id, transition.patient_id,
                                       dict(event, topic=topic.id))
            FHIR_EVENTS.labels(topic.id, "numbered" if new else "duplicate").inc()
            if new:
                woken.add(sub.id)
        return woken

    # --- delivery -------------------------------------------------------------------------------------------------
    async def _supervise_forever(self) -> None:
        while not self._stopping:
            subs = await asyncio.to_thread(self.store.all)
            ids = {s.id for s in subs if s.status in LIVE}
            for sub_id in ids - set(self._tasks):
                self._wake[sub_id] = asyncio.Event()
                self._tasks[sub_id] = asyncio.create_task(self._deliver_forever(sub_id))
            for sub_id in [i for i, task in self._tasks.items() if i not in ids or task.done()]:
                self._tasks.pop(sub_id).cancel()
                self._wake.pop(sub_id, None)
            counts: dict[str, int] = {}
            for s in subs:
                counts[s.status] = counts.get(s.status, 0) + 1
            for status in ("requested", "active", "error", "off"):
                FHIR_SUBSCRIPTIONS.labels(status).set(counts.get(status, 0))
            await asyncio.sleep(1.0)

    async def _post(self, sub: Subscription, bundle: dict[str, Any], kind: str) -> None:
        """POST one notification; :class:`SubscriberUnreachable` when the endpoint does not take it."""
        # deferred: aiohttp is slow to import
        import aiohttp

        fhir_version = "4.3" if sub.version == "R4B" else "5.0"
        headers = {"Content-Type": f"{FHIR_JSON}; fhirVersion={fhir_version}", **dict(sub.headers)}
        timeout = aiohttp.ClientTimeout(total=sub.timeout_s or self.settings.fhir_delivery_timeout_s)
        try:
            async with self._session.post(sub.endpoint, data=json.dumps(bundle).encode(), headers=headers,
                                          timeout=timeout, allow_redirects=False) as resp:
                await resp.read()
                if not 200 <= resp.status < 300:
                    raise SubscriberUnreachable(f"{kind}: the endpoint answered HTTP {resp.status}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            FHIR_NOTIFICATIONS.labels(kind, "failed").inc()
            raise SubscriberUnreachable(f"{kind}: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}") from None
        except SubscriberUnreachable:
            FHIR_NOTIFICATIONS.labels(kind, "failed").inc()
            raise
        FHIR_NOTIFICATIONS.labels(kind, "sent").inc()

    async def _try(self, sub: Subscription, bundle: dict[str, Any], kind: str, attempts: int) -> str | None:
        """Up to ``attempts`` POSTs with a doubling wait; None when one was taken, else the last error."""
        wait = self.settings.fhir_retry_s
        for i in range(attempts):
            try:
                await self._post(sub, bundle, kind)
                return None
            except SubscriberUnreachable as exc:
                error = str(exc)
                if i + 1 < attempts:
                    await asyncio.sleep(wait)
                    wait *= 2
        return error

    async def _set_status(self, sub: Subscription, status: str, error: str = "", **changes: Any) -> None:
        if sub.status == status and sub.error == error and not changes:
            return
        if status != sub.status:
            log.info("subscription %s: %s -> %s%s", sub.id, sub.status, status, f" ({error})" if error else "")
        sub.status, sub.error = status, error
        for k, v in changes.items():
            setattr(sub, k, v)
        await asyncio.to_thread(self.store.save, sub)

    async def _deliver_forever(self, sub_id: str) -> None:
        last_out = time.monotonic()
        while not self._stopping:
            try:
                last_out = await self._deliver_once(sub_id, last_out)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a Redis outage: logged, retried; the subscription is not lost
                log.exception("subscription %s: delivery failed; retrying", sub_id)
                await asyncio.sleep(self.settings.fhir_retry_s)
            if last_out < 0:
                return

    async def _deliver_once(self, sub_id: str, last_out: float) -> float:
        """One step of a subscription's delivery; the time of the last notification out (-1: stop)."""
        sub = await asyncio.to_thread(self.store.get, sub_id)
        if sub is None or sub.status not in LIVE:
            return -1
        if not await asyncio.to_thread(self.store.lease, sub_id, self.owner, LEASE_MS):
            await asyncio.sleep(2.0)  # another process delivers it
            return last_out
        if sub.end and sub.end <= now_iso():
            await self._set_status(sub, "off")
            return -1
        if not sub.handshaken:
            since = await asyncio.to_thread(self.store.events_since_start, sub_id)
            bundle = notification(sub, "handshake", since, [], self.base, now_iso())
            error = await self._try(sub, bundle, "handshake", 1)
            if error is None:
                await self._set_status(sub, "active", handshaken=True)
                return time.monotonic()
            await self._set_status(sub, "error", error)
            await self._wait(sub_id, self.settings.fhir_retry_s)
            return last_out
        sent = await asyncio.to_thread(self.store.sent, sub_id)
        pending, lost = await asyncio.to_thread(self.store.events, sub_id, sent + 1, None, sub.max_count)
        if pending or lost:
            last = max([e["n"] for e in pending] + lost)
            if pending:
                bundle = notification(sub, "event-notification", pending[-1]["n"], pending, self.base, now_iso())
                error = await self._try(sub, bundle, "event-notification", self.settings.fhir_delivery_attempts)
                if error is None:
                    done = time.time()
                    for e in pending:
                        applied = datetime.fromisoformat(e["transition"]["recorded_at"]).timestamp()
                        FHIR_DELIVERY_SECONDS.observe(max(0.0, done - applied))
                    await self._set_status(sub, "active")
                else:
                    FHIR_NOTIFICATIONS.labels("event-notification", "dropped").inc()
                    await self._set_status(sub, "error", f"{error}; events {pending[0]['n']}-{pending[-1]['n']} {KEPT}")
            await asyncio.to_thread(self.store.mark_sent, sub_id, last)
            return time.monotonic()
        if sub.heartbeat_s and time.monotonic() - last_out >= sub.heartbeat_s:
            since = await asyncio.to_thread(self.store.events_since_start, sub_id)
            error = await self._try(sub, notification(sub, "heartbeat", since, [], self.base, now_iso()), "heartbeat", 1)
            if error is None:
                await self._set_status(sub, "active")
            else:  # the status keeps saying which events wait for $events until a notification gets through
                kept = next((p for p in sub.error.split("; ") if p.endswith(KEPT)), "")
                await self._set_status(sub, "error", "; ".join(x for x in (error, kept) if x))
            return time.monotonic()
        wait = 1.0 if not sub.heartbeat_s else max(0.05, min(1.0, sub.heartbeat_s - (time.monotonic() - last_out)))
        await self._wait(sub_id, wait)
        return last_out

    async def _wait(self, sub_id: str, seconds: float) -> None:
        wake = self._wake.get(sub_id)
        if wake is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), seconds)
        wake.clear()
