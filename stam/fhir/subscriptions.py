"""A Subscription as a subscriber posts it, R4B (Subscriptions R5 Backport IG) or R5, read into one shape.

R5: ``topic``, ``filterBy`` (``filterParameter`` ``patient`` or ``category``, comparator ``eq`` or none),
``channelType`` ``rest-hook``, ``endpoint``, ``parameter`` (HTTP headers), ``heartbeatPeriod``, ``timeout``,
``content`` and ``maxCount``.

R4B (backport): ``criteria`` is the topic's canonical URL, its ``_criteria`` extensions
``backport-filter-criteria`` hold the filters as a query (``MedicationRequest?patient=Patient/abc&category=
medication``), ``channel.type`` ``rest-hook``, ``channel.endpoint``, ``channel.header`` (``Name: value``),
``channel.payload`` ``application/fhir+json`` with its ``backport-payload-content`` extension, and the channel's
``backport-heartbeat-period``, ``backport-timeout`` and ``backport-max-count`` extensions.

``full-resource`` sends patient data, so its endpoint must be ``https``; ``STAM_FHIR_ALLOW_PLAIN_LOOPBACK`` lets a
loopback ``http`` endpoint have it (tests, a one-machine demo), never another host.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import ValidationError

from schemas import Category
from stam.errors import SubscriptionRefused
from stam.fhir.resources import CATEGORY_SYSTEM, Version
from stam.fhir.topics import topic_for_url

BACKPORT = "http://hl7.org/fhir/uv/subscriptions-backport/StructureDefinition/"
CHANNEL_TYPE_SYSTEM = "http://terminology.hl7.org/CodeSystem/subscription-channel-type"
CONTENTS = ("empty", "id-only", "full-resource")
STATUSES = ("requested", "active", "error", "off", "entered-in-error")
FHIR_JSON = "application/fhir+json"
MAX_COUNT = 100


@dataclass
class Subscription:
    id: str
    version: Version
    topic: str
    endpoint: str
    content: str = "id-only"
    headers: list[tuple[str, str]] = field(default_factory=list)
    heartbeat_s: int | None = None
    timeout_s: float | None = None
    max_count: int = 1
    patient: str | None = None
    category: str | None = None
    status: str = "requested"
    reason: str = ""
    end: str | None = None
    created: str = ""
    error: str = ""
    handshaken: bool = False
    """The handshake was taken: events may be sent."""
    resource: dict[str, Any] = field(default_factory=dict)
    """The resource as posted (its id set), returned on read with the current status."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Subscription:
        data = dict(data)
        data["headers"] = [tuple(h) for h in data.get("headers") or ()]
        return cls(**data)

    def as_resource(self) -> dict[str, Any]:
        """The Subscription as read back: its current status, header values redacted."""
        out = dict(self.resource, id=self.id, status=self.status)
        if self.version == "R5":
            if out.get("parameter"):
                out["parameter"] = [dict(p, value="[redacted]") for p in out["parameter"]]
        else:
            channel = dict(out.get("channel") or {})
            if channel.get("header"):
                channel["header"] = [f"{h.split(':', 1)[0]}: [redacted]" for h in channel["header"]]
            out["channel"] = channel
            if self.error:
                out["error"] = self.error
        return out


def version_of(body: dict[str, Any]) -> Version:
    """R4B when the Subscription has R4's ``criteria``/``channel``, R5 when it has ``topic``/``channelType``."""
    if "criteria" in body or "channel" in body:
        return "R4B"
    return "R5"


def _ext(items: list[dict[str, Any]] | None, name: str) -> Any:
    for e in items or ():
        if e.get("url") == BACKPORT + name:
            return next((v for k, v in e.items() if k.startswith("value")), None)
    return None


