"""Fixtures of the integration tests: a write-path worker process on the module's embedded stack."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def worker(stack_settings: Any) -> Any:
    s = stack_settings
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), STAM_WEB_PORT="0",
               STAM_METRICS_PORT=str(metrics_port))
    log = open(s.home / "worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "info"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.metrics_port = metrics_port  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


QUERY_TOKEN = "integration-test-token"


@pytest.fixture(scope="module")
def query_worker(stack_settings: Any) -> Any:
    """The query consumer in its own process, with an HTTP port and a bearer token."""
    s = stack_settings
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        web_port = sock.getsockname()[1]
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), STAM_WEB_PORT="0",
               STAM_QUERY_WEB_PORT=str(web_port), STAM_QUERY_TOKEN=QUERY_TOKEN)
    log = open(s.home / "query-worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "query-worker", "--loglevel", "info"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.web_port = web_port  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
