"""Answers that use the state, on a real MIMIC-IV patient loaded with every table, asked at their clinical time.

MIMIC-IV demo subject 10018501 (a training-split patient, 435 entries from every table) is replayed through the
write-path stages on real stores. Its MIMIC-QA questions (every template: latest, previous, first, lowest,
highest, value at a time, count, change since the first, the active order started most recently, the order
discontinued or changed most recently, whether a drug was an active order, what an order was changed into) are
computed from the CSV rows alone (``stam_lab.eval.mimic_qa``), never from STAM. Each is asked at its clinical time
through ``as_of``, as a user would: the packet must carry every supporting row, and where the question names a
concept the computed fact must state the rows' answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from schemas import Store
from schemas.query import QueryRequest
from stam.compose import local_query_service
from stam.sources.mimic import TABLES
from stam_lab.eval.mimic_qa import build_questions
from stam_lab.eval.qa import normalize_answer
from tests.conftest import DATA

pytestmark = pytest.mark.integration
MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10018501"
VALUE_TYPES = {"first_value", "last_value", "previous_value", "min_value", "max_value", "value_at_time", "count"}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory, embedder: Any) -> Iterator[Any]:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC}")
    from stam_lab.eval.state_eval import replay_mimic

    run = replay_mimic(MIMIC, subjects=[PATIENT], tables=TABLES, variant="stam",
                       workdir=Path(tmp_path_factory.mktemp("mimic")), embedder=embedder)
    yield run
    run.close()


def test_every_template_gets_its_evidence_and_the_rows_answer(replayed: Any, embedder: Any) -> None:
    svc = local_query_service(replayed.deps, embedder=embedder)
    questions = build_questions(MIMIC, subjects=[PATIENT])
    assert len({q.qtype for q in questions}) == 16
    later: dict[str, list[datetime]] = {}  # lab results by item, to check nothing stale is served as current
    for e in replayed.entries[PATIENT]:
        if e.entry_id.startswith("mimic-iv:labevents:") and e.effective_at is not None:
            later.setdefault(e.codes[0].code, []).append(e.effective_at)
    code_of = {e.entry_id: e.codes[0].code for e in replayed.entries[PATIENT] if e.codes}
    for q in questions:
        as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
        p = svc.packet(QueryRequest(request_id=q.question_id, patient_id=PATIENT, question=q.question, as_of=as_of))
        served = {i.source_entry_id for i in p.items}
        assert set(q.evidence) <= served, (q.qtype, q.question, set(q.evidence) - served, p.rendered)
        if q.qtype in VALUE_TYPES:
            assert p.facts, (q.question, p.rendered)
            assert normalize_answer(q.answer) in normalize_answer(p.facts[0].text), (q.answer, p.facts[0].text)
        for i in p.items:  # a lab result served as current has no later result of its item by the packet's time
            if i.store is Store.ACTIVE and i.source_entry_id.startswith("mimic-iv:labevents:") and i.effective_start:
                times = later[code_of[i.source_entry_id]]
                assert not [t for t in times if i.effective_start < t <= (p.at or t)], (q.question, i.text)


def test_order_questions_are_computed_from_the_orders_of_the_named_drug(replayed: Any, embedder: Any) -> None:
    svc = local_query_service(replayed.deps, embedder=embedder)
    questions = [q for q in build_questions(MIMIC, subjects=[PATIENT])
                 if q.qtype in ("drug_active_at", "order_changed_into", "current_medication",
                                "discontinued_medication")]
    assert questions
    for q in questions:
        as_of = datetime.fromisoformat(q.as_of) if q.as_of else None
        p = svc.packet(QueryRequest(request_id=q.question_id, patient_id=PATIENT, question=q.question, as_of=as_of))
        assert p.facts, (q.question, p.rendered)
        fact = normalize_answer(p.facts[0].text)
        if q.qtype == "drug_active_at":  # "yes" / "no"
            assert f": {q.answer}, " in p.facts[0].text, (q.answer, p.facts[0].text)  # the answer first
        else:
            assert normalize_answer(q.answer) in fact, (q.answer, p.facts[0].text)
