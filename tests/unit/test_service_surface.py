"""The service surface without a stack: settings -> client kwargs (SASL/TLS, Redis), JSON logs, --stages,
a taken port, the publisher's pushed counts."""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from stam.config import Settings
from stam.transport import faust_broker_kwargs, kafka_client_kwargs, milvus_token, redis_client, redis_kwargs
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # starts worker processes: skipped by `make test-fast`

# A CA and a client certificate made once per session with the openssl command line.


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("certs")
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=stam-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=client")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "client.pem", "-days", "2")
    return {"ca": d / "ca.pem", "cert": d / "client.pem", "key": d / "client.key"}


def test_plaintext_is_the_default_and_keeps_the_bootstrap_list() -> None:
    s = Settings(broker_url="kafka://a:9092;kafka://b:9093")
    assert kafka_client_kwargs(s) == {"bootstrap_servers": "a:9092,b:9093", "security_protocol": "PLAINTEXT"}
    assert faust_broker_kwargs(s) == {}


def test_sasl_scram_over_tls_with_a_ca_file(certs: dict[str, Path]) -> None:
    s = Settings(broker_url="kafka://k:9093", kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="SCRAM-SHA-512",
                 kafka_sasl_username="stam", kafka_sasl_password="s3cret", kafka_ssl_cafile=certs["ca"])
    kw = kafka_client_kwargs(s)
    ctx = kw.pop("ssl_context")
    assert kw == {"bootstrap_servers": "k:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                  "sasl_plain_username": "stam", "sasl_plain_password": "s3cret"}
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert any(c["subject"] == ((("commonName", "stam-test-ca"),),) for c in ctx.get_ca_certs())
    # the same settings reach the Faust app's aiokafka clients
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    auth = credentials_to_aiokafka_auth(faust_broker_kwargs(s)["broker_credentials"])
    assert {k: auth[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username",
                                 "sasl_plain_password")} == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "stam",
        "sasl_plain_password": "s3cret"}
    assert isinstance(auth["ssl_context"], ssl.SSLContext)
    # the password is a secret: not in the settings' repr
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.model_dump())


def test_mutual_tls_without_sasl(certs: dict[str, Path]) -> None:
    s = Settings(kafka_security_protocol="SSL", kafka_ssl_cafile=certs["ca"], kafka_ssl_certfile=certs["cert"],
                 kafka_ssl_keyfile=certs["key"])
    kw = kafka_client_kwargs(s)
    assert kw["security_protocol"] == "SSL" and isinstance(kw["ssl_context"], ssl.SSLContext)
    assert not any(k.startswith("sasl") for k in kw)
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    assert credentials_to_aiokafka_auth(faust_broker_kwargs(s)["broker_credentials"])["security_protocol"] == "SSL"


def test_sasl_plaintext_has_no_tls_context() -> None:
    s = Settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u",
                 kafka_sasl_password="p")
    kw = kafka_client_kwargs(s)
    assert "ssl_context" not in kw and kw["sasl_mechanism"] == "PLAIN"


