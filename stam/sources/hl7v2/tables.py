"""HL7 v2 vocabulary: code systems, status tables (OBX-11, OBR-25, ORC-1/5, PRB-14, RXA-20), which message
families carry which segments, and the patterns the parser and the mapper check fields against."""

from __future__ import annotations

import re

from schemas import CodeSystem

SOURCE = "hl7v2"
"""Entries' ``source``, and the first part of their ids."""


# --- code systems -----------------------------------------------------------------------------------------

NDC = "http://hl7.org/fhir/sid/ndc"
V2_CLASS = "http://terminology.hl7.org/CodeSystem/v2-0004"
SYSTEMS: dict[str, str] = {
    "LN": CodeSystem.LOINC, "LOINC": CodeSystem.LOINC,
    "SCT": CodeSystem.SNOMED, "SNOMED": CodeSystem.SNOMED, "SNOMEDCT": CodeSystem.SNOMED,
    "SNOMED-CT": CodeSystem.SNOMED, "SNOMED CT": CodeSystem.SNOMED,
    "I10": CodeSystem.ICD10, "I10C": CodeSystem.ICD10, "ICD10": CodeSystem.ICD10, "ICD-10": CodeSystem.ICD10,
    "ICD10CM": CodeSystem.ICD10, "ICD-10-CM": CodeSystem.ICD10,
    "I9": CodeSystem.ICD9, "I9C": CodeSystem.ICD9, "I9CM": CodeSystem.ICD9, "ICD9": CodeSystem.ICD9,
    "ICD-9": CodeSystem.ICD9, "ICD9CM": CodeSystem.ICD9, "ICD-9-CM": CodeSystem.ICD9,
    "RXNORM": CodeSystem.RXNORM, "CVX": CodeSystem.CVX, "NDC": NDC,
    "MVX": "http://hl7.org/fhir/sid/mvx", "C4": "http://www.ama-assn.org/go/cpt",
    "CPT": "http://www.ama-assn.org/go/cpt", "CPT4": "http://www.ama-assn.org/go/cpt",
    "UCUM": "http://unitsofmeasure.org",
}
CLASS_DISPLAY = {"I": "inpatient", "O": "outpatient", "E": "emergency", "P": "preadmit", "R": "recurring patient",
                  "B": "obstetrics", "C": "commercial account", "N": "not applicable", "U": "unknown"}

# --- status tables ----------------------------------------------------------------------------------------

# OBX-11 (HL7 table 0085). X (cannot obtain), N (not asked) and O/I without a value carry no result.
OBX_STATUS = {"F": "final", "U": "final", "C": "corrected", "A": "amended", "P": "preliminary", "S": "preliminary",
               "R": "preliminary", "I": "registered", "O": "registered", "D": "entered-in-error",
               "W": "entered-in-error"}
OBX_NO_RESULT = {"X": "result cannot be obtained", "N": "not asked"}
# OBR-25 (table 0123) for reports.
OBR_STATUS = {"F": "final", "C": "corrected", "A": "partial", "P": "preliminary", "R": "preliminary",
               "S": "partial", "I": "registered", "O": "registered"}
# ORC-1 order control (table 0119) and ORC-5 order status (table 0038).
ORDER_CONTROL = {"NW": "active", "SN": "active", "OK": "active", "XO": "active", "XX": "active", "RP": "active",
                  "RU": "active", "RL": "active", "RO": "active", "PA": "active", "CA": "cancelled",
                  "OC": "cancelled", "CR": "cancelled", "DC": "stopped", "OD": "stopped", "DR": "stopped",
                  "DE": "entered-in-error", "HD": "on-hold", "OH": "on-hold", "HR": "on-hold"}
ORDER_STATUS = {"A": "active", "IP": "active", "SC": "active", "CM": "completed", "CA": "cancelled",
                 "DC": "stopped", "ER": "entered-in-error", "HD": "on-hold"}
ENDING = {"cancelled", "stopped", "entered-in-error"}
REPLACING_CONTROLS = {"XO", "XX", "RP", "RU"}
# PRB-14 problem life cycle status -> condition clinical status.
LIFE_CYCLE = {"active": "active", "a": "active", "resolved": "resolved", "r": "resolved", "inactive": "inactive",
               "i": "inactive", "remission": "remission", "recurrence": "recurrence", "relapse": "relapse",
               "deleted": "resolved", "d": "resolved"}
# RXA-20 completion status.
RXA_STATUS = {"CP": "completed", "PA": "completed", "RE": "not-done", "NA": "not-done"}

# --- message families -------------------------------------------------------------------------------------

# ADT events that describe a visit: status of the Encounter entry (None: in-progress, finished when PV1-45
# carries a discharge time). Cancel events retract that visit only ("entered-in-error"): "cancelled" would
# make the coded reasoner end every active encounter of the same class.
VISIT_EVENTS: dict[str, str | None] = {
    "A01": None, "A02": None, "A04": None, "A06": None, "A07": None, "A08": None, "A09": None, "A10": None,
    "A12": None, "A15": None, "A16": None, "A21": None, "A22": None, "A25": None, "A26": None, "A32": None,
    "A33": None, "A54": None, "A55": None, "A61": None, "A62": None,
    "A03": "finished", "A05": "planned", "A14": "planned", "A13": "in-progress",
    "A11": "entered-in-error", "A23": "entered-in-error", "A27": "entered-in-error", "A38": "entered-in-error",
}
RETRACTING_EVENTS = {"A11", "A23", "A27", "A38"}
IDENTITY_EVENTS = {"A18", "A24", "A30", "A34", "A35", "A36", "A37", "A39", "A40", "A41", "A42", "A43", "A44",
                    "A45", "A46", "A47", "A48", "A49", "A50", "A51"}
