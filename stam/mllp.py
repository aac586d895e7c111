"""HL7 v2 over MLLP: a live listener that acknowledges a message only once it is durable (``stam listen mllp``).

Framing is MLLP (``0x0B`` message ``0x1C 0x0D``) on the ``hl7`` package's asyncio server and streams
(:func:`hl7.mllp.start_hl7_server`); connections are persistent, one message is in flight per connection, and the
acknowledgement goes back on the same socket. A message becomes record entries through the same HL7 v2 mapping
(:func:`stam.sources.hl7v2.parse_message`) and the same :class:`stam.publish.Publisher` as ``stam publish``:

* mapped: its entries are sent sealed and keyed by the patient's pseudonym with ``acks=all``, and only when the
  broker has acknowledged every one is the sender told ``AA`` (enhanced mode: ``CA``);
* malformed or not mappable: its bytes and the reason go to the dead-letter topic (``publish:hl7v2``), and only
  then ``AE`` with an ERR segment (``CE``);
* the broker or Redis unreachable (or slower than ``STAM_MLLP_BROKER_TIMEOUT_S``): ``AR`` (``CR``), nothing is
  acknowledged that is not on a topic, and the sender retries;
* larger than ``STAM_MLLP_MAX_MESSAGE_BYTES``, or from a sender not on ``STAM_MLLP_ALLOWED_SENDERS``: ``AR``
  (``CR``) with an ERR segment saying so; nothing is ingested.

``MSA-2`` echoes ``MSH-10``. Enhanced mode is chosen by the message (``MSH-15``/``MSH-16`` not empty): an accept
acknowledgement is sent as ``MSH-15`` asks (``AL`` or empty: always, ``NE``: never, ``ER``: on error or reject,
``SU``: on success). STAM's processing is asynchronous (the write path), so no application acknowledgement
(``MSH-16``) is ever sent.

Duplicates: the acknowledgement of every message that was ingested or dead-lettered is kept in Redis (the stack's,
``<collection_prefix>:mllp:ack:<sha256 of MSH-3, MSH-4, MSH-10>``, for ``STAM_MLLP_ACK_TTL_S``) after the durable
write and before it is sent. The same (``MSH-3``, ``MSH-4``, ``MSH-10``) again, on any connection and after a
restart, gets that stored acknowledgement byte for byte and is not ingested again. The one window this leaves
(the listener killed after the broker's acknowledgement and before Redis kept the ACK, or Redis losing its last
second of writes) makes a resend publish the same entries again: their ids derive from ``MSH-10`` and the
message's content (``stam.sources.hl7v2``), so the write path applies them once (the update stage skips an entry it
already applied) and the record holds each fact once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from hl7.mllp import start_hl7_server
from hl7.mllp.streams import CARRIAGE_RETURN, END_BLOCK, START_BLOCK

from stam.config import Settings
from stam.errors import ListenerUnavailable, SourceConfigError, SourceError
from stam.metrics import MLLP_ACK_SECONDS, MLLP_ACKS, MLLP_CONNECTIONS, MLLP_MESSAGES
from stam.sources.hl7v2 import parse_message

if TYPE_CHECKING:
    from stam.publish import Publisher

log = logging.getLogger("stam.mllp")

FRAME_END = END_BLOCK + CARRIAGE_RETURN
HEAD_BYTES = 4096
"""What is kept of a message over the size limit: enough for its MSH segment (the acknowledgement's addresses)."""

SOURCE = "hl7v2"
"""The dead letters' stage is ``publish:hl7v2``, as for ``stam publish`` of the same message from a file."""

# HL7 table 0357 (message error condition codes) used in ERR-3.
ERR_UNSUPPORTED = ("200", "Unsupported message type")
ERR_INTERNAL = ("207", "Application internal error")
ERR_REQUIRED = ("101", "Required field missing")
UNSUPPORTED_WORDS = ("unsupported", "not a clinical fact", "no clinical fact", "not supported")
"""A mapping's reason with one of these refuses the message type itself (ERR-3 200), not a malformed message."""


# --- framing ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """One MLLP block: the message bytes (between the start block and ``0x1C 0x0D``), or for a message over the
    size limit its first :data:`HEAD_BYTES`; ``size``: the whole message's length."""

    data: bytes
    size: int
    too_large: bool = False
    framed: bool = True
    """False: the block had no start block ``0x0B`` (``data`` is all of it)."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> Frame | None:
    """The next MLLP block of ``reader`` (whose limit is ``max_bytes``), or None at a clean end of the connection
    between blocks. A block over the limit is read to its end and dropped, its head kept (so the stream stays
    framed: the next block is read as the next message). Bytes before the start block (a stray line end between
    blocks) are dropped. ``ConnectionError`` when the connection ends inside a block."""
    head = b""
    size = 0
    too_large = False
    while True:
        try:
            chunk = await reader.readuntil(FRAME_END)
        except asyncio.IncompleteReadError as exc:
            if not too_large and not exc.partial.strip(b" \t\r\n\x00"):
                return None
            raise ConnectionError(f"connection ended inside a message ({size + len(exc.partial)} bytes)") from None
        except asyncio.LimitOverrunError as exc:  # over the limit: consume what was scanned, keep the head
            part = await reader.readexactly(exc.consumed)
            too_large = True
            head += part[:max(0, HEAD_BYTES - len(head))]
            size += len(part)
            continue
        if too_large:
            head += chunk[:max(0, HEAD_BYTES - len(head))]
            size += len(chunk) - len(FRAME_END)
            start = head.find(START_BLOCK)
            return Frame(head[start + 1:] if start >= 0 else head, size - max(start + 1, 0), too_large=True)
        body = chunk[:-len(FRAME_END)]
        start = body.find(START_BLOCK)
        if start < 0:
            return Frame(body, len(body), framed=False)
        body = body[start + 1:]
        return Frame(body, len(body))


# --- the MSH header and the acknowledgement -----------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    """The MSH segment of a message, as far as an acknowledgement needs it: ``field(n)`` is MSH-n as sent."""

    fields: tuple[str, ...]
    component: str
    repetition: str

    def field(self, n: int) -> str:
        value = self.fields[n] if n < len(self.fields) else ""
        return value.split(self.repetition)[0] if self.repetition and n > 2 else value

    def part(self, n: int, comp: int = 1) -> str:
        parts = self.field(n).split(self.component) if self.component else [self.field(n)]
        return parts[comp - 1].strip() if comp <= len(parts) else ""

    def copied(self, n: int) -> str:
        """MSH-n re-written with the standard delimiters (components joined with ``^``)."""
        parts = self.field(n).split(self.component) if self.component else [self.field(n)]
        return "^".join(_escape(p, keep_escapes=True) for p in parts).rstrip("^")

    @property
    def control_id(self) -> str:
        return self.field(10).strip()

    @property
    def enhanced(self) -> bool:
        return bool(self.field(15).strip() or self.field(16).strip())

    def sends(self, status: str) -> bool:
        """Whether an accept acknowledgement of ``status`` (ok, error, reject) goes back (MSH-15 in enhanced
        mode; the original mode always acknowledges)."""
        if not self.enhanced:
            return True
        wanted = self.field(15).strip().upper() or "AL"
        return {"AL": True, "NE": False, "ER": status != "ok", "SU": status == "ok"}.get(wanted, True)


_LINE = re.compile(rb"[\r\n]")


def parse_header(data: bytes) -> Header | None:
    """The MSH segment of ``data``, or None when the message does not start with one (after a byte order mark)."""
    first = _LINE.split(data.lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf"), maxsplit=1)[0]
    line = first.decode("utf-8", errors="replace")
    if not line.startswith("MSH") or len(line) < 8 or line[3].isalnum() or line[3].isspace():
        return None
    sep = line[3]
    parts = line.split(sep)
    encoding = parts[1] if len(parts) > 1 else ""
    return Header(fields=("MSH", sep, *parts[1:]), component=encoding[:1], repetition=encoding[1:2])


def _escape(text: str, *, keep_escapes: bool = False) -> str:
    """``text`` safe inside a field of a message with the standard delimiters (HL7 escape sequences)."""
    if not keep_escapes:
        text = text.replace("\\", "\\E\\")
    text = text.replace("|", "\\F\\").replace("^", "\\S\\").replace("&", "\\T\\").replace("~", "\\R\\")
    return " ".join(text.split())


CODES = {False: {"ok": "AA", "error": "AE", "reject": "AR"}, True: {"ok": "CA", "error": "CE", "reject": "CR"}}


def build_ack(header: Header | None, status: str, *, error: str | None = None,
              condition: tuple[str, str] = ERR_INTERNAL, now: datetime | None = None) -> bytes:
    """The acknowledgement of a message (``status``: ok, error, reject), in its mode: MSH addressed back to the
    sender, MSA (code, MSH-10, the reason as MSA-3) and, for an error or a reject, an ERR segment (ERR-3 the HL7
    table 0357 condition, ERR-4 ``E``, ERR-8 the reason). ``header`` None (no MSH could be read): original mode,
    MSA-2 empty."""
    h = header
    code = CODES[h is not None and h.enhanced][status]
    now = now or datetime.now(UTC)
    stamp = now.strftime("%Y%m%d%H%M%S") + "+0000"
    control = h.control_id if h is not None else ""
    sender = (h.copied(3), h.copied(4)) if h is not None else ("", "")
    ack_id = "A" + hashlib.sha256(f"{control}|{sender}|{code}|{stamp}".encode()).hexdigest()[:19]
    event = _escape(h.part(9, 2)) if h is not None else ""
    msh = ["MSH", "^~\\&", h.copied(5) if h is not None else "", h.copied(6) if h is not None else "",
           sender[0], sender[1], stamp, "", f"ACK^{event}^ACK" if event else "ACK", ack_id,
           _escape(h.part(11)) if h is not None and h.part(11) else "P",
           _escape(h.part(12)) if h is not None and h.part(12) else "2.5"]
    reason = _escape(error or "")[:200]
    msa = ["MSA", code, _escape(control, keep_escapes=True)] + ([reason] if reason else [])
    segments = ["|".join(msh), "|".join(msa)]
    if status != "ok":
        segments.append("|".join(["ERR", "", "", f"{condition[0]}^{condition[1]}^HL70357", "E", "", "", "",
                                  reason]))
    return ("\r".join(segments) + "\r").encode("ascii", errors="replace")


def allowed_senders(spec: str) -> list[tuple[str, str]]:
    """``STAM_MLLP_ALLOWED_SENDERS`` as (application, facility) pairs; facility ``*``: any."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if item:
            app, _, facility = item.partition("^")
            out.append((app.strip(), facility.strip() or "*"))
    return out


def sender_allowed(header: Header, allowed: Iterable[tuple[str, str]]) -> bool:
    app, facility = header.part(3), header.part(4)
    return any(a in (app, "*") and f in (facility, "*") for a, f in allowed)


def ack_key(prefix: str, header: Header) -> str:
    """The Redis key of a message's stored acknowledgement: (MSH-3, MSH-4, MSH-10) as sent, hashed (no
    identifier of anyone in a key)."""
    ident = "\x1f".join((header.field(3).strip(), header.field(4).strip(), header.control_id))
    return f"{prefix}:mllp:ack:{hashlib.sha256(ident.encode()).hexdigest()}"


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The listener's TLS context (``STAM_MLLP_TLS_*``), None for plain TCP."""
    if not settings.mllp_tls_certfile or not settings.mllp_tls_keyfile:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(settings.mllp_tls_certfile), str(settings.mllp_tls_keyfile))
    if settings.mllp_tls_client_cafile:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(settings.mllp_tls_client_cafile))
    return ctx


