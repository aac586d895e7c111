"""HL7 v2 orders -> entries: an ORM/OML/OMG OBR (ServiceRequest), and what an ORC group holds once read whole:
RXE/RXO (MedicationRequest), RXD (a dispense: MedicationStatement) and RXA (Immunization, or a RAS
MedicationAdministration), with their dosage."""

from __future__ import annotations

from typing import Any

from schemas import Reference, ReferenceRole
from stam.sources.hl7v2.message import EntrySpec, MessageMapping, OrderGroup
from stam.sources.hl7v2.parsing import Segment, parse_dtm, safe_id
from stam.sources.hl7v2.tables import ENDING, ORDER_CONTROL, ORDER_STATUS, REPLACING_CONTROLS, RXA_STATUS


class OrderMapping(MessageMapping):
    """OBR of an order, the order status, and the pharmacy and immunization segments of an ORC group."""

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

    def order(self, obr: Segment, group: OrderGroup) -> EntrySpec | None:
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
        spec = self.add(EntrySpec(obr.pos, "OBR", "ServiceRequest", ref, codes, self.order_status(orc, obr), start,
                              attrs=attrs))
        for i in range(1, len(obr.reps(31)) + 1):
            spec.refs.extend(Reference(role=ReferenceRole.REASON, target=self.concept(c))
                             for c in self.codings(obr.comps(31, i)))
        return spec

    def close(self, group: OrderGroup, enabled: frozenset[str]) -> None:
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

    def after(self, group: OrderGroup, anchor: Segment, name: str) -> Segment | None:
        """The first ``name`` segment after ``anchor`` in the group, else the first one in the group."""
        found = [s for s in group.segs if s.name == name]
        return next((s for s in found if s.pos > anchor.pos), found[0] if found else None)

    def dosage(self, group: OrderGroup, anchor: Segment, amount: tuple[str, str, str], instructions: list[str],
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

    def medication_request(self, group: OrderGroup, rxe: Segment | None, rxo: Segment | None) -> None:
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
        spec = self.add(EntrySpec(seg.pos, seg.name, "MedicationRequest", ref, codes, self.order_status(orc), start, end,
                              dosage=dosage, attrs=attrs))
        parent = orc.get(8) if orc is not None else ""
        if control in REPLACING_CONTROLS and parent and f"MedicationRequest/{safe_id(parent)}" != ref:
            spec.refs.append(Reference(role=ReferenceRole.REPLACES, target=f"MedicationRequest/{safe_id(parent)}"))

    def dispense(self, group: OrderGroup, rxd: Segment, rxe: Segment | None) -> None:
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
        self.add(EntrySpec(rxd.pos, "RXD", "MedicationStatement", ref, codes, status, self.time(rxd, 3), dosage=dosage,
                       attrs=attrs))

    def immunization(self, group: OrderGroup, rxa: Segment) -> None:
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
        self.add(EntrySpec(rxa.pos, "RXA", rtype, ref, codes, status, start, end, dosage=dosage, attrs=attrs))
