"""One inpatient visit as an integration engine would send it over HL7 v2: admit (A01), a lab order (ORM NW), a
pharmacy order (RDE NW), a dose given (RAS), discharge (A03), discharge cancelled (A13). Built field by field here
(the shared samples are single messages of unrelated patients and visits). Used by tests/unit/test_lifecycle.py
and benchmarks/discharge_cost.py."""

from __future__ import annotations

PATIENT_MRN = "LC-1001"
VISIT = "V-778"
ADMIT, DISCHARGE = "20300104081500", "20300109113000"


def seg(name: str, fields: dict[int, str]) -> str:
    """A segment with ``fields`` at their HL7 positions (1-based; MSH's field 1 is the separator itself)."""
    last = max(fields)
    values = [fields.get(i, "") for i in range(1, last + 1)]
    return name + "|" + "|".join(values)


def message(kind: str, control: str, when: str, *body: str) -> bytes:
    msh = "MSH|^~\\&|" + "|".join(["ADT1", "GHH", "STAM", "GHH", when, "", kind, control, "P", "2.5"])
    pid = seg("PID", {1: "1", 3: f"{PATIENT_MRN}^^^GHH^MR", 5: "TEST^LIFECYCLE", 7: "19600101", 8: "F"})
    return "\r".join([msh, *body[:1], pid, *body[1:]]).encode() + b"\r"


def pv1(admit: str = ADMIT, discharge: str = "") -> str:
    fields = {1: "1", 2: "I", 3: "W4^412^A", 19: VISIT, 44: admit}
    if discharge:
        fields[45] = discharge
    return seg("PV1", fields)


def admit() -> bytes:
    return message("ADT^A01^ADT_A01", "LC-A01", ADMIT, seg("EVN", {1: "A01", 2: ADMIT}), pv1())


def lab_order() -> bytes:
    return message("ORM^O01^ORM_O01", "LC-ORM", "20300104093000", seg("EVN", {2: "20300104093000"}), pv1(),
                seg("ORC", {1: "NW", 2: "ORD-55", 9: "20300104093000"}),
                seg("OBR", {1: "1", 2: "ORD-55", 4: "2823-3^Potassium [Moles/volume] in Serum or Plasma^LN",
                             7: "20300104093000"}))


def pharmacy_order() -> bytes:
    return message("RDE^O11^RDE_O11", "LC-RDE", "20300104094500", seg("EVN", {2: "20300104094500"}), pv1(),
                seg("ORC", {1: "NW", 2: "RX-91", 9: "20300104094500"}),
                seg("RXE", {2: "5856^Insulin regular^RXNORM", 3: "4", 5: "U^units"}),
                seg("TQ1", {1: "1", 7: "20300104100000"}))


def dose_given() -> bytes:
    return message("RAS^O17^RAS_O17", "LC-RAS", "20300104120000", seg("EVN", {2: "20300104120000"}), pv1(),
                seg("ORC", {1: "RE", 2: "RX-91"}),
                seg("RXA", {1: "0", 2: "1", 3: "20300104120000", 5: "5856^Insulin regular^RXNORM", 6: "4",
                             7: "U^units", 20: "CP"}))


def discharge() -> bytes:
    return message("ADT^A03^ADT_A03", "LC-A03", DISCHARGE, seg("EVN", {1: "A03", 2: DISCHARGE}),
                pv1(discharge=DISCHARGE))


def cancel_discharge() -> bytes:
    return message("ADT^A13^ADT_A01", "LC-A13", "20300109120000", seg("EVN", {1: "A13", 2: "20300109120000"}), pv1())


VISIT_MESSAGES = (admit, lab_order, pharmacy_order, dose_given, discharge, cancel_discharge)
