"""Prompts are versioned (stam/llm/prompt.py): the words of each version are pinned here.

Changing a prompt's template without a new version fails ``test_each_template_is_the_one_its_version_pins``;
a new version is a new row below (purpose, version, fingerprint of its template), so the change is visible in
review and every report names the new id.
"""

from __future__ import annotations

import pytest

import stam.deletion.judge
import stam.read.reader
import stam.reasoning.prompts as prompts
import stam_lab.eval.qa_run
from schemas.vocabulary import Reason, RelationType
from stam.llm.prompt import PROMPTS, Prompt, fingerprint, ids, prompt

PINNED = {
    # purpose: {version: fingerprint of the template}
    "extract": {1: "4126627a"},
    "judge": {1: "bae2ef72"},
    "answer": {1: "95a549da"},
    "answer-short": {1: "0f19c377"},
    "endurance": {1: "8b217688", 2: "752ad622"},
}


def test_every_prompt_sent_is_registered_and_pinned() -> None:
    assert set(PROMPTS) == set(PINNED)
    assert stam.reasoning.prompts.EXTRACT is PROMPTS["extract"]
    assert stam.read.reader.ANSWER is PROMPTS["answer"]
    assert stam.deletion.judge.ENDURANCE is PROMPTS["endurance"]
    assert PROMPTS["answer-short"].text == stam_lab.eval.qa_run.READER_SYSTEM


@pytest.mark.parametrize("purpose", sorted(PINNED))
def test_each_template_is_the_one_its_version_pins(purpose: str) -> None:
    p = PROMPTS[purpose]
    assert p.version in PINNED[purpose], f"{purpose} v{p.version} is not pinned: add its row to PINNED"
    assert fingerprint(p.template) == PINNED[purpose][p.version], (
        f"the {purpose} prompt's words changed but its version did not: give it version {p.version + 1} where it "
        f"is defined and pin {fingerprint(p.template)} for that version here")


def test_what_is_sent_is_the_registered_text() -> None:
    messages = prompts.judge_messages("new fact", None, ["a current fact"], [])
    assert messages[0]["content"] == prompts.JUDGE.text
    extract = prompts.extract_messages("note")
    assert extract[0]["content"] in prompts.EXTRACT.text and extract[1]["content"].removeprefix("Note:\n") in \
        prompts.EXTRACT.text
    assert stam.read.reader.messages("q?", "evidence")[0]["content"] == stam.read.reader.ANSWER.text


def test_the_judge_prose_comes_from_the_vocabulary() -> None:
    text = prompts.JUDGE.text
    for r in RelationType:
        assert (f"{r.value} ({r.prompt})" if r.prompt else r.value) in text
    named = [r for r in Reason if r.prompt]
    assert set(prompts.ENDED_NAMED) == set(named), "every reason with prompt prose is named on the ended: line"
    assert all(r.offered for r in named), "the prompt names only reasons the model may answer"
    for r in named:
        assert f"{r.prompt} ({r.value})" in text
    # A derived part changes the id (the text), not the pinned template: no version to bump for a new relation.
    fewer = prompts.judge_system(list(RelationType)[:-1])
    assert fingerprint(fewer) != fingerprint(text)
    assert prompts.JUDGE_TEMPLATE.format(relations="{relations}", ended="{ended}") == prompts.JUDGE.template


def test_a_purpose_has_one_definition_and_an_id_names_its_words() -> None:
    p = PROMPTS["answer"]
    assert prompt("answer", p.version, p.template) == p  # importing a module twice registers nothing new
    with pytest.raises(ValueError, match="defined twice"):
        prompt("answer", p.version + 1, p.template + " Be kind.")
    assert PROMPTS["answer"] == p
    assert p.id == f"answer/v{p.version}-{fingerprint(p.text)}"
    assert ids("answer") == {"answer": p.id}
    assert Prompt("x", 1, "a", "b").id != Prompt("x", 1, "a", "c").id
