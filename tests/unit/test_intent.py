"""What a question asks of time: intents and time expressions, resolved against the patient's clinical clock."""

from datetime import UTC, datetime

import pytest

from schemas.query import GateMode
from stam.read.intent import find_times, parse
from stam.read.store_gate import StoreGate

NOW = datetime(2148, 2, 1, 12, 0, tzinfo=UTC)


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@pytest.mark.parametrize(("question", "kind"), [
    ("What is the patient's body height?", "current"),
    ("What was the most recent Potassium (Blood) value recorded for the patient?", "current"),
    ("What was the Potassium (Blood) value before the most recent one?", "previous"),
    ("What was the previous creatinine?", "previous"),
    ("What was the first Glucose (Blood) value recorded for the patient?", "first"),
    ("What was the baseline hemoglobin?", "first"),
    ("What was the highest lactate?", "highest"),
    ("What was the lowest Sodium value recorded?", "lowest"),
    ("How many hospital admissions does the patient have?", "count"),
    ("How has the patient's Creatinine (Blood) changed since the first result?", "change"),
    ("Has the weight increased?", "change"),
    ("Was carbamazepine ever stopped?", "history"),
    ("As of 2148-01-28 20:06:00, which of the patient's active medication orders was started most recently?",
     "started"),
    ("As of 2148-01-28 20:06:00, which medication order was most recently discontinued or changed?", "stopped"),
    ("As of 2148-01-28 20:06:00, was Heparin an active medication order?", "active"),
    ("Is the patient still on warfarin?", "active"),
    ("What was the Heparin order of 2148-01-20 10:00:00 changed into?", "changed_into"),
    ("What was vancomycin switched to?", "changed_into"),
])
def test_kinds(question: str, kind: str) -> None:
    assert parse(question, NOW).kind == kind


def test_history_kinds_open_the_gate_and_current_ones_do_not() -> None:
    gate = StoreGate(threshold=0.0)
    for q, served in (("What was the first potassium?", True), ("What is the latest potassium?", False),
                      ("potassium in the last 24 hours", True)):
        d = gate.decide(q, GateMode.AUTO, 0.8, 0.8, parse(q, NOW))
        assert d.serve_history is served, (q, d.reason)


def test_a_tie_is_not_history_matching_better() -> None:
    gate = StoreGate(threshold=0.0)
    q = "What is the patient's body height?"
    for noise in (0.0, 1e-7, 0.004):  # every value of a coded concept shares one vector: float noise only
        assert not gate.decide(q, GateMode.AUTO, 0.62, 0.62 + noise, parse(q, NOW)).serve_history
    assert gate.decide(q, GateMode.AUTO, 0.50, 0.62, parse(q, NOW)).serve_history


def test_explicit_dates_and_times() -> None:
    assert parse("As of 2148-01-28 20:06:00, what was the most recent potassium?", NOW).at == at(2148, 1, 28, 20, 6)
    assert parse("potassium at 2148-01-28T20:06", NOW).at == at(2148, 1, 28, 20, 6)
    # A date alone is the end of that day; "on" a day is a window of that day.
    assert parse("as of 2148-01-28, the potassium?", NOW).at == at(2148, 1, 29)
    on = parse("What was the potassium on 01/28/2148?", NOW)
    assert (on.start, on.end, on.at) == (at(2148, 1, 28), at(2148, 1, 29), at(2148, 1, 29))
    assert parse("glucose on January 5, 2148", NOW).start == at(2148, 1, 5)
    assert parse("glucose on 5 Jan 2148", NOW).start == at(2148, 1, 5)
    month = parse("weight in March 1939", NOW)
    assert (month.start, month.end) == (at(1939, 3, 1), at(1939, 4, 1))
    year = parse("weight in 1939", NOW)
    assert (year.start, year.end) == (at(1939, 1, 1), at(1940, 1, 1))
    before = parse("the last potassium before 2148-01-20 08:00", NOW)
    assert (before.end, before.at) == (at(2148, 1, 20, 8), at(2148, 1, 20, 8))
    assert parse("creatinine since 2148-01-10", NOW).start == at(2148, 1, 10)
    between = parse("What did the potassium do between 2148-01-01 and 2148-01-10?", NOW)
    assert (between.start, between.end) == (at(2148, 1, 1), at(2148, 1, 11))
    assert parse("sodium 140 mmol/L", NOW).at is None  # a value is not a time
    assert find_times("2148-02-30") == []  # not a date


