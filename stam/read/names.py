"""Concept names in words: the words of a concept's name and of a question, the concentrations they give,
and a thread's name (the lexical half of ranking threads, :mod:`stam.read.select`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from stam.read.timeline import Timeline, words

_STOP = frozenset({
    "a", "an", "the", "of", "and", "or", "in", "on", "at", "to", "for", "by", "with", "from", "as", "is", "was",
    "were", "are", "be", "been", "has", "have", "had", "do", "does", "did", "what", "which", "who", "whose",
    "when", "how", "many", "much", "patient", "patients", "patient's", "value", "values", "result", "results",
    "level", "levels", "recorded", "charted", "most", "recent", "recently", "latest", "last", "first",
    "current", "currently", "earlier", "previous", "before", "after", "since", "until", "highest", "lowest",
    "maximum", "minimum", "any", "all", "ever", "still", "now", "time", "times", "date", "order", "orders",
    "ordered", "medication", "medications", "active", "started", "discontinued", "changed", "stopped", "into",
    "one", "that", "this", "there", "their", "his", "her", "its", "number", "count", "him",
})


def _stem(w: str) -> str:
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w


SALT_WORDS = frozenset({
    "sodium", "potassium", "calcium", "magnesium", "hcl", "hydrochloride", "sulfate", "sulphate", "tartrate",
    "bitartrate", "succinate", "citrate", "phosphate", "acetate", "maleate", "mesylate", "besylate", "fumarate",
    "bromide", "gluconate", "propionate", "dipropionate", "xinafoate", "monohydrate", "trihydrate", "er", "sr",
    "xl", "dr",
})
"""Salt, ester and release-form words: after a drug's first word they do not change which drug it is ("Heparin
Sodium" is what a clinician calls heparin; "Sodium Chloride" keeps both words)."""


@lru_cache(maxsize=65536)
def name_words(display: str) -> tuple[frozenset[str], frozenset[str]]:
    """(all words, core words) of a concept name; the core is what precedes a parenthesis, colon, semicolon or
    comma, without salt words after the first word ("Potassium (Blood)" -> {potassium}, "Heparin Sodium" ->
    {heparin}); stop words and bare numbers are not words here."""
    core_text = re.split(r"[(:;,]", display, maxsplit=1)[0]

    def ws(text: str) -> list[str]:
        return [_stem(w) for w in words(text) if w not in _STOP and not w.replace(".", "").isdigit()]

    all_w = frozenset(ws(display))
    core_l = ws(core_text)
    core = frozenset(core_l[:1] + [w for w in core_l[1:] if w not in SALT_WORDS])
    return all_w, core or all_w


_STRENGTH = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*%")


def strengths(text: str) -> frozenset[str]:
    """The concentrations a name or question gives ("Dextrose 5%" -> {"5.0"}). Bare numbers are not name words, but a
    concentration tells products apart: Dextrose 5% is a maintenance fluid, Dextrose 50% a rescue for
    hypoglycaemia."""
    return frozenset(str(float(m)) for m in _STRENGTH.findall(text))


def same_strength(asked: frozenset[str], display: str) -> bool:
    """Whether ``display`` may be the product a question asked about with concentrations ``asked`` (either gives
    none, or they share one)."""
    if not asked:
        return True
    given = strengths(display)
    return not given or bool(given & asked)


def question_words(question: str) -> frozenset[str]:
    """The words of a question, stemmed, without stop words."""
    return frozenset(_stem(w) for w in words(question) if w not in _STOP)


def thread_name(tl: Timeline, ms: Sequence[int] | np.ndarray) -> str:
    """A thread's name: its concept's display when every memory shares it, else their common core name."""
    displays = list(dict.fromkeys(tl.display[int(i)] for i in ms))
    if len(displays) == 1:
        return displays[0]
    cores = {re.split(r"[(:;,]", d, maxsplit=1)[0].strip() for d in displays}
    return cores.pop() if len(cores) == 1 else displays[-1]


Name = tuple[frozenset[str], frozenset[str]]
"""(all words, core words) of one concept name."""
