"""A FHIR resource that arrives again with the same id and new content is a state change (real stores)."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import Category, Reason, Store, TransitionKind
from stam.sources.fhir_r4 import resource_to_entry
from stam.stages import process_entry

pytestmark = pytest.mark.integration
RXNORM = "http://www.nlm.nih.gov/research/umls/rxnorm"


def _apply(deps: Any, resource: dict[str, Any]) -> list[Any]:
    entry = resource_to_entry(resource, "version-patient")
    assert entry is not None
    return process_entry(entry, deps).transitions


def _order(status: str, version: str) -> dict[str, Any]:
    return {"resourceType": "MedicationRequest", "id": "mr1", "meta": {"versionId": version},
            "status": status, "intent": "order", "authoredOn": "2021-01-01",
            "medicationCodeableConcept": {"coding": [{"system": RXNORM, "code": "860975",
                                                      "display": "metformin 500 MG Oral Tablet"}]}}


def _condition(status: str, version: str, verification: str = "confirmed") -> dict[str, Any]:
    return {"resourceType": "Condition", "id": "c1", "meta": {"versionId": version},
            "clinicalStatus": {"coding": [{"code": status}]},
            "verificationStatus": {"coding": [{"code": verification}]},
            "code": {"coding": [{"system": "http://snomed.info/sct", "code": "44054006",
                                 "display": "Diabetes mellitus type 2"}]}, "onsetDateTime": "2020-06-01"}


def test_order_active_then_stopped(deps: Any) -> None:
    _apply(deps, _order("active", "1"))
    out = _apply(deps, _order("stopped", "2"))
    state = deps.states.load("version-patient")
    v1, v2 = sorted(state.by_source("MedicationRequest/mr1"), key=lambda s: s.memory.status == "stopped")
    assert (v1.store, v1.reason, v1.successor_id) == (Store.HISTORY, Reason.STOPPED, v2.memory.memory_id)
    assert (v2.store, v2.reason) == (Store.HISTORY, Reason.STOPPED)
    assert [t.kind for t in out] == [TransitionKind.ADDED, TransitionKind.ARCHIVED]
    assert list(state.in_store(Store.ACTIVE)) == []


def test_condition_active_then_resolved_then_entered_in_error(deps: Any) -> None:
    _apply(deps, _condition("active", "1"))
    _apply(deps, _condition("resolved", "2"))
    state = deps.states.load("version-patient")
    assert [s.store for s in state.by_source("Condition/c1")] == [Store.HISTORY, Store.HISTORY]
    assert {s.reason for s in state.by_source("Condition/c1")} == {Reason.RESOLVED}

    v3, v4 = _condition("active", "3"), _condition("active", "4", verification="entered-in-error")
    _apply(deps, v3)  # recurrence: the resource is active again
    assert [s.store for s in deps.states.load("version-patient").by_source("Condition/c1")][-1] is Store.ACTIVE
    _apply(deps, v4)  # ... and then retracted
    state = deps.states.load("version-patient")
    ids = {resource_to_entry(v, "version-patient").entry_id for v in (v3, v4)}  # type: ignore[union-attr]
    latest = [s for s in state.by_source("Condition/c1") if s.memory.entry_id in ids]
    assert {(s.store, s.reason) for s in latest} == {(Store.HISTORY, Reason.ENTERED_IN_ERROR)}
    assert not [s for s in state.in_store(Store.ACTIVE) if s.memory.category is Category.CONDITION]


def test_same_content_again_is_not_a_change(deps: Any) -> None:
    entry = resource_to_entry(_order("active", "1"), "version-patient")
    assert entry is not None
    assert not process_entry(entry, deps).duplicate
    again = process_entry(entry, deps)
    assert again.duplicate and again.state_version == 1
    assert deps.states.load("version-patient").version == 1
