"""Endurance labels: may an archived memory of this concept type be forgotten?

Three classes, as in the paper: *safe to forget* (resolved, and not expected to matter to later reasoning),
*never forget* (stays clinically or temporally relevant although historical), *uncertain* (cannot be told from
the content alone). Never-forget and uncertain are both **protected**: the gate's loss counts them.

Labels are given per **concept type**, not per memory, so that near-duplicate memories of one type (a heart
rate charted hourly) cannot sit on both sides of a train/calibration split. A concept type is the memory's
coded concept (``system|code``) where it has one, else its category and normalised text.

Two sources of labels:

- :func:`code_label`: what the codes already say, where that is sound. A vital sign charted again and again
  (LOINC vital-signs codes, MIMIC-IV charted vitals) is safe to forget once archived: a newer value replaced it
  and the series stays in the memories kept. A diagnosis, an allergy, a procedure and an immunization are
  never forgotten (history that later reasoning needs: past surgery, prior reactions, vaccination status).
  Nor is a coded laboratory result (a MIMIC-IV ``d_labitems`` item, valued or not, or a LOINC observation
  that is not a vital sign, with a value). A lab series is read as a trend: its nadir and peak, the value at a
  past time and the value before the latest are what clinicians ask of it (a baseline creatinine, the lowest
  haemoglobin), and deleting one from the middle of a series changes those answers (measured on MIMIC-QA: the
  first gate, which left labs to the judge and the head, cost 7 of 150 answers, all of them lab questions). The
  judge called 6 of the 17 lab types it labelled safe; the codes decide. Everything else is left to the judge
  (``None``).
- the blinded language-model judge over the concept and up to three example memories (:mod:`.judge`), stored
  with the judge, its prompt version and the date (or a reviewer's labels, added to the label file by hand).
  The two sources are compared where both label a type.
"""

from __future__ import annotations

import re
from enum import StrEnum

from schemas import AtomicMemory, Category, CodeSystem


class Endurance(StrEnum):
    SAFE = "safe-to-forget"
    UNCERTAIN = "uncertain"
    NEVER_FORGET = "never-forget"

    @property
    def protected(self) -> bool:
        """Counted by the gate's loss: never-forget and uncertain (the paper's strict rule)."""
        return self is not Endurance.SAFE


MIMIC_ITEMS = "mimic-d-items"
"""Suffix of the MIMIC-IV charted-items code system (stam/sources/mimic/codes.py SYS_ITEMS)."""

MIMIC_LABITEMS = "mimic-d-labitems"
"""Suffix of the MIMIC-IV laboratory-items code system (stam/sources/mimic/codes.py SYS_LAB)."""

VITAL_LOINC = frozenset({
    "85353-1", "85354-9", "8480-6", "8462-4", "8478-0",  # vital signs panel, blood pressure panel, systolic, diastolic, mean
    "8867-4", "9279-1", "8310-5", "8331-1", "2708-6", "59408-5",  # heart rate, respiratory rate, temperatures, SpO2
    "29463-7", "3141-9", "8302-2", "8306-3", "39156-5", "8287-5", "9843-4",  # weight, height, BMI, head circumference
    "72514-3",  # pain severity
})
"""LOINC codes of the FHIR vital-signs profile (and the pain score Synthea charts with them)."""

VITAL_MIMIC_ITEMS = frozenset({
    "220045",  # heart rate
    "220050", "220051", "220052",  # arterial blood pressure systolic, diastolic, mean
    "220179", "220180", "220181",  # non-invasive blood pressure systolic, diastolic, mean
    "220210", "224690",  # respiratory rate (and total)
    "220277",  # SpO2
    "223761", "223762",  # temperature F, C
})
"""MIMIC-IV ``d_items`` ids of the vital signs charted at the bedside (metavision)."""

NEVER_FORGET_CATEGORIES = frozenset({Category.CONDITION, Category.ALLERGY, Category.PROCEDURE,
                                     Category.IMMUNIZATION})


def concept_type(memory: AtomicMemory) -> str:
    """The unit labels are given for: the coded concept, else the category and the text, normalised."""
    if memory.concept is not None:
        return f"{memory.concept.system}|{memory.concept.code}"
    text = re.sub(r"[^a-z0-9]+", " ", memory.text.lower()).strip()
    return f"{memory.category.value}:{text[:120]}"


def _vital(memory: AtomicMemory) -> bool:
    c = memory.concept
    if c is None:
        return False
    if c.system == CodeSystem.LOINC.value:
        return c.code in VITAL_LOINC
    return c.system.endswith(MIMIC_ITEMS) and c.code in VITAL_MIMIC_ITEMS


def _lab_result(memory: AtomicMemory) -> bool:
    """A MIMIC-IV lab event (with or without a value: a result withheld or not reported still replaced the value
    before it in its series), or a LOINC observation with a value that is not a vital sign."""
    c = memory.concept
    if c is None:
        return False
    if c.system.endswith(MIMIC_LABITEMS):
        return True
    has_value = memory.value is not None or bool(memory.value_text)
    return has_value and c.system == CodeSystem.LOINC.value and c.code not in VITAL_LOINC


def code_label(memory: AtomicMemory) -> Endurance | None:
    """The label the codes support, or ``None`` where they do not decide (the judge labels those types)."""
    if memory.category is Category.OBSERVATION and _vital(memory):
        return Endurance.SAFE
    if memory.category is Category.OBSERVATION and _lab_result(memory):
        return Endurance.NEVER_FORGET
    if memory.category in NEVER_FORGET_CATEGORIES and memory.concept is not None:
        return Endurance.NEVER_FORGET
    return None
