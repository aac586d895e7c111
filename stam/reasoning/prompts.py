"""Prompts of the language-model reasoner, each beside the pydantic model of its output.

Each is registered with its version in ``stam.llm.prompt`` (``EXTRACT``, ``JUDGE``): change the words of a
template and its version with it (``tests/unit/test_prompts.py`` pins them).

The JSON schema of each output model is sent as ``response_format`` (the engine constrains decoding to
it); the reply is then validated with the same model, so a reply that is not what the schema says never
reaches the state. Candidates are numbered in the prompt and answered by number, which keeps replies short
and makes a hallucinated memory id impossible.

Output fields are few and short on purpose: completion tokens are the cost on a CPU (15-35 tokens/s).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.vocabulary import Reason, RelationType
from stam.llm.prompt import prompt

FactCategory = Literal["condition", "medication", "observation", "procedure", "allergy", "immunization",
                       "careplan", "encounter", "social", "symptom"]
FactStatus = Literal["active", "stopped", "resolved", "completed", "planned", "history", "negated"]
# The relation names and end reasons the model may answer, derived from schemas/vocabulary.py (in table
# order): literals, so the output schema carries plain strings; replies are read back with RelationType(...)
# and Reason(...).
if TYPE_CHECKING:
    RelationName = str
    EndReason = str
else:
    RelationName = Literal[tuple(r.value for r in RelationType)]
    EndReason = Literal[tuple(r.value for r in Reason if r.offered)]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- extraction -----------------------------------------------------------------------------------------

class Fact(_Out):
    category: FactCategory
    name: str = Field(min_length=1, max_length=120,
                      description="The concept as the note words it, e.g. 'ibuprofen 400 mg oral tablet'")
    status: FactStatus
    value: str | None = Field(default=None, max_length=40, description="A measured value with its unit")


class Extraction(_Out):
    facts: list[Fact] = Field(max_length=40)


EXTRACT_SYSTEM = (
    "You turn one clinical note into a list of atomic facts about the patient. One fact per condition, "
    "medication, procedure, allergy, immunization, measurement, symptom or social fact (smoking, "
    "employment, living situation). name: the words of the note, with the dose for a medication. status: "
    "active = holds now; history = past history; resolved/stopped/completed = the note says it ended or "
    "was done; planned = ordered for later; negated = the note says it is absent (e.g. no known "
    "allergies). Each fact once, even if the note repeats it. Do not invent facts. Reply in JSON."
)


# One worked example (invented, no patient's data): small models follow a shown shape far better than a
# described one. It is deliberately unlike the layout of the notes it will see, and names things those notes
# rarely name, so an example fact copied into a reply is caught by the grounding check of the reasoner.
_EXAMPLE_NOTE = (
    "72 y/o man seen for follow-up of gout; history of kidney stones. Takes colchicine 0.6 mg daily. "
    "Allopurinol was stopped last month. Denies chest pain. BP 142/90 mmHg. Works as a carpenter. "
    "Plan: uric acid level."
)
_EXAMPLE_FACTS = Extraction(facts=[
    Fact(category="condition", name="gout", status="active"),
    Fact(category="condition", name="kidney stones", status="history"),
    Fact(category="medication", name="colchicine 0.6 mg daily", status="active"),
    Fact(category="medication", name="allopurinol", status="stopped"),
    Fact(category="symptom", name="chest pain", status="negated"),
    Fact(category="observation", name="blood pressure", status="active", value="142/90 mmHg"),
    Fact(category="social", name="works as a carpenter", status="active"),
    Fact(category="procedure", name="uric acid level", status="planned"),
])


EXTRACT = prompt("extract", 1, EXTRACT_SYSTEM + "\n\n" + _EXAMPLE_NOTE + "\n\n"
                 + _EXAMPLE_FACTS.model_dump_json(exclude_none=True))
"""Extraction: the system text and the worked example (the template has nothing derived)."""


def extract_messages(text: str, context: Sequence[str] = ()) -> list[dict[str, str]]:
    known = ("Coded facts already recorded for this entry (do not repeat them):\n"
             + "\n".join(f"- {c}" for c in context) + "\n\n" if context else "")
    return [{"role": "system", "content": EXTRACT_SYSTEM},
            {"role": "user", "content": f"Note:\n{_EXAMPLE_NOTE}"},
            {"role": "assistant", "content": _EXAMPLE_FACTS.model_dump_json(exclude_none=True)},
            {"role": "user", "content": f"{known}Note:\n{text.strip()}"}]


# --- linking + update: one call per new memory over all its candidates ----------------------------------

class Link(_Out):
    n: int = Field(ge=1, description="Number of a CURRENT fact")
    type: RelationName


class Ended(_Out):
    n: int = Field(ge=1, description="Number of a CURRENT fact that no longer holds")
    reason: EndReason


class Judgement(_Out):
    new_is: Literal["current", "past"] = Field(description="past: the NEW fact describes an earlier state")
    past_reason: EndReason | None = None
    links: list[Link] = Field(default_factory=list, max_length=12)
    ended: list[Ended] = Field(default_factory=list, max_length=12)


JUDGE_TEMPLATE = (
    "You maintain a patient's memory. You get a NEW fact and numbered existing facts: CURRENT ones hold "
    "now, PAST ones held before. Decide:\n"
    "new_is: 'current', or 'past' if the NEW fact only describes an earlier state (then past_reason).\n"
    "links: CURRENT facts the NEW fact is clinically related to: {relations}.\n"
    "ended: CURRENT facts that the NEW fact shows no longer hold: {ended}. A fact that is only similar still "
    "holds: leave it out. Most NEW facts end nothing.\n"
    "Reply in JSON."
)
"""The link+update system prompt; ``{relations}`` and ``{ended}`` come from schemas/vocabulary.py."""

ENDED_NAMED = (Reason.SUPERSEDED, Reason.STOPPED, Reason.RESOLVED)
"""The end reasons the "ended:" line describes, in the order it names them (each with its ``prompt`` prose)."""


def judge_system(relations: Iterable[RelationType] = tuple(RelationType)) -> str:
    """The system prompt of the link+update call: :data:`JUDGE_TEMPLATE` with each relation type's ``prompt``
    (table order) and each named end reason's ``prompt`` filled in."""
    prose = ", ".join(f"{r.value} ({r.prompt})" if r.prompt else r.value for r in relations)
    ended = ", ".join(f"{r.prompt} ({r.value})" for r in ENDED_NAMED)
    return JUDGE_TEMPLATE.format(relations=prose, ended=ended)