def _filters(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in ("patient", "category"):
            raise SubscriptionRefused(f"filter {name!r} is not one the topic can filter by (patient, category)")
        if name in out and out[name] != value:
            raise SubscriptionRefused(f"two values for filter {name!r}")
        if name == "patient":
            value = value.removeprefix("Patient/")
            if not value or "/" in value:
                raise SubscriptionRefused("filter patient: Patient/<id> expected")
        else:
            value = value.removeprefix(CATEGORY_SYSTEM + "|")
            if value not in {c.value for c in Category}:
                raise SubscriptionRefused(f"filter category: {value!r} is not a code of {CATEGORY_SYSTEM}")
        out[name] = value
    return out


def _loopback(host: str | None) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def parse(body: dict[str, Any], sub_id: str, *, allow_plain_loopback: bool, now: str) -> Subscription:
    """The subscriber's Subscription checked and read; :class:`SubscriptionRefused` says what is wrong."""
    if body.get("resourceType") != "Subscription":
        raise SubscriptionRefused("a Subscription resource is expected")
    version = version_of(body)
    _validate_model(body, version)
    if version == "R5":
        topic_url = body.get("topic") or ""
        ctype = (body.get("channelType") or {})
        if ctype.get("code") != "rest-hook":
            raise SubscriptionRefused("channelType: only rest-hook is supported")
        endpoint = body.get("endpoint") or ""
        headers = [(p.get("name") or "", p.get("value") or "") for p in body.get("parameter") or ()]
        content = body.get("content") or "empty"
        heartbeat, timeout, max_count = body.get("heartbeatPeriod"), body.get("timeout"), body.get("maxCount")
        pairs = []
        for f in body.get("filterBy") or ():
            if f.get("comparator") not in (None, "eq") or f.get("modifier"):
                raise SubscriptionRefused(f"filterBy {f.get('filterParameter')}: only equality is supported")
            pairs.append((f.get("filterParameter") or "", f.get("value") or ""))
        if body.get("contentType") not in (None, FHIR_JSON):
            raise SubscriptionRefused(f"contentType: only {FHIR_JSON} is supported")
    else:
        topic_url = body.get("criteria") or ""
        channel = body.get("channel") or {}
        if channel.get("type") != "rest-hook":
            raise SubscriptionRefused("channel.type: only rest-hook is supported")
        endpoint = channel.get("endpoint") or ""
        headers = []
        for h in channel.get("header") or ():
            name, sep, value = h.partition(":")
            if not sep:
                raise SubscriptionRefused(f"channel.header {name!r}: 'Name: value' expected")
            headers.append((name.strip(), value.strip()))
        if channel.get("payload") not in (None, FHIR_JSON):
            raise SubscriptionRefused(f"channel.payload: only {FHIR_JSON} is supported")
        content = _ext((channel.get("_payload") or {}).get("extension"), "backport-payload-content") or "empty"
        ext = channel.get("extension")
        heartbeat = _ext(ext, "backport-heartbeat-period")
        timeout = _ext(ext, "backport-timeout")
        max_count = _ext(ext, "backport-max-count")
        pairs = []
        for crit in (e.get("valueString") or "" for e in (body.get("_criteria") or {}).get("extension") or ()
                     if e.get("url") == BACKPORT + "backport-filter-criteria"):
            pairs.extend(parse_qsl(crit.partition("?")[2], keep_blank_values=True))
    topic = topic_for_url(topic_url)
    if topic is None:
        raise SubscriptionRefused(f"unknown topic {topic_url!r} (GET /fhir/SubscriptionTopic lists them)")
    if content not in CONTENTS:
        raise SubscriptionRefused(f"content {content!r}: one of {', '.join(CONTENTS)}")
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise SubscriptionRefused("endpoint: an http(s) URL is expected")
    if content == "full-resource" and url.scheme != "https" and not (allow_plain_loopback and _loopback(url.hostname)):
        raise SubscriptionRefused("content full-resource sends patient data: its endpoint must be https (TLS)")
    for name, _ in headers:
        if not name or any(c in name for c in " \r\n:") or name.lower() in ("content-type", "content-length", "host"):
            raise SubscriptionRefused(f"header {name!r} cannot be set by a subscription")
    if any("\r" in v or "\n" in v for _, v in headers):
        raise SubscriptionRefused("a header value with a line break")
    filters = _filters(pairs)
    status = body.get("status") or "requested"
    if status not in ("requested", "active"):
        raise SubscriptionRefused(f"status {status!r}: a new subscription is requested (or active)")
    return Subscription(
        id=sub_id, version=version, topic=topic.id, endpoint=endpoint, content=content, headers=headers,
        heartbeat_s=int(heartbeat) if heartbeat else None, timeout_s=float(timeout) if timeout else None,
        max_count=max(1, min(int(max_count or 1), MAX_COUNT)), patient=filters.get("patient"),
        category=filters.get("category"), status="requested", reason=body.get("reason") or "", end=body.get("end"),
        created=now, resource=dict(body, id=sub_id))


def _validate_model(body: dict[str, Any], version: Version) -> None:
    if version == "R5":
        # deferred: fhir.resources' models are slow to import
        from fhir.resources.subscription import Subscription as Model
    else:
        # deferred: fhir.resources' models are slow to import
        from fhir.resources.R4B.subscription import Subscription as Model  # type: ignore[assignment]
    try:
        Model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise SubscriptionRefused(f"not a valid {version} Subscription: {where}: {first['msg']}") from None