def test_relative_times_resolve_against_the_clinical_clock() -> None:
    last = parse("What was the highest potassium in the last 24 hours?", NOW)
    assert (last.kind, last.start) == ("highest", at(2148, 1, 31, 12))
    assert parse("creatinine over the past 3 days", NOW).start == at(2148, 1, 29, 12)
    assert parse("weight in the past week", NOW).start == at(2148, 1, 25, 12)
    assert parse("What was the potassium 2 days ago?", NOW).at == at(2148, 1, 30, 12)
    y = parse("What was the potassium yesterday?", NOW)
    assert (y.start, y.end) == (at(2148, 1, 31), at(2148, 2, 1))
    # Without a clock (an empty record), relative times stay unresolved rather than guessed.
    assert parse("potassium in the last 24 hours", None).start is None


def test_the_time_of_a_changed_order_names_the_order_not_the_point_of_view() -> None:
    i = parse("What was the Heparin order of 2148-01-20 10:00:00 changed into?", NOW)
    assert i.at is None and i.about == at(2148, 1, 20, 10)


@pytest.mark.parametrize(("question", "kind", "scope", "hours", "category"), [
    ("Is the patient currently receiving insulin?", "active", None, None, None),
    ("As of 2148-01-28 20:06:00, is the patient currently receiving Heparin?", "active", None, None, None),
    ("How has the PTT changed since the first measurement of this admission?", "change", "stay", None, None),
    ("What was the highest Creatinine (Blood) value within the first day of this admission?", "highest", "first", 24,
     None),
    ("What was the most recent Potassium (Blood) value at hour 344 of the stay?", "current", "hour", 344, None),
    ("What changed at discharge: which of the patient's medication orders did the discharge end?", "discharge",
     "discharge", None, "medication"),
    ("What changed at discharge?", "discharge", "discharge", None, None),
    ("Which medication orders were still active at discharge?", "discharge", "discharge", None, "medication"),
    ("What was the creatinine at discharge?", "current", "discharge", None, None),
    ("How many diagnoses were billed for this admission?", "count", "stay", None, "condition"),
    ("Which diagnoses were billed for this admission?", "current", "stay", None, "condition"),
    ("Which medication was administered most often during this stay?", "most_frequent", "stay", None,
     "administration"),
    ("How many doses of heparin were given within the first 48 hours of the prescription?", "count", "first", 48,
     None),
    ("How old is the patient?", "age", None, None, None),
    ("What is the patient's sex?", "sex", None, None, None),
    ("When was the patient discharged?", "admission", None, None, None),
    ("Where was the patient discharged to?", "admission", None, None, None),
    ("How many hospital admissions does the patient have?", "count", None, None, None),
])
def test_encounter_words_kinds_and_categories(question: str, kind: str, scope: str | None, hours: float | None,
                                              category: str | None) -> None:
    got = parse(question, NOW)
    assert (got.kind, got.scope, got.hours, got.category) == (kind, scope, hours, category), got


def test_a_scope_names_no_time_of_its_own_and_the_first_day_is_not_the_first_value() -> None:
    got = parse("What was the highest Creatinine (Blood) value within the first day of this admission?", NOW)
    assert got.at is None and got.start is None and got.needs_history
    assert parse("What was the first creatinine of this admission?", NOW).kind == "first"
    assert parse("How many doses of heparin were given within the first day of the prescription?", NOW).scope_of \
        == "order"