JUDGE_SYSTEM = judge_system()
JUDGE = prompt("judge", 1, JUDGE_TEMPLATE, JUDGE_SYSTEM)


def judge_messages(new: str, new_date: str | None, current: Sequence[str],
                   past: Sequence[str]) -> list[dict[str, str]]:
    """The NEW fact and its candidates, CURRENT numbered first, then PAST (context only)."""
    lines = [f"NEW ({new_date or 'date unknown'}): {new}", ""]
    n = 0
    if current:
        lines.append("CURRENT:")
        for text in current:
            n += 1
            lines.append(f"{n}. {text}")
    if past:
        lines.append("PAST (context only):")
        for text in past:
            n += 1
            lines.append(f"{n}. {text}")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()


def judgement_schema(n_current: int) -> dict[str, Any]:
    """``Judgement``'s schema with each candidate number limited to the CURRENT facts of this prompt (an enum,
    which both engines' grammars enforce; llama.cpp's ignores ``maximum``), so a constrained reply cannot name a
    PAST fact or a number that is no fact at all (the 0.5B through vLLM answered the note's year)."""
    out = schema(Judgement)
    for name in ("Link", "Ended"):
        prop = out["$defs"][name]["properties"]["n"]
        prop.pop("minimum", None)
        prop["enum"] = list(range(1, n_current + 1))
    return out
