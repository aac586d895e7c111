"""Every prompt STAM sends a language model, by purpose, versioned.

A prompt is defined once, in the module of its purpose (extraction and the link+update judgement in
``stam/reasoning/prompts.py``, the reader's answer in ``stam/read/reader.py``, the evaluation's short answer
in ``lab/stam_lab/eval/qa_run.py``), and registered here with :func:`prompt`. Two parts:

- ``template``: the words a person wrote. It changes only with ``version``: ``tests/unit/test_prompts.py`` pins
  the fingerprint of each version's template, so an edit without a new version fails there, and a new version
  is one line in that table that a reviewer sees.
- ``text``: the template as sent, with what is derived from elsewhere filled in (the relation types and end
  reasons of ``schemas/vocabulary.py``). Adding a relation type changes the text, not the template: no version
  to bump, and the prompt's :attr:`Prompt.id` still changes with it.

``Prompt.id`` (``judge/v1-d797eb05``: purpose, version, fingerprint of the text) is what evaluation and
benchmark reports and ``ModelReasoner.prompts`` name, and the metric ``stam_prompt_info`` carries, so a figure
can always be traced to the exact words that produced it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from stam.metrics import PROMPT_INFO


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Prompt:
    purpose: str
    version: int
    template: str
    """The hand-written words (placeholders included); pinned per version by the tests."""
    text: str
    """What is sent: the template with derived parts filled in (system text and any fixed worked example)."""

    @property
    def id(self) -> str:
        return f"{self.purpose}/v{self.version}-{fingerprint(self.text)}"


PROMPTS: dict[str, Prompt] = {}
"""The registered prompts by purpose (filled as their modules are imported)."""


def prompt(purpose: str, version: int, template: str, text: str | None = None) -> Prompt:
    """Register the prompt of ``purpose``; ``text`` defaults to the template (nothing derived)."""
    p = Prompt(purpose, version, template, template if text is None else text)
    known = PROMPTS.get(purpose)
    if known is not None and known != p:
        raise ValueError(f"prompt {purpose!r} is defined twice ({known.id} and {p.id}): one place per purpose")
    PROMPTS[purpose] = p
    PROMPT_INFO.labels(purpose=purpose, prompt=p.id).set(1)
    return p


def ids(*purposes: str) -> dict[str, str]:
    """``{purpose: id}`` of the given purposes (all registered ones if none given), for a report."""
    return {k: p.id for k, p in sorted(PROMPTS.items()) if not purposes or k in purposes}
