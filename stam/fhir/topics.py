"""The SubscriptionTopics STAM publishes: one per kind of state transition, each filterable by patient and category.

A transition matches a topic by what it did to a memory (its kind, reason, the memory's category and the store it
went to), never by text:

==================== =================================================================================================
fact-superseded      an ACTIVE fact replaced by a newer one of the same thing (a MedicationRequest renewed or re-dosed,
                     an Observation's newer value): ``archived``, reason ``superseded``
condition-resolved   a condition known to be over: a Condition memory into HISTORY for reason ``resolved`` (an ACTIVE
                     one archived, or one that arrives resolved)
encounter-ended      an encounter that finished: an Encounter memory into HISTORY for reason ``encounter-ended`` or
                     ``completed`` (archived, or arriving finished)
memory-archived      any ACTIVE memory moved to HISTORY, whatever the reason
==================== =================================================================================================

Filters (``canFilterBy``): ``patient`` (``Patient/<id>``, the id as notifications render it, see
:mod:`stam.fhir.resources`) and ``category`` (a code of :data:`stam.fhir.resources.CATEGORY_SYSTEM`: medication,
observation, condition, encounter...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import Category, Reason, Store, StoredMemory, TransitionEvent, TransitionKind
from stam.fhir.resources import CATEGORY_SYSTEM, STAM_FHIR, Version

TOPIC_BASE = f"{STAM_FHIR}/SubscriptionTopic/"
EVENT_SYSTEM = f"{STAM_FHIR}/CodeSystem/transition-event"
FILTERS = ("patient", "category")
TOPIC_DATE = "2026-11-27"


def _into_history(t: TransitionEvent) -> bool:
    return t.to_store is Store.HISTORY and t.kind in (TransitionKind.ARCHIVED, TransitionKind.ADDED)


@dataclass(frozen=True)
class Topic:
    id: str
    title: str
    description: str
    resources: tuple[str, ...]
    """Resource types of its focus (resourceTrigger)."""
    matches: Callable[[TransitionEvent, StoredMemory], bool]

    @property
    def url(self) -> str:
        return TOPIC_BASE + self.id

    def resource(self, version: Version) -> dict[str, Any]:
        """The SubscriptionTopic resource (R4B and R5 have the same shape for what STAM uses)."""
        sd = "http://hl7.org/fhir/StructureDefinition/"
        return {
            "resourceType": "SubscriptionTopic", "id": self.id, "url": self.url, "version": "1",
            "title": self.title, "status": "active", "date": TOPIC_DATE, "publisher": "STAM",
            "description": self.description,
            "resourceTrigger": [{"description": f"{r} moved to HISTORY by a STAM transition", "resource": sd + r,
                                 "supportedInteraction": ["create", "update"]} for r in self.resources],
            "eventTrigger": [{"description": self.description,
                              "event": {"coding": [{"system": EVENT_SYSTEM, "code": self.id}]},
                              "resource": sd + self.resources[0]}],
            "canFilterBy": [
                {"description": "The patient the transition belongs to (Patient/<id> as notifications render it)",
                 "resource": "Patient", "filterParameter": "patient"},
                {"description": f"The memory's category (a code of {CATEGORY_SYSTEM})",
                 "filterParameter": "category", "filterDefinition": CATEGORY_SYSTEM},
            ],
            "notificationShape": [{"resource": sd + r, "include": [f"Provenance:target:{r}"]}
                                  for r in self.resources],
        }


TOPICS: dict[str, Topic] = {t.id: t for t in (
    Topic("fact-superseded", "A fact superseded",
          "An ACTIVE fact was replaced by a newer one of the same thing (a medication order renewed or re-dosed, a "
          "newer value of an observation); the old version is in HISTORY with reason superseded",
          ("MedicationRequest", "Observation", "DiagnosticReport", "ServiceRequest", "Condition", "Basic"),
          lambda t, m: t.kind is TransitionKind.ARCHIVED and t.reason is Reason.SUPERSEDED),
    Topic("condition-resolved", "A condition resolved",
          "A condition is known to be over: it moved to HISTORY, or arrived, with reason resolved",
          ("Condition",),
          lambda t, m: _into_history(t) and t.reason is Reason.RESOLVED and m.memory.category is Category.CONDITION),
    Topic("encounter-ended", "An encounter ended",
          "An encounter finished (a discharge, the end of a visit): its record moved to HISTORY, or arrived, with "
          "reason encounter-ended or completed",
          ("Encounter",),
          lambda t, m: _into_history(t) and t.reason in (Reason.ENCOUNTER_ENDED, Reason.COMPLETED)
          and m.memory.category is Category.ENCOUNTER),
    Topic("memory-archived", "A memory archived",
          "Any ACTIVE memory moved to HISTORY, whatever the reason (superseded, stopped, resolved, completed, "
          "cancelled, entered-in-error, encounter-ended, expired)",
          ("MedicationRequest", "Condition", "Observation", "Encounter", "AllergyIntolerance", "CarePlan",
           "ServiceRequest", "DiagnosticReport", "Procedure", "Basic"),
          lambda t, m: t.kind is TransitionKind.ARCHIVED),
)}


def topic_for_url(url: str) -> Topic | None:
    """The topic of a canonical URL (a ``|version`` suffix allowed), or of its bare id."""
    key = url.split("|", 1)[0]
    return TOPICS.get(key.removeprefix(TOPIC_BASE)) if key.startswith(TOPIC_BASE) or key in TOPICS else None


def matching(transition: TransitionEvent, stored: StoredMemory) -> list[Topic]:
    return [t for t in TOPICS.values() if t.matches(transition, stored)]
