"""Timeline page: first-view load time (the data call and the render) in Chromium, through the real query worker.

A patient of a replayed MIMIC-IV store (``--rdb``: the Redis file of ``stam eval`` runs, e.g.
``/work/runs/final/stam/redis-stam.rdb``; copied, never opened in place) is copied key by key (DUMP/RESTORE of its
records, timeline rows, version and gaps) into the Redis of a fresh embedded stack in a temporary home; a query
worker serves the page on that stack; Chromium (Selenium, Debian's chromium and chromium-driver) opens
``/patients/{id}/timeline`` with a token ``--runs`` times, a fresh tab each time. The page measures itself
(``window.stam.state.timing``): ``fetch_ms`` from the request for the data to its JSON parsed, ``render_ms`` from
there to the second animation frame after vis-timeline's first draw of it. A patient's first run reads it from Redis (the
timeline rows); the later ones draw the timeline the page kept (``stam.read.page.PageTimelines``).

Patients (``--patient``, repeatable): an id, ``largest`` (the one with the most memories in the store, the
default) or ``median`` (the middle one by memories). Prints one JSON object (stdout), rendered in docs/timeline.md by
``make figures``; progress on stderr.

Usage: python -m benchmarks.timeline_page --rdb PATH [--patient largest --patient median] [--runs 3] [--shots DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stam.net import free_port
from stam.transport import local_redis_client, stop_local_redis
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
TOKEN = "timeline-benchmark-token"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def copy_patient(source: Any, target: Any, patient: str, prefix: str = "stam") -> int:
    """The patient's keys from one Redis to another (DUMP/RESTORE, byte for byte); returns its memory count."""
    keys = [k.decode() if isinstance(k, bytes) else k for k in source.scan_iter(match=f"{prefix}:{{{patient}}}:*")]
    for key in keys:
        dumped = source.dump(key)
        if dumped is not None:
            target.restore(key, 0, dumped, replace=True)
    target.sadd(f"{prefix}:patients", patient)
    return int(target.hlen(f"{prefix}:{{{patient}}}:mem"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rdb", type=Path, required=True, help="a replayed store's Redis file (copied, not modified)")
    ap.add_argument("--patient", action="append", default=None,
                    help="an id, largest or median; repeatable (default: largest)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shots", type=Path, default=None, help="save a screenshot of the first view here")
    args = ap.parse_args(argv)
    if not args.rdb.is_file():
        print(f"timeline_page: {args.rdb} not found (--rdb)", file=sys.stderr)
        return 2
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        print("timeline_page: chromium and chromium-driver are needed (make browser)", file=sys.stderr)
        return 2

    import redis
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from stam import stack
    from topology.admin import ensure_topics

    work = Path(tempfile.mkdtemp(prefix="stam-timeline-bench-"))
    try:
        copy = work / "source.rdb"
        shutil.copy(args.rdb, copy)
        _say(f"opening a copy of {args.rdb}")
        source = local_redis_client(copy)
        sizes = {p.decode(): int(source.hlen(f"stam:{{{p.decode()}}}:mem")) for p in source.smembers("stam:patients")}
        by_size = sorted(sizes, key=lambda p: (sizes[p], p))
        named = {"largest": by_size[-1] if by_size else None, "median": by_size[len(by_size) // 2] if by_size else None}
        asked = [named.get(p, p) for p in (args.patient or ["largest"])]
        patients = [p for p in asked if p is not None and p in sizes]
        if len(patients) < len(asked):
            print(f"timeline_page: no such patient in {args.rdb}: {', '.join(args.patient or ['largest'])}",
                  file=sys.stderr)
            return 2
        home = work / "home"
        info = stack.up(home, partitions=4)
        try:
            settings = stack.settings(info, home, web_port=0)
            asyncio.run(ensure_topics(settings))
            target = redis.Redis.from_url(info.redis_url)
            counts = {p: copy_patient(source, target, p) for p in dict.fromkeys(patients)}
            stop_local_redis(source)
            _say(f"patients {', '.join(f'{p} ({n} memories)' for p, n in counts.items())} copied; starting the query "
                 "worker")
            result = _measure(settings, counts, args, chromium, driver_path, webdriver, Service, By, WebDriverWait)
        finally:
            stack.down(home)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(stamp({"benchmark": "timeline_page", "store_patients": len(sizes), **result}), indent=2))
    return 0


def _measure(settings: Any, counts: dict[str, int], args: argparse.Namespace, chromium: str, driver_path: str,
             webdriver: Any, Service: Any, By: Any, WebDriverWait: Any) -> dict[str, Any]:  # noqa: N803
    port = free_port()
    env = dict(os.environ, STAM_HOME=str(settings.home), STAM_BROKER_URL=settings.broker_url,
               STAM_REDIS_URL=settings.redis_url, STAM_MILVUS_URI=settings.milvus_uri, STAM_PARTITIONS="4",
               STAM_WEB_PORT="0", STAM_QUERY_WEB_PORT=str(port), STAM_QUERY_TOKEN=TOKEN)
    log = open(settings.home / "query-worker.log", "wb")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "query-worker"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100", "--disable-gpu"):
        opts.add_argument(arg)
    driver = None
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("query worker did not start: " + (settings.home / "query-worker.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        driver = webdriver.Chrome(service=Service(driver_path), options=opts)
        measured = [{"patient": patient, "memories": n,
                     "runs": _runs(driver, f"http://127.0.0.1:{port}/patients/{quote(patient)}/timeline", patient,
                                   args, By, WebDriverWait)}
                    for patient, n in counts.items()]
        return {"patients": measured, "chromium": driver.capabilities.get("browserVersion"),
                "machine_cpus": os.cpu_count()}
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _runs(driver: Any, url: str, patient: str, args: argparse.Namespace, By: Any,  # noqa: N803
          WebDriverWait: Any) -> list[dict[str, Any]]:  # noqa: N803
    """``args.runs`` first views of one patient's page, a fresh tab state each time (the token asked again)."""
    runs = []
    for k in range(args.runs):
        driver.get(url)
        driver.execute_script("sessionStorage.clear()")
        driver.get(url)
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.body.dataset.state") == "token")
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        started = time.perf_counter()
        driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
        WebDriverWait(driver, 300, poll_frequency=0.05).until(lambda d: d.execute_script(
            "return document.body.dataset.state === 'ready' && window.stam.state.timing !== null"))
        wall = (time.perf_counter() - started) * 1000
        timing = driver.execute_script("return window.stam.state.timing")
        counts = driver.execute_script("return window.stam.state.data.counts")
        runs.append({**{k2: round(v, 1) for k2, v in timing.items() if k2.endswith("_ms")},
                     "wall_ms_from_click": round(wall, 1), "shown": counts["shown"],
                     "transitions": counts["transitions"],
                     "threads": driver.execute_script("return window.stam.state.data.threads.length"),
                     "rows": driver.execute_script("return window.stam.groups.length")})
        _say(f"{patient} run {k + 1}: {runs[-1]}")
        if k == 0 and args.shots is not None:
            args.shots.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.shots / f"timeline-mimic-{patient}.png"))
    return runs


if __name__ == "__main__":
    sys.exit(main())
