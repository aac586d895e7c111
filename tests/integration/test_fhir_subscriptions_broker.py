"""``stam listen fhir`` on the real embedded stack (Tansu broker, redis-server), with the real worker applying a real
Synthea patient, notifying a real aiohttp receiver on loopback (HTTP and HTTPS with its own certificate).

One flow, in order: subscriptions of each topic, version and content are created over REST; each gets its
handshake before any event; the patient's entries go in in three parts: the first with the receiver up, the second
with it down (the notifier tries, gives up and says ``error``), then the notifier process is restarted (its
Subscriptions and numbering are in Redis), the receiver comes back and the third part goes in. The receiver checks
``application/fhir+json``, the headers, heartbeats, consecutive event numbers, and recovers the gap with ``$events``.
Every Bundle received or read is parsed by fhir.resources (R4B and R5) and checked against the IG's invariants
(``stam.fhir.validate``). The expected events are computed from the transitions topic itself, not from the notifier.
Last, the patient is erased (its data key shredded) while a subscription's events wait: none is ever sent.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest

from stam.fhir.subscriptions import BACKPORT
from stam.fhir.topics import TOPICS
from stam.fhir.validate import check_notification
from stam.net import free_port
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import _publish, collect_outputs
from tests.integration.conftest import _stam_process
from tests.integration.fhir_receiver import Receiver

pytestmark = pytest.mark.integration
CHANNEL = {"system": "http://terminology.hl7.org/CodeSystem/subscription-channel-type", "code": "rest-hook"}


def r5(topic: str, endpoint: str, content: str, *, heartbeat: int | None = None, max_count: int = 1,
       headers: dict[str, str] | None = None, **filters: str) -> dict[str, Any]:
    body: dict[str, Any] = {"resourceType": "Subscription", "status": "requested", "reason": "integration test",
                            "topic": TOPICS[topic].url, "channelType": CHANNEL, "endpoint": endpoint,
                            "contentType": "application/fhir+json", "content": content, "maxCount": max_count,
                            "filterBy": [{"filterParameter": k, "value": v} for k, v in filters.items()],
                            "parameter": [{"name": k, "value": v} for k, v in (headers or {}).items()]}
    if heartbeat:
        body["heartbeatPeriod"] = heartbeat
    return body


def r4b(topic: str, endpoint: str, content: str, *, heartbeat: int | None = None, max_count: int = 1,
        headers: dict[str, str] | None = None, **filters: str) -> dict[str, Any]:
    ext = [{"url": BACKPORT + "backport-max-count", "valuePositiveInt": max_count}]
    if heartbeat:
        ext.append({"url": BACKPORT + "backport-heartbeat-period", "valueUnsignedInt": heartbeat})
    body: dict[str, Any] = {
        "resourceType": "Subscription", "status": "requested", "reason": "integration test", "criteria": TOPICS[topic].url,
        "channel": {"type": "rest-hook", "endpoint": endpoint, "payload": "application/fhir+json",
                    "_payload": {"extension": [{"url": BACKPORT + "backport-payload-content", "valueCode": content}]},
                    "header": [f"{k}: {v}" for k, v in (headers or {}).items()], "extension": ext}}
    if filters:
        q = "&".join(f"{k}={v}" for k, v in filters.items())
        body["_criteria"] = {"extension": [{"url": BACKPORT + "backport-filter-criteria", "valueString": f"Resource?{q}"}]}
    return body


@contextmanager
def notifier(settings: Any, port: int, metrics_port: int, cafile: Any, log: str) -> Iterator[Any]:
    with _stam_process(settings, "listen fhir", log, STAM_FHIR_PORT=str(port), STAM_METRICS_PORT=str(metrics_port),
                       STAM_FHIR_ENDPOINT_CAFILE=str(cafile), STAM_FHIR_DELIVERY_ATTEMPTS="2",
                       STAM_FHIR_RETRY_S="0.3") as proc:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (settings.home / log).read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (settings.home / log).read_text()[-3000:]
            time.sleep(0.5)
        yield proc


def expected(transitions: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Transition ids each subscription of the flow must be notified of, from the topic alone, in log order."""
    category = {t["memory_id"]: t["memory"]["category"] for t in transitions if t.get("memory")}
    out: dict[str, list[str]] = {"superseded-obs": [], "encounter-ended": [], "condition-resolved": [],
                                 "archived": []}
    for t in transitions:
        into_history = t["to_store"] == "history" and t["kind"] in ("archived", "added")
        cat = category.get(t["memory_id"])
        if t["kind"] == "archived" and t["reason"] == "superseded" and cat == "observation":
            out["superseded-obs"].append(t["transition_id"])
        if into_history and cat == "encounter" and t["reason"] in ("encounter-ended", "completed"):
            out["encounter-ended"].append(t["transition_id"])
        if into_history and cat == "condition" and t["reason"] == "resolved":
            out["condition-resolved"].append(t["transition_id"])
        if t["kind"] == "archived":
            out["archived"].append(t["transition_id"])
    return out


