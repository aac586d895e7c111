"""Endurance labels from a blinded language-model judge, per concept type (the paper's label construction).

The judge sees one concept and up to three example memories of it, and nothing else: no patient, no other
label, no score, no split. It answers one of the three classes through the project's one client
(:class:`stam.llm.client.LLMClient`: the local model served by ``stam serve``, or any OpenAI-compatible endpoint)
with the reply constrained to a JSON schema and validated. A reply that stays invalid after a retry labels the
type *uncertain* (protected) and says so in the label's ``note``: a judge failure never makes a type deletable.

Each label records the judge (the endpoint's model name), the prompt id (``stam.llm.prompt``) and the date, so a
label set can be traced and a changed prompt is visible. Labels are kept as JSON lines.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from schemas import AtomicMemory
from stam.deletion.labels import Endurance, code_label, concept_type
from stam.llm.client import LLMClient
from stam.llm.prompt import prompt

ENDURANCE_SYSTEM = (
    "You decide whether a kind of clinical fact about a patient may be forgotten once it is no longer current. "
    "You get a concept and up to three example facts of it. Answer one class:\n"
    "safe-to-forget: once replaced or ended it will not matter to later care (a routine measurement taken again "
    "and again, an administrative event).\n"
    "never-forget: it matters for the rest of the patient's care even when past (a diagnosis, an allergy or "
    "adverse reaction, a surgery or major procedure, a vaccination, a high-risk medication).\n"
    "uncertain: it may matter, or the examples do not say enough to tell.\n"
    "When in doubt, answer uncertain. Reply in JSON."
)
# Worked examples (invented, none from the data): the packaged 1.5B model answered at random without them
# (a heart rate "never-forget", a diagnosis and warfarin "safe-to-forget") and sensibly with them.
_SHOTS = (
    ("Concept: observation: Respiratory rate\nExamples:\n- Respiratory rate 16 /min\n- Respiratory rate 18 /min",
     "safe-to-forget"),
    ("Concept: condition: Appendicitis\nExamples:\n- Appendicitis; status resolved", "never-forget"),
    ("Concept: medication: Amoxicillin 500 mg oral capsule\nExamples:\n- Amoxicillin 500 mg oral capsule; status "
     "completed", "uncertain"),
)
ENDURANCE = prompt("endurance", 2, "\n\n".join([ENDURANCE_SYSTEM, *(f"{q}\n=> {a}" for q, a in _SHOTS)]))
"""The judge's prompt: the system text and three worked examples (a new wording: a new version, see
stam/llm/prompt.py). Version 1 had no examples."""


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endurance: Literal["safe-to-forget", "uncertain", "never-forget"]


@dataclass(frozen=True)
class Label:
    concept_type: str
    endurance: Endurance
    source: str
    """``judge``, ``codes``, or ``person`` (a reviewer's label added to the label file by hand)."""
    judge: str
    """The judge's model name (``codes`` for labels from codes)."""
    prompt: str
    """The prompt id the judge answered (empty for labels from codes)."""
    date: str
    examples: int
    note: str = ""


def examples(memories: Sequence[AtomicMemory], k: int = 3) -> list[str]:
    """Up to ``k`` distinct example texts, spread over the type's memories in their order (first, middle,
    last), so a long series is not shown as three copies of its first value."""
    texts = list(dict.fromkeys(m.text.strip() for m in memories if m.text.strip()))
    if len(texts) <= k:
        return texts
    step = (len(texts) - 1) / (k - 1)
    return [texts[round(i * step)] for i in range(k)]


def concept_name(memories: Sequence[AtomicMemory]) -> str:
    first = memories[0]
    if first.concept is not None and first.concept.display:
        return f"{first.category.value}: {first.concept.display}"
    return f"{first.category.value}: {first.text.strip()[:200]}"


def label_messages(concept: str, shown: Sequence[str]) -> list[dict[str, str]]:
    lines = [f"Concept: {concept}", "Examples:", *(f"- {t}" for t in shown)]
    shots = [turn for q, a in _SHOTS for turn in ({"role": "user", "content": q},
                                                   {"role": "assistant", "content": json.dumps({"endurance": a})})]
    return [{"role": "system", "content": ENDURANCE_SYSTEM}, *shots, {"role": "user", "content": "\n".join(lines)}]


def judge_type(client: LLMClient, memories: Sequence[AtomicMemory], *, today: date | None = None,
               attempts: int = 2) -> Label:
    """The judge's label for one concept type (its memories, all of one type)."""
    shown = examples(memories)
    messages = label_messages(concept_name(memories), shown)
    problem = ""
    for _ in range(attempts):
        reply = client.chat(messages, schema=Verdict.model_json_schema(), schema_name="Verdict", max_tokens=24)
        try:
            verdict = Verdict.model_validate_json(reply.content)
        except ValidationError as exc:
            problem = f"invalid reply: {reply.content[:80]!r} ({exc.errors()[0]['msg']})"
            continue
        return Label(concept_type(memories[0]), Endurance(verdict.endurance), "judge", client.model, ENDURANCE.id,
                     (today or date.today()).isoformat(), len(shown))
    return Label(concept_type(memories[0]), Endurance.UNCERTAIN, "judge", client.model, ENDURANCE.id,
                 (today or date.today()).isoformat(), len(shown), note=f"no valid verdict; protected ({problem})")


def by_type(memories: Iterable[AtomicMemory]) -> dict[str, list[AtomicMemory]]:
    out: dict[str, list[AtomicMemory]] = {}
    for m in memories:
        out.setdefault(concept_type(m), []).append(m)
    return out


def code_labels(types: dict[str, list[AtomicMemory]], *, today: date | None = None) -> list[Label]:
    """The labels codes give (:func:`stam.deletion.labels.code_label`), for the types they decide."""
    out = []
    for t, ms in types.items():
        e = code_label(ms[0])
        if e is not None:
            out.append(Label(t, e, "codes", "codes", "", (today or date.today()).isoformat(), 0))
    return out


def agreement(codes: Iterable[Label], judge: Iterable[Label]) -> dict[str, object]:
    """How the two sources agree on the types both label: share equal, and the (codes, judge) pairs counted."""
    a = {x.concept_type: x.endurance for x in codes}
    b = {x.concept_type: x.endurance for x in judge}
    both = sorted(set(a) & set(b))
    pairs = Counter(f"{a[t].value} / {b[t].value}" for t in both)
    return {"types_both": len(both), "agree": round(sum(a[t] is b[t] for t in both) / len(both), 4) if both else None,
            "codes_vs_judge": dict(sorted(pairs.items()))}


def write_labels(path: Path, labels: Iterable[Label]) -> int:
    n = 0
    with path.open("w") as f:
        for x in labels:
            f.write(json.dumps({**asdict(x), "endurance": x.endurance.value}) + "\n")
            n += 1
    return n


def append_label(path: Path, label: Label) -> None:
    with path.open("a") as f:
        f.write(json.dumps({**asdict(label), "endurance": label.endurance.value}) + "\n")


def read_labels(path: Path) -> list[Label]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Label(**{**d, "endurance": Endurance(d["endurance"])}))
    return out
