"""A real Prometheus server scrapes a running write worker and query worker while a Synthea patient streams and
questions are asked: every PromQL expression of the dashboard (``stam.ops.dashboard.queries``) and a fixed list
of core expressions return data (an explicit allow-list says which cannot here, and why); the consumer lag rises
during the burst and drains to 0. Then the probes: readiness follows a Redis outage and recovery.

Prometheus is Debian's ``prometheus`` package (``make prometheus`` installs it); the test skips without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stam.net import free_port
from stam.transport import kafka_producer
from tests.conftest import SMALL_PATIENT, need_data
from tests.integration.broker import collect_outputs
from tests.integration.conftest import QUERY_TOKEN, _stam_process

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")

CORE: list[tuple[str, str]] = [
    ("entries/s per stage", 'sum by (stage) (rate(stam_messages_total[1m]))'),
    ("stage latency p99", 'histogram_quantile(0.99, sum by (le, stage) (rate(stam_stage_seconds_bucket[1m])))'),
    ("stage latency p50", 'histogram_quantile(0.5, sum by (le, stage) (rate(stam_stage_seconds_bucket[1m])))'),
    ("transitions by kind and reason", 'sum by (kind, reason) (increase(stam_transitions_total[5m]))'),
    ("dead letters by stage and error", 'sum by (stage, error_type) (increase(stam_dead_letters_total[5m]))'),
    ("consumer lag", 'sum by (group, topic, partition) (stam_consumer_lag)'),
    ("stale redo ratio", 'sum(rate(stam_stale_redo_total[1m])) / clamp_min(sum(rate(stam_messages_total'
                         '{stage="update"}[1m])), 1e-9)'),
    ("link and impact work at the updater", 'sum by (reads) (increase(stam_update_reads_total[5m]))'),
    ("queries/s", 'sum by (channel, outcome) (rate(stam_queries_total[1m]))'),
    ("query p99", 'histogram_quantile(0.99, sum by (le, channel) (rate(stam_query_seconds_bucket[1m])))'),
    ("HISTORY served rate", 'sum(rate(stam_queries_total{served="both"}[1m])) / clamp_min(sum(rate('
                            'stam_queries_total{outcome="ok"}[1m])), 1e-9)'),
    ("served tokens per query", 'sum(rate(stam_query_served_tokens_sum[1m])) / clamp_min(sum(rate('
                                'stam_query_served_tokens_count[1m])), 1e-9)'),
    ("readiness", 'min by (job, dependency) (stam_ready)'),
    ("process memory", 'process_resident_memory_bytes{job=~"stam-.*"}'),
]

# Expressions that cannot have data in this run: a metric named here may come back empty (never a reason to
# skip one that has data). Each with why.
ALLOW_EMPTY: dict[str, str] = {
    "stam_llm_": "no language model is configured (STAM_LLM_URL unset): no model calls, tokens or latency",
    'handling="decomposed"': "free text is decomposed only by a language model; none is configured",
    "stam_free_text_entries_total": "the Synthea bundle streamed here carries no free-text entry",
    "stam_stage_bug_total": "counts bugs (unexpected exceptions); none happens in a good run",
    "stam_partition_stalled": "set only while a bug holds a partition",
    "stam_archive_refused_total": "counts forged or unsigned archivals refused; no source is configured here",
    "stam_background_failures_total": "counts failed timers; none fails in a good run",
    "stam_state_recover": "counts rebuilds after a store lost writes; none is lost in this run",
    "stam_state_unreadable": "counts transitions whose data key is missing; none is",
    "stam_publisher_": "pushed by `stam publish` to a Pushgateway; none runs in this test (the push itself is "
                       "tested in tests/unit/test_service_surface.py)",
}


# --- Prometheus ---------------------------------------------------------------------------------------------

class Prometheus:
    def __init__(self, home: Path, targets: dict[str, int]) -> None:
        self.port = free_port()
        self.home = home
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
                       for job, port in targets.items())
        self.config = home / "prometheus.yml"
        self.config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n" + jobs)
        promtool = shutil.which("promtool")
        if promtool:
            subprocess.run([promtool, "check", "config", str(self.config)], check=True, capture_output=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={self.home / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=(self.home / "prometheus.log").open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("prometheus did not become ready: " + (self.home / "prometheus.log").read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def api(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def over(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])


def _values(series: list[dict[str, Any]]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"]]


def _grafana_to_promql(expr: str) -> str:
    """Grafana's interval variables to fixed windows, other template variables to match-all."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "5m")
    expr = re.sub(r'=~?\s*"\$\{?\w+(?::\w+)?\}?"', '=~".*"', expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


# --- workers ------------------------------------------------------------------------------------------------

def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _ask(port: int, question: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"patient_id": SMALL_PATIENT, "question": question, **extra}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/query", method="POST", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {QUERY_TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wait(what: str, cond: Any, timeout: float, *logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(p.read_text()[-3000:] for p in logs
                                                                       if p.exists()))


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