class _Flow:
    """The flow's REST calls and parts, on one stack, receiver and notifier port; ``ids`` are its subscriptions."""

    def __init__(self, s: Any, receiver: Receiver, base: str) -> None:
        self.s, self.receiver, self.base = s, receiver, base
        self.ids: dict[str, str] = {}

    async def rest(self, session: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with session.request(method, self.base + path, json=body) as resp:
            assert resp.content_type == "application/fhir+json"
            return resp.status, await resp.json(content_type=None)

    async def until_applied(self, part: list[Any]) -> list[dict[str, Any]]:
        transitions, _ = await collect_outputs(self.s, {e.entry_id for e in part}, timeout=420)
        assert {e.entry_id for e in part} <= {t["entry_id"] for t in transitions}, "the worker did not apply them"
        return transitions

    async def subscribe(self, session: aiohttp.ClientSession) -> None:
        """Subscriptions of each topic, version and content; each gets its handshake."""
        receiver = self.receiver
        subs = {
            # R5, full-resource over TLS, filtered to the patient and a category, with a header and heartbeats
            "a": r5("fact-superseded", receiver.url("a", tls=True), "full-resource", heartbeat=2,
                    headers={"X-Stam-Test": "yes"}, patient=f"Patient/{SMALL_PATIENT}", category="observation"),
            "b": r4b("encounter-ended", receiver.url("b", tls=False), "id-only", heartbeat=2, max_count=5),
            "c": r5("condition-resolved", receiver.url("c", tls=False), "empty", heartbeat=2),
            "d": r4b("memory-archived", receiver.url("d", tls=False), "id-only", patient="Patient/nobody"),
            "e": r4b("memory-archived", receiver.url("e", tls=True), "full-resource", max_count=10),
        }
        for hook, body in subs.items():
            status, created = await self.rest(session, "POST", "/Subscription", body)
            assert status == 201, created
            self.ids[hook] = created["id"]
        # full-resource to a plain-http endpoint is refused (patient data needs TLS)
        status, refused = await self.rest(session, "POST", "/Subscription",
                                          r5("fact-superseded", receiver.url("x", tls=False), "full-resource"))
        assert status == 422 and "https" in refused["issue"][0]["diagnostics"]
        await receiver.wait(lambda: all(receiver.of(h, "handshake") for h in subs), 60, "the handshakes")

    async def until_kept_for_events(self, session: aiohttp.ClientSession, want: dict[str, list[str]]) -> None:
        # Wait until a and e have given every event numbered so far up to $events: their status says which
        # ("events N-M are kept for $events") until a delivery succeeds. A failed heartbeat alone is not the gap
        # part 3 must recover, and a restart before the last try would deliver the events instead.
        deadline = time.monotonic() + 180
        for hook in ("a", "e"):
            while True:
                _, st = await self.rest(session, "GET", f"/Subscription/{self.ids[hook]}/$status")
                res = st["entry"][0]["resource"]
                kept = [int(m) for e in res.get("error", [])
                        for m in re.findall(r"events \d+-(\d+) are kept for \$events", e.get("text", ""))]
                since = int(res["eventsSinceSubscriptionStart"])  # R4B: an integer64 as a string
                if (res["status"] == "error" and kept and kept[-1] == since
                        and (hook != "a" or since == len(want["superseded-obs"]))):
                    break
                assert time.monotonic() < deadline, (hook, res.get("eventsSinceSubscriptionStart"),
                                                     res.get("error"), len(want["superseded-obs"]))
                await asyncio.sleep(0.5)

    async def parts_1_and_2(self, thirds: list[list[Any]]) -> None:
        receiver = self.receiver
        await receiver.start()
        async with aiohttp.ClientSession() as session:
            await self.subscribe(session)
            # part 1, receiver up
            await _publish(self.s, thirds[0])
            log1 = await self.until_applied(thirds[0])
            want = expected(log1)
            await receiver.wait(lambda: sum(len(r.numbers) for r in receiver.of("a")) >= len(want["superseded-obs"]),
                                180, "part 1's events at a")
            # part 2, the https receiver down: a's and e's notifications fail and are left for $events
            await receiver.stop()
            await _publish(self.s, thirds[1])
            log2 = await self.until_applied(thirds[1])
            await self.until_kept_for_events(session, expected(log2))

    async def recover(self, session: aiohttp.ClientSession, out: dict[str, Any]) -> None:
        """The gaps of a and e read back with ``$events``; every status, a's subscription read, d deleted."""
        ids = self.ids
        for hook in ("a", "e"):
            got = {n for r in self.receiver.of(hook) for n in r.numbers}
            missing = sorted(set(range(1, max(got) + 1)) - got)
            assert missing, f"{hook}: the receiver was down, some events must have been missed"
            status, bundle = await self.rest(session, "GET", f"/Subscription/{ids[hook]}/$events"
                                             f"?eventsSinceNumber={missing[0]}&eventsUntilNumber={missing[-1]}")
            assert status == 200
            out["events"][hook] = (missing, bundle)
        for hook in ids:
            _, out["status"][hook] = await self.rest(session, "GET", f"/Subscription/{ids[hook]}/$status")
        _, out["read"] = await self.rest(session, "GET", f"/Subscription/{ids['a']}")
        status, _ = await self.rest(session, "DELETE", f"/Subscription/{ids['d']}")
        assert status == 200
        status, _ = await self.rest(session, "GET", f"/Subscription/{ids['d']}")
        assert status == 404

    # the notifier restarted between part 2 and 3: subscriptions and numbers come back from Redis
    async def part_3(self, third: list[Any]) -> dict[str, Any]:
        receiver = self.receiver
        await receiver.start()
        await _publish(self.s, third)
        log3 = await self.until_applied(third)
        want = expected(log3)
        await receiver.wait(lambda: max([0] + [n for r in receiver.of("a") for n in r.numbers])
                            >= len(want["superseded-obs"]), 240, "part 3's last event at a")
        await receiver.wait(lambda: max([0] + [n for r in receiver.of("e") for n in r.numbers])
                            >= len(want["archived"]), 240, "part 3's last event at e")
        await asyncio.sleep(4.5)  # two heartbeat periods: the idle subscriptions beat
        async with aiohttp.ClientSession() as session:
            out: dict[str, Any] = {"log": log3, "events": {}, "status": {}}
            await self.recover(session, out)
        await receiver.stop()
        return out


def _check_every_notification(receiver: Receiver, versions: dict[str, str]) -> None:
    for r in receiver.got:  # every notification: FHIR JSON, a valid Bundle of its version
        assert r.content_type.split(";")[0] == "application/fhir+json", r.content_type
        assert check_notification(r.bundle, versions[r.hook]) == [], (r.hook, r.type)
    for hook, version in versions.items():
        got = receiver.of(hook)
        assert got and got[0].type == "handshake", hook  # the handshake before anything else
        assert all(r.type in ("handshake", "heartbeat", "event-notification") for r in got)
        last = 0
        for r in got:  # numbers only grow; a heartbeat counts every event so far
            if r.type == "event-notification":
                assert r.numbers[0] > last, (hook, r.numbers, last)
                last = r.numbers[-1]
            if r.type == "heartbeat":
                assert int(r.status["eventsSinceSubscriptionStart"]) >= last
        assert (r.bundle["type"] for r in got) and {r.bundle["type"] for r in got} == {
            "history" if version == "R4B" else "subscription-notification"}
    for hook in ("b", "c"):
        assert receiver.of(hook, "heartbeat"), f"{hook}: no heartbeat"
    assert all(r.headers.get("X-Stam-Test") == "yes" for r in receiver.of("a"))
    assert not receiver.of("d", "event-notification")  # filtered to another patient


def _check_every_event_once(receiver: Receiver, out: dict[str, Any], versions: dict[str, str], counts: dict[str, int],
                            want: dict[str, list[str]]) -> None:
    # consecutive numbers: what came, and what $events recovered, is every event once, 1..N, of the right transitions
    for hook in ("a", "e"):
        missing, bundle = out["events"][hook]
        assert check_notification(bundle, versions[hook]) == []
        recovered = [int(e["eventNumber"]) for e in bundle["entry"][0]["resource"]["notificationEvent"]]
        assert bundle["entry"][0]["resource"]["type"] == "query-event"
        assert recovered == missing
        got = [n for r in receiver.of(hook, "event-notification") for n in r.numbers]
        assert len(got) == len(set(got)) and sorted(set(got) | set(recovered)) == list(range(1, counts[hook] + 1))
    from stam.fhir.resources import derived_id
    provenances = {e["resource"]["id"] for r in receiver.of("a", "event-notification") for e in r.bundle["entry"]
                   if e.get("resource", {}).get("resourceType") == "Provenance"}
    provenances |= {e["resource"]["id"] for e in out["events"]["a"][1]["entry"]
                    if e.get("resource", {}).get("resourceType") == "Provenance"}
    assert provenances == {derived_id("provenance", t) for t in want["superseded-obs"]}
    for hook in ("b", "c"):  # down too in part 2: their gaps are recoverable the same way
        got_b_c = {n for r in receiver.of(hook, "event-notification") for n in r.numbers}
        assert got_b_c <= set(range(1, counts[hook] + 1))
    assert all("resource" not in e for r in receiver.of("b", "event-notification") for e in r.bundle["entry"][1:])
    assert all(len(r.bundle["entry"]) == 1 and "focus" not in r.status["notificationEvent"][0]
               for r in receiver.of("c", "event-notification"))


def _check_status_metrics_and_logs(s: Any, out: dict[str, Any], counts: dict[str, int], metrics: str,
                                   metrics1: str) -> None:
    for hook, st in out["status"].items():
        if hook == "d":
            continue
        res = st["entry"][0]["resource"]
        assert int(res["eventsSinceSubscriptionStart"]) == counts[hook], (hook, res)
        assert res["status"] == "active", (hook, res)
    assert out["read"]["parameter"] == [{"name": "X-Stam-Test", "value": "[redacted]"}]

    assert 'stam_fhir_notifications_total{outcome="sent",type="event-notification"}' in metrics
    assert 'stam_fhir_notifications_total{outcome="dropped",type="event-notification"}' in metrics1  # part 2
    assert SMALL_PATIENT not in metrics + metrics1
    for log in ("fhir-1.log", "fhir-2.log"):
        text = (s.home / log).read_text(errors="replace")
        assert "INFO" in text and SMALL_PATIENT not in text


def test_subscribers_get_handshakes_heartbeats_numbered_events_and_recover_a_gap(
        stack_settings: Any, worker: Any, small_bundle: Any, tmp_path: Any) -> None:
    s = stack_settings
    entries = small_bundle.entries
    thirds = [entries[: len(entries) // 3], entries[len(entries) // 3: 2 * len(entries) // 3],
              entries[2 * len(entries) // 3:]]
    receiver = Receiver(tmp_path)
    port, metrics_port = free_port(), free_port()
    flow = _Flow(s, receiver, f"http://127.0.0.1:{port}/fhir")

    with notifier(s, port, metrics_port, receiver.cert, "fhir-1.log"):
        asyncio.run(flow.parts_1_and_2(thirds))
        metrics1 = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    with notifier(s, port, metrics_port, receiver.cert, "fhir-2.log"):  # a restart: Redis keeps the subscriptions
        out = asyncio.run(flow.part_3(thirds[2]))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()

    want = expected(out["log"])
    versions = {"a": "R5", "b": "R4B", "c": "R5", "d": "R4B", "e": "R4B"}
    counts = {"a": len(want["superseded-obs"]), "b": len(want["encounter-ended"]),
              "c": len(want["condition-resolved"]), "d": 0, "e": len(want["archived"])}
    assert min(counts["a"], counts["b"], counts["c"]) >= 3, counts  # the patient has each kind, three times at least
    _check_every_notification(receiver, versions)
    _check_every_event_once(receiver, out, versions, counts, want)
    _check_status_metrics_and_logs(s, out, counts, metrics, metrics1)


def test_nothing_is_sent_for_a_patient_erased_while_their_events_waited(
        stack_settings: Any, worker: Any, small_bundle: Any, tmp_path: Any) -> None:
    """The subscriber refuses the handshake, so events are numbered and kept but not sent; the patient's data key is
    then shredded (what ``stam erase`` does to every copy on every topic); when the subscriber takes the handshake,
    none of those events is sent, and ``$events`` cannot read them back. Runs last: the patient stays erased."""
    from datetime import timedelta

    from stam.crypto import sealer_for

    s = stack_settings
    later = [e.model_copy(update={"entry_id": f"{e.entry_id}:later", "effective_at": e.effective_at + timedelta(days=400),
                                  "recorded_at": (e.recorded_at or e.effective_at) + timedelta(days=400)})
             for e in small_bundle.entries if e.resource_type == "Observation" and e.effective_at][-12:]
    receiver = Receiver(tmp_path)
    receiver.answer = 503
    port = free_port()
    base = f"http://127.0.0.1:{port}/fhir"

    async def rest(session: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
        async with session.request(method, base + path, json=body) as resp:
            return await resp.json(content_type=None)

    async def flow() -> tuple[Any, Any]:
        await receiver.start()
        async with aiohttp.ClientSession() as session:
            sub = await rest(session, "POST", "/Subscription", r5("fact-superseded", receiver.url("f", tls=False),
                                                                  "id-only", patient=f"Patient/{SMALL_PATIENT}"))
            await _publish(s, later)
            await collect_outputs(s, {e.entry_id for e in later}, timeout=300)
            deadline = time.monotonic() + 120
            while True:
                st = (await rest(session, "GET", f"/Subscription/{sub['id']}/$status"))["entry"][0]["resource"]
                if st["eventsSinceSubscriptionStart"] >= 3 and st["status"] == "error":
                    break
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.5)
            assert not receiver.of("f", "event-notification")  # held behind the refused handshake
            assert sealer_for(s).keys.shred(SMALL_PATIENT)
            await asyncio.sleep(6)  # the notifier's key cache (5 s) forgets the key
            receiver.answer = 200
            await receiver.wait(lambda: [r for r in receiver.of("f", "handshake")], 60, "the handshake taken")
            await asyncio.sleep(5)
            events = await rest(session, "GET", f"/Subscription/{sub['id']}/$events")
            status = await rest(session, "GET", f"/Subscription/{sub['id']}/$status")
        await receiver.stop()
        return events, status

    with notifier(s, port, free_port(), receiver.cert, "fhir-3.log"):
        events, status = asyncio.run(flow())
    assert not receiver.of("f", "event-notification")
    assert "notificationEvent" not in events["entry"][0]["resource"] and len(events["entry"]) == 1
    assert check_notification(events, "R5") == []
    assert status["entry"][0]["resource"]["eventsSinceSubscriptionStart"] >= 3  # numbered, never sent
