"""Fixtures of the integration tests: worker processes (write path, query consumer) on the module's stack."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from stam.net import free_port
from tests.conftest import REPO

QUERY_TOKEN = "integration-test-token"


@contextmanager
def _stam_process(s: Any, command: str, log_name: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """``stam <command>`` (``worker``, ``listen fhir``) against the stack of settings ``s``, logging to
    ``<home>/<log_name>``."""
    full = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
                STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions), STAM_WEB_PORT="0")
    full.update(env)  # a test may give the worker a web port
    with open(s.home / log_name, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stam.cli", *command.split(), "--loglevel", "info"],
                                cwd=REPO, env=full, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def worker_stages() -> str:
    """The ``--stages`` of the module's ``worker`` ("": the default, the fused write path); a module that exercises
    the four stages end to end overrides this fixture with ``"all"``."""
    return ""


@pytest.fixture(scope="module")
def worker(stack_settings: Any, worker_stages: str) -> Any:
    """``stam worker`` (with the module's ``worker_stages``) on the module's stack, with a metrics port."""
    metrics_port = free_port()
    command = f"worker --stages {worker_stages}" if worker_stages else "worker"
    with _stam_process(stack_settings, command, "worker.log", STAM_METRICS_PORT=str(metrics_port)) as proc:
        proc.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield proc


@pytest.fixture(scope="module")
def query_worker(stack_settings: Any) -> Any:
    """The query consumer in its own process, with an HTTP port and a bearer token."""
    web_port = free_port()
    with _stam_process(stack_settings, "query-worker", "query-worker.log", STAM_QUERY_WEB_PORT=str(web_port),
                       STAM_QUERY_TOKEN=QUERY_TOKEN) as proc:
        proc.web_port = web_port  # type: ignore[attr-defined]
        yield proc