@pytest.fixture(scope="module")
def ops(stack_settings: Any) -> Iterator[dict[str, Any]]:
    """Write worker (web + metrics ports) and query worker (HTTP + metrics ports) on the module's stack, lag
    exported every second, and a Prometheus scraping both every second."""
    if PROMETHEUS is None:
        pytest.skip("no prometheus server on PATH (Debian package `prometheus`: `make prometheus`)")
    need_data()
    s = stack_settings
    ports = {"web": free_port(), "write_metrics": free_port(), "query_web": free_port(),
             "query_metrics": free_port()}
    common = {"STAM_LAG_INTERVAL_S": "1", "STAM_READY_CACHE_S": "1", "STAM_READY_TIMEOUT_S": "2"}
    # The four stages: the dashboard's queries need every stage's metrics (the fused worker reports one stage).
    with _stam_process(s, "worker --stages all", "ops-worker.log", STAM_WEB_PORT=str(ports["web"]),
                       STAM_METRICS_PORT=str(ports["write_metrics"]), **common) as worker, \
            _stam_process(s, "query-worker", "ops-query-worker.log", STAM_QUERY_WEB_PORT=str(ports["query_web"]),
                          STAM_METRICS_PORT=str(ports["query_metrics"]), STAM_QUERY_TOKEN=QUERY_TOKEN,
                          **common) as query_worker:
        prom = Prometheus(Path(s.home), {"stam-write": ports["write_metrics"], "stam-query": ports["query_metrics"]})
        prom.start()
        try:
            yield {"settings": s, "ports": ports, "prom": prom, "worker": worker, "query_worker": query_worker,
                   "logs": (Path(s.home) / "ops-worker.log", Path(s.home) / "ops-query-worker.log")}
        finally:
            prom.stop()


def _check_both_workers_up(ports: dict[str, int], logs: Any) -> None:
    # Both workers up: ready, and holding their partitions (the lag gauge exists once partitions are assigned).
    _wait("both workers ready and assigned", lambda: _get(ports["web"], "/readyz")[0] == 200
          and _get(ports["query_web"], "/readyz")[0] == 200
          and 'stam_consumer_lag{group="stam-write"' in _scrape(ports["write_metrics"])
          and 'stam_consumer_lag{group="stam-query"' in _scrape(ports["query_metrics"]), 300, *logs)
    status, alive = _get(ports["web"], "/healthz")
    assert status == 200 and alive == {"alive": True}
    status, ready = _get(ports["web"], "/readyz")
    assert ready["ready"] and set(ready["dependencies"]) == {"broker", "redis", "milvus"}
    # the bind fix: the endpoints listen on 127.0.0.1 only (STAM_WEB_HOST / STAM_QUERY_WEB_HOST defaults)
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
    for port in (ports["web"], ports["query_web"], ports["write_metrics"], ports["query_metrics"]):
        if listening:
            assert f"127.0.0.1:{port} " in listening and f"0.0.0.0:{port} " not in listening \
                and f"*:{port} " not in listening, (port, listening)


def _warm_up(s: Any, prom: Any, logs: Any, small_bundle: Any) -> None:
    # One entry of another patient first, through every stage: the stage histograms exist (and the worker's first
    # model and store calls are paid) before the window. A rate needs two samples that differ; a warm worker can
    # apply the whole burst between two scrapes, and then series first seen after the burst would have none.
    from stam.publish import Publisher, PublishSummary

    first = small_bundle.entries[0]
    warm = first.model_copy(update={"patient_id": "prom-warm-up", "entry_id": "prom-warm-up-" + first.entry_id})

    async def warm_up() -> None:
        async with Publisher(s) as pub:
            await pub.send_entries([warm], PublishSummary())

    asyncio.run(warm_up())
    asyncio.run(collect_outputs(s, {warm.entry_id}, timeout=300))
    _wait("the warm-up entry's stage timings scraped", lambda: prom.instant(
        'count(stam_stage_seconds_bucket{stage="update"})') != [], 60, *logs)


