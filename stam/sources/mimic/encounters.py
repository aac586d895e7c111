"""MIMIC-IV encounters -> entries: admissions (with their discharge and a death), transfers (care units), services,
ICU stays, and the patient's demographics (``patients``)."""

from __future__ import annotations

from schemas import Coding, Lifecycle, Quantity
from schemas.wire import CodeSystem
from stam.errors import SourceError
from stam.sources.base import BadInput
from stam.sources.mimic.builder import RowBuilder
from stam.sources.mimic.codes import ANCHOR_YEAR, LOINC_AGE, LOINC_SEX, SYS_ENCOUNTER, SYS_PATIENT
from stam.sources.mimic.reading import Row, clean_text, parse_mimic_time, parse_number, row_bytes


class EncounterRows(RowBuilder):
    """The handlers of ``admissions``, ``transfers``, ``services`` and ``icustays``, and the death and demographics
    read with the admissions."""

    def _admissions(self, r: Row) -> None:
        """Two entries: the admission at admittime (in progress), and its discharge at dischtime (finished), which
        ends every fact of the admission that ends with it (``stam.lifecycle``)."""
        start, end = parse_mimic_time(r["admittime"], "admittime"), parse_mimic_time(r.get("dischtime"), "dischtime")
        ref = f"Encounter/{r['hadm_id']}"
        attributes = {"hadm_id": r["hadm_id"], "admission_type": r.get("admission_type")}
        display = (f"Hospital admission ({r.get('admission_type') or 'unknown type'}; from "
                   f"{r.get('admission_location') or 'unknown'})")
        self.emit("admissions", r["hadm_id"], start, source_ref=ref, encounter=ref, resource_type="Encounter",
                  effective_at=start, recorded_at=start, status="in-progress",
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-admission", display=display),),
                  attributes=attributes)
        if end is None:
            return
        if start is not None and end < start:
            raise SourceError(f"dischtime {r.get('dischtime')} is before admittime {r['admittime']}")
        discharged = f"{display[:-1]}; discharged to {r.get('discharge_location') or 'n/a'})"
        self.emit("admissions", f"{r['hadm_id']}:discharge", end, last=True, source_ref=ref, encounter=ref,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=end,
                  status="finished",
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-admission", display=discharged),),
                  attributes={**attributes, "discharge_location": r.get("discharge_location") or None})

    def _death(self) -> None:
        deaths = [(r["deathtime"], r["hadm_id"]) for r in self.rows.get("admissions", []) if r.get("deathtime")]
        when_s, key = deaths[0] if deaths else (self.lk.dod.get(self.subject), f"{self.subject}:dod")
        if not when_s:
            return
        when = parse_mimic_time(when_s, "deathtime")
        self.emit("admissions", f"{key}:death", when, source_ref=f"Observation/death-{self.subject}",
                  resource_type="Observation", effective_at=when, recorded_at=when, status="final",
                  codes=(Coding(system=CodeSystem.SNOMED.value, code="419620001", display="Death"),),
                  value=Quantity(text="deceased"))

    def _demographics(self) -> None:
        """The patient's sex, age in the anchor year and that year (one ``Patient`` entry with three facts), first in
        the record: it has no clinical time of its own and holds throughout the record."""
        r = self.lk.patients.get(self.subject)
        if r is None or not self.out:
            return
        table = self.result.tables["patients"]
        table.rows += 1
        parts: list[tuple[Coding, Quantity]] = []
        if clean_text(r.get("gender")):
            parts.append((Coding(system=CodeSystem.LOINC.value, code=LOINC_SEX, display="Sex"),
                          Quantity(text=r["gender"].strip())))
        age, year = parse_number(r.get("anchor_age")), parse_number(r.get("anchor_year"))
        if age is not None and year is not None:
            parts.append((Coding(system=CodeSystem.LOINC.value, code=LOINC_AGE, display="Age in the anchor year"),
                          Quantity(value=age, unit="years")))
            parts.append((Coding(system=SYS_PATIENT, code=ANCHOR_YEAR, display="Anchor year of the age"),
                          Quantity(value=year)))
        if not parts:
            table.bad += 1
            self.result.bad.append(BadInput("patients.csv", row_bytes(r), "SourceError",
                                            "MIMIC-IV patients row: neither gender nor anchor_age/anchor_year"))
            return
        first = min(t for t, *_ in self.out)
        self.emit("patients", self.subject, first, source_ref=f"Patient/{self.subject}", resource_type="Patient",
                  lifecycle=Lifecycle.STATE, codes=tuple(c for c, _ in parts), components=tuple(parts),
                  attributes={"gender": r.get("gender") or None, "anchor_age": age, "anchor_year": year,
                              "anchor_year_group": r.get("anchor_year_group") or None})

    def _transfers(self, r: Row) -> None:
        start, end = parse_mimic_time(r["intime"], "intime"), parse_mimic_time(r.get("outtime"), "outtime")
        unit = r.get("careunit") or ("discharged" if r["eventtype"] == "discharge" else "unknown unit")
        self.emit("transfers", r["transfer_id"], start, source_ref=f"Encounter/transfer-{r['transfer_id']}",
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.INTERVAL,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=start,
                  codes=(Coding(system=SYS_ENCOUNTER, code="care-unit", display="Care unit"),),
                  value=Quantity(text=unit), attributes={"hadm_id": r.get("hadm_id"), "eventtype": r["eventtype"]})

    def _services(self, r: Row) -> None:
        when = parse_mimic_time(r["transfertime"], "transfertime")
        self.emit("services", f"{r['hadm_id']}:{r['transfertime']}", when,
                  source_ref=f"Encounter/service-{r['hadm_id']}-{r['curr_service']}", resource_type="Encounter",
                  encounter=self._encounter(r.get("hadm_id")),
                  effective_at=when, recorded_at=when,
                  codes=(Coding(system=SYS_ENCOUNTER, code="hospital-service", display="Hospital service"),),
                  value=Quantity(text=r["curr_service"]),
                  attributes={"hadm_id": r.get("hadm_id"), "prev_service": r.get("prev_service") or None})

    def _icustays(self, r: Row) -> None:
        start, end = parse_mimic_time(r["intime"], "intime"), parse_mimic_time(r.get("outtime"), "outtime")
        self.emit("icustays", r["stay_id"], start, source_ref=f"Encounter/icu-{r['stay_id']}",
                  encounter=self._encounter(r.get("hadm_id")), lifecycle=Lifecycle.INTERVAL,
                  resource_type="Encounter", effective_at=start, effective_end=end, recorded_at=start,
                  status="finished" if end else "in-progress",
                  codes=(Coding(system=SYS_ENCOUNTER, code="icu-stay",
                                display=f"ICU stay ({r.get('first_careunit')})"),),
                  value=Quantity(value=parse_number(r.get("los")), unit="d"),
                  attributes={"hadm_id": r.get("hadm_id"), "last_careunit": r.get("last_careunit")})
