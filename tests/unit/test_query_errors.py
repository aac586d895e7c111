"""Failed queries: classification of real client exceptions, the answer and log of each kind, HTTP statuses
and metrics. The outage exceptions are the ones the clients really raise against a port nobody listens on."""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
import redis
from aiokafka.errors import KafkaConnectionError
from prometheus_client import REGISTRY
from pymilvus.exceptions import MilvusException

from schemas.query import QueryAnswer, QueryRequest
from stam.net import free_port
from stam.read.service import QueryError, QueryService, UnsupportedQuery, classify, failed_answer
from stam.transport import milvus_client
from workers.query_consumer import http_status, observe

PATIENT = "patient-secret-17"


def _raised(call: Any) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("expected an exception")


def test_query_errors_are_not_found_or_invalid() -> None:
    assert classify(QueryError(f"no memory for patient {PATIENT!r}")) == (
        "not_found", f"no memory for patient {PATIENT!r}")
    assert classify(UnsupportedQuery("as_of needs the transition log"))[0] == "invalid"


@pytest.mark.slow  # starts and stops a Redis server
def test_redis_down_is_unavailable_but_a_refused_login_is_not() -> None:
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=2)
    exc = _raised(lambda: client.get("k"))
    kind, message = classify(exc)
    assert kind == "unavailable" and message.startswith("Redis unavailable: ") and "Connection refused" in message
    assert classify(redis.exceptions.TimeoutError("Timeout reading from socket"))[0] == "unavailable"
    assert classify(redis.exceptions.AuthenticationError("invalid password"))[0] == "internal"
    assert classify(redis.exceptions.ResponseError("WRONGTYPE"))[0] == "internal"


def test_milvus_down_is_unavailable_other_milvus_errors_are_not() -> None:
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    exc = _raised(lambda: milvus_client(f"http://127.0.0.1:{free_port()}"))
    kind, message = classify(exc)
    assert isinstance(exc, MilvusException) and kind == "unavailable"
    assert message.startswith("Milvus unavailable: Fail connecting to server") and "MilvusException" not in message
    # What pymilvus's retry decorator raises once its retries on an UNAVAILABLE gRPC status run out.
    exhausted = MilvusException(grpc.StatusCode.UNAVAILABLE, "[search] Retry run out of 75 retry times")
    assert classify(exhausted)[0] == "unavailable"
    assert classify(MilvusException(100, "collection not found[collection=stam_memories]"))[0] == "internal"
    assert classify(MilvusException(message="Unexpected error, message=<boom>"))[0] == "internal"


def test_grpc_unavailable_and_wrapped_connection_errors_are_unavailable() -> None:
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        exc = _raised(lambda: channel.unary_unary("/milvus.proto.milvus.MilvusService/Search")(b"", timeout=5))
    assert isinstance(exc, grpc.RpcError) and classify(exc)[0] == "unavailable"
    refused = _raised(lambda: socket.create_connection(("127.0.0.1", free_port()), timeout=2))
    assert classify(refused) == ("unavailable", f"Store unavailable: {refused}")
    try:  # pymilvus wraps what it did not expect; the cause says it was an outage
        raise MilvusException(message="Unexpected error") from refused
    except MilvusException as wrapped:
        assert classify(wrapped) == ("unavailable", "Milvus unavailable: Unexpected error")
    assert classify(KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]"))[0] == "unavailable"


def test_other_exceptions_are_internal() -> None:
    for exc in (KeyError(PATIENT), ValueError("bad"), FileNotFoundError(2, "No such file", "/x/gate.json"),
                RuntimeError("Already borrowed")):
        kind, message = classify(exc)
        assert kind == "internal" and message == f"internal error ({type(exc).__name__})"
        assert PATIENT not in message


def _req() -> QueryRequest:
    return QueryRequest(request_id="req-42", patient_id=PATIENT, question="What is the body height?")


class _BrokenStates:
    """A state store with a bug: every read fails with an unexpected error."""

    def version(self, patient_id: str) -> int:
        raise KeyError(patient_id)


def test_a_bug_is_answered_internal_and_logged_with_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    svc = QueryService(states=_BrokenStates(), vectors=None, embedder=None, tokenizer=None,  # type: ignore[arg-type]
                       gate=None)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="stam.query"):
        answer = asyncio.run(svc.answer(_req()))  # answered, not raised
    svc.close()
    assert not answer.ok and answer.error_kind == "internal" and answer.packet is None
    assert answer.error == "internal error (KeyError); logged with request_id req-42"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and "req-42" in record.getMessage()
    assert PATIENT not in record.getMessage() and record.exc_info is not None  # the traceback is in the log only
    assert "Traceback" not in answer.model_dump_json()


def test_an_outage_is_logged_at_warning_without_the_patient(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="stam.query"):
        answer = failed_answer(_req(), redis.exceptions.ConnectionError("Error 111 connecting to x:1."), 0.0)
    assert answer.error_kind == "unavailable" and answer.error == "Redis unavailable: Error 111 connecting to x:1."
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and PATIENT not in record.getMessage() and record.exc_info is None


def _answer(**kw: Any) -> QueryAnswer:
    return QueryAnswer(request_id="r", patient_id=PATIENT, answered_at=datetime.now(UTC), latency_ms=1.0, **kw)


def test_http_status_and_metrics_by_error_kind() -> None:
    assert http_status(_answer(ok=False, error="x", error_kind="not_found")) == (404, {})
    assert http_status(_answer(ok=False, error="x", error_kind="invalid")) == (400, {})
    assert http_status(_answer(ok=False, error="x", error_kind="unavailable")) == (503, {"Retry-After": "5"})
    assert http_status(_answer(ok=False, error="x", error_kind="internal")) == (500, {})
    assert http_status(_answer(ok=False, error="x")) == (500, {})  # an old answer without a kind

    def count(outcome: str) -> float:
        return REGISTRY.get_sample_value("stam_queries_total", {"channel": "unit", "outcome": outcome,
                                                                "served": "none"}) or 0.0

    before = count("unavailable")
    observe(_answer(ok=False, error="x", error_kind="unavailable"), "unit")
    assert count("unavailable") == before + 1
    labels = {k for m in REGISTRY.collect() if m.name == "stam_queries" for s in m.samples for k in s.labels.values()}
    assert PATIENT not in labels
