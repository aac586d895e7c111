"""benchmarks.llm_notes: one note's row of the report (cost and extraction quality against its gold facts)."""

from __future__ import annotations

from types import SimpleNamespace as N
from typing import Any

from benchmarks import llm_notes


def _added(category: str, text: str, status: str = "") -> Any:
    return N(kind=N(value="added"), memory=N(category=N(value=category), embed_text=None, text=text, status=status))


def test_a_note_row_scores_its_extractions_against_the_gold_facts() -> None:
    transitions = [_added("condition", "condition: Acute bronchitis", "active"), _added("note", "note: the note"),
                   N(kind=N(value="archived"), memory=None)]
    usage = {"extraction": {"calls": 1, "prompt_tokens": 100, "completion_tokens": 20},
             "link+update": {"calls": 1, "prompt_tokens": 50, "completion_tokens": 5}}
    gold = [["condition", "Acute bronchitis (disorder)", "active"], ["symptom", "cough", "active"]]
    row, counts = llm_notes.note_row("n1", gold, transitions, usage, 200)
    # the note memory is no extracted fact; bronchitis matches its gold fact by name words, the cough is missed
    assert (row["memories"], row["archived"], row["extracted"], row["matched"]) == (2, 1, 1, 1)
    assert (row["precision"], row["recall"], row["link_update_calls_per_memory"]) == (1.0, 0.5, 0.5)
    assert row["tokens_per_1k_source"] == {"prompt": 750, "completion": 125}
    assert row["missed"] == ["cough"] and row["unmatched_extractions"] == []
    assert counts == {"tp": 1, "extracted": 1, "gold": 2, "category_ok": 1, "status_ok": 1}
