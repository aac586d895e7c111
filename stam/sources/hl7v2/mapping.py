"""HL7 v2 segments -> record entries: :class:`Mapper` walks one message by family (ADT, results, orders,
pharmacy, immunizations, problems, documents) and makes one entry per clinical segment; the rules are in the
package docstring (``stam.sources.hl7v2``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from schemas import CodeSystem, Coding, Lifecycle, Quantity, RecordEntry, Reference, ReferenceRole
from stam.errors import SourceError
from stam.ids import digest
from stam.sources.hl7v2.parsing import Segment, component, parse_dtm, safe_id
from stam.sources.hl7v2.tables import (
    ADT_EVENT_NAMES,
    BAR_NO_FACTS,
    CLASS_DISPLAY,
    ENDING,
    IDENTITY_EVENTS,
    LIFE_CYCLE,
    MESSAGE_CODE,
    NO_CLINICAL_FACTS,
    NUMBER,
    OBR_STATUS,
    OBX_NO_RESULT,
    OBX_STATUS,
    OBX_VALUE_TYPES,
    ORDER_CONTROL,
    ORDER_STATUS,
    REPLACING_CONTROLS,
    REPORT_FAMILIES,
    RETRACTING_EVENTS,
    RXA_STATUS,
    SEGMENTS,
    SOURCE,
    SYSTEMS,
    V2_CLASS,
    VISIT_EVENTS,
    VXU_ADMIN_LOINC,
)

# --- mapping ----------------------------------------------------------------------------------------------

@dataclass
class _Spec:
    """An entry under construction (mutable until the message is finished)."""

    pos: int
    segment: str
    resource_type: str
    source_ref: str | None
    codes: list[Coding]
    status: str | None = None
    start: datetime | None = None
    end: datetime | None = None
    text: list[str] = field(default_factory=list)
    value: Quantity | None = None
    dosage: str | None = None
    refs: list[Reference] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Group:
    """Segments from one ORC to the next (an order with its pharmacy/immunization detail)."""

    orc: Segment | None = None
    segs: list[Segment] = field(default_factory=list)


class Mapper:
    def __init__(self, segs: list[Segment]) -> None:
        self.segs = segs
        msh = segs[0]
        code, event = msh.get(9, 1).upper(), msh.get(9, 2).upper()
        self.mtype = "unknown"
        if not MESSAGE_CODE.fullmatch(code):
            raise SourceError(f"MSH-9 message type {msh.text(9)[:20]!r} is missing or invalid")
        if event and not MESSAGE_CODE.fullmatch(event):
            raise SourceError(f"MSH-9 trigger event {event[:20]!r} is invalid")
        self.code, self.event = code, event
        self.mtype = f"{code}^{event}" if event else code
        self.control_id = msh.get(10) or "sha:" + digest("\r".join(repr(s.fields) for s in segs))
        self.sender = msh.get(3) or "unknown"
        self.recorded = parse_dtm(msh.get(7), "MSH-7")
        self.base: dict[str, Any] = {"hl7_message": self.mtype, "hl7_control_id": self.control_id[:200]}
        if msh.get(12):
            self.base["hl7_version"] = msh.get(12)[:20]
        self.specs: list[_Spec] = []
        self.skipped: dict[str, int] = {}
        self.patient_id = ""
        self.visit: str | None = None
        self.patient_class = ""
        self.encounter_reasons: list[Coding] = []

    # -- helpers -------------------------------------------------------------------------------------------

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def system(self, name: str) -> str:
        key = name.strip()
        if not key:
            return f"urn:hl7v2:local:{quote(self.sender, safe='')}"
        if key.upper() in SYSTEMS:
            return SYSTEMS[key.upper()]
        m = re.fullmatch(r"HL7(\d{4})", key.upper())
        if m:
            return f"http://terminology.hl7.org/CodeSystem/v2-{m[1]}"
        return f"urn:hl7v2:coding-system:{quote(key, safe='')}"

    def codings(self, comps: Sequence[Sequence[str]], default_system: str = "") -> list[Coding]:
        """CWE/CE/CNE -> codings: the identifier triplet, the alternate one, the second alternate (2.7+)."""
        out: list[Coding] = []
        for code_i, text_i, sys_i in ((1, 2, 3), (4, 5, 6), (10, 11, 12)):
            code = component(comps, code_i)
            if not code:
                continue
            display = component(comps, text_i, joined=True) or (component(comps, 9, joined=True) if code_i == 1 else "")
            system = self.system(component(comps, sys_i) or (default_system if code_i == 1 else ""))
            coding = Coding(system=system, code=code, display=display or None)
            if all((c.system, c.code) != (coding.system, coding.code) for c in out):
                out.append(coding)
        return out

    def time(self, seg: Segment, n: int) -> datetime | None:
        return parse_dtm(seg.get(n), f"{seg.name}-{n}")

    def first_time(self, *candidates: tuple[Segment | None, int]) -> datetime | None:
        for seg, n in candidates:
            if seg is not None and seg.get(n):
                return self.time(seg, n)
        return None

    def fallback_ref(self, rtype: str, *parts: str) -> str:
        return f"{rtype}/hl7v2-{digest(self.patient_id, *parts, size=8)}"

    def add(self, spec: _Spec) -> _Spec:
        self.specs.append(spec)
        return spec

    @staticmethod
    def concept(c: Coding) -> str:
        return f"concept:{c.system}|{c.code}"

    # -- patient -------------------------------------------------------------------------------------------

    def patient(self) -> str:
        pids = [s for s in self.segs if s.name == "PID"]
        if not pids:
            raise SourceError("no PID segment: the message names no patient")
        ids = {self._patient_id(p) for p in pids}
        if len(ids) > 1:
            raise SourceError(f"{len(pids)} PID segments name {len(ids)} different patients; one message, one patient")
        return ids.pop()

    @staticmethod
    def _patient_id(pid: Segment) -> str:
        reps = pid.reps(3)
        if not any(component(rep, 1) for rep in reps):
            raise SourceError("PID-3 (patient identifier list) is empty")
        for rep in reps:
            number = component(rep, 1)
            if not number or component(rep, 5).upper() == "SS":
                continue
            authority = rep[3] if len(rep) > 3 else ()
            name = next((s.strip() for s in authority[:2] if s.strip()), "local")
            return f"hl7v2:{safe_id(name).replace(':', '%3A')}:{safe_id(number)}"
        raise SourceError("PID-3 holds only social-security numbers (CX.5 SS), no usable patient identifier")

    # -- the message ---------------------------------------------------------------------------------------

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
        group = _Group()
        obr: _Spec | None = None  # the report (ORU) or order (ORM) the next OBX/NTE belong to
        obr_seg: Segment | None = None
        note_target: _Spec | None = None
        retracting = self.code == "ADT" and self.event in RETRACTING_EVENTS
        document: list[Segment] = []
        for seg in self.segs[1:]:
            name = seg.name
            if name == "ORC":
                self.close(group, enabled)
                group, obr, obr_seg = _Group(orc=seg), None, None
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

    # -- ADT -----------------------------------------------------------------------------------------------

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
        spec = self.add(_Spec(pv1.pos, "PV1", "Encounter", ref, codes, status, start, end, attrs=attrs))
        spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c)) for c in self.encounter_reasons)

    def diagnosis(self, dg1: Segment) -> _Spec | None:
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
        return self.add(_Spec(dg1.pos, "DG1", "Condition", ref, codes, status, self.time(dg1, 5),
                              text=[] if codes else [text], attrs=attrs))

    def allergy(self, al1: Segment) -> None:
        codes = self.codings(al1.comps(3))
        if not codes:
            self.skip("AL1 without an allergen code (AL1-3)")
            return
        attrs: dict[str, Any] = {}
        for key, n in (("allergen_type", 2), ("severity", 4)):
            if al1.get(n):
                attrs[key] = al1.get(n)[:32]
        if al1.texts(5):
            attrs["reaction"] = "; ".join(al1.texts(5))[:200]
        ref = self.fallback_ref("AllergyIntolerance", codes[0].system, codes[0].code)
        self.add(_Spec(al1.pos, "AL1", "AllergyIntolerance", ref, codes, "active", self.time(al1, 6), attrs=attrs))

    def allergy_iam(self, iam: Segment) -> None:
        codes = self.codings(iam.comps(3))
        if not codes:
            self.skip("IAM without an allergen code (IAM-3)")
            return
        action, verification = iam.get(6).upper(), iam.get(17).upper()
        status = "entered-in-error" if verification == "E" else "inactive" if action == "D" else "active"
        ref = (f"AllergyIntolerance/{safe_id(iam.get(7))}" if iam.get(7)
               else self.fallback_ref("AllergyIntolerance", codes[0].system, codes[0].code))
        attrs: dict[str, Any] = {"hl7_action": action} if action else {}
        for key, n in (("allergen_type", 2), ("severity", 4)):
            if iam.get(n):
                attrs[key] = iam.get(n)[:32]
        reactions = [s.get(1, 2) or s.get(1) for s in self.segs if s.name == "IAR" and s.pos > iam.pos]
        if reactions:
            attrs["reaction"] = "; ".join(r for r in reactions if r)[:200]
        start = self.first_time((iam, 11), (iam, 13))
        self.add(_Spec(iam.pos, "IAM", "AllergyIntolerance", ref, codes, status, start, attrs=attrs))

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
        spec = self.add(_Spec(pr1.pos, "PR1", "Procedure", ref, codes, status, self.time(pr1, 5),
                              text=[] if codes else [text]))
        spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c)) for c in self.codings(pr1.comps(15)))

    # -- problems (PPR) ------------------------------------------------------------------------------------

    def problem(self, prb: Segment) -> _Spec | None:
        codes = self.codings(prb.comps(3))
        if not codes:
            self.skip("PRB without a problem code (PRB-3)")
            return None
        action = prb.get(1).upper()
        life = (prb.get(14) or prb.get(14, 2)).lower()
        if not life and prb.get(13).lower() in LIFE_CYCLE and len(prb.get(13)) > 1:
            life = prb.get(13).lower()  # v2.3.1 senders that put the life cycle one field early
        # A problem deleted from the list (PC3 or PRB-1 DE) is resolved, not retracted (issue rule).
        status = "resolved" if action == "DE" or self.event == "PC3" else LIFE_CYCLE.get(life, "active")
        start = self.first_time((prb, 16), (prb, 7), (prb, 2))
        end = self.time(prb, 9)
        if status == "resolved" and end is None:
            end = self.time(prb, 2)
        if start is not None and end is not None and end < start:
            end = start
        ref = (f"Condition/{safe_id(prb.get(4))}" if prb.get(4)
               else self.fallback_ref("Condition", codes[0].system, codes[0].code))
        attrs: dict[str, Any] = {"hl7_action": action} if action else {}
        if life:
            attrs["problem_life_cycle"] = life[:32]
        return self.add(_Spec(prb.pos, "PRB", "Condition", ref, codes, status, start, end, attrs=attrs))

    # -- results -------------------------------------------------------------------------------------------

    @staticmethod
    def order_number(*candidates: tuple[Segment | None, int]) -> str:
        for seg, n in candidates:
            if seg is not None and seg.get(n):
                return safe_id(seg.get(n))
        return ""

    def report(self, obr: Segment, group: _Group) -> _Spec | None:
        codes = self.codings(obr.comps(4))
        result = obr.get(25).upper()
        if not codes:
            self.skip("OBR without a service code (OBR-4): no report")
            return None
        if result == "X":
            self.skip("OBR-25 X: no results, procedure cancelled")
            return None
        number = self.order_number((obr, 3), (obr, 2), (group.orc, 3), (group.orc, 2))
        ref = (f"DiagnosticReport/{number}" if number
               else self.fallback_ref("DiagnosticReport", codes[0].system, codes[0].code, obr.get(7)))
        spec = self.add(_Spec(obr.pos, "OBR", "DiagnosticReport", ref, codes, OBR_STATUS.get(result),
                              self.time(obr, 7), attrs={"order_number": number} if number else {}))
        placer = self.order_number((obr, 2), (group.orc, 2))
        if placer:  # the order this report answers (ServiceRequest/<placer> from ORM/OML)
            spec.refs.append(Reference(role=ReferenceRole.BASED_ON, target=f"ServiceRequest/{placer}"))
        return spec

    def observation(self, obx: Segment, parent: _Spec | None, obr: Segment | None) -> _Spec | None:
        codes = self.codings(obx.comps(3))
        vtype, flag = obx.get(2).upper(), obx.get(11).upper()
        if not codes:
            self.skip("OBX without an observation code (OBX-3)")
            return None
        if self.code == "VXU" and codes[0].system == CodeSystem.LOINC and codes[0].code in VXU_ADMIN_LOINC:
            self.skip("VXU OBX: immunization-registry administrative observation (funding, VIS, forecast)")
            return None
        if flag in OBX_NO_RESULT:
            self.skip(f"OBX-11 {flag}: {OBX_NO_RESULT[flag]}")
            return None
        if vtype not in OBX_VALUE_TYPES:
            self.skip(f"OBX-2 {vtype}: value type not mapped (no clinical text or number)")
            return None
        status = OBX_STATUS.get(flag)
        has_value = any(s.strip() for rep in obx.reps(5) for comp in rep for s in comp)
        if not has_value and status != "entered-in-error":
            self.skip("OBX without a value (OBX-5 empty)")
            return None
        value, text = self.obx_value(obx, vtype)
        start = self.first_time((obx, 14), (obr, 7))
        number = parent.attrs.get("order_number", "") if parent is not None else ""
        sub = ".".join(s for s in (component(c, 1) for c in obx.comps(4)) if s)
        key = codes[0]
        ref = (f"Observation/{number}-{safe_id(key.code)}" + (f"-{safe_id(sub)}" if sub else "") if number
               else self.fallback_ref("Observation", key.system, key.code, sub, obx.get(14) or (obr.get(7) if obr else "")))
        attrs: dict[str, Any] = {}
        if obx.get(7):
            attrs["reference_range"] = obx.text(7)[:64]
        flags = [f for f in (obx.get(8, rep=i) for i in range(1, len(obx.reps(8)) + 1)) if f]
        if flags:
            attrs["abnormal_flags"] = ",".join(flags)[:32]
        spec = self.add(_Spec(obx.pos, "OBX", "Observation", ref, codes, status, start, value=value,
                              text=[text] if text else [], attrs=attrs))
        if parent is not None and parent.source_ref:
            spec.refs.append(Reference(role=ReferenceRole.PART_OF, target=parent.source_ref))
            if parent.resource_type == "DiagnosticReport":
                parent.refs.append(Reference(role=ReferenceRole.HAS_MEMBER, target=ref))
        return spec

    def obx_value(self, obx: Segment, vtype: str) -> tuple[Quantity | None, str]:
        unit = obx.get(6, 2) or obx.get(6, 1) or None
        if vtype in ("TX", "FT"):
            return None, "\n".join(obx.texts(5)).strip()
        if vtype == "NM":
            raw = obx.get(5)
            if NUMBER.fullmatch(raw):
                return Quantity(value=float(raw), unit=unit), ""
            return (Quantity(text=raw, unit=unit) if raw else None), ""
        if vtype == "SN":
            comparator, num1, sep, num2 = (obx.get(5, i) for i in (1, 2, 3, 4))
            if comparator in ("", "=") and not sep and not num2 and NUMBER.fullmatch(num1):
                return Quantity(value=float(num1), unit=unit), ""
            shown = f"{comparator}{num1}{sep}{num2}".strip()
            return (Quantity(text=shown, unit=unit) if shown else None), ""
        if vtype in ("CE", "CWE", "CNE", "CF"):
            shown = "; ".join(c for c in (component(rep, 2, True) or component(rep, 9, True) or component(rep, 1, True)
                                          for rep in obx.reps(5)) if c)
            return (Quantity(text=shown) if shown else None), ""
        shown = "; ".join(obx.texts(5))
        return (Quantity(text=shown, unit=unit if vtype in ("NA", "MA") else None) if shown else None), ""

    # -- orders --------------------------------------------------------------------------------------------

    def order_status(self, orc: Segment | None, obr: Segment | None = None) -> str:
        control = orc.get(1).upper() if orc is not None else ""
        by_control = ORDER_CONTROL.get(control)
        if by_control in ENDING:
            return by_control or "active"
        if orc is not None and orc.get(5).upper() in ORDER_STATUS:
            return ORDER_STATUS[orc.get(5).upper()]
        if obr is not None and obr.get(25).upper() in ("F", "C"):
            return "completed"
        return by_control or "active"

    def order(self, obr: Segment, group: _Group) -> _Spec | None:
        codes = self.codings(obr.comps(4))
        if not codes:
            self.skip("OBR without a service code (OBR-4): no order")
            return None
        orc = group.orc
        tq1 = next((s for s in group.segs if s.name == "TQ1"), None)
        start = self.first_time((tq1, 7), (obr, 7), (obr, 6), (orc, 15), (orc, 9))
        number = self.order_number((orc, 2), (obr, 2), (orc, 3), (obr, 3))
        ref = (f"ServiceRequest/{number}" if number
               else self.fallback_ref("ServiceRequest", codes[0].system, codes[0].code, obr.get(7) or obr.get(6)))
        attrs: dict[str, Any] = {"order_number": number} if number else {}
        if orc is not None and orc.get(1):
            attrs["order_control"] = orc.get(1)[:8]
        spec = self.add(_Spec(obr.pos, "OBR", "ServiceRequest", ref, codes, self.order_status(orc, obr), start,
                              attrs=attrs))
        for i in range(1, len(obr.reps(31)) + 1):
            spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c))
                             for c in self.codings(obr.comps(31, i)))
        return spec

    def close(self, group: _Group, enabled: frozenset[str]) -> None:
        """Pharmacy and immunization detail: known only once the whole ORC group has been read."""
        rxe = next((s for s in group.segs if s.name == "RXE"), None)
        rxo = next((s for s in group.segs if s.name == "RXO"), None)
        if "RXE" in enabled and (rxe is not None or rxo is not None):
            self.medication_request(group, rxe, rxo)
        if "RXD" in enabled:
            for rxd in (s for s in group.segs if s.name == "RXD"):
                self.dispense(group, rxd, rxe)
        if "RXA" in enabled:
            for rxa in (s for s in group.segs if s.name == "RXA"):
                self.immunization(group, rxa)

    def after(self, group: _Group, anchor: Segment, name: str) -> Segment | None:
        """The first ``name`` segment after ``anchor`` in the group, else the first one in the group."""
        found = [s for s in group.segs if s.name == name]
        return next((s for s in found if s.pos > anchor.pos), found[0] if found else None)

    def dosage(self, group: _Group, anchor: Segment, amount: tuple[str, str, str], instructions: list[str],
               rate: tuple[str, str] = ("", "")) -> str | None:
        low, high, unit = amount
        head = [f"{low}-{high}" if low and high else low, unit] if low else []
        if rate[0]:
            head += ["at", rate[0], rate[1]]
        rxr = self.after(group, anchor, "RXR")
        if rxr is not None and (rxr.get(1, 2) or rxr.get(1)):
            head.append(rxr.get(1, 2) or rxr.get(1))
        tq1 = self.after(group, anchor, "TQ1")
        if tq1 is not None and tq1.get(3):
            head.append(tq1.get(3, 1, 2) or tq1.get(3))
        parts = [" ".join(p for p in head if p)] + instructions
        text = "; ".join(p for p in parts if p.strip())
        return text[:500] or None

    def medication_request(self, group: _Group, rxe: Segment | None, rxo: Segment | None) -> None:
        seg = rxe if rxe is not None else rxo
        assert seg is not None
        codes = self.codings(rxe.comps(2)) if rxe is not None else []
        if not codes and rxo is not None:
            codes = self.codings(rxo.comps(1))
        if not codes:
            self.skip(f"{seg.name} without a drug code (RXE-2/RXO-1)")
            return
        orc = group.orc
        tq1 = self.after(group, seg, "TQ1")
        if rxe is not None:
            amount = (rxe.get(3), rxe.get(4), rxe.get(5, 2) or rxe.get(5))
            instructions = [t for t in (rxe.get(7, 2, rep=i) or rxe.get(7, rep=i) for i in range(1, len(rxe.reps(7)) + 1))
                            if t]
            dosage = self.dosage(group, seg, amount, instructions, (rxe.get(23), rxe.get(24, 2) or rxe.get(24)))
            start = self.first_time((tq1, 7))
            if start is None and rxe.get(1, 4):  # RXE-1 (TQ, before v2.5): component 4 is the start
                start = parse_dtm(rxe.get(1, 4), "RXE-1.4")
            if start is None:
                start = self.first_time((orc, 15), (orc, 9))
            end = self.first_time((tq1, 8))
            if end is None and rxe.get(1, 5):
                end = parse_dtm(rxe.get(1, 5), "RXE-1.5")
        else:
            assert rxo is not None
            amount = (rxo.get(2), rxo.get(3), rxo.get(4, 2) or rxo.get(4))
            instructions = [t for t in (rxo.get(7, 2) or rxo.get(7), rxo.get(6, 2) or rxo.get(6)) if t]
            dosage = self.dosage(group, seg, amount, instructions)
            start = self.first_time((tq1, 7), (orc, 15), (orc, 9))
            end = self.first_time((tq1, 8))
        number = self.order_number((orc, 2), (orc, 3), (rxe, 15))
        ref = (f"MedicationRequest/{number}" if number
               else self.fallback_ref("MedicationRequest", codes[0].system, codes[0].code, orc.get(9) if orc else ""))
        control = orc.get(1).upper() if orc is not None else ""
        attrs: dict[str, Any] = {"order_number": number} if number else {}
        if control:
            attrs["order_control"] = control[:8]
        spec = self.add(_Spec(seg.pos, seg.name, "MedicationRequest", ref, codes, self.order_status(orc), start, end,
                              dosage=dosage, attrs=attrs))
        parent = orc.get(8) if orc is not None else ""
        if control in REPLACING_CONTROLS and parent and f"MedicationRequest/{safe_id(parent)}" != ref:
            spec.refs.append(Reference(role=ReferenceRole.REPLACES, target=f"MedicationRequest/{safe_id(parent)}"))

    def dispense(self, group: _Group, rxd: Segment, rxe: Segment | None) -> None:
        codes = self.codings(rxd.comps(2))
        if not codes:
            self.skip("RXD without a dispensed drug code (RXD-2)")
            return
        orc = group.orc
        instructions = [t for t in (rxd.get(9, 2) or rxd.get(9),) if t]
        if rxe is not None:
            instructions = [t for t in (rxe.get(7, 2, rep=i) or rxe.get(7, rep=i) for i in range(1, len(rxe.reps(7)) + 1))
                            if t] + instructions
        amount = (rxe.get(3), rxe.get(4), rxe.get(5, 2) or rxe.get(5)) if rxe is not None else ("", "", "")
        dosage = self.dosage(group, rxd, amount, instructions)
        number = self.order_number((rxd, 7), (orc, 2), (orc, 3))
        ref = (f"MedicationStatement/dispense-{number}-{safe_id(rxd.get(1) or '1')}" if number
               else self.fallback_ref("MedicationStatement", codes[0].system, codes[0].code, rxd.get(3)))
        attrs: dict[str, Any] = {"medication_event": "dispense"}
        if rxd.get(4):
            attrs["dispense_quantity"] = " ".join(p for p in (rxd.get(4), rxd.get(5, 2) or rxd.get(5)) if p)[:64]
        status = self.order_status(orc)
        self.add(_Spec(rxd.pos, "RXD", "MedicationStatement", ref, codes, status, self.time(rxd, 3), dosage=dosage,
                       attrs=attrs))

    def immunization(self, group: _Group, rxa: Segment) -> None:
        """RXA: a vaccine given (VXU) or a dose of a medication given (RAS: a MedicationAdministration, an event)."""
        given = self.code == "RAS"
        codes = self.codings(rxa.comps(5))
        if not codes:
            self.skip(f"RXA without a {'drug' if given else 'vaccine'} code (RXA-5)")
            return
        status = "entered-in-error" if rxa.get(21).upper() == "D" else RXA_STATUS.get(rxa.get(20).upper(), "completed")
        start, end = self.time(rxa, 3), self.time(rxa, 4)
        if start is not None and end is not None and end < start:
            end = None
        amount = rxa.get(6)
        if amount in ("999", "999.0"):  # CDC guide: 999 = amount unknown
            amount = ""
        route = self.after(group, rxa, "RXR")
        head = [amount, rxa.get(7, 2) or rxa.get(7) if amount else ""]
        if route is not None and route.pos > rxa.pos:
            head += [route.get(1, 2) or route.get(1), route.get(2, 2) or route.get(2)]
        dosage = " ".join(p for p in head if p)[:200] or None
        orc = group.orc
        number = self.order_number((orc, 3), (orc, 2))
        rtype = "MedicationAdministration" if given else "Immunization"
        ref = (f"{rtype}/{number}-{safe_id(rxa.get(2) or '1')}" if number and given else f"{rtype}/{number}" if number
               else self.fallback_ref(rtype, codes[0].system, codes[0].code, rxa.get(3)))
        attrs: dict[str, Any] = {}
        for key, value in (("lot_number", rxa.get(15)), ("manufacturer", rxa.get(17, 2) or rxa.get(17)),
                           ("information_source", rxa.get(9, 2) if rxa.get(9) == "01" else ""),
                           ("completion_status", rxa.get(20)), ("refusal_reason", rxa.get(18, 2) or rxa.get(18))):
            if value:
                attrs[key] = value[:64]
        if given and orc is not None and self.order_number((orc, 2)):
            attrs["order_number"] = self.order_number((orc, 2))
        self.add(_Spec(rxa.pos, "RXA", rtype, ref, codes, status, start, end, dosage=dosage, attrs=attrs))

    # -- documents (MDM) -----------------------------------------------------------------------------------

    def document(self, txa: Segment, obxs: list[Segment]) -> None:
        parts: list[str] = []
        for obx in obxs:
            vtype = obx.get(2).upper()
            if vtype in ("TX", "FT", "ST", "CE", "CWE"):
                parts.extend(obx.texts(5))
            else:
                self.skip(f"MDM OBX-2 {vtype or '(empty)'}: document content not text (not mapped)")
        text = "\n".join(p.strip() for p in parts if p.strip())
        if not text:
            self.skip(f"MDM^{self.event or '?'}: document notification without content (no TX/FT OBX)")
            return
        availability = txa.get(19).upper()
        status = ("entered-in-error" if self.event == "T11" or availability == "CA"
                  else "superseded" if availability == "OB" else "current")
        number = txa.get(12)
        ref = (f"DocumentReference/{safe_id(number)}" if number
               else self.fallback_ref("DocumentReference", txa.get(4) or txa.get(6), text[:200]))
        attrs: dict[str, Any] = {}
        for key, n in (("document_type", 2), ("completion_status", 17), ("availability_status", 19)):
            if txa.get(n):
                attrs[key] = txa.get(n)[:32]
        if txa.get(13):
            attrs["parent_document"] = safe_id(txa.get(13))
        spec = self.add(_Spec(txa.pos, "TXA", "DocumentReference", ref, [], status,
                              self.first_time((txa, 4), (txa, 6)), text=[text], attrs=attrs))
        if self.event in ("T09", "T10") and txa.get(13):
            spec.refs.append(Reference(role=ReferenceRole.REPLACES, target=f"DocumentReference/{safe_id(txa.get(13))}"))

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

    def lifecycle(self, spec: _Spec) -> Lifecycle | None:
        """A pharmacy order of an inpatient visit (PV1-2 I) ends with the stay, or at its own end (TQ1-8) first; other
        entries keep the default of their resource type."""
        if spec.resource_type != "MedicationRequest":
            return None
        if spec.end is not None:
            return Lifecycle.INTERVAL
        return Lifecycle.ENCOUNTER if self.patient_class == "I" else None

    def finish(self, spec: _Spec) -> RecordEntry:
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


