"""Per-patient data keys and sealed topic payloads: erasing a patient's key makes every copy of its messages on
every topic unreadable (crypto-shredding).

Topics are append-only logs: a record cannot be taken out of a partition, and the transitions topic is kept
forever. So STAM never writes a patient's data to a topic in the clear. Every value it sends for a patient is an
*envelope*, AES-256-GCM under that patient's data key, and every message key is the patient's *pseudonym*, a
keyed digest of the id (HMAC-SHA256 under the master key), so partitioning and per-patient order are kept
without the id:

    envelope = MAGIC | pseudonym (32 hex characters) | key generation (4 bytes) | nonce (12 bytes) | ciphertext

The associated data is everything before the nonce, so an envelope cannot be moved to another patient or
generation. A data key is 32 random bytes, kept in Redis in the hash ``<prefix>:datakeys`` under the pseudonym,
itself sealed (AES-GCM) under the *master key*: a Redis dump alone opens nothing. The master key is a file
(``STAM_DATA_KEY_FILE``; default ``<home>/data.key``, created 0600 on first use on the embedded stack); every
process of a deployment must read the same file (a Kubernetes Secret).

``shred`` replaces a patient's data key with a tombstone of its generation. From then on every envelope of that
generation raises :class:`Erased` when opened, wherever a copy of it lies (a topic, a dead letter that carries it,
a consumer's backup of the topic). A patient who comes back later gets a new key of the next generation; the
old envelopes stay unreadable.

What this does not cover: values a producer outside STAM writes in the clear (a raw ``RecordEntry`` on the
entries topic, a query on the queries topic). They are read as before (a plain value opens as itself), and stay
readable on the topic until its retention drops them (entries 7 days, queries 1 day); the erasure scan reports
them. Publish with ``stam publish`` (or :class:`stam.publish.Publisher`) to have entries sealed at the source.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stam.errors import Erased, KeyConfigError, SealBroken
from stam.transport import redis_client

log = logging.getLogger("stam.crypto")

MAGIC = b"\x00STAM\x01"
"""Starts every envelope; a JSON value never starts with NUL, so a plain value is never taken for one."""
PSEUDONYM_LEN = 32
_HEAD = len(MAGIC) + PSEUDONYM_LEN + 4
_NONCE = 12
OVERHEAD = _HEAD + _NONCE + 16
"""Bytes an envelope adds to its plaintext."""
_TOMBSTONE = b""


def master_key_path(settings: Any) -> Path:
    path = getattr(settings, "data_key_file", None)
    return Path(path) if path else Path(settings.home) / "data.key"


def load_master_key(settings: Any, *, create: bool | None = None) -> bytes:
    """The master key (32 bytes, base64 in the file). ``create``: make the file when missing (default: only
    when no explicit ``STAM_DATA_KEY_FILE`` was given, i.e. on the embedded stack's home)."""
    path = master_key_path(settings)
    if create is None:
        create = not getattr(settings, "data_key_file", None)
    if not path.exists():
        if not create:
            raise KeyConfigError(f"the data key file {path} does not exist (STAM_DATA_KEY_FILE); every process of "
                                 "a deployment must read the same file")
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole to a private temporary file, then linked into place: a process starting at the same
        # moment either sees no file or a complete one, and only one file wins.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64encode(secrets.token_bytes(32)) + b"\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: read theirs
        else:
            log.info("created a new master data key at %s: every process of this deployment must use this file "
                        "(losing it makes every sealed message unreadable)", path)
        finally:
            tmp.unlink()
    try:
        raw = base64.b64decode(path.read_bytes().strip(), validate=True)
    except (OSError, ValueError) as exc:
        raise KeyConfigError(f"the data key file {path} cannot be read as base64: {type(exc).__name__}") from exc
    if len(raw) != 32:
        raise KeyConfigError(f"the data key file {path} must hold 32 bytes (base64), not {len(raw)}")
    return raw


# Atomic get-or-create of a patient's key: keeps a live key, else writes the next generation's.
_GET_OR_CREATE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
local gen = 0
if v then
  local sep = string.find(v, '|', 1, true)
  gen = tonumber(string.sub(v, 1, sep - 1))
  if #v > sep then return {v, 0} end
end
local nv = tostring(gen + 1) .. '|' .. ARGV[2]
redis.call('HSET', KEYS[1], ARGV[1], nv)
return {nv, 1}
"""
# Shred: a tombstone of the current generation (generation 0 when the patient never had a key).
_SHRED = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
local gen = 0
local live = 0
if v then
  local sep = string.find(v, '|', 1, true)
  gen = tonumber(string.sub(v, 1, sep - 1))
  if #v > sep then live = 1 end
end
redis.call('HSET', KEYS[1], ARGV[1], tostring(gen) .. '|')
return live
"""


def _split(value: bytes) -> tuple[int, bytes]:
    gen, _, wrapped = value.partition(b"|")
    return int(gen), wrapped


def redis_fsync_window(client: Any) -> float | None:
    """Seconds after which a write to this Redis is on disk: 2 with ``appendfsync everysec``, 0 with ``always``,
    None when it keeps no append-only file (a write is on disk only after the next RDB save). Raises what
    ``CONFIG GET`` raises (it is often disabled on managed Redis)."""
    conf = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in client.config_get("append*").items()}
    if conf.get("appendonly") != "yes":
        return None
    return 0.0 if conf.get("appendfsync") == "always" else 2.0


