"""HL7 v2 results and documents -> entries: an ORU/OUL OBR (DiagnosticReport) with its OBX (Observation, the value
read by value type), and an MDM TXA with its text OBX (DocumentReference)."""

from __future__ import annotations

from typing import Any

from schemas import CodeSystem, Quantity, Reference, ReferenceRole
from stam.sources.hl7v2.message import EntrySpec, MessageMapping, OrderGroup
from stam.sources.hl7v2.parsing import Segment, component, safe_id
from stam.sources.hl7v2.tables import NUMBER, OBR_STATUS, OBX_NO_RESULT, OBX_STATUS, OBX_VALUE_TYPES, VXU_ADMIN_LOINC


class ResultMapping(MessageMapping):
    """OBR of a report, OBX, and MDM documents."""

    def report(self, obr: Segment, group: OrderGroup) -> EntrySpec | None:
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
        spec = self.add(EntrySpec(obr.pos, "OBR", "DiagnosticReport", ref, codes, OBR_STATUS.get(result),
                              self.time(obr, 7), attrs={"order_number": number} if number else {}))
        placer = self.order_number((obr, 2), (group.orc, 2))
        if placer:  # the order this report answers (ServiceRequest/<placer> from ORM/OML)
            spec.refs.append(Reference(role=ReferenceRole.BASED_ON, target=f"ServiceRequest/{placer}"))
        return spec

    def observation(self, obx: Segment, parent: EntrySpec | None, obr: Segment | None) -> EntrySpec | None:
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
        spec = self.add(EntrySpec(obx.pos, "OBX", "Observation", ref, codes, status, start, value=value,
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
        spec = self.add(EntrySpec(txa.pos, "TXA", "DocumentReference", ref, [], status,
                              self.first_time((txa, 4), (txa, 6)), text=[text], attrs=attrs))
        if self.event in ("T09", "T10") and txa.get(13):
            spec.refs.append(Reference(role=ReferenceRole.REPLACES, target=f"DocumentReference/{safe_id(txa.get(13))}"))
