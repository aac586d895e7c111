"""MIMIC-IV orders and medications -> entries: POE orders (Change and D/C linked to the order they end), pharmacy
orders with their prescriptions, orphan prescriptions, and eMAR administrations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from schemas import Coding, Lifecycle, Quantity, Reference, ReferenceRole
from stam.errors import SourceError
from stam.sources.mimic.builder import RowBuilder
from stam.sources.mimic.codes import SYS_DRUG, SYS_FORMULARY, SYS_NDC, SYS_ORDER, SYS_PHARMACY_ORDER
from stam.sources.mimic.reading import Row, clean_text, parse_mimic_time

# emar event_txt -> status. Anything "Not ..." or held is an administration that did not happen.
_EMAR_NOT_DONE = ("Not ", "Hold Dose", "Infusion Reconciliation Not Done")
PHARMACY_STATUS = {
    "Discontinued": "stopped",
    "Discontinued via patient discharge": "stopped",
    "Inactive (Due to a change order)": "stopped",
    "Expired": "completed",
    "H": "on-hold",
}
SAME_ACT = timedelta(hours=1)
"""A pharmacy stop this long or less before the POE order that discontinued the order is the same discontinuation,
recorded by the pharmacy first; one earlier than that is the order's own end, and the POE order comes later."""


def dosage_text(rx: Row | None, ph: Row | None) -> str | None:
    """An order's dosage as the record writes it: the prescription's dose and unit, the route (pharmacy's first), the
    pharmacy's frequency; None when the rows give none."""
    bits = []
    if rx and rx.get("dose_val_rx"):
        bits.append(f"{rx['dose_val_rx']} {rx.get('dose_unit_rx') or ''}".strip())
    route = (ph or {}).get("route") or (rx or {}).get("route")
    if route:
        bits.append(route)
    if ph and ph.get("frequency"):
        bits.append(ph["frequency"])
    return " ".join(bits) or None


