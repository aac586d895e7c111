"""HL7 v2 segments -> record entries: :class:`Mapper` walks one message by family (ADT, results, orders,
pharmacy, immunizations, problems, documents) and makes one entry per clinical segment; the rules are in the
package docstring (``stam.sources.hl7v2``)."""

from __future__ import annotations

from schemas import Lifecycle, RecordEntry, Reference, ReferenceRole
from stam.errors import SourceError
from stam.ids import digest
from stam.sources.hl7v2.allergies_problems import AllergyProblemMapping
from stam.sources.hl7v2.message import EntrySpec, OrderGroup
from stam.sources.hl7v2.orders import OrderMapping
from stam.sources.hl7v2.parsing import Segment, safe_id
from stam.sources.hl7v2.results import ResultMapping
from stam.sources.hl7v2.tables import (
    ADT_EVENT_NAMES,
    BAR_NO_FACTS,
    IDENTITY_EVENTS,
    NO_CLINICAL_FACTS,
    REPORT_FAMILIES,
    RETRACTING_EVENTS,
    SEGMENTS,
    SOURCE,
)
from stam.sources.hl7v2.visits import VisitMapping


class Mapper(VisitMapping, AllergyProblemMapping, ResultMapping, OrderMapping):
    """One message -> entries (:meth:`run`): refused whole, or walked segment by segment, each segment group mapped
    by its mixin, then every entry finished."""

    def run(self) -> list[RecordEntry]:
        reason = self.refusal()
        if reason:
            raise SourceError(f"{self.mtype} {reason}")
        self.patient_id = self.patient()
        pv1 = next((s for s in self.segs if s.name == "PV1"), None)
        pv2 = next((s for s in self.segs if s.name == "PV2"), None)
        if pv1 is not None and pv1.get(19):
            self.visit = safe_id(pv1.get(19))
        if pv1 is not None:
            self.patient_class = pv1.get(2).upper()
        if pv2 is not None:
            self.encounter_reasons = self.codings(pv2.comps(3))
        self.walk(SEGMENTS[self.code])
        if not self.specs:
            present = sorted({s.name for s in self.segs[1:]})
            detail = f"; left out: {', '.join(sorted(self.skipped))}" if self.skipped else ""
            raise SourceError(f"{self.mtype} ({self.describe()}) carries no clinical facts to map "
                              f"(segments: {' '.join(present)}){detail}")
        return [self.finish(spec) for spec in self.specs]

    def describe(self) -> str:
        if self.code == "ADT":
            return ADT_EVENT_NAMES.get(self.event, "ADT event")
        return {"BAR": "billing account", "DFT": "financial transaction", "ORU": "results", "OUL": "lab results",
                "ORM": "order", "OML": "lab order", "OMG": "general order", "RDE": "pharmacy order",
                "RDS": "pharmacy dispense", "RAS": "pharmacy administration", "PPR": "problem", "MDM": "document",
                "VXU": "immunization", "REF": "referral", "RRI": "referral response"}.get(self.code, "message")

    def refusal(self) -> str | None:
        """Why a whole message type carries no clinical fact (None: map it)."""
        if self.code in NO_CLINICAL_FACTS:
            return NO_CLINICAL_FACTS[self.code]
        if self.code not in SEGMENTS:
            return f"message type {self.code} is not supported by the HL7 v2 source (no clinical mapping)"
        if self.code == "ADT" and self.event in IDENTITY_EVENTS:
            return (f"({ADT_EVENT_NAMES.get(self.event, 'merge/link/move')}) is an identity operation on patient "
                    "identifiers: no clinical facts")
        if self.code == "ADT" and self.event == "A29":
            return "(delete person information) removes a person record: no clinical facts to map"
        if self.code == "BAR" and self.event in BAR_NO_FACTS:
            return f"({BAR_NO_FACTS[self.event]}) is an account operation: no clinical facts"
        return None

    def walk(self, enabled: frozenset[str]) -> None:
        group = OrderGroup()
        obr: EntrySpec | None = None  # the report (ORU) or order (ORM) the next OBX/NTE belong to
        obr_seg: Segment | None = None
        note_target: EntrySpec | None = None
        retracting = self.code == "ADT" and self.event in RETRACTING_EVENTS
        document: list[Segment] = []
        for seg in self.segs[1:]:
            name = seg.name
            if name == "ORC":
                self.close(group, enabled)
                group, obr, obr_seg = OrderGroup(orc=seg), None, None
            group.segs.append(seg)
            if name == "NTE":
                if note_target is not None:
                    note_target.text.extend(seg.texts(3))
                continue
            if name != "PRT":
                note_target = None
            if name not in enabled:
                continue
            if retracting and name != "PV1":
                self.skip(f"ADT^{self.event} cancel event: {name} not mapped")
                continue
            if name == "PV1":
                self.encounter(seg)
            elif name == "DG1":
                note_target = self.diagnosis(seg)
            elif name == "AL1":
                self.allergy(seg)
            elif name == "IAM":
                self.allergy_iam(seg)
            elif name == "PR1":
                self.procedure(seg)
            elif name == "PRB":
                note_target = self.problem(seg)
            elif name == "OBR":
                obr_seg = seg
                obr = self.report(seg, group) if self.code in REPORT_FAMILIES else self.order(seg, group)
                note_target = obr
            elif name == "OBX":
                if self.code == "MDM":
                    document.append(seg)
                else:
                    note_target = self.observation(seg, obr, obr_seg)
            elif name == "TXA":
                document.insert(0, seg)
        self.close(group, enabled)
        if document and document[0].name == "TXA":
            self.document(document[0], document[1:])
        self.link_reasons()

    # -- finishing -----------------------------------------------------------------------------------------

    def link_reasons(self) -> None:
        """Orders point at the diagnoses of their message; an encounter at the diagnoses of its visit."""
        conditions = [s.source_ref for s in self.specs if s.segment == "DG1" and s.source_ref]
        for spec in self.specs:
            if spec.resource_type in ("ServiceRequest", "MedicationRequest", "Encounter"):
                spec.refs.extend(Reference(role=ReferenceRole.REASON, target=c) for c in conditions)
            if self.encounter_reasons and spec.resource_type != "Encounter":
                spec.refs.extend(Reference(role=ReferenceRole.ENCOUNTER_REASON, target=self.concept(c))
                                 for c in self.encounter_reasons)

    def lifecycle(self, spec: EntrySpec) -> Lifecycle | None:
        """A pharmacy order of an inpatient visit (PV1-2 I) ends with the stay, or at its own end (TQ1-8) first; other
        entries keep the default of their resource type."""
        if spec.resource_type != "MedicationRequest":
            return None
        if spec.end is not None:
            return Lifecycle.INTERVAL
        return Lifecycle.ENCOUNTER if self.patient_class == "I" else None

    def finish(self, spec: EntrySpec) -> RecordEntry:
        if spec.start is not None and spec.end is not None and spec.end < spec.start:
            raise SourceError(f"{self.mtype} {spec.segment} (segment {spec.pos + 1}): end {spec.end.isoformat()} "
                              f"is before start {spec.start.isoformat()}")
        refs: list[Reference] = []
        for ref in spec.refs:
            if ref not in refs:
                refs.append(ref)
        text = "\n".join(t.strip() for t in spec.text if t.strip()) or None
        encounter = (spec.source_ref if spec.resource_type == "Encounter"
                     else f"Encounter/{self.visit}" if self.visit else None)
        entry = RecordEntry(
            patient_id=self.patient_id, entry_id="pending", source=SOURCE, source_ref=spec.source_ref,
            resource_type=spec.resource_type, effective_at=spec.start, effective_end=spec.end,
            recorded_at=self.recorded, status=spec.status, codes=tuple(spec.codes), text=text, value=spec.value,
            dosage=spec.dosage, references=tuple(refs), encounter=encounter, lifecycle=self.lifecycle(spec),
            attributes={**self.base, "hl7_segment": spec.segment, **spec.attrs},
        )
        content = entry.model_dump_json(exclude={"entry_id"})
        hashed = digest(self.control_id, str(spec.pos), content, size=8)
        entry_id = f"{SOURCE}:{spec.source_ref or spec.resource_type}:{hashed}"
        return entry.model_copy(update={"entry_id": entry_id})
