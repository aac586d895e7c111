"""The read path knows the encounter: a hand-written record of two admissions, read at clinical times.

Admission 1 (2145-07-01 08:00 to 2145-07-10 12:00, discharged to HOME) holds an insulin order the discharge ended,
two billed diagnoses and two PTT results; admission 2 (from 2148-01-20 08:00, no discharge recorded) holds a heparin
order and three PTT results. The patient's record gives sex F and age 52 in its anchor year 2145. Each question goes
through the read path's own plan (``read_plan``: the intent, the time, the view, the stay) and selection, with no
store, model or embedding (every score 0: the words of the question decide).
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from schemas import AtomicMemory, Category, Coding, Lifecycle, Reason, Store, StoredMemory
from schemas.query import EvidenceItem
from stam.read.aggregate import select
from stam.read.render import render_block
from stam.read.service import read_plan
from stam.read.threads import Selection, ThreadIndex
from stam.read.timeline import Timeline

LAB = "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-d-labitems"
ORDER = "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-poe-order"
ENC = "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-encounter-concept"


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


ADMIT1, DISCH1, ADMIT2 = t(2145, 7, 1, 8), t(2145, 7, 10, 12), t(2148, 1, 20, 8)


def mem(mid: str, category: Category, system: str, code: str, display: str, start: datetime | None, *,
        end: datetime | None = None, value: float | None = None, unit: str | None = None,
        value_text: str | None = None, ref: str | None = None, enc: str | None = None,
        lifecycle: Lifecycle | None = None, position: int = 0) -> AtomicMemory:
    return AtomicMemory(memory_id=mid, patient_id="p", entry_id=f"e-{mid}", position=position, category=category,
                        text=f"{display}: {value if value is not None else value_text or ''}",
                        concept=Coding(system=system, code=code, display=display), value=value, unit=unit,
                        value_text=value_text, effective_start=start, effective_end=end, source_ref=ref,
                        encounter_id=enc, lifecycle=lifecycle)


def stored(m: AtomicMemory, store: Store = Store.ACTIVE, reason: Reason | None = None, evidence: str | None = None,
           successor: str | None = None, ended_at: datetime | None = None) -> StoredMemory:
    return StoredMemory(memory=m, store=store, reason=reason, evidence_id=evidence, successor_id=successor,
                        ended_at=ended_at, archived_by_entry=m.entry_id if store is Store.HISTORY and not evidence
                        and not ended_at else None)


def ptt(mid: str, when: datetime, value: float, enc: str, nxt: str | None) -> StoredMemory:
    m = mem(mid, Category.OBSERVATION, LAB, "51275", "PTT (Blood)", when, value=value, unit="sec", enc=enc,
            ref=f"Observation/lab-{mid}")
    return stored(m, Store.HISTORY, Reason.SUPERSEDED, nxt, nxt) if nxt else stored(m)


def record() -> Timeline:
    e1, e2 = "Encounter/1", "Encounter/2"
    adm = "Hospital admission (EW EMER.; from EMERGENCY ROOM)"
    admission1 = mem("adm1", Category.ENCOUNTER, ENC, "hospital-admission", adm, ADMIT1, ref=e1, enc=e1,
                     lifecycle=Lifecycle.ENCOUNTER)
    discharge1 = mem("dc1", Category.ENCOUNTER, ENC, "hospital-admission", adm[:-1] + "; discharged to HOME)",
                     ADMIT1, end=DISCH1, ref=e1, enc=e1, lifecycle=Lifecycle.ENCOUNTER)
    admission2 = mem("adm2", Category.ENCOUNTER, ENC, "hospital-admission", adm, ADMIT2, ref=e2, enc=e2,
                     lifecycle=Lifecycle.ENCOUNTER)
    insulin = mem("insulin", Category.MEDICATION, ORDER, "p-1", "Insulin", t(2145, 7, 2, 9),
                  ref="MedicationRequest/poe-1", enc=e1, lifecycle=Lifecycle.ENCOUNTER)
    heparin = mem("heparin", Category.MEDICATION, ORDER, "p-2", "Heparin", t(2148, 1, 21, 9),
                  ref="MedicationRequest/poe-2", enc=e2, lifecycle=Lifecycle.ENCOUNTER)
    dx = [mem(f"dx{k}", Category.CONDITION, "http://hl7.org/fhir/sid/icd-10-cm", code, name, ADMIT1,
              ref=f"Condition/1-{k}", enc=e1) for k, (code, name) in enumerate((("E11", "Type 2 diabetes"),
                                                                               ("I10", "Hypertension")))]
    demo = [mem("sex", Category.OTHER, "http://loinc.org", "76689-9", "Sex", None, value_text="F", ref="Patient/p"),
            mem("age", Category.OTHER, "http://loinc.org", "30525-0", "Age in the anchor year", None, value=52,
                unit="years", ref="Patient/p", position=1),
            mem("anchor", Category.OTHER, "x", "anchor-year", "Anchor year of the age", None, value=2145,
                ref="Patient/p", position=2)]
    labs = [ptt("ptt1", t(2145, 7, 1, 20), 42, e1, "ptt2"), ptt("ptt2", t(2145, 7, 5, 6), 35, e1, "ptt3"),
            ptt("ptt3", t(2148, 1, 21, 10), 53.7, e2, "ptt4"), ptt("ptt4", t(2148, 1, 24, 6), 44, e2, "ptt5"),
            ptt("ptt5", t(2148, 1, 28, 6), 30.5, e2, None)]
    rows = [stored(admission1, Store.HISTORY, Reason.SUPERSEDED, "dc1", "dc1"),
            stored(discharge1, Store.HISTORY, Reason.ENCOUNTER_ENDED), stored(admission2),
            stored(insulin, Store.HISTORY, Reason.ENCOUNTER_ENDED, "dc1", ended_at=DISCH1), stored(heparin),
            *(stored(d) for d in dx), *(stored(d) for d in demo), *labs]
    return Timeline.from_stored("p", 1, rows)


@pytest.fixture(scope="module")
def timeline() -> tuple[Timeline, ThreadIndex]:
    tl = record()
    return tl, ThreadIndex.build(tl)


def ask(timeline: tuple[Timeline, ThreadIndex], question: str, as_of: datetime,
        serve_history: bool = True) -> Selection:
    tl, idx = timeline
    intent, _, view, stay = read_plan(tl, idx, question, as_of, None)
    return select(tl, idx, view, np.zeros(len(tl), dtype=np.float32), question, intent,
                  serve_history=serve_history, k_threads=8, k_history=8, stay=stay)


def served(timeline: tuple[Timeline, ThreadIndex], sel: Selection) -> set[str]:
    tl, _ = timeline
    return {tl.ids[i] for p in sel.picks for i in p.members}


def fact(sel: Selection) -> str:
    assert sel.facts, "no computed fact"
    return sel.facts[0].text


def test_the_stay_at_a_time_is_the_latest_admission_begun_by_then(timeline: tuple[Timeline, ThreadIndex]) -> None:
    tl, idx = timeline
    assert idx.encounters.at(tl, tl.view(t(2145, 7, 5))).encounter_id == "Encounter/1"  # type: ignore[union-attr]
    during = idx.encounters.at(tl, tl.view(t(2145, 7, 5)))
    assert during is not None and not during.ended  # its discharge is not recorded yet then
    after = idx.encounters.at(tl, tl.view(t(2146, 1, 1)))
    assert after is not None and after.ended and after.discharged_to() == "HOME"
    assert after.label() == "this admission, 2145-07-01 08:00 to 2145-07-10 12:00"
    now = idx.encounters.at(tl, tl.view(None))
    assert now is not None and now.encounter_id == "Encounter/2" and now.span().endswith("no discharge recorded")
    assert idx.encounters.at(tl, tl.view(t(2140, 1, 1))) is None


def test_since_the_first_measurement_of_this_admission_is_this_admissions_first(
        timeline: tuple[Timeline, ThreadIndex]) -> None:
    """The issue's example: the whole record went 42 -> 30.5 sec, this admission 53.7 -> 30.5 sec."""
    sel = ask(timeline, "How has the PTT changed since the first measurement of this admission?", t(2148, 1, 29))
    text = fact(sel)
    assert "change since the first value: -23.2 sec (53.7 sec at " in text and "to 30.5 sec at " in text, text
    assert "this admission, from 2148-01-20 08:00, no discharge recorded" in text
    assert {"ptt3", "ptt5"} <= served(timeline, sel) and "ptt1" not in served(timeline, sel)
    whole = fact(ask(timeline, "How has the PTT changed since the first result?", t(2148, 1, 29)))
    assert "change since the first value: -11.5 sec (42 sec at 2145-07-01 20:00 to 30.5 sec at " in whole, whole