def _stream_and_ask(s: Any, ports: dict[str, int], small_bundle: Any) -> None:
    # The stream: one malformed entry (a dead letter), then the patient's 132 entries at 40/s (several batches
    # per stage, so every rate sees increases between scrapes), questions meanwhile.
    from schemas.query import QueryRequest
    from stam.publish import Publisher, PublishSummary
    from topology import topics as t

    want = {e.entry_id for e in small_bundle.entries}

    async def burst() -> None:
        producer = kafka_producer(s)
        await producer.start()
        try:
            await producer.send_and_wait(t.ENTRIES.name(s.topic_prefix), key=SMALL_PATIENT.encode(),
                                         value=b'{"not": "an entry"}')
            async with Publisher(s) as pub:
                await pub.send_entries(list(small_bundle.entries), PublishSummary(), rate=40)
            for i in range(3):
                req = QueryRequest(request_id=f"prom-kafka-{i}", patient_id=SMALL_PATIENT, question="What is the body "
                                   "height?")
                await producer.send_and_wait(t.QUERIES.name(s.topic_prefix), key=SMALL_PATIENT.encode(),
                                             value=req.model_dump_json().encode())
        finally:
            await producer.stop()

    sender = threading.Thread(target=lambda: asyncio.run(burst()))
    sender.start()
    asked: list[int] = []
    while sender.is_alive() or len(asked) < 3:
        asked.append(_ask(ports["query_web"], "What are the current conditions?")[0])
        time.sleep(0.5)
    sender.join()
    transitions, _ = asyncio.run(collect_outputs(s, want, timeout=600))
    assert want <= {x["entry_id"] for x in transitions}, "not every entry was applied"
    for q, extra in (("How has the body height changed?", {"k_history": 10}), ("What is the body height?", {}),
                     ("What medications were stopped in the past?", {"k_history": 10})):
        status, answer = _ask(ports["query_web"], q, **extra)
        assert status == 200 and answer["ok"], answer
    assert set(asked) <= {200, 404}, asked  # 404 while the patient has no state yet


def _check_the_lag_rose_and_drained(s: Any, prom: Any, started: float, end: float) -> None:
    lag = prom.over('sum(stam_consumer_lag{group="stam-write"})', started - 5, end)
    values = _values(lag)
    print(f"\nwrite-group lag over the run (1 s steps): {values}")
    assert max(values) > 0, f"the write group's lag never rose during the burst: {values}"
    assert values[-1] == 0
    peak = values.index(max(values))
    assert all(v == 0 for v in values[-3:]) and peak < len(values) - 3
    by_topic = prom.instant('max_over_time(sum by (topic) (stam_consumer_lag{group="stam-write"})[10m:1s])')
    assert any(x["metric"]["topic"] == f"{s.topic_prefix}.entries.v1" and float(x["value"][1]) > 0 for x in by_topic)


def _check_every_expression_has_data(prom: Any, started: float, end: float) -> None:
    # Every expression: the dashboard's and the core list. Data = at least one non-NaN sample over the run.
    try:
        from stam.ops.dashboard import queries
    except ImportError:
        dashboard: list[tuple[str, str]] = []
        print("stam.ops.dashboard not in this tree: the core expressions only")
    else:
        dashboard = list(queries())
        assert dashboard, "the dashboard has no queries"
    empty_allowed: list[tuple[str, str, str]] = []
    failures: list[str] = []
    for title, expr in [*CORE, *dashboard]:
        promql = _grafana_to_promql(expr)
        series = prom.over(promql, started - 5, end, step=2)
        if any(not math.isnan(v) for v in _values(series)):
            continue
        reason = next((why for key, why in ALLOW_EMPTY.items() if key in promql), None)
        if reason is None or (title, expr) in CORE:
            failures.append(f"{title}: {promql} returned no data")
        else:
            empty_allowed.append((title, promql, reason))
    print("\nno data, allowed:\n" + "\n".join(f"  {t}: {e}  -- {r}" for t, e, r in empty_allowed))
    assert not failures, "\n".join(failures)


