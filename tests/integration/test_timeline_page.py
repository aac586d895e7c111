"""The timeline page (issue 37) in a real browser: Debian's Chromium driven by Selenium against the real query
worker on the real stack, with the small Synthea patient applied by the real worker. What the page draws is
checked against the patient's state read from Redis (its threads, transitions and what is current as of a time),
the question box against ``POST /v1/query``, the scopes against a token that may not read the patient, and the
static export (``stam state --html``) offline.

Screenshots go to each test's tmp dir, and to ``$STAM_ARTEFACTS`` when it is set. Chromium and chromedriver come
from ``make browser`` (part of ``make test``); without them these tests skip and say so."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest

from stam.net import free_port
from stam.read.scopes import new_token
from stam.read.timeline import ARCHIVED, Timeline
from tests.conftest import REPO, SMALL_PATIENT
from tests.integration.broker import _publish, collect_outputs
from tests.integration.conftest import _stam_process

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
GHOST = "patient-that-does-not-exist-0002"
QUESTION = "What is the body height?"


def _need_browser() -> None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium not installed (the dev extra: pip install -e '.[dev]')")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium or chromium-driver not installed (make browser: apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100",
                "--disable-gpu", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(stack_settings: Any, worker: Any, small_bundle: Any) -> Iterator[dict[str, Any]]:
    """The small Synthea patient applied by the real worker; a query worker with a clinician token and a token
    for another patient only."""
    _need_browser()
    entries = small_bundle.entries
    asyncio.run(_publish(stack_settings, entries))
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in entries}, timeout=240))
    assert {e.entry_id for e in entries} <= {x["entry_id"] for x in transitions}
    path = stack_settings.home / "timeline-tokens.json"
    tokens = {"ward": new_token(path, "ward", "clinician", None),
              "other": new_token(path, "other", "service:other", [GHOST])}
    port = free_port()
    log = stack_settings.home / "query-worker-timeline.log"
    with _stam_process(stack_settings, "query-worker", log.name, STAM_QUERY_WEB_PORT=str(port),
                       STAM_QUERY_TOKENS_FILE=str(path)) as proc:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if _get(port, "/v1/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        yield {"port": port, "tokens": tokens, "base": f"http://127.0.0.1:{port}", "settings": stack_settings,
               "log": log}


@pytest.fixture(scope="module")
def timeline(page: dict[str, Any]) -> Timeline:
    """The patient's timeline as the state store holds it: what the page must show."""
    from stam.backends.redis_state import RedisStateStore
    from stam.read.page import load_timeline
    from stam.transport import redis_client

    states = RedisStateStore(redis_client(page["settings"]), prefix=page["settings"].collection_prefix)
    tl = load_timeline(states, SMALL_PATIENT)
    assert len(tl) > 50
    return tl