# --- the listener -----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    ack: bytes | None
    outcome: str
    code: str


class MllpListener:
    """The MLLP server: ``await start()``, then it serves until ``close()``; ``port`` is the bound port."""

    def __init__(self, settings: Settings, *, source_system: str | None = None) -> None:
        if not settings.redis_url:
            raise SourceConfigError("the MLLP listener keeps its acknowledgements in Redis: set STAM_REDIS_URL "
                                    "(or run `stam stack up`)")
        self.settings = settings
        self.source_system = source_system
        self._publisher: Publisher | None = None
        self.allowed = allowed_senders(settings.mllp_allowed_senders)
        self.tls = server_tls(settings)
        self._redis: Any = None
        self._server: asyncio.Server | None = None
        self._keys_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stam-mllp-keys")
        self._connections: set[asyncio.Task[Any]] = set()
        self._inflight: dict[str, list[Any]] = {}  # key -> [lock, users]: one message key handled at a time

    async def start(self) -> None:
        # deferred: stam.publish, stam.transport pull in igraph, redis, numpy
        from stam.publish import ACK_LINGER_MS, Publisher
        from stam.transport import async_redis_client

        # In the loop (aiokafka); each message is acknowledged once its entries are on the topic: a short linger.
        self._publisher = Publisher(self.settings, source_system=self.source_system, linger_ms=ACK_LINGER_MS)
        await self._publisher.__aenter__()
        self._redis = async_redis_client(self.settings)
        await self._redis.ping()
        # The reader's limit is the size limit (read_frame handles a block over it); the ACKs are small.
        self._server = await start_hl7_server(self._connected, self.settings.mllp_host, self.settings.mllp_port,
                                              limit=self.settings.mllp_max_message_bytes, ssl=self.tls)

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None, "start() first"
        return self._publisher

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.__aexit__(None, None, None)
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
        self._keys_pool.shutdown(wait=False, cancel_futures=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: Any) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        MLLP_CONNECTIONS.inc()
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(read_frame(reader, self.settings.mllp_max_message_bytes),
                                                   self.settings.mllp_idle_timeout_s)
                except TimeoutError:
                    log.info("MLLP connection idle for %gs: closed", self.settings.mllp_idle_timeout_s)
                    break
                except (ConnectionError, OSError) as exc:
                    log.info("MLLP connection lost: %s", exc)
                    break
                if frame is None:
                    break
                started = time.perf_counter()
                result = await self.handle(frame)
                MLLP_MESSAGES.labels(outcome=result.outcome).inc()
                if result.ack:
                    writer.writeblock(result.ack)
                    await writer.drain()
                    MLLP_ACKS.labels(code=result.code).inc()
                    MLLP_ACK_SECONDS.labels(code=result.code).observe(time.perf_counter() - started)
        except (ConnectionError, OSError) as exc:
            log.info("MLLP connection lost while acknowledging: %s", exc)
        finally:
            MLLP_CONNECTIONS.dec()
            if task is not None:
                self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def handle(self, frame: Frame) -> Outcome:
        """The acknowledgement of one message, after its durable write (see the module's docstring)."""
        header = parse_header(frame.data) if frame.framed else None

        def reply(status: str, outcome: str, error: str | None = None,
                  condition: tuple[str, str] = ERR_INTERNAL) -> Outcome:
            ack = build_ack(header, status, error=error, condition=condition)
            sent = header is None or header.sends(status)  # enhanced mode: as MSH-15 asks
            return Outcome(ack if sent else None, outcome, CODES[header is not None and header.enhanced][status])

        if frame.too_large:
            return reply("reject", "too_large", f"message of {frame.size:,} bytes is over this listener's limit of "
                         f"{self.settings.mllp_max_message_bytes:,} (STAM_MLLP_MAX_MESSAGE_BYTES); not ingested")
        if self.allowed and (header is None or not sender_allowed(header, self.allowed)):
            return reply("reject", "refused_sender", "sending application/facility not allowed on this listener "
                         "(STAM_MLLP_ALLOWED_SENDERS); not ingested")
        key = ack_key(self.settings.collection_prefix, header) if header is not None and header.control_id else None
        async with self._one_at_a_time(key):
            return await self._handle_once(frame, header, key, reply)

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, key: str | None) -> AsyncIterator[None]:
        """The same message (key) on two connections of this listener at once (a sender retrying on a new
        connection while its first attempt is in flight): the second waits for the first, then finds its ACK."""
        if key is None:
            yield
            return
        entry = self._inflight.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._inflight.pop(key, None)

    async def _handle_once(self, frame: Frame, header: Header | None, key: str | None,
                           reply: Callable[..., Outcome]) -> Outcome:
        try:
            if key is not None:
                stored = await asyncio.wait_for(self._redis.get(key), self.settings.mllp_broker_timeout_s)
                if stored is not None:
                    code = bytes(stored).split(b"\rMSA|", 1)[1][:2].decode() if stored else ""
                    return Outcome(bytes(stored) or None, "duplicate", code)
            result = await self._ingest(frame, header, reply)
            if key is not None:
                await asyncio.wait_for(self._redis.set(key, result.ack or b"", ex=self.settings.mllp_ack_ttl_s),
                                       self.settings.mllp_broker_timeout_s)
            return result
        except (ListenerUnavailable, TimeoutError, ConnectionError, OSError) as exc:
            return reply("reject", "unavailable", f"not stored, send it again: {_unavailable(exc)}")
        except Exception as exc:
            # deferred: aiokafka, redis.exceptions are slow to import
            from aiokafka.errors import KafkaError
            from redis.exceptions import RedisError

            if isinstance(exc, KafkaError | RedisError):
                return reply("reject", "unavailable", f"not stored, send it again: {_unavailable(exc)}")
            # A bug is not a bad message: nothing is dead-lettered, the sender is told to retry, the traceback logged.
            log.exception("MLLP listener failed on a message (a bug: the sender gets AR and retries)")
            return reply("reject", "bug", "internal error in the listener; not stored, send it again")

    async def _ingest(self, frame: Frame, header: Header | None, reply: Callable[..., Outcome]) -> Outcome:
        # deferred: stam.publish pulls in igraph, redis, numpy
        from stam.publish import PublishSummary

        summary = PublishSummary()
        where = f"MLLP message {header.control_id}" if header is not None and header.control_id else "MLLP message"
        try:
            if not frame.framed:
                raise SourceError("not an MLLP block: no start block (0x0B) before the end block (0x1C 0x0D)")
            if header is None:
                raise SourceError("not an HL7 v2 message: it does not start with an MSH segment")
            entries = parse_message(frame.data, where)
        except SourceError as exc:
            await self._timed(self.publisher.dead_letter(frame.data, SOURCE, exc, summary, where=where))
            unsupported = header is not None and any(w in str(exc).lower() for w in UNSUPPORTED_WORDS)
            return reply("error", "dead_lettered", f"dead-lettered: {exc}",
                         ERR_UNSUPPORTED if unsupported else ERR_REQUIRED if header is None else ERR_INTERNAL)
        pids = list(dict.fromkeys(e.patient_id for e in entries))
        await self._timed(asyncio.get_running_loop().run_in_executor(self._keys_pool, self._keys_for, pids))
        await self._timed(self.publisher.send_entries(entries, summary))
        if summary.dead_lettered:
            return reply("error", "dead_lettered", f"{summary.dead_lettered} of {len(entries)} entries dead-lettered "
                         "(over the entry limits); the others stored")
        return reply("ok", "accepted")

    def _keys_for(self, patients: list[str]) -> None:
        """Each patient's data key made and durable before anything is sealed under it (off the event loop: a new
        patient's key waits out Redis's fsync window)."""
        sealer = self.publisher.sealer
        for pid in patients:
            sealer.keys.key_for_sealing(pid)
        sealer.durable()

    async def _timed(self, work: Any) -> Any:
        try:
            return await asyncio.wait_for(work, self.settings.mllp_broker_timeout_s)
        except TimeoutError:
            raise ListenerUnavailable(f"the broker or Redis did not answer within {self.settings.mllp_broker_timeout_s:g} s "
                              "(STAM_MLLP_BROKER_TIMEOUT_S)") from None


def _unavailable(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:120]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
