"""The coded reasoner: exact judgements for structured entries, no model call.

Identity comes from codes (RxNorm, SNOMED CT, LOINC, ICD, CVX: ``system|code``); state from statuses and
effective times; relations from source references.

Update rules, for a new memory ``m`` with concept ``k``:

1. ``entered-in-error`` retracts: every ACTIVE memory of the same source resource moves to HISTORY
   (reason ``entered-in-error``) and ``m`` itself goes to HISTORY.
2. A terminal status (medication stopped/completed/cancelled, condition resolved/inactive/remission or
   abated, care plan completed/revoked...) places ``m`` in HISTORY with that reason, and moves to HISTORY
   every ACTIVE memory of ``k`` (or of the same resource) that began no later than ``m`` ended.
   A cancelled or not-done fact (an order cancelled, a dose not given) says nothing about other instances
   of the concept: it archives only earlier versions of its own resource.
3. Otherwise ``m`` is current: every ACTIVE memory of ``k`` (or of the same resource, an older version)
   that is not clinically newer is superseded by ``m`` (a newer lab value, a renewed or re-dosed order).
   If an ACTIVE memory of ``k`` is clinically newer, ``m`` arrived late: it goes straight to HISTORY
   (reason ``prior-state``) linked to the memory that followed it in clinical time.

Explicit references take precedence over codes: an entry that ``replaces`` a source resource (a POE
'Change' order, FHIR ``MedicationRequest.priorPrescription`` / ``ServiceRequest.replaces``, an HL7 order
replacement) supersedes every ACTIVE memory of that resource whatever its code; one that ``discontinues`` a
resource (a POE 'D/C' order) ends it with the new memory's own reason (stopped when it has none).

Memories that are only similar in meaning are never archived by this reasoner: an ACTIVE memory stays
unless the codes show it no longer holds.

Events (``Lifecycle.EVENT``: a dose given, a procedure done) are history from the start: such a memory goes to
HISTORY (reason ``event``) and ends nothing by its concept (a dose given does not end the order for the drug); only
its explicit references and its own resource's versions apply. The encounter and interval endings are the update
stage's (``stam.lifecycle``), after these rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from schemas import (
    LIFECYCLE_BY_RESOURCE,
    Archive,
    AtomicMemory,
    Category,
    CodeSystem,
    Coding,
    Quantity,
    Reason,
    RecordEntry,
    ReferenceRole,
    Relation,
    RelationType,
    Store,
    UpdateDecision,
)
from schemas.vocabulary import RELATION_WEIGHT as RELATION_WEIGHT  # its former home, kept importable
from stam.ids import memory_id
from stam.patient_state import PatientState, is_encounter_record, lifecycle_of
from stam.reasoning.base import Candidate

RESOURCE_CATEGORY: dict[str, Category] = {
    "Condition": Category.CONDITION,
    "MedicationRequest": Category.MEDICATION,
    "MedicationStatement": Category.MEDICATION,
    "MedicationAdministration": Category.MEDICATION,
    "Observation": Category.OBSERVATION,
    "Procedure": Category.PROCEDURE,
    "Immunization": Category.IMMUNIZATION,
    "Encounter": Category.ENCOUNTER,
    "AllergyIntolerance": Category.ALLERGY,
    "CarePlan": Category.CAREPLAN,
    "DiagnosticReport": Category.REPORT,
    "ServiceRequest": Category.ORDER,
    "DocumentReference": Category.NOTE,
}

# Statuses after which a fact no longer holds, per category ("completed" ends a medication course or a
# care plan, but a completed procedure or immunization is an event that happened and stays current).
_ANY_TERMINAL = {
    "entered-in-error": Reason.ENTERED_IN_ERROR,
    "refuted": Reason.ENTERED_IN_ERROR,
    "cancelled": Reason.CANCELLED,
    "revoked": Reason.CANCELLED,
    "not-done": Reason.CANCELLED,
    "stopped": Reason.STOPPED,
}
_TERMINAL_BY_CATEGORY: dict[Category, dict[str, Reason]] = {
    Category.MEDICATION: {"completed": Reason.COMPLETED},
    Category.CAREPLAN: {"completed": Reason.COMPLETED},
    Category.ORDER: {"completed": Reason.COMPLETED},
    Category.CONDITION: {"resolved": Reason.RESOLVED, "inactive": Reason.RESOLVED,
                         "remission": Reason.RESOLVED},
    Category.ALLERGY: {"resolved": Reason.RESOLVED, "inactive": Reason.RESOLVED},
}

_PREFERRED_SYSTEMS = (CodeSystem.RXNORM, CodeSystem.LOINC, CodeSystem.SNOMED, CodeSystem.CVX,
                      CodeSystem.ICD10, CodeSystem.ICD9)

_EPOCH = datetime(1, 1, 1, tzinfo=UTC)


def primary_coding(codes: Sequence[Coding]) -> Coding | None:
    """The coding that names the concept: a standard terminology first, else the first one."""
    for system in _PREFERRED_SYSTEMS:
        for c in codes:
            if c.system == system.value:
                return c
    return codes[0] if codes else None


def terminal_reason(category: Category, status: str | None, ended: bool = False) -> Reason | None:
    s = (status or "").lower()
    reason = _ANY_TERMINAL.get(s) or _TERMINAL_BY_CATEGORY.get(category, {}).get(s)
    if reason is None and ended and category in (Category.CONDITION, Category.ALLERGY):
        return Reason.RESOLVED
    return reason


def _when(m: AtomicMemory) -> datetime:
    return m.effective_start or m.recorded_at or _EPOCH


def _fmt_value(q: Quantity | None) -> tuple[float | None, str | None, str | None]:
    if q is None:
        return None, None, None
    return q.value, q.unit, q.text


def _date(d: datetime | None) -> str:
    return d.date().isoformat() if d else "unknown date"


def _statement(category: Category, display: str, value: float | None, unit: str | None,
               value_text: str | None, status: str | None, dosage: str | None,
               start: datetime | None, end: datetime | None) -> str:
    if category is Category.OBSERVATION:
        shown = (f"{value:g} {unit or ''}".strip() if value is not None else value_text) or "recorded"
        return f"{display}: {shown} ({_date(start)})"
    if category is Category.OTHER and (value is not None or value_text):
        # A fact with a value and no clinical category (a patient's sex, age): its value is the fact, and it may hold
        # throughout the record (no time of its own).
        shown = f"{value:g} {unit or ''}".strip() if value is not None else str(value_text)
        return f"{display}: {shown}" + (f" ({_date(start)})" if start else "")
    parts = [f"{category.value.capitalize()}: {display}"]
    if dosage:
        parts.append(f"dosage {dosage}")
    if status:
        parts.append(f"status {status}")
    span = f"from {_date(start)}" + (f" to {_date(end)}" if end else "")
    parts.append(span)
    return "; ".join(parts)


def _one_thread(new: AtomicMemory, old: AtomicMemory) -> bool:
    """Whether two memories of one concept are one fact over time, so that the newer replaces the older.

    Not two encounters' own records (one admission does not replace another: each ends with its own discharge, so a
    discharge recorded after the next admission began is no late arrival), nor another resource's interval that is
    still running when the new fact starts (two infusions of one item at once, overlapping prescriptions of one
    drug: each is current inside its own interval). Versions of one resource always are."""
    if new.source_ref is not None and new.source_ref == old.source_ref:
        return True
    if is_encounter_record(new) or is_encounter_record(old):
        return False
    running = lifecycle_of(old).expires and old.effective_end is not None and old.effective_end > _when(new)
    return not running


def _referenced_archives(entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate],
                         own: Reason | None) -> dict[str, Archive]:
    """The ACTIVE prior memories of the resources ``entry`` names as replaced (superseded by ``memory``) or
    discontinued (ended for ``memory``'s own reason, else stopped), by memory id."""
    mid = memory.memory_id
    archives: dict[str, Archive] = {}
    replaced = {r.target for r in entry.references if r.role == ReferenceRole.REPLACES}
    discontinued = {r.target for r in entry.references if r.role == ReferenceRole.DISCONTINUES}
    for c in candidates:
        s = c.stored
        if s.store is not Store.ACTIVE or s.memory.entry_id == memory.entry_id or not s.memory.source_ref:
            continue
        if s.memory.source_ref in replaced:
            archives[s.memory.memory_id] = Archive(memory_id=s.memory.memory_id, reason=Reason.SUPERSEDED,
                                                   successor_id=mid)
        elif s.memory.source_ref in discontinued:
            archives[s.memory.memory_id] = Archive(memory_id=s.memory.memory_id, reason=own or Reason.STOPPED,
                                                   successor_id=mid)
    return archives


def verbatim_memory(entry: RecordEntry, position: int = 0) -> AtomicMemory:
    """The entry's text kept whole as one ``note`` memory (free text nobody decomposed)."""
    return AtomicMemory(
        memory_id=memory_id(entry.patient_id, entry.entry_id, position), patient_id=entry.patient_id,
        entry_id=entry.entry_id, position=position, category=Category.NOTE, text=(entry.text or "").strip(),
        status=entry.status, effective_start=entry.effective_at, effective_end=entry.effective_end,
        recorded_at=entry.recorded_at, source_ref=entry.source_ref, encounter_id=entry.encounter,
    )


class CodedReasoner:
    name = "coded"

    def semantic_floor(self, memory: AtomicMemory) -> float:
        """Never a candidate found by meaning alone: its update acts only on candidates of the memory's concept, of
        its source resource, or of a resource the entry replaces or discontinues (all looked up by key)."""
        return float("inf")

    # --- extract -----------------------------------------------------------------------------------

    def extract(self, entry: RecordEntry) -> list[AtomicMemory]:
        category = RESOURCE_CATEGORY.get(entry.resource_type or "", Category.OTHER)
        if not entry.codes:
            return [self._verbatim(entry)]
        parts: list[tuple[Coding, Quantity | None]] = []
        if entry.components:
            parts.extend(entry.components)
        else:
            coding = primary_coding(entry.codes)
            assert coding is not None  # entries with codes always have a primary coding
            parts.append((coding, entry.value))
        memories = []
        for pos, (coding, qty) in enumerate(parts):
            value, unit, value_text = _fmt_value(qty)
            display = coding.display or coding.code
            memories.append(AtomicMemory(
                memory_id=memory_id(entry.patient_id, entry.entry_id, pos), patient_id=entry.patient_id,
                entry_id=entry.entry_id, position=pos, category=category,
                text=_statement(category, display, value, unit, value_text, entry.status, entry.dosage,
                                entry.effective_at, entry.effective_end),
                embed_text=f"{category.value}: {display}",
                concept=coding, status=entry.status, value=value, value_text=value_text, unit=unit,
                dosage=entry.dosage, effective_start=entry.effective_at, effective_end=entry.effective_end,
                recorded_at=entry.recorded_at, source_ref=entry.source_ref, encounter_id=entry.encounter,
                lifecycle=entry.lifecycle or LIFECYCLE_BY_RESOURCE.get(entry.resource_type or ""),
            ))
        if entry.text and entry.text.strip():
            # A coded entry that also carries text (a report's presented form): the text is kept verbatim
            # beside the coded facts; decomposing it is the language-model reasoner's job.
            memories.append(self._verbatim(entry, position=len(memories)))
        return memories

    def _verbatim(self, entry: RecordEntry, position: int = 0) -> AtomicMemory:
        return verbatim_memory(entry, position)

    # --- link --------------------------------------------------------------------------------------

    def link(self, entry: RecordEntry, memories: Sequence[AtomicMemory], state: PatientState) -> list[Relation]:
        relations: dict[tuple[str, str, RelationType], Relation] = {}

        def add(src: str, dst: str, rtype: RelationType, weight: float | None = None) -> None:
            if src != dst:
                relations[(src, dst, rtype)] = Relation(
                    source_id=src, target_id=dst, type=rtype,
                    weight=rtype.weight if weight is None else weight)

        for m in memories:
            if m.concept_key:
                for other in state.active_by_concept(m.concept_key):
                    add(m.memory_id, other.memory.memory_id, RelationType.RESTATEMENT)
            for ref in entry.references:
                rtype, weight = self._relation_for(ref.role, m.category)
                if rtype is None:
                    continue
                for target in self._resolve(ref.target, state):
                    add(m.memory_id, target, rtype, weight)
        return list(relations.values())

    @staticmethod
    def _relation_for(role: str, category: Category) -> tuple[RelationType | None, float | None]:
        """The relation a reference of ``role`` gives a memory of ``category``, and its weight (None: the
        type's own); (None, None) for a role that does not link (schemas/vocabulary.py, ``ReferenceRole``)."""
        known = ReferenceRole.of(role)
        if known is None or not known.links:
            return None, None
        if category in (Category.MEDICATION, Category.PROCEDURE, Category.CAREPLAN, Category.IMMUNIZATION):
            return RelationType.TREATMENT_FOR, known.link_weight
        if category in (Category.OBSERVATION, Category.REPORT):
            return RelationType.MONITORING_FOR, known.link_weight
        return RelationType.SAME_CONDITION_THREAD, known.link_weight

    @staticmethod
    def _resolve(target: str, state: PatientState) -> list[str]:
        """ACTIVE memories a reference points at: by source resource, or ``concept:<system>|<code>``."""
        if target.startswith("concept:"):
            found = state.active_by_concept(target.removeprefix("concept:"))
        else:
            found = state.by_source(target)
        return [s.memory.memory_id for s in found if s.store is Store.ACTIVE]

    # --- update ------------------------------------------------------------------------------------

    def update(self, entry: RecordEntry, memory: AtomicMemory, candidates: Sequence[Candidate]) -> UpdateDecision:
        own = terminal_reason(memory.category, memory.status, ended=memory.effective_end is not None)
        mid = memory.memory_id
        same_resource = [c.stored for c in candidates if memory.source_ref
                         and c.stored.memory.source_ref == memory.source_ref
                         and c.stored.memory.entry_id != memory.entry_id]

        if own is Reason.ENTERED_IN_ERROR:
            archive = tuple(Archive(memory_id=s.memory.memory_id, reason=own)
                            for s in same_resource if s.store is Store.ACTIVE)
            return UpdateDecision(memory_id=mid, placement=Store.HISTORY, placement_reason=own,
                                  archive=archive, rationale="source resource entered in error")

        key = memory.concept_key
        same_concept = [c.stored for c in candidates
                        if key and c.stored.memory.concept_key == key
                        and c.stored.memory.entry_id != memory.entry_id and _one_thread(memory, c.stored.memory)]
        archives = _referenced_archives(entry, memory, candidates, own)
        explicit = bool(archives)
        for s in same_resource:
            # Versions of one resource replace each other concept by concept (a panel's components differ); an
            # encounter's records replace each other whatever their class (an admission's discharge, its transfer).
            if s.store is Store.ACTIVE and (s.memory.concept_key == key or memory.category is Category.ENCOUNTER):
                archives[s.memory.memory_id] = Archive(memory_id=s.memory.memory_id,
                                                       reason=own or Reason.SUPERSEDED, successor_id=mid)
        if not lifecycle_of(memory).current:
            # An event that did not happen (not done, held) says so; one that happened, completed or stopped, is
            # an event.
            placed = own if own is Reason.CANCELLED else Reason.EVENT
            return UpdateDecision(memory_id=mid, placement=Store.HISTORY, placement_reason=placed,
                                  archive=tuple(archives.values()),
                                  rationale="an event: it happened at its time, it is no current state")
        active_same = [s for s in same_concept if s.store is Store.ACTIVE
                       and s.memory.memory_id not in archives]

        if own is not None:
            until = memory.effective_end or _when(memory)
            # A cancelled/not-done fact ends only its own resource (handled above), never its concept.
            for s in active_same if own is not Reason.CANCELLED else ():
                if _when(s.memory) <= until:
                    archives[s.memory.memory_id] = Archive(memory_id=s.memory.memory_id, reason=own,
                                                           successor_id=mid)
            return UpdateDecision(memory_id=mid, placement=Store.HISTORY, placement_reason=own,
                                  archive=tuple(archives.values()),
                                  rationale=f"status {memory.status!r} ends the fact")

        t_new = _when(memory)
        # A clinically newer fact of the concept makes this one a late arrival, unless it is an earlier version of
        # this very resource, which this one replaces whatever the times (archived above).
        newer = [s for s in same_concept if _when(s.memory) > t_new and s.memory.memory_id not in archives]
        if any(s.store is Store.ACTIVE for s in newer):
            follower = min(newer, key=lambda s: _when(s.memory))
            newest = max(active_same, key=lambda x: _when(x.memory))
            for s in active_same:
                if _when(s.memory) <= t_new:
                    archives[s.memory.memory_id] = Archive(
                        memory_id=s.memory.memory_id, reason=Reason.SUPERSEDED,
                        successor_id=newest.memory.memory_id)
            return UpdateDecision(memory_id=mid, placement=Store.HISTORY,
                                  placement_reason=Reason.PRIOR_STATE,
                                  successor_id=follower.memory.memory_id,
                                  archive=tuple(archives.values()),
                                  rationale="arrived after a clinically newer fact of the same concept")
        for s in active_same:
            archives[s.memory.memory_id] = Archive(memory_id=s.memory.memory_id,
                                                   reason=Reason.SUPERSEDED, successor_id=mid)
        rationale = ("replaces or discontinues the referenced order" if explicit
                     else "newer fact of the same concept" if archives else None)
        return UpdateDecision(memory_id=mid, placement=Store.ACTIVE, archive=tuple(archives.values()),
                              rationale=rationale)