class KeyStore:
    """The patients' data keys in Redis, sealed under the master key; a small in-process cache.

    Thread-safe. A key read from Redis is trusted for ``cache_s`` seconds: another process's ``shred`` takes at
    most that long to reach this one (meanwhile it may seal a few more messages with the shredded key, which are
    then as unreadable as the rest)."""

    def __init__(self, client: Any, master: bytes, *, prefix: str = "stam", cache_s: float = 5.0,
                 cache_size: int = 100_000, fsync_window_s: float | None = None) -> None:
        self._client = client
        self._master = AESGCM(master)
        self._mac_key = hashlib.sha256(b"stam-pseudonym\0" + master).digest()
        self._hash = f"{prefix}:datakeys"
        self._cache: dict[str, tuple[int, bytes, float]] = {}
        self._cache_s = cache_s
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._create = client.register_script(_GET_OR_CREATE)
        self._fsync_window_s = fsync_window_s
        self._last_created = 0.0
        self._warned_no_aof = False
        self._shred = client.register_script(_SHRED)

    def pseudonym(self, patient_id: str) -> str:
        return hmac.new(self._mac_key, patient_id.encode(), hashlib.sha256).hexdigest()[:PSEUDONYM_LEN]

    def _unwrap(self, pseudonym: str, wrapped: bytes) -> bytes:
        try:
            return self._master.decrypt(wrapped[:_NONCE], wrapped[_NONCE:], pseudonym.encode())
        except InvalidTag as exc:
            raise KeyConfigError("a data key in Redis does not open under this master key: the processes of this "
                                 "deployment read different STAM_DATA_KEY_FILE files") from exc

    def _wrap(self, pseudonym: str, key: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        return nonce + self._master.encrypt(nonce, key, pseudonym.encode())

    def _remember(self, pseudonym: str, gen: int, key: bytes) -> None:
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[pseudonym] = (gen, key, time.monotonic())

    def key_for_sealing(self, patient_id: str) -> tuple[str, int, bytes]:
        """(pseudonym, generation, key) of the patient's live key, made when it has none (atomically: two
        processes sealing a new patient's first messages at once get the same key)."""
        p = self.pseudonym(patient_id)
        cached = self._cache.get(p)
        if cached is not None and time.monotonic() - cached[2] < self._cache_s:
            return p, cached[0], cached[1]
        raw, created = self._create(keys=[self._hash], args=[p, self._wrap(p, secrets.token_bytes(32))])
        gen, wrapped = _split(raw)
        if created:
            self._last_created = time.monotonic()
        key = self._unwrap(p, wrapped)
        self._remember(p, gen, key)
        return p, gen, key

    def key_for_opening(self, pseudonym: str, gen: int) -> bytes:
        cached = self._cache.get(pseudonym)
        if cached is not None and cached[0] == gen and time.monotonic() - cached[2] < self._cache_s:
            return cached[1]
        raw = self._client.hget(self._hash, pseudonym)
        if raw is None:  # shredding leaves a tombstone, so this is not an erased patient
            raise SealBroken("no data key for this envelope (sealed under another master key?)")
        current, wrapped = _split(raw)
        if current != gen or wrapped == _TOMBSTONE:
            raise Erased("the data key of this envelope was shredded")
        key = self._unwrap(pseudonym, wrapped)
        self._remember(pseudonym, gen, key)
        return key

    def _window(self) -> float | None:
        """:func:`redis_fsync_window`, probed each time (an operator may turn AOF off live); CONFIG disabled (as
        on many managed Redis): assume everysec. ``STAM_REDIS_FSYNC_WINDOW_S`` overrides the probe."""
        if self._fsync_window_s is not None:
            return self._fsync_window_s
        try:
            return redis_fsync_window(self._client)
        except redis.ResponseError:
            return 2.0

    def durable(self) -> None:
        """Wait until the keys this process created are on Redis's disk. A key is the one thing in Redis the
        transition log cannot rebuild: no envelope sealed under a new key may leave the process before the key
        is durable (a crash of Redis right after would otherwise leave messages nobody can open). With an
        append-only file: wait out its fsync window. Without one: an RDB ``SAVE`` (blocking, costly on a large
        Redis; a WARNING says so once: keep ``appendonly yes`` as the stack and the chart do)."""
        if not self._last_created:
            return
        window = self._window()
        if window is None:
            self._save()
        else:
            wait = self._last_created + window - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        self._last_created = 0.0

    def _save(self) -> None:
        if not self._warned_no_aof:
            self._warned_no_aof = True
            log.warning("Redis keeps no append-only file: every new patient's data key forces an RDB save before "
                        "anything sealed under it is sent (turn appendonly on)")
        deadline = time.monotonic() + 300
        while True:
            try:
                self._client.save()
                return
            except redis.ResponseError as exc:
                # A background save already running may have started before the key was written: save again.
                if "in progress" not in str(exc) or time.monotonic() > deadline:
                    raise KeyConfigError(f"cannot make new data keys durable (Redis has no append-only file and "
                                         f"SAVE failed: {exc}); turn appendonly on") from exc
                time.sleep(0.1)

    def prefetch(self, pseudonyms: Iterable[str]) -> None:
        """Load the keys of these pseudonyms in one round trip (before a batch is opened on the event loop)."""
        now = time.monotonic()
        todo = sorted({p for p in pseudonyms if now - self._cache.get(p, (0, b"", -1e9))[2] >= self._cache_s})
        if not todo:
            return
        for p, raw in zip(todo, self._client.hmget(self._hash, todo), strict=True):
            if raw is None:
                continue
            gen, wrapped = _split(raw)
            if wrapped != _TOMBSTONE:
                self._remember(p, gen, self._unwrap(p, wrapped))

    def shred(self, patient_id: str) -> bool:
        """Replace the patient's data key by a tombstone. True when a live key was shredded."""
        p = self.pseudonym(patient_id)
        live = bool(self._shred(keys=[self._hash], args=[p]))
        with self._lock:
            self._cache.pop(p, None)
        return live

    def erased(self, patient_id: str) -> bool:
        """True when the patient's key is a tombstone (shredded and no new key since)."""
        raw = self._client.hget(self._hash, self.pseudonym(patient_id))
        return raw is not None and _split(raw)[1] == _TOMBSTONE


class Sealer:
    """Seals values for one patient and opens envelopes; plain values open as themselves."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    def message_key(self, patient_id: str) -> bytes:
        """The Kafka message key of the patient's messages: its pseudonym (same partition in every topic)."""
        return self.keys.pseudonym(patient_id).encode()

    def seal(self, patient_id: str, plaintext: bytes) -> bytes:
        p, gen, key = self.keys.key_for_sealing(patient_id)
        head = MAGIC + p.encode() + gen.to_bytes(4, "big")
        nonce = secrets.token_bytes(_NONCE)
        return head + nonce + AESGCM(key).encrypt(nonce, plaintext, head)

    @staticmethod
    def sealed(value: bytes | None) -> bool:
        return value is not None and value[:len(MAGIC)] == MAGIC

    @staticmethod
    def pseudonym_of(value: bytes | None) -> str | None:
        if not Sealer.sealed(value) or value is None or len(value) < _HEAD:
            return None
        return value[len(MAGIC):len(MAGIC) + PSEUDONYM_LEN].decode("ascii", errors="replace")

    def open(self, value: bytes) -> bytes:
        """The plaintext of an envelope (a plain value as it is). :class:`Erased` when its key was shredded,
        :class:`SealBroken` when it does not open."""
        if not self.sealed(value):
            return value
        if len(value) < OVERHEAD:
            raise SealBroken(f"a sealed value of {len(value)} bytes is truncated")
        head, nonce, body = value[:_HEAD], value[_HEAD:_HEAD + _NONCE], value[_HEAD + _NONCE:]
        try:
            p = head[len(MAGIC):len(MAGIC) + PSEUDONYM_LEN].decode("ascii")
        except UnicodeDecodeError as exc:
            raise SealBroken("a sealed value with a malformed pseudonym") from exc
        gen = int.from_bytes(head[-4:], "big")
        key = self.keys.key_for_opening(p, gen)
        try:
            return AESGCM(key).decrypt(nonce, body, head)
        except InvalidTag as exc:
            raise SealBroken("a sealed value does not open under its patient's key (corrupted or forged)") from exc

    def prefetch(self, values: Iterable[bytes | None]) -> None:
        self.keys.prefetch(p for p in (self.pseudonym_of(v) for v in values) if p is not None)

    def durable(self) -> None:
        """Call before sending what was sealed: waits only when a new patient's key was made (``KeyStore.durable``)."""
        self.keys.durable()


def sealer_for(settings: Any, client: Any = None) -> Sealer:
    """The deployment's sealer: the master key of ``settings`` and its Redis (``client`` or the configured one)."""
    if client is None:
        client = redis_client(settings)
    return Sealer(KeyStore(client, load_master_key(settings), prefix=settings.collection_prefix,
                           fsync_window_s=getattr(settings, "redis_fsync_window_s", None)))
