"""Checks every notification Bundle STAM produces: the ``fhir.resources`` model classes (R4B or R5) parse it and each
resource in it, and the rules those classes do not enforce are evaluated as FHIRPath (``fhirpathpy``): the IG's and
the core Bundle's invariants, and the required code bindings.

Used by the tests and by the evidence script (``benchmarks/fhir_notifications.py``); ``fhirpathpy`` is a dev
dependency, imported here only.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from stam.fhir.resources import Version

NOTIFICATION_TYPES = "('handshake' | 'heartbeat' | 'event-notification' | 'query-status' | 'query-event')"
SUB_STATUS = "('requested' | 'active' | 'error' | 'off' | 'entered-in-error')"

BUNDLE_RULES: dict[Version, list[tuple[str, str]]] = {
    "R5": [
        ("bdl-13", "type = 'subscription-notification' implies entry.first().resource.is(SubscriptionStatus)"),
        ("type", "type = 'subscription-notification'"),
        ("bdl-5", "entry.all(resource.exists() or request.exists() or response.exists())"),
        ("bdl-7", "entry.where(fullUrl.exists()).select(fullUrl & iif(resource.meta.versionId.exists(), "
                  "resource.meta.versionId, '')).isDistinct()"),
    ],
    "R4B": [
        ("backport-notification-bundle-1", "entry.first().resource.is(SubscriptionStatus)"),
        ("type", "type = 'history'"),
        ("bdl-3", "entry.all(request.exists())"),
        ("bdl-4", "entry.all(response.exists())"),
        ("bdl-7", "type = 'history' or entry.where(fullUrl.exists()).select(fullUrl).isDistinct()"),
    ],
}
COMMON_RULES = [
    ("bdl-8", "entry.fullUrl.all(contains('/_history/').not())"),
    ("status-first-only", "entry.skip(1).resource.where($this is SubscriptionStatus).empty()"),
]
STATUS_RULES = [
    ("type-binding", f"type in {NOTIFICATION_TYPES}"),
    ("status-binding", f"status.empty() or status in {SUB_STATUS}"),
    ("sst-events", "type = 'event-notification' implies notificationEvent.exists()"),
    ("sst-no-events", "(type = 'handshake' or type = 'heartbeat' or type = 'query-status') implies "
                      "notificationEvent.empty()"),
    ("events-since", "notificationEvent.all(eventNumber.toInteger() <= %since)"),
    ("subscription", "subscription.reference.exists()"),
]
RESOURCE_RULES: dict[str, list[tuple[str, str]]] = {
    "MedicationRequest": [
        ("status-binding", "status in ('active' | 'on-hold' | 'ended' | 'stopped' | 'completed' | 'cancelled' | "
                           "'entered-in-error' | 'draft' | 'unknown')"),
        ("intent-binding", "intent in ('proposal' | 'plan' | 'order' | 'original-order' | 'reflex-order' | "
                           "'filler-order' | 'instance-order' | 'option')"),
        ("stopped-has-reason", "status = 'stopped' implies statusReason.exists()"),
    ],
    "Condition": [
        ("clinical-binding", "clinicalStatus.coding.where(system = 'http://terminology.hl7.org/CodeSystem/"
                             "condition-clinical').code.all($this in ('active' | 'recurrence' | 'relapse' | "
                             "'inactive' | 'remission' | 'resolved' | 'unknown'))"),
        ("con-4", "abatementDateTime.exists() implies clinicalStatus.coding.where(system = 'http://terminology.hl7."
                  "org/CodeSystem/condition-clinical' and code in ('inactive' | 'resolved' | 'remission')).exists()"),
        ("con-5", "verificationStatus.coding.where(code = 'entered-in-error').exists() implies "
                  "clinicalStatus.empty()"),
    ],
    "Observation": [
        ("status-binding", "status in ('registered' | 'preliminary' | 'final' | 'amended' | 'corrected' | "
                           "'cancelled' | 'entered-in-error' | 'unknown' | 'cannot-be-obtained')"),
    ],
    "Provenance": [
        ("role-binding", "entity.role.all($this in ('derivation' | 'revision' | 'quotation' | 'source' | "
                         "'instantiates' | 'removal'))"),
        ("targets", "target.exists() and agent.exists()"),
        ("source-entity", "entity.where(role = 'source').exists()"),
    ],
}
ENCOUNTER_STATUS: dict[Version, str] = {
    "R4B": "('planned' | 'arrived' | 'triaged' | 'in-progress' | 'onleave' | 'finished' | 'cancelled' | "
           "'entered-in-error' | 'unknown')",
    "R5": "('planned' | 'in-progress' | 'on-hold' | 'discharged' | 'completed' | 'cancelled' | 'discontinued' | "
          "'entered-in-error' | 'unknown')",
}


def _models(version: Version) -> tuple[Any, Any]:
    if version == "R5":
        # deferred: fhir.resources' models are slow to import
        from fhir.resources import get_fhir_model_class
        from fhir.resources.bundle import Bundle
    else:
        # deferred: fhir.resources' models are slow to import
        from fhir.resources.R4B import get_fhir_model_class
        from fhir.resources.R4B.bundle import Bundle  # type: ignore[assignment]
    return Bundle, get_fhir_model_class


def check_notification(bundle: dict[str, Any], version: Version) -> list[str]:
    """What is wrong with a notification Bundle of ``version`` (empty: nothing)."""
    # deferred: optional fhirpathpy (stam[dev]), not installed everywhere
    import fhirpathpy
    from fhirpathpy.models import models

    model = models["r5" if version == "R5" else "r4"]
    problems: list[str] = []
    bundle_cls, model_class = _models(version)
    try:
        bundle_cls.model_validate(bundle)
    except ValidationError as exc:
        problems.append(f"{version} Bundle: {str(exc)[:400]}")
    for entry in bundle.get("entry") or ():
        if "resource" in entry:
            r = entry["resource"]
            try:
                model_class(r["resourceType"]).model_validate(r)
            except ValidationError as exc:
                problems.append(f"{version} {r['resourceType']}: {str(exc)[:400]}")

    def rule(resource: Any, name: str, expr: str, **env: Any) -> None:
        try:
            got = fhirpathpy.evaluate(resource, expr, context=env or None, model=model)
        except Exception as exc:  # an expression this library cannot evaluate is a failed check, said
            problems.append(f"{name}: {expr}: {type(exc).__name__}: {exc}")
            return
        if got != [True]:
            what = resource.get("resourceType", "?")
            problems.append(f"{what} {name} does not hold: {expr} -> {got}")

    for name, expr in BUNDLE_RULES[version] + COMMON_RULES:
        rule(bundle, name, expr)
    entries = bundle.get("entry") or []
    status = entries[0].get("resource", {}) if entries else {}
    if status.get("resourceType") == "SubscriptionStatus":
        since = int(status.get("eventsSinceSubscriptionStart") or 0)
        for name, expr in STATUS_RULES:
            rule(status, name, expr, since=since)
        numbers = [int(e["eventNumber"]) for e in status.get("notificationEvent") or ()]
        if numbers != sorted(set(numbers)):
            problems.append(f"event numbers not increasing: {numbers}")
        urls = {e.get("fullUrl") for e in entries}
        for ev in status.get("notificationEvent") or ():
            for ref in [ev.get("focus")] + list(ev.get("additionalContext") or ()):
                if ref and ref.get("reference") not in urls:
                    problems.append(f"event {ev['eventNumber']}: {ref.get('reference')} is not an entry")
    for entry in entries[1:]:
        r = entry.get("resource")
        if not r:
            continue
        for name, expr in RESOURCE_RULES.get(r["resourceType"], []):
            rule(r, name, expr)
        if r["resourceType"] == "Encounter":
            rule(r, "status-binding", f"status in {ENCOUNTER_STATUS[version]}")
            end = "period.end" if version == "R4B" else "actualPeriod.end"
            done = "finished" if version == "R4B" else "completed"
            rule(r, "ended-has-end", f"status = '{done}' implies {end}.exists()")
    return problems