ADT_EVENT_NAMES = {
    "A01": "admit/visit notification", "A02": "transfer", "A03": "discharge/end visit", "A04": "register a patient",
    "A05": "pre-admit", "A06": "change outpatient to inpatient", "A07": "change inpatient to outpatient",
    "A08": "update patient information", "A09": "patient departing (tracking)", "A10": "patient arriving (tracking)",
    "A11": "cancel admit/visit", "A12": "cancel transfer", "A13": "cancel discharge", "A14": "pending admit",
    "A15": "pending transfer", "A16": "pending discharge", "A17": "swap patients", "A20": "bed status update",
    "A25": "cancel pending discharge", "A26": "cancel pending transfer", "A27": "cancel pending admit",
    "A28": "add person information", "A29": "delete person information", "A31": "update person information",
    "A40": "merge patient - patient identifier list", "A41": "merge account - patient account number",
    "A45": "move visit information - visit number", "A47": "change patient identifier list",
    "A60": "update allergy information",
}
SEGMENTS: dict[str, frozenset[str]] = {
    "ADT": frozenset({"PV1", "DG1", "AL1", "IAM", "PR1", "OBX"}),
    "BAR": frozenset({"DG1", "AL1", "PR1", "OBX"}),
    "DFT": frozenset({"DG1", "AL1", "PR1", "OBX"}),
    "REF": frozenset({"DG1", "AL1", "PR1", "OBX"}),
    "RRI": frozenset({"DG1", "AL1", "PR1", "OBX"}),
    "ORU": frozenset({"OBR", "OBX"}),
    "OUL": frozenset({"OBR", "OBX"}),
    "ORM": frozenset({"OBR", "RXO", "RXE", "DG1", "AL1", "OBX"}),
    "OML": frozenset({"OBR", "RXO", "RXE", "DG1", "AL1", "OBX"}),
    "OMG": frozenset({"OBR", "RXO", "RXE", "DG1", "AL1", "OBX"}),
    "RDE": frozenset({"RXO", "RXE", "AL1", "OBX"}),
    "RDS": frozenset({"RXD", "OBX"}),
    "RAS": frozenset({"RXA", "OBX"}),
    "PPR": frozenset({"PRB", "AL1", "OBX"}),
    "MDM": frozenset({"OBR", "TXA", "OBX"}),
    "VXU": frozenset({"RXA", "AL1", "OBX"}),
}
REPORT_FAMILIES = {"ORU", "OUL"}
NO_CLINICAL_FACTS = {
    "SIU": "scheduling message (appointment booking/update): appointment data is not a clinical fact",
    "ACK": "acknowledgement: no clinical facts",
    "MFN": "master file notification: no patient data",
    "QRY": "query: no clinical facts",
    "QBP": "query: no clinical facts",
}
BAR_NO_FACTS = {"P02": "purge patient accounts", "P06": "end account", "P10": "transmit ambulatory payment"}

# Immunization-registry bookkeeping OBX (funding, VIS documents, forecasts) that are no clinical facts.
VXU_ADMIN_LOINC = {"64994-7", "30963-3", "69764-9", "29768-9", "29769-7", "30956-7", "30979-9", "30980-7",
                    "30981-5", "59779-9", "59780-7", "59781-5", "59782-3", "48767-8", "30973-2"}
OBX_VALUE_TYPES = {"NM", "SN", "CE", "CWE", "CNE", "CF", "ST", "ID", "IS", "TX", "FT", "DT", "DTM", "TS", "TM",
                    "NA", "MA", ""}
NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
DTM_PATTERN = re.compile(r"(\d{4})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:\.?(\d{1,4}))?)?)?)?)?)?([+-]\d{4})?")
SEGMENT_ID = re.compile(r"[A-Z][A-Z0-9]{2}")
MESSAGE_CODE = re.compile(r"[A-Z0-9_]{2,10}")
MSH_START = re.compile(rb"(?:^|(?<=[\r\n]))[\x0b\x1c\s]*(?:\xef\xbb\xbf)?MSH")
CHARSETS = {"8859/1": "latin-1", "8859/15": "iso8859-15", "ASCII": "ascii", "UNICODE UTF-8": "utf-8",
             "UTF-8": "utf-8", "8859/2": "iso8859-2", "8859/5": "iso8859-5", "8859/7": "iso8859-7"}
ENVELOPE = {"FHS", "BHS", "BTS", "FTS"}
UNESCAPE_MAP = {"H": "", "N": ""}  # highlighting on/off: drop rather than the library's "_"
MAX_ID = 120
BLANK = b"\x0b\x1c\x00 \t\r\n\xef\xbb\xbf"

Reps = tuple[tuple[tuple[str, ...], ...], ...]


