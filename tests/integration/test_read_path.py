"""The read path on real data and real stores: concept threads, intents, the gate, packets, point in time,
visibility, and isolation between patients.

Patient 12981771-... (Synthea bundle 7bf5504f-...): Body Height (LOINC 8302-2) was measured 11 times;
the last, 87.8171 cm on 1941-03-15, is ACTIVE, the ten before it are in HISTORY (superseded, each linked
to the next). Carbamazepine was stopped in 1938 and re-ordered in 1940.
"""

from __future__ import annotations

import asyncio
import random
from datetime import datetime
from typing import Any

import pytest

from schemas import Store, TransitionEvent
from schemas.query import GateMode, QueryRequest, Visibility
from stam.compose import local_query_service
from stam.read.service import NO_READER, QueryService, TimelineCache
from stam.read.store_gate import StoreGate
from stam.sources.fhir_r4 import load_bundle
from stam.stages import process_entry
from tests.conftest import BUNDLES, SMALL_PATIENT

pytestmark = pytest.mark.integration
HEIGHT = "http://loinc.org|8302-2"
OTHER_BUNDLE = BUNDLES / "22bbe238-220e-495c-8abc-0ce3aa28a605.json"  # the second smallest bundle


@pytest.fixture()
def loaded(deps: Any, small_bundle: Any) -> tuple[Any, list[TransitionEvent]]:
    events: list[TransitionEvent] = []
    for e in small_bundle.entries:
        events.extend(process_entry(e, deps).transitions)
    return deps, events


def service(deps: Any, *, events: list[TransitionEvent] | None = None, cache: int = 500_000) -> QueryService:
    async def log(_pid: str) -> list[TransitionEvent]:
        return list(events or [])

    return local_query_service(deps, gate=StoreGate(0.0), transitions=log if events is not None else None,
                               cache=TimelineCache(cache))


def ask(svc: QueryService, question: str, **kw: Any) -> Any:
    req = QueryRequest(request_id="r1", patient_id=kw.pop("patient_id", SMALL_PATIENT), question=question, **kw)
    return asyncio.run(svc.answer(req))


def heights(packet: Any, deps: Any) -> list[Any]:
    state = deps.states.load(SMALL_PATIENT)
    return [i for i in packet.items if state.get(i.memory_id).memory.concept_key == HEIGHT]


def test_current_question_gets_only_the_current_fact_as_current(loaded: Any) -> None:
    deps, _ = loaded
    answer = ask(service(deps), "What is the patient's body height?")
    assert answer.ok and answer.note == NO_READER and answer.answer is None
    p = answer.packet
    assert not p.gate.serve_history and p.gate.cue is None and "margin 0.000" in p.gate.reason  # a tie: ACTIVE
    (h,) = heights(p, deps)
    assert h.store is Store.ACTIVE and h.text.startswith("Body Height: 87.8") and h.role == "current"
    assert "- Body Height: 87.8171 cm at 1941-03-15 07:44 [current]" in p.rendered
    assert "earlier" not in next(x for x in p.rendered.splitlines() if x.startswith("- Body Height:"))
    assert p.rendered.splitlines()[-1].startswith("Computed from the record: ")  # last, next to the question
    (fact,) = p.facts
    assert fact.text == "Body Height, most recent value (at 1941-03-15 07:44): 87.8171 cm"  # the answer last
    assert fact.memory_ids == (h.memory_id,) and "Computed from the record: " + fact.text in p.rendered
    assert p.tokens > 0 and p.tokenizer == "all-MiniLM-L6-v2"


def test_a_hit_brings_the_thread_in_clinical_order(loaded: Any, small_bundle: Any) -> None:
    deps, _ = loaded
    p = ask(service(deps), "How has the body height changed over time?", k_history=10).packet
    assert p.gate.serve_history and p.intent == "change"
    hs = heights(p, deps)
    assert len(hs) == 11 and {h.thread for h in hs} == {0}  # the whole thread, one block
    starts = [h.effective_start for h in hs]
    assert starts == sorted(starts, reverse=True)  # newest first
    assert hs[0].store is Store.ACTIVE and all(h.store is Store.HISTORY for h in hs[1:])
    for h in hs[1:]:
        assert h.reason is not None and h.reason.value == "superseded" and h.successor_id
    measured = sorted((e for e in small_bundle.entries if e.codes and e.codes[0].code == "8302-2"),
                      key=lambda e: e.effective_at)
    assert hs[-1].source_entry_id == measured[0].entry_id and hs[-1].role == "first"
    line = next(x for x in p.rendered.splitlines() if x.startswith("- Body Height:"))
    # the question's time falls in the record's last encounter (1941-03-29): the current value predates it
    assert line.startswith("- Body Height: 87.8171 cm at 1941-03-15 07:44 [current] (before this admission, from "
                           "1941-03-29 07:44); earlier: 83.211 cm at ")
    assert "replaced by" not in p.rendered and line.count("Body Height") == 1  # the successor is not repeated
    (fact,) = p.facts
    assert fact.text == ("Body Height, change since the first value: +39.8 cm (48.0211 cm at 1938-04-09 07:44 to "
                         "87.8171 cm at 1941-03-15 07:44, the most recent)")


