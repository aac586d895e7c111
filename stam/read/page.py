"""The timeline page: a patient's memory in a browser (``GET /patients/{id}/timeline`` of the query worker, and
``stam state --patient P --html out.html``).

The page is a shell (``stam/read/web/timeline.html``: no patient datum in it) whose script asks for a query token
(kept in the tab's sessionStorage) and fetches the data of the visible window from
``GET /patients/{id}/timeline/data?from=&to=&as_of=`` with ``Authorization: Bearer``. This module builds that data
from what the read path already has, never re-deriving state:

- the patient's :class:`~stam.read.timeline.Timeline` (the query service's cached one when it holds the current
  version, else one read from the timeline rows) and its :meth:`~stam.read.timeline.Timeline.view` at ``as_of``,
  the very view a query with that ``as_of`` reads;
- concept threads (``Timeline.thread``): one row per thread;
- encounters as the view sees them (:class:`~stam.read.encounters.Encounters`);
- the record gaps dead letters left (``StateStore.gaps``).

Only the window's memories are sent (a memory whose interval overlaps it; a transition whose clinical time is in
it): the first view of a patient with 20,000 memories is its latest :data:`FIRST_VIEW_ITEMS` or so. A window holds
at most :data:`MAX_ITEMS` memories (the latest; ``truncated`` says so).

The export (:func:`export_html`) is the same shell with the vendored vis-timeline, the page's script and one
window's data (the whole record by default) inlined.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from schemas import StoredMemory
from schemas.query import RecordGap
from stam.cache import VersionedCache
from stam.deadletters import gap_line
from stam.errors import PageInputError
from stam.read.encounters import Encounters
from stam.read.timeline import ARCHIVED, Timeline, View, from_epoch

WEB = Path(__file__).resolve().parent / "web"
STATIC = WEB / "static"
ASSETS: dict[str, str] = {
    "vis-timeline-graph2d.min.js": "application/javascript; charset=utf-8",
    "vis-timeline-graph2d.min.css": "text/css; charset=utf-8",
    "timeline.js": "application/javascript; charset=utf-8",
    "timeline.css": "text/css; charset=utf-8",
}
"""The page's static files (``stam/read/web/static``), by name: the only ones the worker serves."""
FIRST_VIEW_ITEMS = 300
"""A first view without a window starts at the start of the latest this-many memories (all of a smaller record);
what lasts into that window is drawn too. vis-timeline measures every item and row in the time range on its first
draw, whichever rows are scrolled into view. For the largest MIMIC-IV demo patient on a 2-core machine, the latest
1,000 (1,428 memories, 509 rows) drew in 1.8-3.0 s and the latest 300 (590 memories, 272 rows) in 1.0-1.9 s; the
latest 100 (351 memories, 253 rows) still took ~1 s: the rows set it (docs/timeline.md, benchmarks/timeline_page.py),
over the page's goal of 1 s."""
MAX_ITEMS = 20_000
"""Most memories one window sends (the latest of a larger window)."""
MAX_DETAILS = 2000
"""Most transitions of a window whose records are read for their recorded time (more: the tooltip says to zoom)."""
POINT_CATEGORIES = frozenset({"observation", "immunization", "report", "note"})
"""Categories drawn as points at their time (a value, a shot, a report); others as bars where they last."""
CATEGORY_ORDER = ("encounter", "condition", "allergy", "medication", "order", "procedure", "careplan",
                  "immunization", "observation", "report", "note", "other")


@dataclass(frozen=True)
class Window:
    start: float | None
    end: float | None
    as_of: datetime | None
    compare: datetime | None = None
    """A second time: memories whose state differs between it and ``as_of`` are marked ``changed``."""


def parse_time(name: str, value: str | None) -> datetime | None:
    """An ISO 8601 time with its offset (``Z`` or ``+00:00``); None for none or an empty value."""
    if value is None or value == "":
        return None
    text = value.replace("Z", "+00:00")
    if "T" in text and text.count(" ") == 1:  # a "+" typed into a URL by hand arrives as a space
        text = text.replace(" ", "+")
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise PageInputError(f"{name}: not an ISO 8601 time: {value[:60]!r}") from None
    if t.tzinfo is None:
        raise PageInputError(f"{name}: a time needs its offset (e.g. 2150-01-01T00:00:00Z)")
    return t


def window_of(params: dict[str, str], names: dict[str, str] | None = None) -> Window:
    """The window a request asks for (``from``, ``to``, ``as_of``, ``compare``); ``names``: how the caller calls
    each parameter in an error (the command line's ``--as-of``)."""
    said = {k: (names or {}).get(k, k) for k in ("from", "to", "as_of", "compare")}
    start, end = parse_time(said["from"], params.get("from")), parse_time(said["to"], params.get("to"))
    if start is not None and end is not None and end <= start:
        raise PageInputError(f"{said['to']}: must be later than {said['from']}")
    return Window(start.timestamp() if start else None, end.timestamp() if end else None,
                  parse_time(said["as_of"], params.get("as_of")), parse_time(said["compare"], params.get("compare")))