@pytest.mark.parametrize("kw, says", [
    ({"kafka_security_protocol": "SASL_SSL"}, "needs STAM_KAFKA_SASL_USERNAME and STAM_KAFKA_SASL_PASSWORD"),
    ({"kafka_ssl_cafile": "/x/ca.pem"}, "SSL or SASL_SSL uses them"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_certfile": "/x/c.pem"}, "go together"),
    ({"redis_url": "redis://r:6379/0", "redis_ssl_cafile": "/x/ca.pem"}, "needs a rediss://"),
    ({"kafka_sasl_mechanism": "GSSAPI"}, "Input should be"),
])
def test_contradictory_security_settings_fail_at_start(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Settings(**kw)


def test_redis_password_and_tls_ca(certs: dict[str, Path]) -> None:
    import redis

    plain = Settings(redis_url="redis://r:6379/0", redis_password="pw")
    assert redis_kwargs(plain) == {"password": "pw"}
    tls = Settings(redis_url="rediss://r:6380/0", redis_password="pw", redis_ssl_cafile=certs["ca"])
    assert redis_kwargs(tls) == {"password": "pw", "ssl_cert_reqs": "required", "ssl_ca_certs": str(certs["ca"])}
    # redis-py accepts them as they are (no connection is made here)
    pool = redis_client(tls).connection_pool
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["ssl_ca_certs"] == str(certs["ca"])
    assert pool.connection_class is redis.SSLConnection
    assert redis_kwargs(Settings(redis_url="redis://r:6379/0")) == {}


def test_milvus_token_is_a_secret() -> None:
    s = Settings(milvus_token="root:Milvus")
    assert milvus_token(s) == "root:Milvus" and "root:Milvus" not in repr(s)
    assert milvus_token(Settings()) == ""


# --- logs -----------------------------------------------------------------------------------------------

def test_json_log_lines() -> None:
    from stam.logs import handler

    out = io.StringIO()
    logger = logging.getLogger("stam.test.json")
    logger.propagate = False
    logger.addHandler(handler(Settings(log_format="json"), out))
    logger.setLevel(logging.INFO)
    try:
        logger.info("applied %d entries", 3, extra={"stage": "update"})
        try:
            raise KeyError("boom")
        except KeyError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the traceback stays inside its line
    first, second = (json.loads(x) for x in lines)
    assert first["message"] == "applied 3 entries" and first["level"] == "INFO" and first["logger"] == "stam.test.json"
    assert first["stage"] == "update" and first["ts"].endswith("+00:00")
    assert second["level"] == "ERROR" and "KeyError: 'boom'" in second["exc"]


def test_json_logging_config_for_the_faust_worker() -> None:
    import logging.config

    from stam.logs import JsonFormatter, faust_logging

    assert faust_logging(Settings()) == {}
    kw = faust_logging(Settings(log_format="json"), "warning")
    assert kw["quiet"] is True and kw["logging_config"]["root"]["level"] == "WARNING"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(kw["logging_config"])
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


_WORKER_LOGGING = """
import logging, os, faust
from stam.config import Settings
from stam.logs import faust_worker
for fmt in ("text", "json"):
    worker = faust_worker(faust.App("log-check", broker="kafka://127.0.0.1:1"), Settings(log_format=fmt), "warning")
    worker._setup_logging()
    debug = logging.getLogger("aiokafka.producer").isEnabledFor(logging.DEBUG)
    os.write(1, f"LEVEL {fmt} {logging.getLogger().level} {debug}\\n".encode())  # past Faust's stdout redirect
"""


@pytest.mark.parametrize("spinner", [False, True])
def test_a_warning_worker_builds_no_debug_records(spinner: bool) -> None:
    """Faust's start-up spinner sets the root logger to DEBUG when the level asked is WARNING or above, so every
    debug call of aiokafka (one per message sent) builds a record nobody prints; the STAM worker has no spinner.
    With it put back, the check sees DEBUG: it can fail."""
    code = _WORKER_LOGGING if not spinner else _WORKER_LOGGING.replace(
        "    worker._setup_logging()", "    worker.spinner = faust.utils.terminal.Spinner(file=worker.stdout)\n"
                                      "    worker._setup_logging()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    want = ["text 10 True", "json 10 True"] if spinner else ["text 30 False", "json 30 False"]
    assert re.findall(r"LEVEL (\w+ \d+ \w+)", out.stdout) == want


def _stam(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", STAM_BROKER_URL="kafka://127.0.0.1:1",
                STAM_REDIS_URL="redis://127.0.0.1:1/0", STAM_MILVUS_URI="http://127.0.0.1:1", **env)
    return subprocess.run([sys.executable, "-m", "stam.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


def test_cli_settings_errors_are_one_line(tmp_path: Path) -> None:
    res = _stam("worker", STAM_HOME=str(tmp_path), STAM_KAFKA_SECURITY_PROTOCOL="SASL_SSL")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "stam: settings: STAM_KAFKA_SECURITY_PROTOCOL=SASL_SSL needs STAM_KAFKA_SASL_USERNAME and "
        "STAM_KAFKA_SASL_PASSWORD"]


# --- stages ---------------------------------------------------------------------------------------------

def test_stages_parsing() -> None:
    from stam.errors import UnknownStage
    from workers.main import parse_stages

    assert parse_stages(None) == parse_stages("") == ("fused",)  # the default: the one-hop write path
    assert parse_stages("all") == parse_stages(" ALL ") == ("extract", "link", "impact", "update")
    assert parse_stages("update, extract") == ("extract", "update")  # pipeline order, spaces ignored
    assert parse_stages("LINK,impact,link") == ("link", "impact")
    with pytest.raises(UnknownStage, match=r"unknown stage 'parse'; --stages takes a comma-separated subset of "
                       r"extract,link,impact,update"):
        parse_stages("extract,parse")
    with pytest.raises(UnknownStage, match="unknown stages 'a', 'b'"):
        parse_stages("a,b")
    with pytest.raises(UnknownStage):
        parse_stages(",")
    assert parse_stages("fused") == parse_stages(" FUSED,fused") == ("fused",)
    with pytest.raises(UnknownStage, match="--stages fused runs the whole write path in one agent"):
        parse_stages("fused,update")


def test_unknown_stage_is_one_line(tmp_path: Path) -> None:
    res = _stam("worker", "--stages", "extract,linker", STAM_HOME=str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "stam worker: unknown stage 'linker'; --stages takes a comma-separated subset of extract,link,impact,update, "
        "all, or fused"]


def test_a_subset_registers_only_its_agents() -> None:
    from workers.main import build

    app, _ = build(Settings(web_port=0), ("extract", "link"))
    assert sorted(app.agents) == ["stam.extract", "stam.link"]
    app, _ = build(Settings(web_port=0), ("extract", "link", "impact", "update"))
    # the update stage is the single writer of patient state: it applies deletion orders too
    assert sorted(app.agents) == ["stam.delete", "stam.extract", "stam.impact", "stam.link", "stam.update"]
    assert app.conf.broker_client_id.startswith("faust-")  # Faust's own: not known to be fused (workers.handoff)
    app, _ = build(Settings(web_port=0), ("update",))
    assert sorted(app.agents) == ["stam.delete", "stam.update"]
    app, _ = build(Settings(web_port=0))  # the default, fused: one agent from the entries topic, and the deletions'
    assert sorted(app.agents) == ["stam.delete", "stam.fused"]
    assert app.agents["stam.fused"].channel.get_topic_name().endswith("entries.v1")
    assert app.conf.broker_client_id == "stam-fused"  # the next fused worker knows it for fused by this


def test_web_binds_to_the_configured_host() -> None:
    """Faust listens on ``web_bind`` (default 0.0.0.0); the configured host must reach it."""
    from workers import main, query_consumer

    app, _ = main.build(Settings(web_port=7000))
    assert (app.conf.web_bind, app.conf.web_host, app.conf.web_port) == ("127.0.0.1", "127.0.0.1", 7000)
    app, _ = main.build(Settings(web_port=7000, web_host="0.0.0.0"))
    assert app.conf.web_bind == "0.0.0.0"
    app, _ = query_consumer.build(Settings(query_web_port=7001))
    assert (app.conf.web_bind, app.conf.web_port) == ("127.0.0.1", 7001)


# --- ports ----------------------------------------------------------------------------------------------

def test_a_taken_port_is_one_line(tmp_path: Path) -> None:
    from stam.errors import PortInUse
    from workers.ops import claim_port

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"STAM_WEB_PORT={port}: 127.0.0.1:{port} is already in use"):
            claim_port("127.0.0.1", port, "STAM_WEB_PORT")
        claim_port("127.0.0.1", 0, "STAM_WEB_PORT")  # 0: off, nothing to claim
        for command, variable, env in (
                ("worker", "STAM_WEB_PORT", {"STAM_WEB_PORT": str(port)}),
                ("query-worker", "STAM_QUERY_WEB_PORT", {"STAM_QUERY_WEB_PORT": str(port)}),
                ("worker", "STAM_METRICS_PORT", {"STAM_WEB_PORT": "0", "STAM_METRICS_PORT": str(port)})):
            res = _stam(command, STAM_HOME=str(tmp_path), **env)
            assert res.returncode == 2, res.stderr
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"stam {command}: {variable}={port}: "), res.stderr
    claim_port("127.0.0.1", port, "STAM_WEB_PORT")  # free again


# --- the publisher's counts -----------------------------------------------------------------------------

def test_publisher_counts_are_logged_and_pushed(caplog: pytest.LogCaptureFixture) -> None:
    from stam.publish import PublishSummary, report

    got: list[tuple[str, str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:  # noqa: N802 - the http.server API
            got.append((self.command, self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    summary = PublishSummary(sent=130, skipped=1, dead_lettered=2, patients={"patient-a", "patient-b"}, seconds=1.5)
    summary.sources["fhir-r4"] = {"sent": 130, "skipped": 1, "dead_lettered": 2, "bundles": 3}
    try:
        with caplog.at_level(logging.INFO, logger="stam.publish"):
            report(Settings(pushgateway_url=f"http://127.0.0.1:{server.server_port}"), summary, "dead_lettered")
    finally:
        server.shutdown()
    record = next(r for r in caplog.records if r.name == "stam.publish")
    assert record.getMessage() == ("publish finished: outcome=dead_lettered sent=130 skipped=1 dead_lettered=2 "
                                   "patients=2 seconds=1.5")
    assert record.sent == 130 and record.sources == {"fhir-r4": {"sent": 130, "skipped": 1, "dead_lettered": 2}}  # type: ignore[attr-defined]
    method, path, body = got[0]
    assert method == "PUT" and path.startswith("/metrics/job/stam-publish/instance/")
    text = body.decode()
    assert 'stam_publisher_entries_total{outcome="sent",source="fhir-r4"} 130.0' in text
    assert 'stam_publisher_entries_total{outcome="dead_lettered",source="fhir-r4"} 2.0' in text
    assert "stam_publisher_patients 2.0" in text
    assert "patient-a" not in text and "patient-a" not in record.getMessage()


def test_a_failed_push_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    from stam.publish import PublishSummary, report

    with caplog.at_level(logging.INFO, logger="stam.publish"):
        report(Settings(pushgateway_url="http://127.0.0.1:1"), PublishSummary(), "ok")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "publish counts not pushed to http://127.0.0.1:1" in warnings[0].getMessage()


# --- readiness ------------------------------------------------------------------------------------------

async def test_readiness_names_each_unreachable_dependency_and_is_cached() -> None:
    from prometheus_client import REGISTRY

    from workers.ops import Readiness

    s = Settings(broker_url="kafka://127.0.0.1:1", redis_url="redis://127.0.0.1:1/0", milvus_uri="http://127.0.0.1:1",
                 ready_timeout_s=1.0, ready_cache_s=60)
    r = Readiness(s, model_url="http://127.0.0.1:1/v1")
    try:
        body = await r.status()
        assert body["ready"] is False and set(body["dependencies"]) == {"broker", "redis", "milvus", "model"}
        for name, dep in body["dependencies"].items():
            assert dep["ok"] is False and dep["error"] and "\n" not in dep["error"], name
            assert dep["ms"] < 5000, (name, dep)  # each check is bounded by its timeout
            assert REGISTRY.get_sample_value("stam_ready", {"dependency": name}) == 0
        assert await r.status() is body  # cached
    finally:
        r.close()


def test_a_worker_with_json_logs_writes_json_lines_only(tmp_path: Path) -> None:
    """Faust's own logging (and its banner) in JSON too: every line of a worker that cannot reach its broker."""
    full = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", STAM_BROKER_URL="kafka://127.0.0.1:1",
                STAM_REDIS_URL="redis://127.0.0.1:1/0", STAM_MILVUS_URI="http://127.0.0.1:1", STAM_WEB_PORT="0",
                STAM_HOME=str(tmp_path), STAM_LOG_FORMAT="json")
    logs = [tmp_path / "worker.out", tmp_path / "worker.err"]
    with logs[0].open("w") as out, logs[1].open("w") as err:
        # The four stages: Faust starts at once. The default (fused) worker first waits for the broker in its
        # check of the consumer group (workers.handoff), logging through the same JSON handler.
        proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--stages", "all"], cwd=REPO, env=full,
                                stdout=out, stderr=err, text=True)
    # Its start (imports) takes from seconds to a minute on a busy machine: from the first line Faust logs, the
    # worker runs 10 s more, retrying its broker, before it is stopped (or stops by itself).
    deadline = time.monotonic() + 180
    while proc.poll() is None and not re.search(r'"logger":\s*"faust', "".join(f.read_text() for f in logs)):
        assert time.monotonic() < deadline, "no Faust log line within 180 s"
        time.sleep(0.2)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [x for f in logs for x in f.read_text().splitlines() if x.strip()]
    assert lines, "the worker logged nothing"
    records = [json.loads(x) for x in lines]  # every line is one JSON object
    assert any(r["logger"].startswith("faust") for r in records)
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
