"""MIMIC-IV measurements -> entries: lab results, microbiology, outpatient measurements (``omr``), and the ICU
tables charted against ``d_items`` (inputs, ingredients, outputs, procedures, date-times)."""

from __future__ import annotations

from schemas import Coding, Lifecycle, Quantity
from stam.sources.mimic.builder import RowBuilder
from stam.sources.mimic.codes import SYS_ITEMS, SYS_LAB, SYS_MICRO, SYS_MICRO_SUSC, SYS_OMR
from stam.sources.mimic.reading import Row, clean_text, parse_mimic_time, parse_number

_ICU_STATUS = {"Stopped": "stopped", "Paused": "on-hold", "Rewritten": "entered-in-error"}


class MeasurementRows(RowBuilder):
    """The handlers of ``labevents``, ``microbiologyevents``, ``omr`` and the ICU event tables."""

    def _labevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        item = self.lk.labitems.get(r["itemid"], {})
        label = item.get("label") or f"lab item {r['itemid']}"
        display = f"{label} ({item['fluid']})" if item.get("fluid") else label
        num = parse_number(r.get("valuenum"))
        value = Quantity(value=num, unit=r.get("valueuom") or None) if num is not None else Quantity(
            text=clean_text(r.get("value")) or None, unit=r.get("valueuom") or None)
        attrs = {"labevent_id": r["labevent_id"], "hadm_id": r.get("hadm_id") or None,
                 "flag": r.get("flag") or None, "ref_range_lower": parse_number(r.get("ref_range_lower")),
                 "ref_range_upper": parse_number(r.get("ref_range_upper")), "priority": r.get("priority") or None}
        self.emit("labevents", r["labevent_id"], when, source_ref=f"Observation/lab-{r['labevent_id']}",
                  resource_type="Observation", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_LAB, code=r["itemid"], display=display),), value=value,
                  attributes={k: v for k, v in attrs.items() if v is not None})

    def _microbiologyevents(self, r: Row) -> None:
        when = parse_mimic_time(r.get("charttime") or r["chartdate"], "charttime")
        test = r.get("test_name") or "microbiology test"
        spec = r.get("spec_type_desc") or "specimen"
        org = clean_text(r.get("org_name"))
        if org and r.get("ab_name"):
            code = Coding(system=SYS_MICRO_SUSC, code=f"{r['test_itemid']}/{r['org_itemid']}/{r['ab_itemid']}",
                          display=f"{r['ab_name']} susceptibility of {org} ({spec})")
            value = Quantity(text=r.get("interpretation") or r.get("dilution_text") or None)
        else:
            code = Coding(system=SYS_MICRO, code=r["test_itemid"] or test, display=f"{test} ({spec})")
            value = Quantity(text=org or clean_text(r.get("comments")) or "no organism reported")
        self.emit("microbiologyevents", r["microevent_id"], when,
                  source_ref=f"Observation/micro-{r['microevent_id']}", resource_type="Observation",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(code,), value=value,
                  attributes={"microevent_id": r["microevent_id"], "hadm_id": r.get("hadm_id") or None})

    def _omr(self, r: Row) -> None:
        when = parse_mimic_time(r["chartdate"], "chartdate")
        name, raw = r["result_name"], r.get("result_value") or ""
        num = parse_number(raw)
        # omr has no row id: subject_id + chartdate + seq_num + result_name identify the row.
        self.emit("omr", f"{self.subject}:{r['chartdate']}:{r['seq_num']}:{name}", when,
                  source_ref=f"Observation/omr-{self.subject}-{r['chartdate']}-{r['seq_num']}-{name}",
                  resource_type="Observation",
                  effective_at=when, recorded_at=when, status="final",
                  codes=(Coding(system=SYS_OMR, code=name.lower(), display=name),),
                  value=Quantity(value=num) if num is not None else Quantity(text=raw or None))

    def _item(self, itemid: str) -> tuple[str, Row]:
        item = self.lk.items.get(itemid, {})
        return item.get("label") or f"ICU item {itemid}", item

    def _inputevents(self, r: Row, table: str = "inputevents") -> None:
        start, end = parse_mimic_time(r["starttime"], "starttime"), parse_mimic_time(r.get("endtime"), "endtime")
        label, _ = self._item(r["itemid"])
        rate = f"rate {r['rate']} {r.get('rateuom') or ''}".strip() if r.get("rate") else None
        key = f"{r['stay_id']}:{r.get('orderid')}:{r['itemid']}:{r['starttime']}"
        self.emit(table, key, start, source_ref=f"MedicationAdministration/{table}-{key}",
                  resource_type="MedicationAdministration", encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL if end and start and end > start else Lifecycle.EVENT, effective_at=start,
                  effective_end=end if end and start and end >= start else None,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or start,
                  status=_ICU_STATUS.get(r.get("statusdescription") or ""),
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=parse_number(r.get("amount")), unit=r.get("amountuom") or None), dosage=rate,
                  attributes={"stay_id": r["stay_id"], "orderid": r.get("orderid") or None,
                              "statusdescription": r.get("statusdescription") or None})

    def _ingredientevents(self, r: Row) -> None:
        self._inputevents(r, "ingredientevents")

    def _outputevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r['itemid']}:{r['charttime']}"
        self.emit("outputevents", key, when, source_ref=f"Observation/output-{key}", resource_type="Observation",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=parse_number(r.get("value")), unit=r.get("valueuom") or None),
                  attributes={"stay_id": r["stay_id"]})

    def _procedureevents(self, r: Row) -> None:
        start, end = parse_mimic_time(r["starttime"], "starttime"), parse_mimic_time(r.get("endtime"), "endtime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r.get('orderid')}:{r['itemid']}"
        status = _ICU_STATUS.get(r.get("statusdescription") or "", "completed")
        self.emit("procedureevents", key, start, source_ref=f"Procedure/icu-{key}", resource_type="Procedure",
                  encounter=self._encounter(r.get("hadm_id")),
                  lifecycle=Lifecycle.INTERVAL if end and start and end > start else Lifecycle.EVENT,
                  effective_at=start, effective_end=end if end and start and end >= start else None,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or start, status=status,
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(value=parse_number(r.get("value")), unit=r.get("valueuom") or None),
                  attributes={"stay_id": r["stay_id"], "orderid": r.get("orderid") or None})

    def _datetimeevents(self, r: Row) -> None:
        when = parse_mimic_time(r["charttime"], "charttime")
        label, _ = self._item(r["itemid"])
        key = f"{r['stay_id']}:{r['itemid']}:{r['charttime']}"
        self.emit("datetimeevents", key, when, source_ref=f"Observation/datetime-{key}",
                  resource_type="Observation", encounter=self._encounter(r.get("hadm_id")), effective_at=when,
                  recorded_at=parse_mimic_time(r.get("storetime"), "storetime") or when, status="final",
                  codes=(Coding(system=SYS_ITEMS, code=r["itemid"], display=label),),
                  value=Quantity(text=r.get("value") or None), attributes={"stay_id": r["stay_id"]})
