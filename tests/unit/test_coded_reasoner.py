"""The coded reasoner's update rules, one function at a time, on FHIR R4 resources built here."""

from __future__ import annotations

from typing import Any

from schemas import AtomicMemory, Channel, ImpactCandidate, Reason, Store, StoredMemory
from stam.reasoning.base import Candidate
from stam.reasoning.coded import CodedReasoner
from stam.sources.fhir_r4 import resource_to_entry

R = CodedReasoner()
RXNORM = "http://www.nlm.nih.gov/research/umls/rxnorm"


def med(rid: str, when: str, status: str = "active", code: str = "314076", dose: float = 1) -> dict[str, Any]:
    return {"resourceType": "MedicationRequest", "id": rid, "status": status, "intent": "order",
            "medicationCodeableConcept": {"coding": [{"system": RXNORM, "code": code,
                                                      "display": "lisinopril 10 MG Oral Tablet"}]},
            "authoredOn": when,
            "dosageInstruction": [{"doseAndRate": [{"doseQuantity": {"value": dose}}]}]}


def lab(rid: str, when: str, value: float) -> dict[str, Any]:
    return {"resourceType": "Observation", "id": rid, "status": "final",
            "code": {"coding": [{"system": "http://loinc.org", "code": "4548-4", "display": "HbA1c"}]},
            "effectiveDateTime": when, "valueQuantity": {"value": value, "unit": "%"}}


def memory_of(resource: dict[str, Any]) -> tuple[Any, AtomicMemory]:
    entry = resource_to_entry(resource, "patient-1")
    assert entry is not None
    return entry, R.extract(entry)[0]


def cand(m: AtomicMemory, store: Store = Store.ACTIVE, channel: Channel = Channel.CODE) -> Candidate:
    return Candidate(StoredMemory(memory=m, store=store),
                     ImpactCandidate(memory_id=m.memory_id, store=store, channels=(channel,), score=1.0))


def test_newer_lab_value_supersedes_older() -> None:
    _, old = memory_of(lab("a", "2020-01-01", 7.1))
    entry, new = memory_of(lab("b", "2020-06-01", 6.4))
    d = R.update(entry, new, [cand(old)])
    assert d.placement is Store.ACTIVE
    assert [(a.memory_id, a.reason, a.successor_id) for a in d.archive] == [
        (old.memory_id, Reason.SUPERSEDED, new.memory_id)]


def test_late_older_value_goes_straight_to_history_linked_to_its_follower() -> None:
    _, current = memory_of(lab("b", "2020-06-01", 6.4))
    entry, late = memory_of(lab("a", "2020-01-01", 7.1))
    d = R.update(entry, late, [cand(current)])
    assert d.placement is Store.HISTORY and d.placement_reason is Reason.PRIOR_STATE
    assert d.successor_id == current.memory_id and d.archive == ()


def test_dose_change_of_same_drug_supersedes_old_order() -> None:
    _, old = memory_of(med("o1", "2020-01-01", dose=1))
    entry, new = memory_of(med("o2", "2020-02-01", dose=2))
    d = R.update(entry, new, [cand(old)])
    assert d.placement is Store.ACTIVE
    assert d.archive[0].memory_id == old.memory_id and d.archive[0].reason is Reason.SUPERSEDED


def test_stopped_order_goes_to_history_and_stops_the_active_one() -> None:
    _, active = memory_of(med("o1", "2020-01-01"))
    entry, stopped = memory_of(med("o2", "2020-03-01", status="stopped"))
    d = R.update(entry, stopped, [cand(active)])
    assert d.placement is Store.HISTORY and d.placement_reason is Reason.STOPPED
    assert [(a.memory_id, a.reason) for a in d.archive] == [(active.memory_id, Reason.STOPPED)]


def test_stop_of_an_older_order_leaves_a_newer_active_order_alone() -> None:
    _, newer = memory_of(med("o2", "2021-01-01"))
    entry, stopped = memory_of(med("o1", "2020-01-01", status="stopped"))
    d = R.update(entry, stopped, [cand(newer)])
    assert d.placement is Store.HISTORY and d.archive == ()


def test_new_version_of_same_resource_entered_in_error_retracts_it() -> None:
    _, original = memory_of(med("o1", "2020-01-01"))
    entry, retraction = memory_of(med("o1", "2020-01-01", status="entered-in-error"))
    d = R.update(entry, retraction, [cand(original)])
    assert d.placement is Store.HISTORY and d.placement_reason is Reason.ENTERED_IN_ERROR
    assert [(a.memory_id, a.reason) for a in d.archive] == [(original.memory_id, Reason.ENTERED_IN_ERROR)]


def test_semantically_similar_memory_of_another_concept_is_kept() -> None:
    _, other = memory_of(med("x", "2020-01-01", code="999"))
    entry, new = memory_of(med("o2", "2020-02-01"))
    d = R.update(entry, new, [cand(other, channel=Channel.SEMANTIC)])
    assert d.placement is Store.ACTIVE and d.archive == ()


def test_condition_with_abatement_is_resolved() -> None:
    cond = {"resourceType": "Condition", "id": "c1",
            "clinicalStatus": {"coding": [{"code": "resolved"}]},
            "code": {"coding": [{"system": "http://snomed.info/sct", "code": "10509002",
                                 "display": "Acute bronchitis (disorder)"}]},
            "onsetDateTime": "2020-01-01", "abatementDateTime": "2020-01-20"}
    entry, m = memory_of(cond)
    assert m.effective_end is not None
    d = R.update(entry, m, [])
    assert d.placement is Store.HISTORY and d.placement_reason is Reason.RESOLVED


def test_memory_ids_are_patient_scoped() -> None:
    from stam.ids import memory_id

    assert memory_id("p1", "e1", 0) != memory_id("p2", "e1", 0)
    assert memory_id("p1", "e1", 0) == memory_id("p1", "e1", 0)


def test_a_new_version_of_a_resource_replaces_it_even_when_its_clinical_time_is_earlier() -> None:
    """An update of the same resource (an ADT A08 correcting a visit's admit time, a corrected result) is a newer
    version of it, not a late arrival: it replaces the ACTIVE version whatever the times."""
    _, current = memory_of(lab("a", "2020-06-01", 6.4))
    entry, corrected = memory_of(lab("a", "2020-05-30", 6.1))
    d = R.update(entry, corrected, [cand(current)])
    assert d.placement is Store.ACTIVE
    assert [(a.memory_id, a.reason, a.successor_id) for a in d.archive] == [
        (current.memory_id, Reason.SUPERSEDED, corrected.memory_id)]
