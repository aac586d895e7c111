"""The vocabulary of the memory, one table each: relation types, reasons, reference roles.

Every member of these enums carries its row (a member written without one fails at import with TypeError),
and what depends on the vocabulary is derived from the rows, never listed a second time:

- ``RelationType``: ``DIRECTED_RELATIONS``, ``RELATION_WEIGHT`` (the weight of an edge of that type), the
  relation names the language model may answer (``stam.reasoning.prompts.RelationName``) and their prose in
  its link prompt (``prompts.judge_system``).
- ``Reason``: the reasons the model may give for a fact that ended (``prompts.EndReason``: the ``offered``
  ones) and how its judge prompt describes them (``prompts.judge_system``).
- ``ReferenceRole``: the roles source mappers (``stam.sources``) give references; ``ENDING_ROLES`` (an entry
  that names a resource with one of them ends that resource's memories: always an impact candidate, and only
  its own source system may do so) and the roles the coded linker turns into relations.

``tests/unit/test_vocabulary.py`` ties the tables to the places that use them. The enums' docstrings are part
of the JSON contract (``python -m schemas``): comments explain the rows instead.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from schemas.wire import Category


# Row: value, directed (reads source -> target), weight (of an edge of this type, 0-1), prompt (what the link
# prompt says of it after its name: "" says nothing; a directed one says which way, from the NEW fact).
class RelationType(StrEnum):
    RESTATEMENT = "restatement", False, 1.0, "same fact again"
    SAME_CONDITION_THREAD = "same_condition_thread", False, 0.7, ""
    DRUG_INTERACTION = "drug_interaction", False, 0.8, ""
    SYSTEMIC_LINK = "systemic_link", False, 0.5, ""
    CAUSAL = "causal", True, 0.8, "NEW causes it"
    TREATMENT_FOR = "treatment_for", True, 0.9, "NEW treats it"
    MONITORING_FOR = "monitoring_for", True, 0.8, "NEW monitors it"

    _value_: str
    directed: bool
    weight: float
    prompt: str

    if not TYPE_CHECKING:  # mypy would read it as the signature of a lookup by value, which takes no row
        def __new__(cls, value: str, directed: bool, weight: float, prompt: str) -> RelationType:
            member = str.__new__(cls, value)
            member._value_ = value
            member.directed, member.weight, member.prompt = directed, weight, prompt
            return member


# Row: value, description, offered (the language model may give it for a CURRENT fact that ended).
# Row: value, description, offered (the language model may answer it for a fact that ended), prompt (how the
# judge prompt's "ended:" line describes it, with the value in brackets; "" leaves it unnamed there).
class Reason(StrEnum):
    """Why a memory is in HISTORY."""

    SUPERSEDED = ("superseded", "a newer fact of the same thing (value, dose, version) replaced it", True,
                  "a newer value or dose of the same thing")
    RESOLVED = "resolved", "the condition or allergy resolved", True, "a resolution"
    STOPPED = "stopped", "the medication or activity was stopped", True, "a stop"
    COMPLETED = "completed", "the course, plan or order was completed", True, ""
    CANCELLED = "cancelled", "cancelled, revoked or not done", True, ""
    ENTERED_IN_ERROR = "entered-in-error", "the source retracted it (entered in error, refuted)", False, ""
    PRIOR_STATE = ("prior-state", "a new memory that describes an earlier state than one already ACTIVE "
                   "(late arrival)", False, "")
    # The lifecycle's reasons (``Lifecycle``): decided by the update stage from the record's own times, never by a
    # reasoner, so none is offered to the language model.
    ENCOUNTER_ENDED = ("encounter-ended", "its encounter ended (a discharge): an inpatient order, a diet, a line or "
                       "an ICU item holds no longer than the stay it belongs to", False, "")
    EXPIRED = ("expired", "its own interval ended on the patient's clinical clock (a pharmacy stop time, a validity "
               "period, an infusion's end)", False, "")
    EVENT = ("event", "an event (a dose given, a procedure done, a billing code): it happened at its time and is "
             "never a current state", False, "")

    _value_: str
    description: str
    offered: bool
    prompt: str

    if not TYPE_CHECKING:  # mypy would read it as the signature of a lookup by value, which takes no row
        def __new__(cls, value: str, description: str, offered: bool, prompt: str) -> Reason:
            member = str.__new__(cls, value)
            member._value_ = value
            member.description, member.offered, member.prompt = description, offered, prompt
            return member


# Row: value, description, ends (the entry ends the memories of the resource it names: replaced or
# discontinued), links (the coded linker relates the entry's memories to the target: treatment_for from a
# medication, procedure, care plan or immunization, monitoring_for from an observation or report,
# same_condition_thread otherwise), link_weight (the weight of that relation; None: its type's own weight).
class ReferenceRole(StrEnum):
    REASON = "reason", "why the entry was made (FHIR reasonReference, HL7 reason codes)", False, True, None
    ADDRESSES = "addresses", "a condition a care plan addresses", False, True, None
    ENCOUNTER_REASON = ("encounter-reason", "a reason code of the encounter the entry was recorded in", False,
                        True, 0.6)
    BASED_ON = "based-on", "the order the entry fulfils", False, False, None
    PART_OF = "part-of", "the panel or report the entry is a member of", False, False, None
    HAS_MEMBER = "has-member", "a member (result) of a panel or report", False, False, None
    REPLACES = "replaces", "a resource the entry replaces: its memories are superseded", True, False, None
    DISCONTINUES = ("discontinues", "a resource the entry discontinues: its memories end (stopped unless the "
                    "entry's own status says otherwise)", True, False, None)

    _value_: str
    description: str
    ends: bool
    links: bool
    link_weight: float | None

    if not TYPE_CHECKING:  # mypy would read it as the signature of a lookup by value, which takes no row
        def __new__(cls, value: str, description: str, ends: bool, links: bool,
                    link_weight: float | None) -> ReferenceRole:
            member = str.__new__(cls, value)
            member._value_ = value
            member.description, member.ends, member.links, member.link_weight = description, ends, links, link_weight
            return member

    @classmethod
    def of(cls, role: str) -> ReferenceRole | None:
        """The member named ``role``; None for a role this vocabulary does not know (the wire allows any)."""
        return cls._value2member_map_.get(role)  # type: ignore[return-value]


# Row: value, description, ends_with_encounter (an ACTIVE fact of this kind that names its encounter ends no later
# than that encounter: reason ``encounter-ended``), expires (an ACTIVE fact of this kind with an end time ends when the
# patient's clinical clock passes it: reason ``expired``), current (a memory of this kind may be ACTIVE at all).
class Lifecycle(StrEnum):
    """How a kind of fact stops being current (the update stage's lifecycle rules, ``stam.lifecycle``)."""

    STATE = ("state", "current until an entry ends it (conditions, allergies, home and community medications, care "
             "plans)", False, False, True)
    ENCOUNTER = ("encounter", "ends no later than its encounter (inpatient orders of every kind, diet, ADT, the "
                 "encounter itself)", True, False, True)
    INTERVAL = ("interval", "current only inside its interval on the patient's clinical clock, and no longer than its "
                "encounter when it names one (pharmacy start/stop, ICU inputs, lines and drains, care units)",
                True, True, True)
    EVENT = ("event", "happened at its time, never a current state: history from the start (administrations, "
             "procedures done, billing codes)", False, False, False)
    MEASUREMENT = ("measurement", "the latest value of its concept is current, earlier ones are history (labs, vital "
                   "signs, results)", False, False, True)

    _value_: str
    description: str
    ends_with_encounter: bool
    expires: bool
    current: bool

    if not TYPE_CHECKING:  # mypy would read it as the signature of a lookup by value, which takes no row
        def __new__(cls, value: str, description: str, ends_with_encounter: bool, expires: bool,
                    current: bool) -> Lifecycle:
            member = str.__new__(cls, value)
            member._value_ = value
            member.description, member.ends_with_encounter, member.expires, member.current = (
                description, ends_with_encounter, expires, current)
            return member


# The lifecycle of a source resource's own coded facts, by resource type; a source that knows more about one entry
# (MIMIC's inpatient orders, an HL7 order of an inpatient visit, a FHIR request with a validity period) says so in
# ``RecordEntry.lifecycle``.
LIFECYCLE_BY_RESOURCE: dict[str, Lifecycle] = {
    "Condition": Lifecycle.STATE,
    "AllergyIntolerance": Lifecycle.STATE,
    "CarePlan": Lifecycle.STATE,
    "MedicationRequest": Lifecycle.STATE,
    "MedicationStatement": Lifecycle.STATE,
    "MedicationAdministration": Lifecycle.EVENT,
    "Observation": Lifecycle.MEASUREMENT,
    "DiagnosticReport": Lifecycle.MEASUREMENT,
    "Procedure": Lifecycle.EVENT,
    "Immunization": Lifecycle.EVENT,
    "Encounter": Lifecycle.ENCOUNTER,
    "ServiceRequest": Lifecycle.ENCOUNTER,
    "DocumentReference": Lifecycle.STATE,
    "Patient": Lifecycle.STATE,
}
# Every other memory (free text decomposed by the language model, a resource type not above), by its category.
LIFECYCLE_BY_CATEGORY: dict[Category, Lifecycle] = {
    Category.CONDITION: Lifecycle.STATE,
    Category.MEDICATION: Lifecycle.STATE,
    Category.OBSERVATION: Lifecycle.MEASUREMENT,
    Category.PROCEDURE: Lifecycle.EVENT,
    Category.IMMUNIZATION: Lifecycle.EVENT,
    Category.ENCOUNTER: Lifecycle.ENCOUNTER,
    Category.ALLERGY: Lifecycle.STATE,
    Category.CAREPLAN: Lifecycle.STATE,
    Category.REPORT: Lifecycle.MEASUREMENT,
    Category.ORDER: Lifecycle.ENCOUNTER,
    Category.NOTE: Lifecycle.STATE,
    Category.OTHER: Lifecycle.STATE,
}

LIFECYCLE_REASONS = frozenset({Reason.ENCOUNTER_ENDED, Reason.EXPIRED})
"""Reasons whose archival happened at a clinical time of its own (``StoredMemory.ended_at``, the transition's
``clinical_time``: the encounter's end, the interval's end), not at its evidence's time."""

DIRECTED_RELATIONS = frozenset(r for r in RelationType if r.directed)
RELATION_WEIGHT: dict[RelationType, float] = {r: r.weight for r in RelationType}
ENDING_ROLES = frozenset(r for r in ReferenceRole if r.ends)
"""Reference roles that name a source resource the entry ends."""
