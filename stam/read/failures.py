"""How a query that failed is answered: store outages named, a query that cannot be answered said plainly, bugs
logged (with the request id, never the patient id) and answered without their text.

``classify`` maps an exception to an ``error_kind`` (``schemas.query.ErrorKind``): ``not_found`` (no memory for the
patient, or none at that point), ``invalid`` (a query this service cannot answer as asked), ``unavailable`` (Redis,
Milvus or Kafka cannot be reached: the HTTP endpoint answers 503 with Retry-After), ``internal`` (anything else).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from datetime import UTC, datetime

import grpc
import redis
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from pymilvus.exceptions import ConnectError, MilvusException, MilvusUnavailableException

from schemas.query import ErrorKind, QueryAnswer, QueryRequest
from stam.errors import QueryError, UnsupportedQuery

MILVUS_CONNECT_FAILED = 2  # pymilvus Status.CONNECT_FAILED; also the server's "service unavailable" code

log = logging.getLogger("stam.query")


_OUTAGE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                            errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETUNREACH, errno.ENETDOWN})
_GRPC_OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _client_of(exc: BaseException) -> str | None:
    if isinstance(exc, redis.exceptions.RedisError):
        return "Redis"
    if isinstance(exc, MilvusException | grpc.RpcError):  # Milvus is the query path's only gRPC service
        return "Milvus"
    if isinstance(exc, KafkaError):
        return "Kafka"
    return None


def _is_outage(exc: BaseException) -> bool:
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        # A refused login is a misconfiguration, not an outage.
        return not isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError)
    if isinstance(exc, MilvusException):
        # Client side: connecting failed (code 2), or the retries ran out on an UNAVAILABLE/DEADLINE_EXCEEDED
        # gRPC status (then the status is the code); server side: code 2 is "service unavailable".
        return (isinstance(exc, ConnectError | MilvusUnavailableException) or exc.code == MILVUS_CONNECT_FAILED
                or exc.code in _GRPC_OUTAGE)
    if isinstance(exc, grpc.RpcError):  # statuses pymilvus does not retry are raised bare
        return callable(getattr(exc, "code", None)) and exc.code() in _GRPC_OUTAGE
    if isinstance(exc, KafkaError):
        return isinstance(exc, KafkaConnectionError | KafkaTimeoutError) or bool(exc.retriable)
    return isinstance(exc, ConnectionError | TimeoutError | socket.gaierror) or (
        isinstance(exc, OSError) and exc.errno in _OUTAGE_ERRNOS)


def unavailable_store(exc: BaseException) -> str | None:
    """The store or service whose outage ``exc`` is ("Redis", "Milvus", "Kafka"; "Store" for a bare network
    error), or None when ``exc`` is not an outage. Causes are followed, as clients wrap what they caught."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        if _is_outage(seen):
            return _client_of(exc) or _client_of(seen) or "Store"
        seen = seen.__cause__
    return None


def classify(exc: BaseException) -> tuple[ErrorKind, str]:
    """``(error_kind, message)`` of a failed query. The message is one line and carries no traceback; an
    ``internal`` error's message does not carry the exception's text either (it is logged)."""
    if isinstance(exc, UnsupportedQuery):
        return "invalid", str(exc)
    if isinstance(exc, QueryError):
        return "not_found", str(exc)
    store = unavailable_store(exc)
    if store is not None:
        detail = exc.message if isinstance(exc, MilvusException) else str(exc)
        detail = " ".join(detail.split()) or type(exc).__name__
        return "unavailable", f"{store} unavailable: {detail}"[:500]
    return "internal", f"internal error ({type(exc).__name__})"


def failed_answer(req: QueryRequest, exc: BaseException, started: float) -> QueryAnswer:
    """The answer to a query that failed with ``exc``: classified and, when the service is at fault, logged
    with the request id (never the patient id)."""
    kind, message = classify(exc)
    if kind == "unavailable":
        log.warning("query %s not answered: %s", req.request_id, message)
    elif kind == "internal":
        log.error("query %s failed: %s", req.request_id, message, exc_info=exc)
        message += f"; logged with request_id {req.request_id}"
    return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=False, error=message,
                       error_kind=kind, answered_at=datetime.now(UTC),
                       latency_ms=round((time.perf_counter() - started) * 1000, 3))
