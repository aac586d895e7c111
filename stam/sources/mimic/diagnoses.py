"""MIMIC-IV billed diagnoses and procedures -> entries: ``diagnoses_icd`` (Condition), ``procedures_icd`` and
``hcpcsevents`` (Procedure)."""

from __future__ import annotations

from datetime import datetime

from schemas import Coding
from schemas.wire import CodeSystem
from stam.errors import SourceError
from stam.sources.mimic.builder import RowBuilder
from stam.sources.mimic.codes import SYS_HCPCS, SYS_ICD9_PROC, SYS_ICD10_PCS
from stam.sources.mimic.reading import Row, parse_mimic_time


class DiagnosisRows(RowBuilder):
    """The handlers of ``diagnoses_icd``, ``procedures_icd`` and ``hcpcsevents``."""

    def _admission_times(self, hadm_id: str) -> tuple[datetime | None, datetime | None]:
        adm = self.admissions.get(hadm_id)
        if adm is None:
            raise SourceError(f"hadm_id {hadm_id} is not in admissions")
        return parse_mimic_time(adm["admittime"], "admittime"), parse_mimic_time(adm.get("dischtime"), "dischtime")

    def _diagnoses_icd(self, r: Row) -> None:
        code, version = r["icd_code"].strip(), r["icd_version"]
        system = {"9": CodeSystem.ICD9.value, "10": CodeSystem.ICD10.value}.get(version)
        if system is None:
            raise SourceError(f"icd_version {version!r} is neither 9 nor 10")
        start, discharged = self._admission_times(r["hadm_id"])
        self.emit("diagnoses_icd", f"{r['hadm_id']}:{r['seq_num']}", start,
                  source_ref=f"Condition/{r['hadm_id']}-{r['seq_num']}", resource_type="Condition",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=start, recorded_at=discharged or start, status="active",
                  codes=(Coding(system=system, code=code, display=self.lk.icd_dx.get((code, version))),),
                  attributes={"hadm_id": r["hadm_id"], "seq_num": int(r["seq_num"])})

    def _procedures_icd(self, r: Row) -> None:
        code, version = r["icd_code"].strip(), r["icd_version"]
        system = {"9": SYS_ICD9_PROC, "10": SYS_ICD10_PCS}.get(version)
        if system is None:
            raise SourceError(f"icd_version {version!r} is neither 9 nor 10")
        when = parse_mimic_time(r["chartdate"], "chartdate")
        self.emit("procedures_icd", f"{r['hadm_id']}:{r['seq_num']}", when,
                  source_ref=f"Procedure/{r['hadm_id']}-{r['seq_num']}", resource_type="Procedure",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=when, recorded_at=when, status="completed",
                  codes=(Coding(system=system, code=code, display=self.lk.icd_proc.get((code, version))),),
                  attributes={"hadm_id": r["hadm_id"]})

    def _hcpcsevents(self, r: Row) -> None:
        when = parse_mimic_time(r["chartdate"], "chartdate")
        self.emit("hcpcsevents", f"{r['hadm_id']}:{r['seq_num']}", when,
                  source_ref=f"Procedure/hcpcs-{r['hadm_id']}-{r['seq_num']}", resource_type="Procedure",
                  encounter=self._encounter(r["hadm_id"]),
                  effective_at=when, recorded_at=when, status="completed",
                  codes=(Coding(system=SYS_HCPCS, code=r["hcpcs_cd"].strip(),
                                display=r.get("short_description") or None),),
                  attributes={"hadm_id": r["hadm_id"]})
