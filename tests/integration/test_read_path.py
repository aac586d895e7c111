"""The read path on real data and real stores: store-aware retrieval, the gate, packets, point in time,
and isolation between patients.

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
from schemas.query import GateMode, QueryRequest
from stam.read.gate import StoreGate
from stam.read.service import NO_READER, QueryService
from stam.read.tokens import load_tokenizer
from stam.sources.fhir_r4 import load_bundle
from stam.stages import process_entry
from stam.stores.projection import VectorProjection
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


def service(deps: Any, *, projection: bool = True, events: list[TransitionEvent] | None = None) -> QueryService:
    async def log(_pid: str) -> list[TransitionEvent]:
        return list(events or [])

    return QueryService(states=deps.states, vectors=deps.vectors, embedder=deps.embedder,
                        tokenizer=load_tokenizer("all-MiniLM-L6-v2"), gate=StoreGate(0.0),
                        projection=VectorProjection(deps.vectors) if projection else None,
                        transitions=log if events is not None else None)


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
    assert not p.gate.serve_history and p.gate.cue is None
    (h,) = heights(p, deps)
    assert h.store is Store.ACTIVE and h.text.startswith("Body Height: 87.8")
    assert "Current:" in p.rendered and "Historical:" not in p.rendered
    assert p.tokens > 0 and p.tokenizer == "all-MiniLM-L6-v2"


def test_history_question_gets_superseded_facts_with_their_successors(loaded: Any) -> None:
    deps, _ = loaded
    p = ask(service(deps), "How has the body height changed over time?", k_history=10).packet
    assert p.gate.serve_history and p.gate.cue == "changed"
    hs = heights(p, deps)
    past = [h for h in hs if h.store is Store.HISTORY]
    assert len(past) == 10 and [h for h in hs if h.store is Store.ACTIVE]
    for h in past:
        assert h.reason is not None and h.reason.value == "superseded"
        assert h.successor_id and h.successor_text and h.successor_text.startswith("Body Height:")
    assert "Historical:" in p.rendered and "replaced by: Body Height:" in p.rendered


def test_gate_modes_labels_joint_ranking_and_token_budget(loaded: Any) -> None:
    deps, _ = loaded
    svc = service(deps)
    both = ask(svc, "What is the patient's body height?", gate=GateMode.BOTH).packet
    assert both.gate.serve_history and any(i.store is Store.HISTORY for i in both.items)
    active = ask(svc, "Was carbamazepine ever stopped?", gate=GateMode.ACTIVE).packet
    assert not active.gate.serve_history and all(i.store is Store.ACTIVE for i in active.items)
    neutral = ask(svc, "body height", gate=GateMode.BOTH, labels=False).packet
    assert "Current" not in neutral.rendered and "Historical" not in neutral.rendered
    joint = ask(svc, "body height", gate=GateMode.BOTH, ranking="joint", k_active=3, k_history=3).packet
    assert len(joint.items) == 6 and [i.score for i in joint.items] == sorted((i.score for i in joint.items),
                                                                              reverse=True)
    small = ask(svc, "body height", gate=GateMode.BOTH, token_budget=60).packet
    assert small.dropped > 0 and small.tokens <= 60
    assert [i.rank for i in small.items] == sorted(i.rank for i in small.items)


def test_as_of_reconstructs_the_past_from_the_transition_log(loaded: Any, small_bundle: Any) -> None:
    deps, events = loaded
    svc = service(deps, events=events)
    when = datetime.fromisoformat("1938-06-01T00:00:00+00:00")
    measured = sorted((e for e in small_bundle.entries if e.codes and e.codes[0].code == "8302-2"),
                      key=lambda e: e.effective_at)
    expected = [e for e in measured if e.effective_at <= when][-1]  # the last height measured by then
    p = ask(svc, "What is the patient's body height?", as_of=when).packet
    (h,) = heights(p, deps)
    assert h.store is Store.ACTIVE and h.source_entry_id == expected.entry_id
    assert p.as_of == when
    # A position in the stream: right after the first entry only that entry's memories exist.
    first = ask(svc, "anything", as_of_version=1).packet
    assert first.state_version == 1 and {i.source_entry_id for i in first.items} == {small_bundle.entries[0].entry_id}
    # Without a transition log, a past query is refused with a clear error, not answered from now.
    refused = ask(service(deps), "body height", as_of=when)
    assert not refused.ok and refused.error_kind == "invalid" and "transition log" in refused.error


def test_a_query_never_returns_another_patients_memory(deps: Any, small_bundle: Any) -> None:
    other = load_bundle(OTHER_BUNDLE)
    for e in small_bundle.entries + other.entries:
        process_entry(e, deps)
    own = {pid: {m.memory.memory_id for m in deps.states.load(pid).memories.values()}
           for pid in (SMALL_PATIENT, other.entries[0].patient_id)}
    vocabulary = [m.memory.text for pid in own for m in deps.states.load(pid).memories.values()]
    rng = random.Random(7)
    for svc in (service(deps), service(deps, projection=False)):  # projection and filtered Milvus search
        for _ in range(150):
            pid = rng.choice(sorted(own))
            q = rng.choice(vocabulary)  # often a fact of the *other* patient, word for word
            p = ask(svc, q, patient_id=pid, gate=GateMode.BOTH, k_active=10, k_history=10).packet
            assert p.items and {i.memory_id for i in p.items} <= own[pid]
    unknown = ask(service(deps), "body height", patient_id="no-such-patient")
    assert not unknown.ok and unknown.error_kind == "not_found" and "no memory" in unknown.error


def test_gate_calibration_on_a_labelled_set_from_real_state(loaded: Any, tmp_path: Any) -> None:
    from stam.read.calibrate import labelled_set, replay
    from stam.read.gate import calibrate, load_gate, write_gate_file

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