def _get(port: int, path: str, token: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _data_path(patient: str, **params: str) -> str:
    q = "&".join(f"{k}={quote(v)}" for k, v in params.items())
    return f"/patients/{quote(patient)}/timeline/data" + (f"?{q}" if q else "")


def _shot(driver: Any, tmp_path: Path, name: str) -> Path:
    out = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(out)), f"screenshot {name} not written"
    if os.environ.get("STAM_ARTEFACTS"):
        dest = Path(os.environ["STAM_ARTEFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, dest / out.name)
    return out


def _wait(driver: Any, script: str, timeout: float = 60) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: d.execute_script(script))
    except TimeoutException:  # what the page showed, for the reader of a failed run
        seen = driver.execute_script("""
            const s = window.stam && window.stam.state, tl = window.stam && window.stam.timeline;
            return {state: document.body.dataset.state, status: (document.getElementById('status') || {}).textContent,
                    url: location.href, as_of: s && s.asOf, request: s && s.request,
                    data_as_of: s && s.data && s.data.as_of, timing: s && s.timing,
                    line: tl ? tl.getCustomTime('as-of').toISOString() : null,
                    window: tl ? [tl.getWindow().start.toISOString(), tl.getWindow().end.toISOString()] : null};""")
        raise AssertionError(f"waited {timeout:.0f} s for: {script}\nthe page: {seen}") from None


def _ready(driver: Any, timeout: float = 60) -> None:
    _wait(driver, "return document.body.dataset.state === 'ready' && window.stam.state.timing !== null", timeout)


def _open(driver: Any, page: dict[str, Any], token: str, query: str = "") -> None:
    """Open the page as a user does: the token typed into its form (the tab forgets it between tests)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{page['base']}/patients/{quote(SMALL_PATIENT)}/timeline{query}")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{page['base']}/patients/{quote(SMALL_PATIENT)}/timeline{query}")
    _wait(driver, "return document.body.dataset.state === 'token'")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()


def _grip(driver: Any, line: str) -> tuple[int, int]:
    """A point (viewport pixels) among the rows where a press lands on the drag strip of the custom-time
    ``line`` (not the axis: its labels lie over the strip)."""
    point = driver.execute_script("""
        const bar = document.querySelector('.vis-custom-time.' + arguments[0]), strip = bar.firstChild;
        const r = strip.getBoundingClientRect(), x = Math.round(r.left + r.width / 2);
        const rows = document.querySelector('.vis-panel.vis-center').getBoundingClientRect();  // below the axis
        const top = Math.max(r.top, rows.top, 0), bottom = Math.min(r.bottom, rows.bottom, window.innerHeight);
        for (let y = Math.round(top) + 2; y < bottom; y += 4) {
          if (document.elementFromPoint(x, y) === strip) return [x, y];
        }
        return null;""", line)
    assert point, f"no point of the {line} line is free to grab"
    return int(point[0]), int(point[1])


def _expected(tl: Timeline, at: datetime | None = None) -> tuple[set[int], set[str], set[str]]:
    """Threads with a timed memory present, ids of memories in a transition (archived by the time), ids of the
    current memories, at ``at``: from the timeline, not from the page's code."""
    view = tl.view(at)
    timed = view.present & (np.isfinite(tl.t_start) | np.isfinite(tl.t_add))
    threads = {int(tl.thread[i]) for i in np.flatnonzero(timed)}
    moved = view.present & view.history & (tl.kind == ARCHIVED) & np.isfinite(tl.t_ended)
    current = {tl.ids[i] for i in np.flatnonzero(timed & ~view.history)}
    return threads, {tl.ids[i] for i in np.flatnonzero(moved)}, current


def _page_items(driver: Any) -> list[dict[str, Any]]:
    return list(driver.execute_script(
        "return window.stam.items.get().map(i => ({id: String(i.id), memory: i.memory || null, group: i.group ?? null,"
        " className: i.className || '', type: i.type}))"))


def test_the_page_draws_one_row_per_thread_and_every_transition(browser: Any, page: dict[str, Any],
                                                                 timeline: Timeline, tmp_path: Path) -> None:
    status, body, headers = _get(page["port"], f"/patients/{quote(SMALL_PATIENT)}/timeline")
    assert status == 200 and headers["cache-control"] == "no-store"
    assert b"body height" not in body.lower() and timeline.ids[0].encode() not in body  # the shell holds no datum
    status, body, headers = _get(page["port"], _data_path(SMALL_PATIENT), page["tokens"]["ward"])
    assert status == 200 and headers["cache-control"] == "no-store", body[:300]
    # A window: only the memories whose time overlaps it, or whose transition is in it, come back.
    full = json.loads(body)
    everything, moved_at = full["memories"], {t["id"]: t["at"] for t in full["transitions"]}
    starts = sorted(m["start"] for m in everything)
    a, b = starts[len(starts) // 3], starts[len(starts) // 2]
    iso = {k: datetime.fromtimestamp(v / 1000, UTC).isoformat() for k, v in (("from", a), ("to", b))}
    window = json.loads(_get(page["port"], _data_path(SMALL_PATIENT, **iso), page["tokens"]["ward"])[1])["memories"]

    def inside(m: dict[str, Any]) -> bool:
        end = m["end"] if m["end"] is not None else m["start"]
        return (m["start"] <= b and end >= a) or a <= moved_at.get(m["id"], -1e18) <= b

    assert 0 < len(window) < len(everything)
    assert {m["id"] for m in window} == {m["id"] for m in everything if inside(m)}

    browser.get_log("browser")
    _open(browser, page, page["tokens"]["ward"])
    _ready(browser)
    # What is drawn is the window the data was read for (vis-timeline would fit its first draw to the items).
    shown, loaded = browser.execute_script("""const w = window.stam.timeline.getWindow(), d = window.stam.state.data;
        return [[w.start.valueOf(), w.end.valueOf()], [d.window.from, d.window.to]];""")
    assert shown == loaded
    threads, moved, current = _expected(timeline)
    groups = set(browser.execute_script("return window.stam.groups.getIds()"))
    assert groups == threads
    labels = browser.execute_script("return document.querySelectorAll('.vis-labelset .vis-label').length")
    assert labels == len(threads)
    items = _page_items(browser)
    assert {i["memory"] for i in items if i["id"].startswith("t")} == moved
    assert moved, "the small patient has transitions (superseded values)"
    memories = [i for i in items if i["id"].startswith("m")]
    assert {i["memory"] for i in memories if "current" in i["className"].split()} == current
    assert {i["memory"] for i in memories if "history" in i["className"].split()} == \
        {timeline.ids[i] for i in range(len(timeline)) if timeline.kind[i] != 0 and
         (np.isfinite(timeline.t_start[i]) or np.isfinite(timeline.t_add[i]))}
    encounters = [i for i in items if i["id"].startswith("e")]
    assert encounters and all(i["type"] == "background" for i in encounters)
    # The category filter leaves only that category's rows.
    browser.execute_script("const s = document.getElementById('category'); s.value = 'observation';"
                           "s.dispatchEvent(new Event('change'))")
    obs = {int(timeline.thread[i]) for i in range(len(timeline)) if timeline.category[i] == "observation"}
    assert set(browser.execute_script("return window.stam.groups.getIds()")) == obs & threads
    timing = browser.execute_script("return window.stam.state.timing")
    print(f"\nfirst view of {SMALL_PATIENT} ({len(timeline)} memories): data call {timing['fetch_ms']:.0f} ms, "
          f"render {timing['render_ms']:.0f} ms, total {timing['total_ms']:.0f} ms")
    _artefact(tmp_path, "timeline-first-view.json", {"patient_memories": len(timeline), **timing})
    browser.execute_script("const s = document.getElementById('category'); s.value = '';"
                           "s.dispatchEvent(new Event('change'))")
    _shot(browser, tmp_path, "timeline-first-view")
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not logs, logs  # no script error, no request the CSP refused


def test_many_threads_open_folded_one_row_per_category(browser: Any, page: dict[str, Any], timeline: Timeline,
                                                       tmp_path: Path) -> None:
    """Above ``?fold=N`` threads (100 by default; the largest MIMIC-IV demo patient has 272 in its first view) the page
    opens folded: one row per category holding its threads' memories and transitions. A click on a category's label
    opens it into its threads; a second folds it again. ``fold=0`` folds the small patient."""
    from selenium.webdriver.common.by import By

    threads, moved, current = _expected(timeline)
    view = timeline.view(None)
    timed = view.present & (np.isfinite(timeline.t_start) | np.isfinite(timeline.t_add))
    category_of = {int(timeline.thread[i]): timeline.category[i] for i in np.flatnonzero(timed)}
    cats = set(category_of.values())
    assert len(cats) > 1 and len(threads) > len(cats)
    _open(browser, page, page["tokens"]["ward"], "?fold=0")
    _ready(browser)
    assert set(browser.execute_script("return window.stam.groups.getIds()")) == {f"c:{c}" for c in cats}
    items = _page_items(browser)
    memories = [i for i in items if i["id"].startswith("m")]
    by_id = {timeline.ids[i]: i for i in range(len(timeline))}
    assert all(i["group"] == f"c:{timeline.category[by_id[i['memory']]]}" for i in memories)
    assert {i["memory"] for i in memories if "current" in i["className"].split()} == current
    assert {i["memory"] for i in items if i["id"].startswith("t")} == moved
    assert f"in {len(cats)} categories" in browser.find_element(By.ID, "counts").text
    # Opened: that category's threads get their rows, the others stay folded.
    browser.find_element(By.CSS_SELECTOR, ".vis-labelset .vis-label.cat-observation").click()
    _wait(browser, "return window.stam.groups.get('c:observation').className.includes('open')", 10)
    obs = {t for t, c in category_of.items() if c == "observation"}
    assert set(browser.execute_script("return window.stam.groups.getIds()")) == \
        {f"c:{c}" for c in cats} | obs
    items = _page_items(browser)
    assert {i["group"] for i in items if i["id"].startswith("m") and i["group"] in obs} == obs
    _shot(browser, tmp_path, "timeline-folded-one-open")
    browser.find_element(By.CSS_SELECTOR, ".vis-labelset .vis-label.cat-observation").click()
    _wait(browser, "return !window.stam.groups.get('c:observation').className.includes('open')", 10)
    assert set(browser.execute_script("return window.stam.groups.getIds()")) == {f"c:{c}" for c in cats}


def _artefact(tmp_path: Path, name: str, value: dict[str, Any]) -> None:
    (tmp_path / name).write_text(json.dumps(value, indent=2))
    if os.environ.get("STAM_ARTEFACTS"):
        dest = Path(os.environ["STAM_ARTEFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, dest / name)


def test_the_as_of_handle_moves_what_is_current(browser: Any, page: dict[str, Any], timeline: Timeline,
                                                tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    # A memory archived by later evidence: current just before that evidence, history now.
    tl = timeline
    archived = [i for i in np.flatnonzero((tl.kind == ARCHIVED) & np.isfinite(tl.t_ended) & np.isfinite(tl.t_start))
                if tl.t_ended[i] - tl.t_start[i] > 120]
    assert archived
    i = int(archived[-1])
    at = datetime.fromtimestamp(float(tl.t_ended[i]) - 60, UTC)
    view = tl.view(at)
    assert view.present[i] and not view.history[i]
    _, moved_then, current_then = _expected(tl, at)
    _, _, current_now = _expected(tl)
    assert tl.ids[i] in current_then and tl.ids[i] not in current_now

    _open(browser, page, page["tokens"]["ward"])
    _ready(browser)
    # The handle on the time axis, dragged back: the page reads the state at the time it was dropped at.
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    browser.execute_script("window.stam.state.timing = null")
    # Grabbed among the rows, where nothing lies over the line's drag strip: pressed on an axis label instead, the
    # drag pans the view (what CI once saw, when the page said ready before its first draw had placed the line).
    x, y = _grip(browser, "as-of")
    drag = ActionBuilder(browser)
    drag.pointer_action.move_to_location(x, y).pointer_down()
    for dx in (-10, -40, -120, -200):
        drag.pointer_action.move_to_location(x + dx, y)
    drag.pointer_action.pointer_up()
    drag.perform()
    _wait(browser, "return window.stam.state.data && window.stam.state.data.as_of !== null")
    _ready(browser)
    dropped = datetime.fromisoformat(browser.execute_script("return window.stam.state.data.as_of"))
    assert dropped.timestamp() < float(np.nanmax(np.where(np.isfinite(tl.t_add), tl.t_add, np.nan)))
    _, moved_drop, current_drop = _expected(tl, dropped)
    items = _page_items(browser)
    assert {x["memory"] for x in items if x["id"].startswith("m") and "current" in x["className"].split()} == \
        current_drop
    assert {x["memory"] for x in items if x["id"].startswith("t")} == moved_drop
    assert "as_of=" in browser.execute_script("return location.search")

    browser.execute_script("window.stam.state.timing = null")
    box = browser.find_element(By.ID, "as-of")
    box.clear()
    box.send_keys(at.isoformat().replace("+00:00", "Z") + Keys.TAB)
    _wait(browser, f"return window.stam.state.data && window.stam.state.data.as_of === {json.dumps(at.isoformat())}")
    _ready(browser)
    assert "as_of=" in browser.execute_script("return location.search")
    items = _page_items(browser)
    memories = [x for x in items if x["id"].startswith("m")]
    assert {x["memory"] for x in memories if "current" in x["className"].split()} == current_then
    assert {x["memory"] for x in items if x["id"].startswith("t")} == moved_then
    line = browser.execute_script("return window.stam.timeline.getCustomTime('as-of').valueOf()")
    assert abs(line / 1000 - at.timestamp()) < 1
    _shot(browser, tmp_path, "timeline-as-of")
    # The URL keeps it: a reload shows the same state.
    browser.refresh()
    _ready(browser)
    assert browser.execute_script("return window.stam.state.data.as_of") == at.isoformat()
    # "changes since": the memories whose state differs between the two times are marked.
    since = datetime.fromtimestamp(float(tl.t_ended[i]) + 60, UTC)
    browser.execute_script("window.stam.state.timing = null")
    box = browser.find_element(By.ID, "compare")
    box.send_keys(since.isoformat().replace("+00:00", "Z") + Keys.TAB)
    _wait(browser, "return window.stam.state.data && window.stam.state.data.compare !== null")
    _ready(browser)
    later = tl.view(since)
    differs = (view.present != later.present) | (view.present & later.present & (view.history != later.history))
    marked = {x["memory"] for x in _page_items(browser) if "changed" in x["className"].split()}
    assert tl.ids[i] in marked
    assert marked == {tl.ids[j] for j in np.flatnonzero(differs & view.present)}


def test_the_question_box_highlights_what_the_packet_served(browser: Any, page: dict[str, Any],
                                                            tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, page, page["tokens"]["ward"])
    _ready(browser)
    browser.find_element(By.ID, "question-text").send_keys(QUESTION)
    browser.find_element(By.CSS_SELECTOR, "#ask button").click()
    _wait(browser, "return document.body.dataset.asked === 'done'", timeout=120)
    served = set(browser.execute_script("return Array.from(window.stam.state.served)"))
    # The same question through the API: the same memories, the same gate decision.
    conn = http.client.HTTPConnection("127.0.0.1", page["port"], timeout=120)
    conn.request("POST", "/v1/query", json.dumps({"patient_id": SMALL_PATIENT, "question": QUESTION,
                                                  "answer": False}),
                 {"Authorization": f"Bearer {page['tokens']['ward']}", "Content-Type": "application/json"})
    packet = json.loads(conn.getresponse().read())["packet"]
    conn.close()
    assert served == {x["memory_id"] for x in packet["items"]} and served
    highlighted = {x["memory"] for x in _page_items(browser) if "served" in x["className"].split()}
    loaded = set(browser.execute_script("return window.stam.state.data.memories.map(m => m.id)"))
    assert highlighted == served & loaded and highlighted
    gate = browser.find_element(By.ID, "gate").text
    assert ("HISTORY served" if packet["gate"]["serve_history"] else "ACTIVE only") in gate
    assert packet["gate"]["reason"] in gate
    listed = browser.find_elements(By.CSS_SELECTOR, "#served li")
    assert len(listed) == len(packet["items"])
    _wait(browser, "return document.querySelectorAll('.vis-item.served').length >= 1", timeout=10)  # drawn, in view
    _shot(browser, tmp_path, "timeline-question")


def test_a_token_that_may_not_read_the_patient_is_refused(browser: Any, page: dict[str, Any],
                                                          tmp_path: Path) -> None:
    port, tokens = page["port"], page["tokens"]
    refused = _get(port, _data_path(SMALL_PATIENT), tokens["other"])
    missing = _get(port, _data_path(GHOST), tokens["other"])
    nobody = _get(port, _data_path(GHOST), tokens["ward"])
    assert refused[0] == missing[0] == nobody[0] == 404
    assert refused[1] == missing[1] == nobody[1]  # byte for byte: 404 says nothing of who exists
    assert refused[2]["cache-control"] == "no-store"
    assert _get(port, _data_path(SMALL_PATIENT))[0] == 401
    assert _get(port, _data_path(SMALL_PATIENT), "stam_not-a-token")[0] == 401
    assert _get(port, _data_path(SMALL_PATIENT, as_of="yesterday"), tokens["ward"])[0] == 400
    assert _get(port, "/static/timeline/..%2F..%2Fpage.py")[0] == 404

    _open(browser, page, tokens["other"])
    _wait(browser, "return document.body.dataset.state === 'not-found'")
    assert browser.execute_script("return window.stam.items.length") == 0
    _shot(browser, tmp_path, "timeline-refused")
    _open(browser, page, "stam_not-a-token")
    _wait(browser, "return document.body.dataset.state === 'token' && "
                   "document.getElementById('status').textContent.includes('401')")
    assert browser.execute_script("return sessionStorage.length") == 0  # a refused token is not kept


def test_the_static_export_opens_without_a_worker(browser: Any, page: dict[str, Any], timeline: Timeline,
                                                  tmp_path: Path) -> None:
    s = page["settings"]
    out = tmp_path / "timeline.html"
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri)
    done = subprocess.run([sys.executable, "-m", "stam.cli", "state", "--patient", SMALL_PATIENT, "--html", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert "<script src=" not in html and 'rel="stylesheet"' not in html  # everything inlined
    bad = subprocess.run([sys.executable, "-m", "stam.cli", "state", "--patient", SMALL_PATIENT, "--html", str(out),
                          "--as-of", "tuesday"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--as-of" in bad.stderr, bad.stderr

    browser.get_log("browser")  # what earlier tests left (a refused token's 401)
    browser.get(out.as_uri())
    _ready(browser)
    threads, moved, current = _expected(timeline)
    assert set(browser.execute_script("return window.stam.groups.getIds()")) == threads
    items = _page_items(browser)
    assert {i["memory"] for i in items if i["id"].startswith("t")} == moved
    assert {i["memory"] for i in items if i["id"].startswith("m") and "current" in i["className"].split()} == current
    assert browser.execute_script("return document.getElementById('question-text').disabled")
    _shot(browser, tmp_path, "timeline-export")
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not logs, logs


def test_record_text_is_never_markup(browser: Any, tmp_path: Path) -> None:
    """A memory whose text is markup (and a script's end tag) is shown as that text in the export and its
    tooltips: nothing of it runs or becomes an element."""
    from stam.read.page import Window, export_html, page_data

    evil = '<img src=x onerror="window.pwned=1"></script><script>window.pwned=2</script>'
    row = ["m-1", "p-evil", "e-1", 0, "condition", "Condition/c-1", "http://snomed.info/sct|1", evil, None, None,
           None, 1.7e9, None, False, None, None, None, "m:m-1", None, None, None, "state"]
    tl = Timeline.from_rows("p-evil", 1, [row])
    out = tmp_path / "evil.html"
    out.write_text(export_html("p-evil<b>", page_data(tl, Window(None, None, None))))
    browser.get(out.as_uri())
    _ready(browser)
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('#timeline img, #timeline b').length") == 0
    texts = browser.execute_script("return Array.from(document.querySelectorAll('.vis-item-content, .vis-label'))"
                                   ".map(e => e.textContent)")
    assert any(evil in t for t in texts), texts
    assert browser.execute_script("return document.getElementById('patient').textContent") == "p-evil<b>"