def test_is_x_current_after_the_discharge_says_no_with_the_discharge_that_ended_it(
        timeline: tuple[Timeline, ThreadIndex]) -> None:
    for gate_open in (True, False):  # HISTORY is opened whatever the store gate said
        sel = ask(timeline, "Is the patient currently receiving insulin?", t(2147, 6, 20), serve_history=gate_open)
        text = fact(sel)
        assert text.startswith("Insulin as of 2147-06-20 00:00: no, not an active order and not being received; its last "
                               "order (from 2145-07-02 09:00, ended 2145-07-10 12:00 when"), text
        assert "ended 2145-07-10 12:00 when its admission ended at discharge" in text, text
        assert {"insulin", "dc1"} <= served(timeline, sel) and {"insulin", "dc1"} <= set(sel.facts[0].memory_ids)
    during = ask(timeline, "Is the patient currently receiving insulin?", t(2145, 7, 3))
    yes = ": yes, an active order, being received (one started"
    assert yes in fact(during) and served(timeline, during) == {"insulin"}
    assert yes in fact(ask(timeline, "Is the patient still on heparin?", t(2148, 1, 29)))


def test_what_the_discharge_ended(timeline: tuple[Timeline, ThreadIndex]) -> None:
    sel = ask(timeline, "What changed at discharge: which of the patient's medication orders did the discharge end?",
              DISCH1)
    text = fact(sel)
    assert "discharged to HOME" in text, text
    assert text.endswith("the discharge ended medication orders for 1 drug: Insulin; number of medication orders the "
                         "discharge ended: 1"), text
    assert served(timeline, sel) == {"dc1", "insulin"}
    before = fact(ask(timeline, "What changed at discharge?", t(2145, 7, 9)))
    assert before.endswith("no discharge recorded as of 2145-07-09 00:00"), before


