"""HL7 v2 visit segments -> entries: PV1 (an ADT visit event's Encounter), DG1 diagnoses (Condition) and PR1
procedures (Procedure)."""

from __future__ import annotations

from typing import Any

from schemas import Coding, Reference, ReferenceRole
from stam.sources.hl7v2.message import EntrySpec, MessageMapping
from stam.sources.hl7v2.parsing import Segment, safe_id
from stam.sources.hl7v2.tables import CLASS_DISPLAY, V2_CLASS, VISIT_EVENTS


class VisitMapping(MessageMapping):
    """PV1, DG1 and PR1."""

    def encounter(self, pv1: Segment) -> None:
        if self.code != "ADT" or self.event not in VISIT_EVENTS:
            if self.code == "ADT":
                self.skip(f"ADT^{self.event or '?'} is not a visit event: PV1 not mapped as an encounter")
            return
        klass = pv1.get(2).upper()
        codes = [Coding(system=V2_CLASS, code=klass, display=CLASS_DISPLAY.get(klass))] if klass else []
        if not codes:
            self.skip("PV1 without a patient class (PV1-2): no encounter")
            return
        evn = next((s for s in self.segs if s.name == "EVN"), None)
        pv2 = next((s for s in self.segs if s.name == "PV2"), None)
        end = self.time(pv1, 45)
        start = self.time(pv1, 44)
        if start is None:
            start = self.first_time((pv2, 8), (evn, 6), (evn, 2))
            if start is not None and end is not None and start > end:
                start = None  # the event time is no admit time when it falls after the discharge
        status = VISIT_EVENTS[self.event]
        if status is None:
            status = "finished" if end is not None else "in-progress"
        if self.event == "A13":
            end = None  # discharge cancelled
        ref = (f"Encounter/{self.visit}" if self.visit
               else self.fallback_ref("Encounter", klass, pv1.get(44) or self.control_id))
        attrs: dict[str, Any] = {"hl7_event": self.event}
        for key, n in (("admission_type", 4), ("hospital_service", 10), ("discharge_disposition", 36)):
            if pv1.get(n):
                attrs[key] = pv1.get(n)[:64]
        spec = self.add(EntrySpec(pv1.pos, "PV1", "Encounter", ref, codes, status, start, end, attrs=attrs))
        spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c)) for c in self.encounter_reasons)

    def diagnosis(self, dg1: Segment) -> EntrySpec | None:
        codes = self.codings(dg1.comps(3), default_system=dg1.get(2))
        text = dg1.text(4)
        if not codes and not text:
            self.skip("DG1 without a diagnosis code or description")
            return None
        status = "entered-in-error" if dg1.get(21).upper() == "D" else "active"
        key = codes[0] if codes else None
        ref = (f"Condition/{safe_id(dg1.get(20))}" if dg1.get(20)
               else self.fallback_ref("Condition", self.visit or "", key.system if key else "",
                                      key.code if key else text))
        attrs: dict[str, Any] = {}
        if dg1.get(6):
            attrs["diagnosis_type"] = dg1.get(6)[:32]
        return self.add(EntrySpec(dg1.pos, "DG1", "Condition", ref, codes, status, self.time(dg1, 5),
                              text=[] if codes else [text], attrs=attrs))


    def procedure(self, pr1: Segment) -> None:
        codes = self.codings(pr1.comps(3), default_system=pr1.get(2))
        text = pr1.text(4)
        if not codes and not text:
            self.skip("PR1 without a procedure code or description")
            return
        status = "entered-in-error" if pr1.get(20).upper() == "D" else "completed"
        key = codes[0] if codes else None
        ref = (f"Procedure/{safe_id(pr1.get(19))}" if pr1.get(19)
               else self.fallback_ref("Procedure", key.system if key else "", key.code if key else text, pr1.get(5)))
        spec = self.add(EntrySpec(pr1.pos, "PR1", "Procedure", ref, codes, status, self.time(pr1, 5),
                              text=[] if codes else [text]))
        spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c)) for c in self.codings(pr1.comps(15)))