@pytest.mark.parametrize(("question", "role", "value"), [
    ("What was the body height before the most recent one?", "previous", "83.211 cm"),
    ("What was the first body height?", "first", "48.0211 cm"),
    ("What was the lowest body height?", "lowest", "48.0211 cm"),
    ("What was the highest body height?", "highest", "87.8171 cm"),
])
def test_the_thread_is_filled_by_what_the_question_asks(loaded: Any, question: str, role: str, value: str) -> None:
    deps, _ = loaded
    p = ask(service(deps), question).packet
    picked = [h for h in heights(p, deps) if h.role == role or (h.role == "current" and h.value == value)]
    assert picked and all(h.value == value for h in picked)  # the current value keeps its role when it is also it
    assert value in p.facts[0].text and set(p.facts[0].memory_ids) >= {h.memory_id for h in picked}


def test_count_and_a_time_window(loaded: Any, small_bundle: Any) -> None:
    deps, _ = loaded
    measured = [e for e in small_bundle.entries if e.codes and e.codes[0].code == "8302-2"]
    p = ask(service(deps), "How many body height measurements were recorded?").packet
    assert p.facts[0].text == f"Number of Body Height records: {len(measured)}"
    in_1939 = [e for e in measured if e.effective_at.year == 1939]
    p = ask(service(deps), "What were the body heights in 1939?").packet
    assert {h.source_entry_id for h in heights(p, deps)} == {e.entry_id for e in in_1939}
    assert p.at == datetime.fromisoformat("1940-01-01T00:00:00+00:00")


def test_gate_modes_labels_joint_ranking_and_token_budget(loaded: Any) -> None:
    deps, _ = loaded
    svc = service(deps)
    both = ask(svc, "What is the patient's body height?", gate=GateMode.BOTH).packet
    assert both.gate.serve_history and any(i.store is Store.HISTORY for i in both.items)
    active = ask(svc, "Was carbamazepine ever stopped?", gate=GateMode.ACTIVE).packet
    assert not active.gate.serve_history and all(i.store is Store.ACTIVE for i in active.items)
    stopped = ask(svc, "Was carbamazepine ever stopped?").packet
    assert stopped.gate.serve_history and any(i.store is Store.HISTORY and "arbamazepine" in i.text
                                              for i in stopped.items)
    neutral = ask(svc, "body height", gate=GateMode.BOTH, labels=False).packet
    assert "[current]" not in neutral.rendered and "superseded" not in neutral.rendered
    joint = ask(svc, "recent results", gate=GateMode.BOTH, ranking="joint", k_active=3, k_history=3).packet
    assert len({i.thread for i in joint.items}) == 3  # no concept named: k_active threads
    small = ask(svc, "How has the body height changed?", token_budget=60).packet
    assert small.dropped > 0 and small.tokens <= 60
    assert [i.rank for i in small.items] == sorted(i.rank for i in small.items)


def test_as_of_reconstructs_the_past(loaded: Any, small_bundle: Any) -> None:
    deps, events = loaded
    svc = service(deps, events=events)
    when = datetime.fromisoformat("1938-06-01T00:00:00+00:00")
    measured = sorted((e for e in small_bundle.entries if e.codes and e.codes[0].code == "8302-2"),
                      key=lambda e: e.effective_at)
    expected = [e for e in measured if e.effective_at <= when][-1]  # the last height measured by then
    for p in (ask(svc, "What is the patient's body height?", as_of=when).packet,
              ask(svc, "What was the body height as of 1938-06-01?").packet):  # the time in the question
        (h,) = heights(p, deps)
        assert h.store is Store.ACTIVE and h.source_entry_id == expected.entry_id
        assert p.at == when or p.at == datetime.fromisoformat("1938-06-02T00:00:00+00:00")
    # A position in the stream: right after the first entry only that entry's memories exist.
    first = ask(svc, "anything", as_of_version=1).packet
    assert first.state_version == 1 and {i.source_entry_id for i in first.items} == {small_bundle.entries[0].entry_id}
    # as_of needs no log (the timeline); a position in the stream does, and without one the query is refused.
    assert ask(service(deps), "body height", as_of=when).ok
    refused = ask(service(deps), "body height", as_of_version=1)
    assert not refused.ok and "transition log" in refused.error and refused.error_kind == "invalid"