def test_lists_and_counts_over_an_encounter(timeline: tuple[Timeline, ThreadIndex]) -> None:
    sel = ask(timeline, "How many diagnoses were billed for this admission?", DISCH1)
    text = fact(sel)
    assert text.startswith("diagnoses recorded in this admission, 2145-07-01 08:00 to 2145-07-10 12:00: "), text
    assert "Hypertension" in text  # the names first, the number last (a small reader took a digit of the list)
    assert text.endswith("; number of diagnoses recorded in this admission: 2"), text
    assert served(timeline, sel) == {"dx0", "dx1"}
    assert "Hypertension" in fact(ask(timeline, "Which diagnoses were billed for this admission?", DISCH1))
    # The second admission has none of them.
    assert fact(ask(timeline, "How many diagnoses were recorded during this admission?", t(2148, 1, 29))) \
        .startswith("number of diagnoses recorded in this admission, from 2148-01-20 08:00, no discharge recorded: 0")


def test_first_day_and_hour_n_of_the_stay(timeline: tuple[Timeline, ThreadIndex]) -> None:
    first_day = fact(ask(timeline, "What was the highest PTT value within the first day of this admission?",
                         t(2145, 7, 9)))
    assert first_day.endswith(": 42 sec") and "the first day of this admission" in first_day, first_day
    hour = fact(ask(timeline, "What was the most recent PTT value at hour 30 of this stay?", t(2148, 1, 29)))
    assert hour.endswith(": 53.7 sec") and "hour 30 of this admission" in hour and "2148-01-21 14:00" in hour, hour
    # Before the admission's first PTT, nothing of this stay: no value from the previous admission is given.
    early = ask(timeline, "What was the most recent PTT value at hour 2 of this stay?", t(2148, 1, 29))
    assert not early.facts


