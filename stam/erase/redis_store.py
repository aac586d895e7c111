"""Redis: the patient's keys, and the persistence files Redis keeps on disk.

- **Redis**: every key of the patient by exact name (state version, graph, memory records, timeline rows, source
  texts, pending outboxes) and its entry in the ``patients`` set; then the persistence files are rewritten so the
  old bytes are not left on disk (``BGREWRITEAOF`` when the append-only file is on, then ``BGSAVE``; both waited
  for).
"""

from __future__ import annotations

import re
import time
from typing import Any

import redis

from stam.backends.redis_state import RedisStateStore
from stam.erase.register import Report
from stam.fhir.store import erase_patient_subscriptions

STATE_PARTS = ("ver", "graph", "glog", "mem", "tl", "src")


# --- what the patient has, where -------------------------------------------------------------------

def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def key_name(key: bytes | str) -> str:
    """A key or member as redis-py returns it (bytes, or text), as text."""
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def state_key(prefix: str, patient_id: str, part: str) -> str:
    """The name of one part of the patient's state (``ver``, ``mem``, ...) as the state store names it."""
    return RedisStateStore(None, prefix=prefix)._key(patient_id, part)  # type: ignore[arg-type]


def redis_keys(client: redis.Redis, prefix: str, patient_id: str) -> dict[str, list[str]]:
    """The patient's Redis keys by exact name: the state parts that exist, pending outboxes, and any other key in
    the patient's namespace ``<prefix>:{<patient>}:`` (parts added later, such as record gaps). Found by a SCAN
    whose pattern escapes the id; a match whose rest holds ``}`` is another patient's (an id that starts with
    this one and a brace), never this one's, and is left alone."""
    fixed = [state_key(prefix, patient_id, p) for p in STATE_PARTS]
    head = state_key(prefix, patient_id, "")
    found = sorted(name for key in client.scan_iter(match=_glob_escape(head) + "*", count=1000)
                   if (name := key_name(key)).startswith(head) and "}" not in name[len(head):])
    outbox = state_key(prefix, patient_id, "outbox:")
    return {"state": [k for k in fixed if k in found], "outboxes": [k for k in found if k.startswith(outbox)],
            "other": [k for k in found if k not in fixed and not k.startswith(outbox)]}


# --- erasing ---------------------------------------------------------------------------------------

def erase_redis(client: redis.Redis, prefix: str, patient_id: str, report: Report) -> None:
    """The patient's keys by exact name, its entry in the ``patients`` set and the FHIR Subscriptions filtered to
    it, deleted, with what was deleted in ``report``."""
    keys = redis_keys(client, prefix, patient_id)
    report.removed["memories"] = int(client.hlen(state_key(prefix, patient_id, "mem")))
    report.removed["source_texts"] = int(client.hlen(state_key(prefix, patient_id, "src")))
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
    report.removed["fhir_subscriptions"] = erase_patient_subscriptions(client, prefix, patient_id)
    report.steps["redis"] = f"deleted {int(deleted)} keys by exact name"


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


def rewrite_redis_files(client: redis.Redis, report: Report) -> None:
    """Rewrite the append-only file (when on) and the RDB snapshot, so no file of Redis keeps the deleted keys."""
    done = []
    try:
        aof = key_name(dict(client.config_get("appendonly")).get("appendonly") or "no")
    except redis.ResponseError as exc:  # managed Redis without CONFIG
        report.steps["redis_files"] = f"not covered (CONFIG refused: {exc}); rewrite the server's persistence files"
        return
    if aof == "yes":
        _wait(client, "aof_rewrite_in_progress")
        client.bgrewriteaof()
        info = _wait(client, "aof_rewrite_in_progress")
        if key_name(info.get("aof_last_bgrewrite_status", "ok")) != "ok":
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
    if key_name(info.get("rdb_last_bgsave_status", "ok")) != "ok":
        raise RuntimeError("Redis BGSAVE failed")
    done.append("RDB snapshot saved (BGSAVE)")
    report.steps["redis_files"] = "; ".join(done)