class PageTimelines(VersionedCache[Timeline]):
    """The timelines the page read itself (the query service's are used first, once a query built them), least
    recently used out first beyond ``max_memories``: panning and zooming read one window after another of the same
    patient. No vectors or thread index: drawing needs neither."""

    def __init__(self, max_memories: int = 100_000) -> None:
        super().__init__(max_memories, version_of=lambda tl: tl.version, weigh=len)


def load_timeline(states: Any, patient_id: str, cache: Any = None, own: PageTimelines | None = None) -> Timeline:
    """The patient's timeline: the query service's cached one when it holds the current version (``cache``: a
    :class:`~stam.read.service.TimelineCache`), else this page's (``own``), else read from the state store."""
    both = getattr(states, "version_and_erasures", None)
    version, erasures = both(patient_id) if both is not None else (states.version(patient_id), 0)
    if cache is not None:
        got = cache.get(patient_id, version, erasures)
        if got is not None:
            return got[0]  # type: ignore[no-any-return]
    if own is not None and (mine := own.get(patient_id, version, erasures)) is not None:
        return mine
    tl = Timeline.read(states, patient_id)
    if own is not None and len(tl):
        own.put(patient_id, tl, erasures)
    return tl


def _iso(t: float) -> str | None:
    d = from_epoch(t)
    return d.strftime("%Y-%m-%d %H:%M") if d is not None else None


def _ms(t: float) -> int | None:
    """Milliseconds since the epoch (what a JavaScript Date takes); None for no time."""
    return int(round(float(t) * 1000)) if np.isfinite(t) else None


def _label(tl: Timeline, i: int) -> str:
    text = tl.display[i]
    v = tl.value[i]
    unit = tl.unit[i] or ""
    if np.isfinite(v):
        text += f": {v:g} {unit}".rstrip()
    elif tl.value_text and tl.value_text[i]:
        text += f": {tl.value_text[i]} {unit}".rstrip()
    if tl.dosage[i]:
        text += f" ({tl.dosage[i]})"
    return text


