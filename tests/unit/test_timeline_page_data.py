"""The timeline page's data (stam/read/page.py) on a timeline built from rows by hand: what is a bar and what a
point, transitions, as of, windows, what changed, the times it refuses, and the export's inlined JSON. The page in
a browser, on the real stack: tests/integration/test_timeline_page.py."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest

from stam.errors import PageInputError
from stam.read.page import Window, export_html, page_data, parse_time, window_of
from stam.read.timeline import Timeline

H = 3600.0
T0 = datetime(2150, 1, 1, tzinfo=UTC).timestamp()
P = "p-1"


def _row(mid: str, category: str, concept: str, display: str, start: float, *, value: float | None = None,
         end: float | None = None, history: bool = False, evidence: str | None = None, successor: str | None = None,
         reason: str | None = None, lifecycle: str = "state") -> list[Any]:
    return [mid, P, f"e-{mid}", 0, category, f"X/{mid}", concept, display, "cm" if value is not None else None, None,
            value, start, end, history, evidence, successor, reason, f"m:{mid}", None, None, None, lifecycle]


def _timeline() -> Timeline:
    """A condition current since T0; a height measured at T0+10h (superseded by the one at T0+20h); a stopped
    order from T0+2h to T0+5h."""
    return Timeline.from_rows(P, 4, [
        _row("cond", "condition", "sct|1", "Epilepsy", T0),
        _row("h1", "observation", "loinc|8302-2", "Body Height", T0 + 10 * H, value=80.0, history=True,
             evidence="h2", successor="h2", reason="superseded", lifecycle="measurement"),
        _row("h2", "observation", "loinc|8302-2", "Body Height", T0 + 20 * H, value=82.5, lifecycle="measurement"),
        _row("med", "medication", "rx|9", "Aspirin 81 MG", T0 + 2 * H, end=T0 + 5 * H, history=True,
             reason="stopped"),
    ])


def _by_id(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in data["memories"]}


def test_bars_points_threads_and_transitions_now() -> None:
    data = page_data(_timeline(), Window(None, None, None))
    m = _by_id(data)
    assert set(m) == {"cond", "h1", "h2", "med"}
    assert m["cond"]["current"] and m["cond"]["end"] == int((T0 + 20 * H) * 1000)  # current: a bar to the clock
    assert m["h2"]["end"] is None and m["h2"]["current"] and m["h2"]["text"] == "Body Height: 82.5 cm"
    assert m["h1"]["end"] is None and not m["h1"]["current"] and m["h1"]["reason"] == "superseded"
    assert m["med"]["end"] == int((T0 + 5 * H) * 1000) and not m["med"]["current"]  # its own end
    assert len(data["threads"]) == 3 and m["h1"]["thread"] == m["h2"]["thread"] != m["cond"]["thread"]
    assert [t["category"] for t in data["threads"]] == ["condition", "medication", "observation"]
    (tr,) = data["transitions"]
    assert tr["id"] == "h1" and tr["at"] == int((T0 + 20 * H) * 1000) and tr["reason"] == "superseded"
    assert tr["successor"] == "Body Height: 82.5 cm" and tr["evidence_entry"] == "e-h2"
    assert data["counts"] == {"memories": 4, "present": 4, "current": 2, "untimed": 0, "shown": 4, "transitions": 1}


def test_as_of_draws_the_state_then_and_a_second_time_marks_what_changed() -> None:
    at = datetime.fromtimestamp(T0 + 15 * H, UTC)
    data = page_data(_timeline(), Window(None, None, at))
    m = _by_id(data)
    assert set(m) == {"cond", "h1", "med"}  # the second height did not exist yet
    assert m["h1"]["current"] and data["transitions"] == []
    assert m["cond"]["end"] == int((T0 + 15 * H) * 1000)  # drawn to the as-of time, not past it
    data = page_data(_timeline(), Window(None, None, at, compare=datetime.fromtimestamp(T0 + 25 * H, UTC)))
    assert {k for k, v in _by_id(data).items() if v["changed"]} == {"h1"}  # current then, history later


def test_a_window_holds_what_overlaps_it_or_moved_in_it() -> None:
    data = page_data(_timeline(), Window(T0 + 19 * H, T0 + 21 * H, None))
    assert set(_by_id(data)) == {"cond", "h1", "h2"}  # h1 for its transition at T0+20h; not the order of T0+2..5h
    assert [t["id"] for t in data["transitions"]] == ["h1"]
    data = page_data(_timeline(), Window(T0 + 3 * H, T0 + 4 * H, None))
    assert set(_by_id(data)) == {"cond", "med"}
    first = page_data(_timeline(), Window(None, None, None), first_view=2)
    assert first["window"]["from"] == int((T0 + 10 * H) * 1000)  # the latest two memories by start


def test_times_it_cannot_read_are_refused_with_their_parameter() -> None:
    assert parse_time("as_of", "2150-01-01T00:00:00Z") == datetime(2150, 1, 1, tzinfo=UTC)
    assert parse_time("as_of", "2150-01-01T00:00:00 00:00") == datetime(2150, 1, 1, tzinfo=UTC)  # a "+" from a URL
    assert parse_time("as_of", "") is None
    for bad, says in (("yesterday", "not an ISO 8601 time"), ("2150-01-01T00:00:00", "needs its offset")):
        with pytest.raises(PageInputError, match=f"as_of: .*{says}"):
            parse_time("as_of", bad)
    with pytest.raises(PageInputError, match="to: must be later than from"):
        window_of({"from": "2150-01-02T00:00:00Z", "to": "2150-01-01T00:00:00Z"})


def test_the_export_inlines_data_that_cannot_end_its_script() -> None:
    evil = "</script><script>alert(1)</script><!--"
    tl = Timeline.from_rows(P, 1, [_row("x", "condition", "sct|2", evil, T0)])
    page = export_html("p<1>", page_data(tl, Window(None, None, None)))
    block = re.search(r'<script id="stam-data" type="application/json">(.*?)</script>', page, re.S)
    assert block is not None and "<" not in block.group(1)
    assert json.loads(block.group(1))["memories"][0]["text"] == evil
    assert 'data-patient="p&lt;1&gt;"' in page and "<script src=" not in page
