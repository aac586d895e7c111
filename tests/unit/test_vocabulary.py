"""schemas/vocabulary.py: one table per vocabulary, and every place that uses it tied to the table.

Each test fails if a member is added without its row, or if a place that used to list the vocabulary by hand
(weights, directed set, prompt prose, prompt output schema, ending roles, source mappers) drifts from it.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args

import pytest

import schemas
from schemas import (
    DIRECTED_RELATIONS,
    ENDING_ROLES,
    RELATION_WEIGHT,
    AtomicMemory,
    Category,
    Channel,
    ImpactCandidate,
    Reason,
    Reference,
    ReferenceRole,
    Relation,
    RelationType,
    Store,
    StoredMemory,
)
from stam import integrity, stages
from stam.reasoning import coded, prompts
from stam.reasoning.base import Candidate
from stam.reasoning.coded import CodedReasoner
from stam.sources.fhir_r4 import resource_to_entry

ROOT = Path(__file__).resolve().parents[2]
SOURCE = (ROOT / "schemas" / "vocabulary.py").read_text()
ROWS: dict[type[StrEnum], dict[str, type | tuple[type, ...]]] = {
    RelationType: {"directed": bool, "weight": float, "prompt": str},
    Reason: {"description": str, "offered": bool, "prompt": str},
    ReferenceRole: {"description": str, "ends": bool, "links": bool, "link_weight": (float, type(None))},
}


# --- every table --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("enum", list(ROWS), ids=lambda e: e.__name__)
def test_every_member_carries_its_row(enum: type[StrEnum]) -> None:
    for member in enum:
        assert isinstance(member.value, str) and member == member.value and enum(member.value) is member
        for field, kind in ROWS[enum].items():
            assert isinstance(getattr(member, field), kind), (member, field)


def _define(enum: type[StrEnum], member_line: str) -> dict[str, Any]:
    """Run schemas/vocabulary.py again with one more member written into ``enum``'s class body."""
    head = f"class {enum.__name__}(StrEnum):\n"
    assert SOURCE.count(head) == 1
    namespace: dict[str, Any] = {"__name__": "vocabulary_probe"}
    exec(compile(SOURCE.replace(head, head + f"    {member_line}\n"), "vocabulary_probe.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("enum", list(ROWS), ids=lambda e: e.__name__)
def test_a_member_without_its_row_fails_at_import(enum: type[StrEnum]) -> None:
    with pytest.raises(TypeError):
        _define(enum, 'ADDED = "added"')
    with pytest.raises(TypeError):
        _define(enum, 'ADDED = "added", ' + ", ".join(["None"] * (len(ROWS[enum]) + 1)))  # a row too long


def test_a_member_with_its_row_is_accepted() -> None:
    ns = _define(RelationType, 'ADDED = "added", False, 0.5, ""')
    assert ns["RELATION_WEIGHT"][ns["RelationType"].ADDED] == 0.5


def test_the_enums_keep_their_json_contract() -> None:
    """Docstrings are the JSON schema's descriptions: RelationType has none, Reason keeps its own."""
    assert RelationType.__doc__ is None
    assert Reason.__doc__ == "Why a memory is in HISTORY."
    ref = schemas.TransitionEvent.model_json_schema()["$defs"]
    assert ref["RelationType"] == {"enum": [r.value for r in RelationType], "title": "RelationType", "type": "string"}
    assert ref["Reason"]["enum"] == [r.value for r in Reason]


# --- relation types -------------------------------------------------------------------------------------

def test_relation_weights_are_the_table() -> None:
    assert {r: r.weight for r in RelationType} == RELATION_WEIGHT
    assert coded.RELATION_WEIGHT is RELATION_WEIGHT
    for r in RelationType:
        assert 0.0 < r.weight <= 1.0, r
        Relation(source_id="a", target_id="b", type=r, weight=r.weight)  # the wire accepts it


def test_directed_relations_are_the_table_and_their_prose_says_which_way() -> None:
    assert {r for r in RelationType if r.directed} == DIRECTED_RELATIONS
    for r in RelationType:
        assert Relation(source_id="a", target_id="b", type=r).directed is r.directed
        # A directed type tells the model which way it reads (from the NEW fact); an undirected one must not.
        assert r.prompt.startswith("NEW ") is r.directed, r


def test_the_judge_prompt_names_every_relation_with_its_prose() -> None:
    line = next(x for x in prompts.JUDGE_SYSTEM.splitlines() if x.startswith("links:"))
    named = [x.split(" (")[0] for x in line.split("related to: ", 1)[1].rstrip(".").split(", ")]
    assert named == [r.value for r in RelationType]
    for r in RelationType:
        assert (f"{r.value} ({r.prompt})" if r.prompt else f" {r.value},") in line, r
    assert prompts.judge_system() == prompts.JUDGE_SYSTEM
    assert prompts.judge_messages("x", None, ["y"], [])[0]["content"] == prompts.JUDGE_SYSTEM
    few = prompts.judge_system([RelationType.CAUSAL])
    assert "related to: causal (NEW causes it).\n" in few and "restatement" not in few


def test_the_model_may_answer_every_relation_and_nothing_else() -> None:
    assert get_args(prompts.RelationName) == tuple(r.value for r in RelationType)
    link = prompts.Link.model_json_schema()["properties"]["type"]
    assert link["enum"] == [r.value for r in RelationType]
    for r in RelationType:
        assert RelationType(prompts.Link(n=1, type=r.value).type) is r  # how the model reasoner reads it back
    with pytest.raises(ValueError):
        prompts.Link(n=1, type="not_a_relation")


# --- reasons --------------------------------------------------------------------------------------------

def test_the_model_may_end_a_fact_with_the_offered_reasons_only() -> None:
    offered = tuple(r.value for r in Reason if r.offered)
    assert get_args(prompts.EndReason) == offered
    schema = prompts.Judgement.model_json_schema()
    assert schema["$defs"]["Ended"]["properties"]["reason"]["enum"] == list(offered)
    assert [x.get("enum") for x in schema["properties"]["past_reason"]["anyOf"]] == [list(offered), None]
    # Retraction and late arrival are the reasoner's rules, never the model's answer.
    assert not Reason.ENTERED_IN_ERROR.offered and not Reason.PRIOR_STATE.offered
    for r in Reason:
        assert r.description and r.description == r.description.strip()


def test_the_reasons_the_judge_prompt_names_are_offered() -> None:
    line = next(x for x in prompts.JUDGE_SYSTEM.splitlines() if x.startswith("ended:"))
    named = [w for w in re.findall(r"\(([a-z-]+)\)", line)]
    assert named and all(Reason(w).offered for w in named), named


# --- reference roles ------------------------------------------------------------------------------------

def test_ending_roles_are_the_table_everywhere() -> None:
    assert ENDING_ROLES == {r for r in ReferenceRole if r.ends} == {ReferenceRole.REPLACES, ReferenceRole.DISCONTINUES}
    assert stages.EXPLICIT_ROLES is ENDING_ROLES and integrity.RESOURCE_ROLES is ENDING_ROLES
    assert "replaces" in ENDING_ROLES  # a role read off the wire is a plain string


def test_roles_that_end_do_not_link_and_link_weights_are_weights() -> None:
    for r in ReferenceRole:
        assert r.description
        assert not (r.ends and r.links), r
        if r.link_weight is not None:
            assert r.links and 0.0 < r.link_weight <= 1.0, r


@pytest.mark.parametrize("category", list(Category), ids=str)
def test_the_coded_linker_follows_the_role_table(category: Category) -> None:
    for r in ReferenceRole:
        rtype, weight = CodedReasoner._relation_for(r.value, category)
        if r.links:
            assert rtype in RelationType and weight == r.link_weight, (r, category)
        else:
            assert (rtype, weight) == (None, None), (r, category)
    assert CodedReasoner._relation_for("a-role-no-table-has", category) == (None, None)
    assert ReferenceRole.of("a-role-no-table-has") is None and ReferenceRole.of("reason") is ReferenceRole.REASON


def _med(rid: str, code: str, when: str) -> dict[str, Any]:
    return {"resourceType": "MedicationRequest", "id": rid, "status": "active", "intent": "order",
            "medicationCodeableConcept": {"coding": [{"system": "http://www.nlm.nih.gov/research/umls/rxnorm",
                                                      "code": code, "display": f"drug {code}"}]},
            "authoredOn": when}


@pytest.mark.parametrize("role", sorted(ENDING_ROLES))
def test_the_coded_reasoner_ends_what_an_ending_role_names(role: ReferenceRole) -> None:
    reasoner = CodedReasoner()
    old_entry = resource_to_entry(_med("o1", "111", "2020-01-01"), "patient-1")
    new_entry = resource_to_entry(_med("o2", "222", "2020-02-01"), "patient-1")  # another code: only the role ties
    assert old_entry is not None and new_entry is not None and old_entry.source_ref
    new_entry = new_entry.model_copy(update={"references": (Reference(role=role, target=old_entry.source_ref),)})
    old: AtomicMemory = reasoner.extract(old_entry)[0]
    new = reasoner.extract(new_entry)[0]
    candidate = Candidate(StoredMemory(memory=old, store=Store.ACTIVE),
                          ImpactCandidate(memory_id=old.memory_id, store=Store.ACTIVE, channels=(Channel.CODE,),
                                          score=1.0))
    decision = reasoner.update(new_entry, new, [candidate])
    assert [a.memory_id for a in decision.archive] == [old.memory_id], role


def test_source_mappers_write_roles_from_the_table() -> None:
    """No bare role string in a source mapper: each writes ReferenceRole members."""
    for path in sorted((ROOT / "stam" / "sources").rglob("*.py")):
        text = path.read_text()
        assert not re.findall(r"""role\s*=\s*["']""", text), path.name
        assert not re.findall(r"""add_refs\(\s*["']""", text), path.name