def test_prometheus_scrapes_the_workers_and_every_dashboard_query_has_data(ops: Any, small_bundle: Any) -> None:
    s, ports, prom, logs = ops["settings"], ops["ports"], ops["prom"], ops["logs"]
    _check_both_workers_up(ports, logs)
    _warm_up(s, prom, logs, small_bundle)
    time.sleep(2)  # a scrape or two more of the same counts
    started = time.time()
    _stream_and_ask(s, ports, small_bundle)

    # Caught up: the lag drains to 0 (committed after the durability window), for both groups.
    _wait("the consumer lag to drain to 0", lambda: (r := prom.instant('sum by (group) (stam_consumer_lag)'))
          and len(r) == 2 and all(float(x["value"][1]) == 0 for x in r), 180, *logs)
    time.sleep(3)  # a few more scrapes after the last change
    end = time.time()
    _check_the_lag_rose_and_drained(s, prom, started, end)
    _check_every_expression_has_data(prom, started, end)

    # No patient identifier in any label of any series.
    for series in prom.api("series", **{"match[]": '{__name__=~"stam_.*"}', "start": started - 5, "end": end}):
        assert not any(SMALL_PATIENT in str(v) for v in series.values()), series
    assert ops["worker"].poll() is None and ops["query_worker"].poll() is None


def test_readiness_follows_a_redis_outage(ops: Any) -> None:
    """Both workers: /readyz (and stam_ready{dependency="redis"}) false while Redis is stopped, true again when it is
    back; /healthz answers throughout; the processes live on."""
    from stam import stack
    from tests.integration.test_query_outages import RedisServer, _wait_closed

    s, ports, prom, logs = ops["settings"], ops["ports"], ops["prom"], ops["logs"]
    probes = (ports["web"], ports["query_web"])
    _wait("ready before the outage", lambda: all(_get(p, "/readyz")[0] == 200 for p in probes), 120, *logs)

    info = stack.read_stack(s.home)
    assert info is not None
    redis_port = int(s.redis_url.rsplit(":", 1)[1].split("/")[0])
    os.kill(info.pids["redis"], signal.SIGTERM)  # saves its data and exits
    _wait_closed(redis_port)
    restarted = RedisServer(Path(s.home).resolve(), redis_port)
    try:
        for port in probes:
            _wait(f"/readyz on {port} to say Redis is down", lambda p=port: (r := _get(p, "/readyz"))[0] == 503
                  and not r[1]["dependencies"]["redis"]["ok"] and r[1]["dependencies"]["broker"]["ok"], 30, *logs)
            status, body = _get(port, "/readyz")
            assert body["ready"] is False and body["dependencies"]["redis"]["error"]
            assert _get(port, "/healthz") == (200, {"alive": True})  # alive: not restarted for an outage
        assert _get(ports["query_web"], "/v1/health")[0] == 503  # the old name answers the same
        _wait("stam_ready{redis} 0 in Prometheus", lambda: (r := prom.instant('stam_ready{dependency="redis"}'))
              and len(r) == 2 and all(float(x["value"][1]) == 0 for x in r), 60, *logs)

        restarted.start()  # same port, same data
        for port in probes:
            _wait(f"/readyz on {port} ready again", lambda p=port: _get(p, "/readyz")[0] == 200, 60, *logs)
        _wait("stam_ready{redis} 1 in Prometheus", lambda: (r := prom.instant('stam_ready{dependency="redis"}'))
              and len(r) == 2 and all(float(x["value"][1]) == 1 for x in r), 60, *logs)
        assert ops["worker"].poll() is None and ops["query_worker"].poll() is None
    finally:
        restarted.stop()


def test_a_second_worker_on_the_same_ports_says_so_in_one_line(ops: Any) -> None:
    """The port clash of a second `stam worker` on one host: one line naming the variable, exit 2."""
    import sys

    from tests.conftest import REPO

    s, ports = ops["settings"], ops["ports"]
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_WEB_PORT=str(ports["web"]))
    res = subprocess.run([sys.executable, "-m", "stam.cli", "worker"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith(f"stam worker: STAM_WEB_PORT={ports['web']}: 127.0.0.1:{ports['web']} is already in use")
    socket.create_connection(("127.0.0.1", ports["web"]), timeout=2).close()  # the first one still listens
