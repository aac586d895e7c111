"""The language-model reasoner's own logic, with a scripted endpoint standing in for the model: turning
replies into memories and decisions, grounding, retries with feedback, the dead-letter error, the call
budget, and routing. (That a real model does the job is shown by tests/integration/test_model_write_path.py
and benchmarks/llm_notes.py.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import AtomicMemory, Category, Channel, Coding, RecordEntry, Store, StoredMemory
from stam.errors import LLMUnavailable, ReasoningError
from stam.llm.client import ChatResult
from stam.reasoning.base import Candidate, Impact, Router
from stam.reasoning.coded import CodedReasoner
from stam.reasoning.language_model import ModelReasoner, find_span, grounded

NOTE = ("# Medications\nlisinopril 10 mg oral tablet; hydrochlorothiazide 25 mg oral tablet\n"
        "# Plan\nMetformin stopped.")


class Scripted:
    """Answers each call with the next reply (a dict becomes JSON); records what it was asked."""

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.calls: list[list[dict[str, str]]] = []
        self.schemas: list[dict[str, Any] | None] = []

    def chat(self, messages: list[dict[str, str]], **kw: Any) -> ChatResult:
        self.calls.append(messages)
        self.schemas.append(kw.get("schema"))
        reply = self.replies.pop(0)
        content = reply if isinstance(reply, str) else json.dumps(reply)
        return ChatResult(content=content, prompt_tokens=100, completion_tokens=20, seconds=0.1, attempts=1)


def note(text: str = NOTE, **kw: Any) -> RecordEntry:
    return RecordEntry(patient_id="p1", entry_id="note-1", source="fhir-r4", source_ref="DocumentReference/1",
                       resource_type="DocumentReference", effective_at=datetime(2020, 5, 1, tzinfo=UTC),
                       text=text, **kw)


def fact(category: str, name: str, status: str = "active", **kw: Any) -> dict[str, Any]:
    return {"category": category, "name": name, "status": status, **kw}


def reasoner(client: Scripted, **kw: Any) -> ModelReasoner:
    return ModelReasoner(client, parallel=1, **kw)  # type: ignore[arg-type]


def stored(mid: str, text: str, store: Store = Store.ACTIVE, **kw: Any) -> Candidate:
    m = AtomicMemory(memory_id=mid, patient_id="p1", entry_id=f"e-{mid}", position=0, category=Category.MEDICATION,
                     text=text, **kw)
    return Candidate(StoredMemory(memory=m, store=store), Impact(mid, store, (Channel.SEMANTIC,), 0.8, None))


def test_extraction_becomes_grounded_deduplicated_memories_with_spans() -> None:
    client = Scripted({"facts": [fact("medication", "lisinopril 10 mg oral tablet"),
                                 fact("medication", "lisinopril 10 mg oral tablet"),  # repeated by the model
                                 fact("medication", "metformin", "stopped"),
                                 fact("condition", "congestive heart failure")]})  # not in the note
    r = reasoner(client)
    mems = r.extract(note())
    assert [m.text for m in mems] == ["Medication: lisinopril 10 mg oral tablet; current (note of 2020-05-01)",
                                      "Medication: metformin; stopped (note of 2020-05-01)"]
    assert [m.position for m in mems] == [0, 1] and len({m.memory_id for m in mems}) == 2
    assert all(m.concept is None and m.patient_id == "p1" and m.entry_id == "note-1" for m in mems)
    span = mems[0].span
    assert span is not None and NOTE[span.start:span.end] == "lisinopril 10 mg oral tablet"
    assert mems[1].span is not None and NOTE[mems[1].span.start:mems[1].span.end].lower() == "metformin"
    assert r.stats.dropped_ungrounded == 1 and r.stats.merged_duplicates == 1 and len(client.calls) == 1


def test_a_note_with_nothing_extracted_is_kept_verbatim() -> None:
    r = reasoner(Scripted({"facts": []}))
    (m,) = r.extract(note())
    assert m.category is Category.NOTE and m.text == NOTE.strip() and r.stats.verbatim_fallbacks == 1


def test_invalid_reply_is_retried_with_the_error_shown_then_accepted() -> None:
    client = Scripted('{"facts": [{"category": "medication", "name": "lisinopril"', {"facts": [fact(
        "medication", "lisinopril 10 mg oral tablet")]})
    mems = reasoner(client).extract(note())
    assert len(mems) == 1 and len(client.calls) == 2
    retry = client.calls[1]
    assert retry[-2]["role"] == "assistant" and "invalid" in retry[-1]["content"]


def test_final_invalid_reply_raises_with_the_raw_output_for_the_dead_letter() -> None:
    client = Scripted("not json", {"facts": "nope"}, '{"facts": [')
    with pytest.raises(ReasoningError) as err:
        reasoner(client, attempts=3).extract(note())
    assert "raw model output" in str(err.value) and '{"facts": [' in str(err.value)
    assert len(client.calls) == 3


def test_replies_are_cached_by_prompt() -> None:
    client = Scripted({"facts": [fact("medication", "lisinopril 10 mg oral tablet")]})
    r = reasoner(client)
    assert r.extract(note()) == r.extract(note())
    assert len(client.calls) == 1


def test_update_without_current_candidates_makes_no_call_and_follows_the_facts_status() -> None:
    client = Scripted()
    r = reasoner(client)
    m_stopped = AtomicMemory(memory_id="n1", patient_id="p1", entry_id="note-1", position=0,
                             category=Category.MEDICATION, text="Medication: metformin; stopped", status="stopped")
    m_active = m_stopped.model_copy(update={"memory_id": "n2", "status": "active"})
    d1 = r.update(note(), m_stopped, [stored("old", "Medication: metformin", Store.HISTORY)])
    d2 = r.update(note(), m_active, [])
    assert d1.placement is Store.HISTORY and d1.placement_reason.value == "stopped"
    assert d2.placement is Store.ACTIVE and not d2.archive and not d2.relations
    assert client.calls == [] and r.stats.judge_skipped == 2


def test_one_call_links_and_updates_over_numbered_candidates() -> None:
    client = Scripted({"new_is": "current", "links": [{"n": 2, "type": "treatment_for"}],
                       "ended": [{"n": 1, "reason": "superseded"}]})
    r = reasoner(client)
    new = AtomicMemory(memory_id="n1", patient_id="p1", entry_id="note-1", position=0,
                       category=Category.MEDICATION, text="Medication: lisinopril 20 mg; current")
    cands = [stored("old-dose", "Medication: lisinopril 10 mg"), stored("htn", "Condition: hypertension"),
             stored("past", "Medication: lisinopril 5 mg", Store.HISTORY)]
    d = r.update(note(), new, cands)
    assert len(client.calls) == 1
    prompt = client.calls[0][-1]["content"]
    assert "CURRENT:\n1. Medication: lisinopril 10 mg\n2. Condition: hypertension" in prompt
    assert "PAST (context only):\n3. Medication: lisinopril 5 mg" in prompt
    assert d.placement is Store.ACTIVE
    assert [(a.memory_id, a.reason.value, a.successor_id) for a in d.archive] == [("old-dose", "superseded", "n1")]
    assert [(x.source_id, x.target_id, x.type.value) for x in d.relations] == [("n1", "htn", "treatment_for")]


def test_a_candidate_number_out_of_range_is_an_invalid_reply() -> None:
    client = Scripted({"new_is": "current", "ended": [{"n": 3, "reason": "stopped"}]},  # 3 is PAST
                      {"new_is": "past", "past_reason": "superseded"})
    new = AtomicMemory(memory_id="n1", patient_id="p1", entry_id="note-1", position=0,
                       category=Category.MEDICATION, text="Medication: lisinopril 10 mg; past history")
    d = reasoner(client).update(note(), new, [stored("a", "x"), stored("b", "y"), stored("c", "z", Store.HISTORY)])
    assert len(client.calls) == 2 and "not CURRENT facts" in client.calls[1][-1]["content"]
    assert d.placement is Store.HISTORY and d.placement_reason.value == "superseded" and not d.archive


def test_the_judgement_schema_allows_only_the_numbers_of_current_facts() -> None:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    client = Scripted({"new_is": "current"})
    new = AtomicMemory(memory_id="n1", patient_id="p1", entry_id="note-1", position=0,
                       category=Category.MEDICATION, text="Medication: lisinopril 10 mg; current")
    reasoner(client).update(note(), new, [stored("a", "x"), stored("b", "y"), stored("c", "z", Store.HISTORY)])
    (sent,) = client.schemas
    assert sent is not None
    for name in ("Link", "Ended"):
        assert sent["$defs"][name]["properties"]["n"]["enum"] == [1, 2]  # 3 is the PAST fact
    # llama.cpp's grammar keeps the enum (it ignores "maximum"): a constrained reply cannot say 3 or 2018.
    grammar = json_schema_to_gbnf(json.dumps(sent))
    assert 'Link-n ::= "1" | "2"\n' in grammar and 'Ended-n ::= "1" | "2"\n' in grammar


def test_router_sends_codes_to_the_coded_reasoner_and_text_to_the_model_with_coded_context() -> None:
    client = Scripted({"facts": [fact("observation", "hemoglobin", value="9.1 g/dL")]})
    router = Router(CodedReasoner(), reasoner(client))
    coded_only = RecordEntry(patient_id="p1", entry_id="obs-1", source="fhir-r4", source_ref="Observation/1",
                             resource_type="Observation", codes=(Coding(system="http://loinc.org", code="718-7",
                                                                        display="Hemoglobin"),))
    assert [m.concept is not None for m in router.extract(coded_only)] == [True] and client.calls == []
    both = coded_only.model_copy(update={"entry_id": "obs-2", "text": "Hemoglobin 9.1 g/dL, down from 11."})
    mems = router.extract(both)
    assert [m.position for m in mems] == [0, 1]
    assert mems[0].concept is not None and mems[1].concept is None and mems[1].value_text == "9.1 g/dL"
    assert "Coded facts already recorded" in client.calls[0][-1]["content"]
    assert "Observation: Hemoglobin" in client.calls[0][-1]["content"] or "Hemoglobin: recorded" in \
        client.calls[0][-1]["content"]
    assert router.links_at_update(mems[1]) and not router.links_at_update(mems[0])


def test_without_a_model_notes_stay_verbatim() -> None:
    router = Router(CodedReasoner())
    (m,) = router.extract(note())
    assert m.category is Category.NOTE and not router.decomposes_text and not router.links_at_update(m)


def test_an_unreachable_model_is_an_outage_not_the_entrys_fault() -> None:
    from workers.stage_agent import MESSAGE_FAULTS, TRANSIENT

    assert issubclass(LLMUnavailable, TRANSIENT) and not issubclass(LLMUnavailable, MESSAGE_FAULTS)


def test_grounding_and_spans() -> None:
    words = {"lisinopril", "oral", "tablet"}
    assert grounded("lisinopril oral tablet", words) and not grounded("atorvastatin 20 mg", words)
    assert find_span("HYDROCHLOROTHIAZIDE", NOTE) is not None and find_span("warfarin", NOTE) is None


@pytest.mark.slow  # real Milvus Lite and Redis
def test_write_path_applies_model_relations_and_archivals_on_real_stores(deps: Any) -> None:
    """Stages on real Redis + Milvus Lite + MiniLM: a coded order, then a note whose fact the (scripted)
    model judges to supersede it; the relation comes on the ADDED transition, the order is archived."""
    from stam.stages import process_entry

    client = Scripted({"facts": [fact("medication", "lisinopril 20 mg oral tablet")]},
                      {"new_is": "current", "links": [{"n": 1, "type": "same_condition_thread"}],
                                       "ended": [{"n": 1, "reason": "superseded"}]})
    deps.router = Router(CodedReasoner(), reasoner(client))
    order = RecordEntry(patient_id="p1", entry_id="rx-1", source="fhir-r4", source_ref="MedicationRequest/1",
                        resource_type="MedicationRequest", status="active",
                        effective_at=datetime(2019, 1, 1, tzinfo=UTC),
                        codes=(Coding(system="http://www.nlm.nih.gov/research/umls/rxnorm", code="314076",
                                      display="lisinopril 10 MG Oral Tablet"),))
    first = process_entry(order, deps)
    old_id = first.transitions[0].memory_id
    result = process_entry(note("# Medications\nlisinopril 20 mg oral tablet (dose increased)"), deps)
    assert len(client.calls) == 2  # one extraction, one link+update call for one memory
    kinds = [(t.kind.value, t.memory_id) for t in result.transitions]
    added = result.transitions[0]
    assert kinds[0][0] == "added" and ("archived", old_id) in kinds
    assert [(r.target_id, r.type.value) for r in added.relations] == [(old_id, "same_condition_thread")]
    archived = next(t for t in result.transitions if t.kind.value == "archived")
    assert archived.successor_id == added.memory_id and archived.reason.value == "superseded"
    state = deps.states.load("p1")
    assert state.memories[old_id].store is Store.HISTORY and state.memories[added.memory_id].store is Store.ACTIVE


def test_older_evidence_never_ends_a_clinically_newer_fact_and_weak_neighbours_cost_no_call() -> None:
    client = Scripted({"new_is": "current", "ended": [{"n": 1, "reason": "superseded"}]})
    r = reasoner(client, min_score=0.35)
    new = AtomicMemory(memory_id="n1", patient_id="p1", entry_id="note-1", position=0, category=Category.MEDICATION,
                       text="Medication: lisinopril 10 mg; current", effective_start=datetime(1998, 11, 30, tzinfo=UTC))
    newer = stored("rx-2022", "Medication: lisinopril 10 MG; status active; from 2022-04-11",
                   effective_start=datetime(2022, 4, 11, tzinfo=UTC))
    d = r.update(note(), new, [newer])
    assert d.archive == () and r.stats.refused_archivals == 1 and d.placement is Store.ACTIVE
    weak = Candidate(newer.stored, Impact("rx-2022", Store.ACTIVE, (Channel.SEMANTIC,), 0.2, None))
    assert r.update(note(), new, [weak]).placement is Store.ACTIVE
    assert len(client.calls) == 1 and r.stats.judge_skipped == 1  # the weak neighbour was not worth a call


def test_a_fact_stated_as_current_is_not_put_behind_older_facts() -> None:
    client = Scripted({"new_is": "past", "past_reason": "superseded",
                       "links": [{"n": 1, "type": "restatement"}]})
    r = reasoner(client)
    new = AtomicMemory(memory_id="n2", patient_id="p1", entry_id="note-2", position=0, category=Category.MEDICATION,
                       text="Medication: lisinopril 10 mg; current (note of 1999-12-06)", status="active",
                       effective_start=datetime(1999, 12, 6, tzinfo=UTC))
    older = stored("n1", "Medication: lisinopril 10 mg; current (note of 1998-11-30)",
                   effective_start=datetime(1998, 11, 30, tzinfo=UTC))
    d = r.update(note(), new, [older])
    assert d.placement is Store.ACTIVE and r.stats.refused_past == 1
    assert [x.type.value for x in d.relations] == ["restatement"]
    late = new.model_copy(update={"effective_start": datetime(1990, 1, 1, tzinfo=UTC)})  # a late arrival
    client.replies.append({"new_is": "past", "past_reason": "superseded"})
    assert r.update(note(), late, [older]).placement is Store.HISTORY


class Named(Scripted):
    """A scripted endpoint that also records the model name each call asked for."""

    model = "base-model"

    def __init__(self, *replies: Any) -> None:
        super().__init__(*replies)
        self.models: list[str | None] = []

    def chat(self, messages: list[dict[str, str]], **kw: Any) -> ChatResult:
        self.models.append(kw.get("model"))
        return super().chat(messages, **kw)


def test_each_kind_of_call_names_its_adapter_and_validated_calls_become_traces(tmp_path: Any) -> None:
    from stam.reasoning.traces import TraceWriter, read_traces

    path = tmp_path / "traces" / "t.jsonl"
    writer = TraceWriter(path)
    client = Named("not json", {"facts": [fact("medication", "lisinopril 10 mg oral tablet")]},
                   {"links": [], "ended": [{"n": 1, "reason": "superseded"}], "new_is": "current"})
    r = reasoner(client, models={"extraction": "extract", "link+update": ""}, trace=writer)
    entry = note()
    (mem,) = r.extract(entry)
    r.update(entry, mem, [stored("old", "Medication: lisinopril 5 mg oral tablet; current")])
    writer.close()
    # extraction (an invalid reply, then a valid one) through the extract adapter; the judgement on the base model
    assert client.models == ["extract", "extract", None]
    ex, judge = list(read_traces(path))
    assert (ex.module, ex.purpose, ex.model, ex.attempts) == ("extract", "extraction", "extract", 2)
    assert ex.prompt_id.startswith("extract/v1-") and ex.schema_name == "Extraction"
    assert ex.messages == client.calls[0] and "lisinopril" in ex.reply  # the original prompt, the valid reply
    assert (ex.entry_id, ex.patient_id) == ("note-1", "p1")
    assert (judge.module, judge.model, judge.attempts, judge.patient_id) == ("update", "base-model", 1, "p1")
    assert judge.prompt_id.startswith("judge/v1-")
    assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(ValueError, match="unknown kinds of call"):
        reasoner(Scripted(), models={"extract": "x"})