def test_demographics_and_admission_facts(timeline: tuple[Timeline, ThreadIndex]) -> None:
    age = fact(ask(timeline, "How old is the patient?", t(2148, 1, 29)))
    assert age.startswith("the patient's age as of 2148-01-29: 55 years (an estimate") and "52 years in 2145" in age
    assert fact(ask(timeline, "What is the patient's sex?", t(2148, 1, 29))).endswith(": F")
    done = fact(ask(timeline, "When was the patient discharged?", t(2146, 1, 1)))
    assert "discharged 2145-07-10 12:00 to HOME" in done and "length of stay 9.2 days" in done, done
    open_ = fact(ask(timeline, "When was the patient discharged?", t(2148, 1, 29)))
    assert "no discharge recorded as of 2148-01-29" in open_, open_


def _item(value: str, when: datetime, store: Store) -> EvidenceItem:
    from schemas import Category as C

    return EvidenceItem(rank=1, memory_id=f"m{when.isoformat()}", store=store, score=0.0, category=C.OBSERVATION,
                        text="PTT", effective_start=when, concept="PTT (Blood)", value=value, tokens=0,
                        source_entry_id="e")


def test_a_value_line_marks_where_the_current_admission_begins() -> None:
    items = [_item("30.5 sec", t(2148, 1, 28, 6), Store.ACTIVE), _item("53.7 sec", t(2148, 1, 21, 10), Store.HISTORY),
             _item("35 sec", t(2145, 7, 5, 6), Store.HISTORY)]
    line = render_block(items, labels=True, stay_start=ADMIT2)
    assert line == ("- PTT (Blood): 30.5 sec at 2148-01-28 06:00 [current]; earlier: 53.7 sec at 2148-01-21 10:00; "
                    "| before this admission (from 2148-01-20 08:00): 35 sec at 2145-07-05 06:00")
    assert "before this admission" not in render_block(items, labels=True)


def test_a_concentration_names_one_product_not_its_namesakes() -> None:
    """Dextrose 5% (a maintenance fluid, ended) and Dextrose 50% (a rescue for low glucose, active) share the core
    name "dextrose": asked about one strength, the answer is about that one (MIMIC patient 10020740 got "yes" for
    Dextrose 5% from the Dextrose 50% order)."""
    e = "Encounter/9"
    admit = mem("adm", Category.ENCOUNTER, ENC, "hospital-admission", "Hospital admission", t(2150, 3, 11), ref=e,
                enc=e, lifecycle=Lifecycle.ENCOUNTER)
    d5 = mem("d5", Category.MEDICATION, "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-medication-icu", "225158",
             "Dextrose 5% (IV therapy: IV fluids)", t(2150, 3, 20), end=t(2150, 3, 21), ref="MedicationRequest/icu-1",
             enc=e, lifecycle=Lifecycle.INTERVAL)
    d50 = mem("d50", Category.MEDICATION, ORDER, "p-9", "Dextrose 50%", t(2150, 3, 26, 17),
              end=t(2150, 4, 25, 18), ref="MedicationRequest/poe-9", enc=e, lifecycle=Lifecycle.ENCOUNTER)
    tl = Timeline.from_stored("p", 1, [stored(admit), stored(d5, Store.HISTORY, Reason.EXPIRED,
                                                             ended_at=t(2150, 3, 21)), stored(d50)])
    pair = (tl, ThreadIndex.build(tl))
    at = t(2150, 4, 1, 8, 10)
    five = fact(ask(pair, "As of 2150-04-01 08:10:00, is the patient currently receiving Dextrose 5%?", at))
    assert ": no, not an active order" in five and "Dextrose 5%" in five, five
    fifty = fact(ask(pair, "Is the patient currently receiving Dextrose 50%?", at))
    assert ": yes, an active order" in fifty, fifty
