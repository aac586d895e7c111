"""Notification Bundles (handshake, heartbeat, event-notification, query-event) and the ``$status`` Bundle.

R4B (Subscriptions R5 Backport IG, ``backport-subscription-notification``): ``type`` ``history``, the
SubscriptionStatus first (``GET .../Subscription/<id>/$status``, ``200``), each resource an entry with a request and
a response. R5: ``type`` ``subscription-notification``, the SubscriptionStatus first.

Content: ``empty`` (the SubscriptionStatus only, event numbers and times), ``id-only`` (the focus and context as
references and entries without a resource), ``full-resource`` (the resources). Pure functions of their inputs.
"""

from __future__ import annotations

import uuid
from typing import Any

from schemas import StoredMemory, TransitionEvent
from stam.fhir.resources import NAMESPACE, Version, event_resources
from stam.fhir.subscriptions import Subscription
from stam.fhir.topics import TOPICS

NOTIFICATION_TYPES = ("handshake", "heartbeat", "event-notification", "query-status", "query-event")


def _count(n: int, version: Version) -> Any:
    return n if version == "R5" else str(n)  # R5 integer64; R4B string


def _full_url(base: str, resource: dict[str, Any]) -> str:
    return f"{base}/{resource['resourceType']}/{resource['id']}"


def _event(record: dict[str, Any], version: Version) -> tuple[TransitionEvent, Any]:
    transition = TransitionEvent.model_validate(record["transition"])
    memories = {k: StoredMemory.model_validate(v) for k, v in record["memories"].items()}
    return transition, event_resources(transition, memories, version)


def status_resource(sub: Subscription, kind: str, events_since: int, events: list[dict[str, Any]], base: str,
                    *, content: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The SubscriptionStatus and the resources the notification carries (``content`` overrides the
    subscription's, as ``$events`` may)."""
    content = content or sub.content
    out: dict[str, Any] = {
        "resourceType": "SubscriptionStatus", "id": str(uuid.uuid4()), "status": sub.status, "type": kind,
        "eventsSinceSubscriptionStart": _count(events_since, sub.version),
        "subscription": {"reference": f"{base}/Subscription/{sub.id}"},
        "topic": TOPICS[sub.topic].url,
    }
    carried: list[dict[str, Any]] = []
    notified = []
    for record in events:
        ev: dict[str, Any] = {"eventNumber": _count(record["n"], sub.version), "timestamp": record["ts"]}
        if content != "empty":
            _, res = _event(record, sub.version)
            ev["focus"] = {"reference": _full_url(base, res.focus)}
            ev["additionalContext"] = [{"reference": _full_url(base, r)} for r in res.context]
            carried.extend(res.all)
        notified.append(ev)
    if notified:
        out["notificationEvent"] = notified
    if sub.status == "error" and sub.error:
        out["error"] = [{"text": sub.error}]
    return out, carried


def notification(sub: Subscription, kind: str, events_since: int, events: list[dict[str, Any]], base: str, now: str,
                 *, content: str | None = None) -> dict[str, Any]:
    """A notification Bundle of ``kind`` (handshake, heartbeat, event-notification, query-event)."""
    content = content or sub.content
    status, carried = status_resource(sub, kind, events_since, events, base, content=content)
    first: dict[str, Any] = {"fullUrl": f"urn:uuid:{status['id']}", "resource": status}
    if sub.version == "R4B":
        first["request"] = {"method": "GET", "url": f"{base}/Subscription/{sub.id}/$status"}
        first["response"] = {"status": "200"}
    entries = [first]
    seen: dict[str, int] = {}
    for r in carried:
        url = _full_url(base, r)
        created = r["resourceType"] == "Provenance"
        entry: dict[str, Any] = {"fullUrl": url}
        if content == "full-resource":
            entry["resource"] = r
        entry["request"] = ({"method": "POST", "url": "Provenance"} if created
                            else {"method": "PUT", "url": f"{r['resourceType']}/{r['id']}"})
        entry["response"] = {"status": "201" if created else "200"}
        if url in seen:  # the same resource in two events of one notification: its latest state, once
            entries[seen[url]] = entry
        else:
            seen[url] = len(entries)
            entries.append(entry)
    return {"resourceType": "Bundle", "id": str(uuid.uuid4()), "meta": {"lastUpdated": now},
            "type": "history" if sub.version == "R4B" else "subscription-notification", "timestamp": now,
            "entry": entries}


def status_bundle(sub: Subscription, events_since: int, base: str, now: str) -> dict[str, Any]:
    """``GET /fhir/Subscription/<id>/$status``: a searchset of one SubscriptionStatus (``query-status``)."""
    status, _ = status_resource(sub, "query-status", events_since, [], base)
    return {"resourceType": "Bundle", "id": str(uuid.uuid5(NAMESPACE, f"status|{sub.id}|{now}")), "type": "searchset",
            "timestamp": now, "total": 1,
            "entry": [{"fullUrl": f"urn:uuid:{status['id']}", "resource": status, "search": {"mode": "match"}}]}


def outcome(code: str, text: str, severity: str = "error") -> dict[str, Any]:
    return {"resourceType": "OperationOutcome",
            "issue": [{"severity": severity, "code": code, "diagnostics": text}]}