def test_visibility_boundary(loaded: Any, small_bundle: Any) -> None:
    deps, _ = loaded
    svc = service(deps)
    measured = sorted((e for e in small_bundle.entries if e.codes and e.codes[0].code == "8302-2"),
                      key=lambda e: e.effective_at)
    hidden = Visibility(exclude_entry_ids=(measured[-1].entry_id,))
    p = ask(svc, "What is the patient's body height?", visibility=hidden).packet
    (h,) = heights(p, deps)  # the one before the withheld measurement is current again
    assert h.source_entry_id == measured[-2].entry_id and h.store is Store.ACTIVE
    assert measured[-1].entry_id not in {i.source_entry_id for i in p.items}
    only = ask(svc, "carbamazepine", visibility=Visibility(categories=("observation",)), gate=GateMode.BOTH).packet
    assert only.items and all(i.category.value == "observation" for i in only.items)


def test_a_query_never_returns_another_patients_memory(deps: Any, small_bundle: Any) -> None:
    other = load_bundle(OTHER_BUNDLE)
    for e in small_bundle.entries + other.entries:
        process_entry(e, deps)
    own = {pid: {m.memory.memory_id for m in deps.states.load(pid).memories.values()}
           for pid in (SMALL_PATIENT, other.entries[0].patient_id)}
    vocabulary = [m.memory.text for pid in own for m in deps.states.load(pid).memories.values()]
    rng = random.Random(7)
    for svc in (service(deps), service(deps, cache=1)):  # timelines kept warm, and read anew every time
        for _ in range(150):
            pid = rng.choice(sorted(own))
            q = rng.choice(vocabulary)  # often a fact of the *other* patient, word for word
            answer = ask(svc, q, patient_id=pid, gate=GateMode.BOTH, k_active=10, k_history=10)
            assert answer.ok, (q, answer.error)
            p = answer.packet
            assert {i.memory_id for i in p.items} <= own[pid]
            assert p.items or "nothing recorded by then" in p.rendered  # a date in the question before the record
    unknown = ask(service(deps), "body height", patient_id="no-such-patient")
    assert not unknown.ok and unknown.error_kind == "not_found" and "no memory" in unknown.error


def test_gate_calibration_on_a_labelled_set_from_real_state(loaded: Any, tmp_path: Any) -> None:
    from stam.read.calibrate import labelled_set, replay
    from stam.read.store_gate import calibrate, load_gate, write_gate_file

    deps, _ = loaded
    items = labelled_set(deps.states, [SMALL_PATIENT], per_patient=200)
    kinds = {i["kind"] for i in items}
    assert kinds == {"current", "past-value", "ended"}
    samples = asyncio.run(replay(service(deps), items))
    by_kind = {k: [s for i, s in zip(items, samples, strict=True) if i["kind"] == k] for k in kinds}
    assert all(s.agree for s in by_kind["current"])  # ACTIVE alone serves the current fact
    assert not all(s.agree for s in by_kind["ended"])  # a stopped drug / resolved condition needs HISTORY
    assert all(s.cue for s in by_kind["past-value"])  # "<concept> on <date>": a date cue
    cal = calibrate(samples, lam=0.2)
    assert cal.n == len(items) and 0 < cal.skip_rate < 1 and cal.disagreement == 0.0
    assert cal.served_tokens_gate < cal.served_tokens_both
    write_gate_file(tmp_path / "gate.json", cal, source="labelled_set")
    gated = service(deps)
    gated.gate = load_gate(tmp_path / "gate.json", default=0.0)
    ended = next(i for i in items if i["kind"] == "ended")
    p = ask(gated, ended["question"]).packet  # e.g. "Does the patient have Diazepam ...?"
    assert p.gate.serve_history and ended["evidence"][0] in {i.source_entry_id for i in p.items}


def test_timeline_rows_kept_beside_the_records_give_the_same_timeline(loaded: Any) -> None:
    import numpy as np

    from stam.read.timeline import Timeline

    deps, _ = loaded
    got = deps.states.timeline_rows(SMALL_PATIENT)
    assert got is not None  # written with every commit
    version, raw = deps.states.records(SMALL_PATIENT)
    fast, full = Timeline.from_rows(SMALL_PATIENT, *got), Timeline.from_records(SMALL_PATIENT, version, raw)
    assert fast.ids == full.ids and fast.version == full.version > 0
    for name in ("t_start", "t_end", "t_add", "t_ended", "kind", "succ", "evid", "covered", "thread"):
        assert np.array_equal(getattr(fast, name), getattr(full, name)), name
    assert fast.display == full.display and fast.reason == full.reason and fast.embed_keys == full.embed_keys
