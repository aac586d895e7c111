"""What every segment of an HL7 v2 message is mapped with: :class:`MessageMapping`, the message's header (MSH), its
patient (PID), the coding, time and reference helpers, and :class:`EntrySpec`, an entry under construction. The
segment groups' mappings are mixins of it (``visits``, ``allergies_problems``, ``results``, ``orders``), put
together in ``mapping``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from schemas import Coding, Quantity, Reference
from stam.errors import SourceError
from stam.ids import digest
from stam.sources.hl7v2.parsing import Segment, component, parse_dtm, safe_id
from stam.sources.hl7v2.tables import MESSAGE_CODE, SYSTEMS


@dataclass
class EntrySpec:
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
class OrderGroup:
    """Segments from one ORC to the next (an order with its pharmacy/immunization detail)."""

    orc: Segment | None = None
    segs: list[Segment] = field(default_factory=list)


class MessageMapping:
    """One message's header, patient and the entries made of it so far, with the helpers every segment group maps
    with."""

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
        self.specs: list[EntrySpec] = []
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

    def add(self, spec: EntrySpec) -> EntrySpec:
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

    @staticmethod
    def order_number(*candidates: tuple[Segment | None, int]) -> str:
        """The first filled field of ``candidates`` as an id: an order's placer or filler number (reports, orders,
        pharmacy and immunization segments)."""
        for seg, n in candidates:
            if seg is not None and seg.get(n):
                return safe_id(seg.get(n))
        return ""
