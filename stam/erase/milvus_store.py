"""Milvus: the patient's vectors, and the bytes a delete leaves behind.

- **Milvus**: every collection with a ``patient_id`` field, delete by patient, flush; then the bytes are purged.
  A Milvus server compacts (``compact`` and wait); Milvus Lite does not implement manual compaction (its
  ``compact`` returns at once and does nothing; its own size-tiered compaction only merges a partition's files
  once four of a size exist, and leaves the delete tombstones), so on Milvus Lite the collection is rewritten
  without the patient (``truncate_collection`` + re-insert); a write of another patient that lands during the
  rewrite is repaired from Redis afterwards.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from schemas import Store
from stam.backends.redis_state import RedisStateStore
from stam.config import Settings
from stam.embedding import deployment_embedder, memory_vectors
from stam.erase.redis_store import key_name, state_key
from stam.erase.register import Report
from stam.transport import deployment_milvus_client


def patient_collections(client: Any) -> list[str]:
    """The collections with a ``patient_id`` field, sorted."""
    out = []
    for name in client.list_collections():
        fields = {f["name"] for f in client.describe_collection(name)["fields"]}
        if "patient_id" in fields:
            out.append(name)
    return sorted(out)


def count_rows(client: Any, name: str, expr: str) -> int:
    """How many rows of collection ``name`` match the filter ``expr``."""
    res = client.query(name, filter=expr, output_fields=["count(*)"])
    return int(res[0]["count(*)"]) if res else 0


def patient_expr(patient_id: str) -> str:
    """The Milvus filter of the patient's rows."""
    return f"patient_id == {json.dumps(patient_id)}"


def _is_lite(client: Any, settings: Settings) -> bool:
    if settings.resolved_milvus_uri().endswith(".db"):
        return True
    try:
        return "lite" in str(client.get_server_version()).lower()
    except Exception:  # noqa: BLE001 - an old server without the call is not Lite
        return False


def _versions(client: redis.Redis, prefix: str) -> dict[str, int]:
    patients = sorted(key_name(p) for p in client.smembers(f"{prefix}:patients"))
    if not patients:
        return {}
    raw = client.mget([state_key(prefix, p, "ver") for p in patients])
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
        have = {r[pk]: r.get("store") for r in mc.query(name, filter=patient_expr(p), output_fields=[pk, "store"])}
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
    mc = deployment_milvus_client(settings)
    try:
        lite = _is_lite(mc, settings)
        removed = 0
        how = []
        for name in patient_collections(mc):
            n = count_rows(mc, name, patient_expr(patient_id))
            mc.delete(name, filter=patient_expr(patient_id))
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
