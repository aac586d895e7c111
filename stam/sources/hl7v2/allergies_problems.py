"""HL7 v2 allergies and problems -> entries: AL1 and IAM (AllergyIntolerance), PRB (a problem-list Condition)."""

from __future__ import annotations

from typing import Any

from stam.sources.hl7v2.message import EntrySpec, MessageMapping
from stam.sources.hl7v2.parsing import Segment, safe_id
from stam.sources.hl7v2.tables import LIFE_CYCLE


class AllergyProblemMapping(MessageMapping):
    """AL1, IAM and PRB."""

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
        self.add(EntrySpec(al1.pos, "AL1", "AllergyIntolerance", ref, codes, "active", self.time(al1, 6), attrs=attrs))

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
        self.add(EntrySpec(iam.pos, "IAM", "AllergyIntolerance", ref, codes, status, start, attrs=attrs))


    # -- problems (PPR) ------------------------------------------------------------------------------------

    def problem(self, prb: Segment) -> EntrySpec | None:
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
        return self.add(EntrySpec(prb.pos, "PRB", "Condition", ref, codes, status, start, end, attrs=attrs))