def spans(tl: Timeline, view: View) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per memory: where it is drawn from, to (``nan``: a point), and whether it is a point. A fact with an end
    (its own, or its lifecycle's) is a bar to it; a current fact with none is a bar to the view's time (or the
    patient's clinical clock); an event, a value or a fact whose end is unknown is a point at its start."""
    n = len(tl)
    lo = np.where(np.isfinite(tl.t_start), tl.t_start, tl.t_add)
    clock = float(view.at) if np.isfinite(view.at) else (tl.latest_time() or datetime.fromtimestamp(0, UTC)).timestamp()
    hi = np.full(n, np.nan)
    point_cat = np.fromiter((c in POINT_CATEGORIES for c in tl.category), dtype=bool, count=n)
    own_end = np.isfinite(tl.t_end) & (tl.t_end > lo)
    hi[own_end] = tl.t_end[own_end]
    ended = ~own_end & view.history & np.isfinite(tl.t_ended) & (tl.t_ended > lo) & ~point_cat
    hi[ended] = tl.t_ended[ended]
    ongoing = ~own_end & ~view.history & ~point_cat & (clock > lo)
    hi[ongoing] = clock
    current_end = own_end & ~view.history & (tl.t_end > clock) & np.isfinite(view.at)
    hi[current_end] = np.maximum(lo[current_end], clock)  # not drawn past the as-of time while it is current
    hi[point_cat & ~own_end] = np.nan
    return lo, hi, np.isnan(hi)


def page_data(tl: Timeline, window: Window, gaps: Sequence[RecordGap] = (),
              details: Callable[[list[str]], dict[str, StoredMemory]] | None = None,
              first_view: int = FIRST_VIEW_ITEMS, max_items: int = MAX_ITEMS) -> dict[str, Any]:
    """The JSON of one window of the page: threads (rows), memories, transitions, encounters, gaps. ``details``
    reads records by memory id (``StateStore.memories`` of this patient): the transitions' recorded times."""
    view = tl.view(window.as_of)
    changed = None
    if window.compare is not None:  # what changed between the two times: came, went, or moved store
        other = tl.view(window.compare)
        changed = (view.present != other.present) | (view.present & other.present & (view.history != other.history))
    lo, hi, point = spans(tl, view)
    top = np.where(point, lo, hi)
    timed = view.present & np.isfinite(lo)
    n_timed = int(timed.sum())
    extent = (float(lo[timed].min()), float(top[timed].max())) if n_timed else None
    a, b = _bounds(window, lo, timed, extent, first_view)
    archived = view.history & (tl.kind == ARCHIVED) & np.isfinite(tl.t_ended)
    if a is None or b is None:
        shown = np.zeros(len(tl), dtype=bool)
    else:
        shown = timed & (lo <= b) & (top >= a)
        shown |= view.present & archived & (tl.t_ended >= a) & (tl.t_ended <= b) & np.isfinite(lo)
    idx = np.flatnonzero(shown)
    truncated = len(idx) > max_items
    if truncated:
        idx = idx[np.argsort(lo[idx], kind="stable")[-max_items:]]
        idx.sort()
    marks = [int(i) for i in idx if archived[i]]
    records = details([tl.ids[i] for i in marks]) if details is not None and len(marks) <= MAX_DETAILS else {}
    memories: list[dict[str, Any]] = []
    transitions: list[dict[str, Any]] = []
    for i in idx.tolist():
        memories.append(_memory_item(tl, view, i, lo, hi, point, changed))
        if archived[i]:
            transitions.append(_transition_item(tl, i, records.get(tl.ids[i])))
    threads = _threads(tl, idx, lo)
    stays = _stays(tl, view, a, b, extent)
    return {
        "patient_id": tl.patient_id, "version": tl.version,
        "as_of": window.as_of.isoformat() if window.as_of else None,
        "compare": window.compare.isoformat() if window.compare else None,
        "window": {"from": _ms(a) if a is not None else None, "to": _ms(b) if b is not None else None},
        "extent": {"from": _ms(extent[0]), "to": _ms(extent[1])} if extent else None,
        "clock": _ms(tl.t_add[np.isfinite(tl.t_add)].max()) if np.isfinite(tl.t_add).any() else None,
        "counts": {"memories": len(tl), "present": int(view.present.sum()), "current":
                   int((view.present & ~view.history).sum()), "untimed": int((view.present & ~np.isfinite(lo)).sum()),
                   "shown": len(memories), "transitions": len(transitions),
                   **({"changed": int((changed & view.present).sum())} if changed is not None else {})},
        "truncated": truncated,
        "categories": sorted({t["category"] for t in threads}, key=_category_key),
        "threads": threads, "memories": memories, "transitions": transitions, "encounters": stays,
        "gaps": [g.model_dump(mode="json") for g in gaps], "gap_line": gap_line(gaps),
    }


def _bounds(window: Window, lo: np.ndarray, timed: np.ndarray, extent: tuple[float, float] | None,
            first_view: int) -> tuple[float | None, float | None]:
    """The window shown: the one asked for, else up to the latest memory (with room after it for the as-of line)
    from the start of the last ``first_view`` memories, at least an hour."""
    a, b = window.start, window.end
    if (a is None or b is None) and extent is not None:
        given_end = b is not None
        b = b if b is not None else extent[1]
        if a is None:
            starts = np.sort(lo[timed & (lo <= b)])
            a = float(starts[-first_view]) if len(starts) > first_view else extent[0]
            a = min(a, b - 3600.0)
        if not given_end:  # room after the latest memory, for the as-of line
            b += max(3600.0, 0.03 * (b - a))
    return a, b


def _memory_item(tl: Timeline, view: View, i: int, lo: np.ndarray, hi: np.ndarray, point: np.ndarray,
                 changed: np.ndarray | None) -> dict[str, Any]:
    """One memory on the page: its bar (or point), its text, and whether and why it ended."""
    hist = bool(view.history[i])
    item: dict[str, Any] = {
        "i": i, "id": tl.ids[i], "thread": int(tl.thread[i]), "category": tl.category[i], "text": _label(tl, i),
        "start": _ms(lo[i]), "end": None if point[i] else _ms(hi[i]), "current": not hist,
        "entry": tl.entry_ids[i], "encounter": tl.encounter[i] if tl.encounter else None,
        "from": _iso(lo[i]), "to": None if point[i] else _iso(hi[i]),
    }
    if changed is not None:
        item["changed"] = bool(changed[i])
    if hist:
        item["reason"] = tl.reason[i]
        item["ended"] = _iso(tl.t_ended[i])
    return item


def _transition_item(tl: Timeline, i: int, rec: StoredMemory | None) -> dict[str, Any]:
    """The move of archived memory ``i`` to HISTORY: when, why, on what evidence, and what replaced it; ``rec``
    (its record, when read) gives when it was recorded."""
    s = int(tl.succ[i])
    e = int(tl.evid[i])
    return {
        "i": i, "id": tl.ids[i], "thread": int(tl.thread[i]), "at": _ms(tl.t_ended[i]),
        "clinical": _iso(tl.t_ended[i]), "reason": tl.reason[i] or "",
        "evidence_entry": (rec.archived_by_entry if rec is not None and rec.archived_by_entry else
                           (tl.entry_ids[e] if e >= 0 else None)),
        "recorded": (rec.archived_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                     if rec is not None and rec.archived_at else None),
        "recorded_known": rec is not None,
        "successor": _label(tl, s) if s >= 0 else None, "successor_id": tl.ids[s] if s >= 0 else None,
    }


def _stays(tl: Timeline, view: View, a: float | None, b: float | None,
           extent: tuple[float, float] | None) -> list[dict[str, Any]]:
    """The encounters that overlap the window shown (an open one up to the as-of time)."""
    stays = []
    for st in Encounters.build(tl).stays(tl, view):
        end = st.end if st.ended else (float(view.at) if np.isfinite(view.at) else (extent[1] if extent else st.start))
        if a is not None and b is not None and st.start <= b and end >= a:
            stays.append({"id": st.encounter_id, "start": _ms(st.start), "end": _ms(max(end, st.start + 60)),
                          "label": st.label(st.display[:120]), "open": not st.ended})
    return stays


def patient_data(states: Any, patient_id: str, window: Window, cache: Any = None,
                 own: PageTimelines | None = None) -> dict[str, Any] | None:
    """One window of a patient's page from its state store (None: no memory of the patient)."""
    tl = load_timeline(states, patient_id, cache, own)
    if len(tl) == 0:
        return None
    return page_data(tl, window, states.gaps(patient_id), details=lambda ids: states.memories(patient_id, ids))


def _category_key(c: str) -> tuple[int, str]:
    return (CATEGORY_ORDER.index(c) if c in CATEGORY_ORDER else len(CATEGORY_ORDER), c)


def _threads(tl: Timeline, idx: np.ndarray, lo: np.ndarray) -> list[dict[str, Any]]:
    """One row per thread with a memory in the window: named by its latest member there, ordered by category then
    name."""
    latest: dict[int, int] = {}
    count: dict[int, int] = {}
    for i in idx.tolist():
        t = int(tl.thread[i])
        count[t] = count.get(t, 0) + 1
        if t not in latest or lo[i] >= lo[latest[t]]:
            latest[t] = i
    order = sorted(latest, key=lambda t: (_category_key(tl.category[latest[t]]), tl.display[latest[t]].lower(), t))
    return [{"id": t, "label": tl.display[latest[t]], "category": tl.category[latest[t]], "n": count[t]} for t in order]


# --- the HTML ---------------------------------------------------------------------------------------------------

def shell(patient_id: str) -> str:
    """The page the worker serves: the patient's id (already in its URL) and no datum of the record."""
    return _template(patient_id, head=_links(), tail=_script_tag())


def export_html(patient_id: str, data: dict[str, Any]) -> str:
    """The page with everything inlined (vis-timeline's JS and CSS, the page's script and the data): one file that
    opens without a worker."""
    css = "\n".join((STATIC / n).read_text(encoding="utf-8") for n in ("vis-timeline-graph2d.min.css", "timeline.css"))
    js = (STATIC / "vis-timeline-graph2d.min.js").read_text(encoding="utf-8")
    app = (STATIC / "timeline.js").read_text(encoding="utf-8")
    payload = _inline_json(data)
    head = f"<style>\n{_inline_text(css, 'style')}\n</style>"
    tail = (f'<script id="stam-data" type="application/json">{payload}</script>\n'
            f"<script>\n{_inline_text(js, 'script')}\n</script>\n<script>\n{_inline_text(app, 'script')}\n</script>")
    return _template(patient_id, head=head, tail=tail)


def _template(patient_id: str, head: str, tail: str) -> str:
    page = (WEB / "timeline.html").read_text(encoding="utf-8")
    return (page.replace("{{patient_attr}}", html.escape(patient_id, quote=True))
            .replace("{{patient_text}}", html.escape(patient_id)).replace("{{head}}", head).replace("{{tail}}", tail))


def _links() -> str:
    return ('<link rel="stylesheet" href="/static/timeline/vis-timeline-graph2d.min.css">\n'
            '<link rel="stylesheet" href="/static/timeline/timeline.css">')


def _script_tag() -> str:
    return ('<script src="/static/timeline/vis-timeline-graph2d.min.js"></script>\n'
            '<script src="/static/timeline/timeline.js"></script>')


def _inline_json(data: dict[str, Any]) -> str:
    """JSON safe inside a <script> element: no ``</`` or ``<!--`` can end or confuse it."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _inline_text(text: str, element: str) -> str:
    """A vendored script or style inside its element: a literal closing tag in it is split."""
    return text.replace(f"</{element}", f"<\\/{element}")


def asset(name: str) -> tuple[bytes, str] | None:
    """A static file of the page by name (None: not one of :data:`ASSETS`)."""
    kind = ASSETS.get(name)
    return ((STATIC / name).read_bytes(), kind) if kind is not None else None