class OrderRows(RowBuilder):
    """The handlers of ``poe``, ``pharmacy``, ``prescriptions`` and ``emar``, and how an order is named."""

    def _drug_codings(self, rx: list[Row], fallback_name: str | None) -> list[Coding]:
        out: list[Coding] = []
        if rx:
            main = rx[0]
            out.append(Coding(system=SYS_DRUG, code=main["drug"].strip().lower(), display=main["drug"].strip()))
            if main.get("formulary_drug_cd"):
                out.append(Coding(system=SYS_FORMULARY, code=main["formulary_drug_cd"], display=main["drug"]))
            ndc = main.get("ndc", "").strip()
            if ndc and ndc.strip("0") and ndc != "0":
                out.append(Coding(system=SYS_NDC, code=ndc.split(".")[0].zfill(11), display=main["drug"]))
        elif fallback_name:
            out.append(Coding(system=SYS_DRUG, code=fallback_name.strip().lower(), display=fallback_name.strip()))
        return out

    def _order_name(self, r: Row) -> tuple[str, list[Coding]]:
        """Display name of a POE order and the drug codings of a medication order."""
        poe_id = r["poe_id"]
        if r["order_type"] == "Medications":
            ph = self.pharmacy_by_poe.get(poe_id)
            em = self.emar_by_poe.get(poe_id)
            fallback = (ph or {}).get("medication") or (em or {}).get("medication")
            drugs = self._drug_codings(self.drug_by_poe.get(poe_id, []), fallback)
            return (drugs[0].display or "medication order") if drugs else "medication order (drug not recorded)", drugs
        name = r["order_type"] + (f": {r['order_subtype']}" if r.get("order_subtype") else "")
        details = "; ".join(f"{k}: {v}" for k, v in self.lk.poe_detail.get(poe_id, []) if clean_text(v))
        return (f"{name} ({details})" if details else name), []

    @staticmethod
    def _order_ref(order_type: str, poe_id: str) -> str:
        rtype = "MedicationRequest" if order_type == "Medications" else "ServiceRequest"
        return f"{rtype}/poe-{poe_id}"

    def _poe(self, r: Row) -> None:
        poe_id, tx = r["poe_id"], r["transaction_type"]
        when = parse_mimic_time(r["ordertime"], "ordertime")
        rtype = "MedicationRequest" if r["order_type"] == "Medications" else "ServiceRequest"
        target = r.get("discontinue_of_poe_id") or None
        attributes: dict[str, Any] = {"poe_id": poe_id, "transaction_type": tx, "order_type": r["order_type"],
                                      "hadm_id": r.get("hadm_id") or None}
        refs: list[Reference] = []
        if tx == "D/C":
            if not target:
                raise SourceError(f"D/C order {poe_id} names no discontinue_of_poe_id")
            # The D/C row is the discontinued order's final state: same identity, status stopped.
            original = self.poe.get(target)
            codes = self.order_codes.get(target)
            if codes is None:
                name, drugs = self._order_name(original or r)
                codes = (Coding(system=SYS_ORDER, code=target, display=name), *drugs)
            refs.append(Reference(role=ReferenceRole.DISCONTINUES, target=self._order_ref(r["order_type"], target)))
            attributes["discontinue_of_poe_id"] = target
            self.emit("poe", poe_id, when, source_ref=f"{rtype}/poe-{poe_id}", resource_type=rtype,
                      encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.ENCOUNTER,
                      effective_at=when, recorded_at=when, status="stopped", codes=codes,
                      references=tuple(refs), attributes=attributes)
            return
        name, drugs = self._order_name(r)
        codes = (Coding(system=SYS_ORDER, code=poe_id, display=name), *drugs)
        self.order_codes[poe_id] = codes
        if tx == "Change":
            if not target:
                raise SourceError(f"Change order {poe_id} names no discontinue_of_poe_id")
            refs.append(Reference(role=ReferenceRole.REPLACES, target=self._order_ref(r["order_type"], target)))
            attributes["discontinue_of_poe_id"] = target
        status = "on-hold" if tx == "H" else "active"
        self.emit("poe", poe_id, when, source_ref=f"{rtype}/poe-{poe_id}", resource_type=rtype,
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.ENCOUNTER,
                  effective_at=when, recorded_at=when, status=status, codes=codes, references=tuple(refs),
                  attributes=attributes)

    def _pharmacy(self, r: Row) -> None:
        pid, poe_id = r["pharmacy_id"], r.get("poe_id") or None
        enc = self._encounter(r.get("hadm_id"))
        start = parse_mimic_time(r.get("starttime") or r.get("entertime"), "starttime")
        stop = parse_mimic_time(r.get("stoptime"), "stoptime")
        rx = self.rx_by_pharmacy.get(pid, [])
        self.result.tables["prescriptions"].folded += len(rx)
        drugs = self._drug_codings(rx, r.get("medication"))
        name = drugs[0].display if drugs else (r.get("medication") or "medication")
        if poe_id:
            identity = self.order_codes.get(poe_id, (Coding(system=SYS_ORDER, code=poe_id, display=name),))[0]
            if drugs and name and identity.display and name.lower() not in identity.display.lower():
                # An IV therapy or TPN order is named by its order type in POE ("IV therapy: IV fluids"); its
                # pharmacy versions say which drug runs (the same order: same code).
                identity = Coding(system=identity.system, code=identity.code, display=f"{name} ({identity.display})")
            # The POE order's own reference (IV therapy and TPN orders are ServiceRequests in POE), so a Change
            # or D/C naming the order reaches its pharmacy versions too.
            source_ref = self._order_ref(self.poe[poe_id]["order_type"] if poe_id in self.poe else "Medications",
                                         poe_id)
        else:
            identity = Coding(system=SYS_PHARMACY_ORDER, code=pid, display=name)
            source_ref = f"MedicationRequest/pharmacy-{pid}"
        codes = (identity, *drugs)
        dosage = dosage_text(rx[0] if rx else None, r)
        attributes = {"pharmacy_id": pid, "poe_id": poe_id, "hadm_id": r.get("hadm_id") or None,
                      "pharmacy_status": r.get("status") or None, "prescription_rows": len(rx)}
        final = PHARMACY_STATUS.get(r.get("status") or "")
        if start is None:
            raise SourceError(f"pharmacy row {pid} has neither starttime nor entertime")
        ended_by = self.ended_by.get(poe_id or "")
        entered = parse_mimic_time(r.get("entertime"), "entertime") or start
        common: dict[str, Any] = {"source_ref": source_ref, "resource_type": "MedicationRequest", "encounter": enc,
                                  "lifecycle": Lifecycle.INTERVAL, "codes": codes, "dosage": dosage,
                                  "attributes": attributes}
        by_time = parse_mimic_time(self.poe[ended_by]["ordertime"], "ordertime") if ended_by else None
        if ended_by and by_time is not None and "poe" in self.chosen and (stop is None or stop > by_time - SAME_ACT):
            attributes["stopped_by_poe_id"] = ended_by
            if by_time <= start:
                # Discontinued before the pharmacy's start time: the order never became current.
                self.emit("pharmacy", f"{pid}", start, effective_at=start, recorded_at=entered,
                          status=final or "stopped", **common)
                return
            # The POE order that discontinued this one (a 'Change' or a 'D/C') is the stop: it supersedes or ends the
            # order with an explicit link. Its pharmacy stop, within an hour before it, is the same act recorded by
            # the pharmacy: a second, pharmacy-timed stop would end the order before the change that caused it.
            self.result.tables["pharmacy"].folded += 1
            self.emit("pharmacy", f"{pid}:start", start, effective_at=start, recorded_at=entered, status="active",
                      **common)
            return
        if stop is None or final is None:
            # No final status: current until its stop time, when it has one (an interval), else until its admission
            # ends.
            open_end = stop if stop is not None and final is None and stop > start else None
            self.emit("pharmacy", f"{pid}", start, effective_at=start, effective_end=open_end, recorded_at=entered,
                      status=final or "active", **common)
            return
        stop = max(stop, start)
        self.emit("pharmacy", f"{pid}:start", start, effective_at=start, recorded_at=entered, status="active", **common)
        self.emit("pharmacy", f"{pid}:stop", stop, effective_at=start, effective_end=stop, recorded_at=stop,
                  status=final, **common)

    def _prescriptions(self, r: Row) -> None:
        # Folded into the pharmacy order of the same pharmacy_id (counted there); only orphans are entries.
        if r.get("pharmacy_id") in self.pharmacy_ids:
            return
        start, stop = parse_mimic_time(r.get("starttime"), "starttime"), parse_mimic_time(r.get("stoptime"), "stoptime")
        drugs = self._drug_codings([r], None)
        key = f"{r.get('pharmacy_id') or 'none'}:{r['drug'].strip().lower()}"
        self.emit("prescriptions", key, start, source_ref=f"MedicationRequest/prescription-{key}",
                  resource_type="MedicationRequest", encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL, effective_at=start,
                  effective_end=stop if stop and start and stop >= start else None, recorded_at=start,
                  status="active", codes=tuple(drugs), dosage=dosage_text(r, None),
                  attributes={"pharmacy_id": r.get("pharmacy_id") or None, "poe_id": r.get("poe_id") or None})

    def _emar(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        event = (r.get("event_txt") or "").strip()
        status = ("not-done" if event.startswith(_EMAR_NOT_DONE)
                  else "stopped" if event.startswith("Stopped") else None)
        med = r.get("medication") or ""
        if not med.strip():
            # Some administrations leave the medication blank; the order they belong to names the drug.
            rx = self.drug_by_poe.get(r.get("poe_id") or "", [])
            ph = self.pharmacy_by_poe.get(r.get("poe_id") or "") or {}
            med = (rx[0]["drug"] if rx else None) or ph.get("medication") or ""
        if not med.strip():
            raise SourceError(f"emar row {r['emar_id']} names no medication, nor does its order")
        self.emit("emar", r["emar_id"], when, source_ref=f"MedicationAdministration/{r['emar_id']}",
                  resource_type="MedicationAdministration", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status=status,
                  codes=(Coding(system=SYS_DRUG, code=med.strip().lower(), display=f"{med.strip()} administration"),),
                  dosage=self.lk.emar_dose.get(r["emar_id"]), value=Quantity(text=event or None),
                  attributes={"emar_id": r["emar_id"], "poe_id": r.get("poe_id") or None,
                              "pharmacy_id": r.get("pharmacy_id") or None, "event": event or None})
