"""Erasure on the real stores without a broker: Redis keys by exact name (hostile ids touch no other patient),
Milvus Lite in file mode (a delete leaves the bytes in a sealed segment; the rewrite removes them), files under
STAM_HOME, the erasure register, and the adapter to crypto-shredding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas import Store
from stam.backends.base import VectorRow
from stam.backends.milvus import MilvusVectorStore
from stam.config import Settings
from stam.erase import (
    Crypto,
    Report,
    erase_files,
    erase_milvus,
    erase_redis,
    is_erased,
    mark_erased,
    parquet_strings,
    redis_keys,
)
from stam.erase.verify import _milvus_dir
from stam.transport import local_redis_client, stop_local_redis


@pytest.fixture()
def client(tmp_path: Path) -> Any:
    c = local_redis_client(tmp_path / "redis.rdb")
    yield c
    stop_local_redis(c)


def _keys(c: Any) -> set[str]:
    return {k.decode() for k in c.keys("*")}


def _key(pid: str, part: str) -> str:
    """The state store's own key for a patient's part (ids are escaped inside key names)."""
    from stam.backends.redis_state import RedisStateStore

    store = RedisStateStore(None)  # type: ignore[arg-type]
    if part.startswith("outbox:"):
        return store._outbox_key(pid, part.removeprefix("outbox:"))
    return store._key(pid, part)


def _fill(c: Any, pid: str) -> None:
    for part in ("ver", "graph", "outbox:fhir-r4:Observation/1:abc"):
        c.set(_key(pid, part), f"data of {pid}")
    for part in ("mem", "tl", "src", "gaps"):  # gaps: a part another branch adds; erasure takes every part
        c.hset(_key(pid, part), mapping={"m-1": f"data of {pid}", "m-2": "more"})
    c.sadd("stam:patients", pid)


@pytest.mark.parametrize("hostile", ["[a-z]*", "a", "*", "a}:outbox:b"])
def test_redis_erasure_deletes_only_the_patients_own_keys(client: Any, hostile: str) -> None:
    others = ["abc", "a}:outbox:b", "a", "b?c"]
    for pid in {*others, hostile}:
        _fill(client, pid)
    before = _keys(client)
    report = Report()
    erase_redis(client, "stam", hostile, report)
    gone = before - _keys(client)
    assert gone == {_key(hostile, p) for p in ("ver", "graph", "mem", "tl", "src", "gaps",
                                                "outbox:fhir-r4:Observation/1:abc")}
    assert report.removed["redis_keys"] == 7 and report.removed["outboxes"] == 1 and report.removed["memories"] == 2
    assert {m.decode() for m in client.smembers("stam:patients")} == {*others, hostile} - {hostile}
    assert redis_keys(client, "stam", hostile) == {"state": [], "outboxes": [], "other": []}


def test_register_holds_no_id_and_rebuild_sees_it(client: Any, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert not is_erased(settings, client, "patient-1")
    mark_erased(client, "stam", "patient-1")
    assert is_erased(settings, client, "patient-1") and not is_erased(settings, client, "patient-2")
    for key in client.keys("*"):
        assert b"patient-1" not in key and b"patient-1" not in client.dump(key)


def test_milvus_lite_file_mode_delete_leaves_bytes_the_rewrite_removes_them(client: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "milvus.db")
    store = MilvusVectorStore(uri, dim=8)
    rng = np.random.default_rng(0)
    target, other = "patient-to-erase-7f3a", "patient-kept-19c2"
    for pid in (target, other):
        store.place(pid, [VectorRow(f"m-{pid}-{i}", rng.random(8).astype(np.float32),
                                    Store.ACTIVE if i % 2 else Store.HISTORY) for i in range(40)])
    store.flush()
    kept_before = {r.memory_id: (r.store, r.vector.tolist()) for s in Store for r in store.fetch(other, s)}
    settings = Settings(home=tmp_path, milvus_uri=uri)
    mdir = _milvus_dir(settings)
    assert mdir is not None and mdir.is_dir()

    def holders() -> list[Path]:
        return [p for p in mdir.rglob("*") if p.is_file() and (
            target.encode() in p.read_bytes() or any(target.encode() in s for s in parquet_strings(p)))]

    assert holders(), "the sealed segment holds the id"
    # What a delete and a flush leave (the library's erase_patient): the id is still in a file.
    store.erase_patient(target)
    store.flush()
    assert store.count(target, Store.ACTIVE) == 0 and holders(), "Milvus Lite keeps the deleted rows' bytes"
    report = Report()
    erase_milvus(settings, target, client, report)
    assert "rewritten" in report.steps["milvus"]
    assert holders() == []
    store.close()
    reopened = MilvusVectorStore(uri, dim=8)
    kept_after = {r.memory_id: (r.store, r.vector.tolist()) for s in Store for r in reopened.fetch(other, s)}
    assert kept_after == kept_before
    reopened.close()


def test_files_lines_removed_and_logs_redacted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "eval").mkdir(parents=True)
    pid = "pt-42"
    rows = [{"patient_id": pid, "question": "q1"}, {"patient_id": "pt-420", "question": "q2"},
            {"patient_id": "pt-7", "question": f"mentions {pid} in text"}]
    jsonl = home / "eval" / "set.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outside = tmp_path / "gate-set.jsonl"
    outside.write_text(jsonl.read_text())
    (home / "gate.json").write_text(json.dumps({"threshold": 0.2, "source": str(outside)}))
    log = home / "worker.log"
    log.write_text("line one\nerror for pt-42 here\nother pt-7\n")
    untouched = home / "notes.txt"
    untouched.write_text(f"{pid}\n")
    report = Report()
    erase_files(Settings(home=home), pid, report)
    for path in (jsonl, outside):
        assert [json.loads(x) for x in path.read_text().splitlines()] == rows[1:]
    assert log.read_text() == "line one\nerror for [erased] here\nother pt-7\n"
    assert untouched.read_text() == f"{pid}\n", "other files are reported by the scan, not edited"
    assert report.removed == {"file_lines": 2, "files_rewritten": 2, "files_redacted": 1}


def test_crypto_adapter_shreds_with_the_deployments_key_store(client: Any, tmp_path: Path) -> None:
    from stam.crypto import sealer_for
    from stam.errors import Erased

    settings = Settings(home=tmp_path)
    sealer = sealer_for(settings, client)
    env = sealer.seal("pt-42", b"a fact of pt-42")
    crypto = Crypto(settings, client)
    assert crypto.available and not crypto.erased("pt-42")
    assert crypto.shred("pt-42") is True and crypto.shred("pt-42") is False and crypto.erased("pt-42")
    with pytest.raises(Erased):
        sealer_for(settings, client).open(env)
    # A master key file that is named but missing: reported, not raised.
    missing = Crypto(Settings(home=tmp_path, data_key_file=tmp_path / "nope.key"), client)
    assert not missing.available and "does not exist" in missing.reason and missing.shred("pt-42") is None


def test_redis_files_are_read_by_a_redis_server_not_only_as_bytes(client: Any, tmp_path: Path) -> None:
    """An RDB compresses strings (LZF): an id with repeats inside is not in the file's bytes, yet a server that
    loads the file has it. The scan loads each RDB/AOF in a throwaway redis-server."""
    from stam.erase.verify import _redis_file_hits, _variants

    pid = "abcabcabcabcabcabcabcabcabc-77"
    client.hset("stam:{x}:mem", mapping={"m-1": json.dumps({"patient_id": pid, "text": "t" * 50})})
    client.save()
    rdb = tmp_path / "redis.rdb"
    assert pid.encode() not in rdb.read_bytes(), "compressed: a byte search misses it"
    assert _redis_file_hits(rdb, [_variants(pid)]) == 1
    assert _redis_file_hits(rdb, [_variants("someone-else")]) == 0


def test_milvus_lite_rewrite_repairs_writes_that_landed_during_it(deps: Any, small_bundle: Any, tmp_path: Path) -> None:
    """A write path upsert between the rewrite's copy and its truncation is lost from Milvus; the patient's state
    version moved in Redis, so the repair places the patient's vectors again (stores as Redis has them)."""
    from stam.erase.milvus_store import _repair, _versions
    from stam.stages import process_entry
    from tests.conftest import SMALL_PATIENT

    entries = small_bundle.entries
    for e in entries[:30]:
        process_entry(e, deps)
    deps.vectors.flush()
    client = deps.states._r
    mc = getattr(deps.vectors, "backing", deps.vectors)._client
    name = "stam_memories"
    before = _versions(client, "stam")
    copied = mc.query(name, filter=f'patient_id == "{SMALL_PATIENT}"', output_fields=["*"])
    for e in entries[30:60]:  # written "during" the rewrite: in Milvus now, lost by the truncation below
        process_entry(e, deps)
    deps.vectors.flush()
    mc.truncate_collection(name)
    mc.upsert(name, [{k: r[k] for k in ("memory_id", "patient_id", "store", "vector")} for r in copied])
    mc.flush(name)
    state = deps.states.load(SMALL_PATIENT)

    def milvus_stores() -> dict[str, str]:
        rows = mc.query(name, filter=f'patient_id == "{SMALL_PATIENT}"', output_fields=["memory_id", "store"])
        return {r["memory_id"]: r["store"] for r in rows}

    expected = {m: s.store.value for m, s in state.memories.items()}
    assert milvus_stores() != expected, "the simulated lost writes"
    settings = Settings(home=tmp_path, milvus_uri=str(tmp_path / "milvus.db"))
    kept = [{k: r[k] for k in ("memory_id", "patient_id", "store", "vector")} for r in copied]
    fixed = _repair(settings, mc, name, "memory_id", kept, before, client)
    assert fixed > 0 and milvus_stores() == expected


@pytest.mark.timeout(60)
def test_redis_files_rewritten_when_the_last_save_was_this_very_second(client: Any) -> None:
    """The RDB save time has one-second resolution: a BGSAVE right after another save must still be waited for
    (and not forever: a save in the same second as the previous one once never looked finished)."""
    from stam.erase import rewrite_redis_files

    client.set("k", "v")
    client.save()
    report = Report()
    rewrite_redis_files(client, report)
    assert report.steps["redis_files"] == "RDB snapshot saved (BGSAVE)"
    assert int(client.info("persistence")["rdb_changes_since_last_save"]) == 0


def test_query_cache_never_serves_an_erased_patient_recreated_to_the_same_version(deps: Any, small_bundle: Any
                                                                                   ) -> None:
    """The query process keeps timelines by state version. Erased, then re-created (another record under the same
    id) up to the same version, the patient must be read anew, not served the erased timeline from the cache."""
    import asyncio

    from schemas.query import QueryRequest
    from stam.sources.fhir_r4 import load_bundle
    from stam.stages import process_entry
    from tests.conftest import BUNDLES, SMALL_PATIENT
    from tests.integration.test_query_outages import _service

    n = 40
    for e in small_bundle.entries[:n]:
        process_entry(e, deps)
    svc = _service(deps)
    try:
        def served() -> set[str]:
            req = QueryRequest(request_id=f"r-{len(deps.states.patients())}", patient_id=SMALL_PATIENT,
                               question="What are the current conditions and medications?")
            answer = asyncio.run(svc.answer(req))
            assert answer.ok and answer.packet is not None, answer.error
            return {i.memory_id for i in answer.packet.items}

        old = served()
        assert old and svc.cache.get(SMALL_PATIENT, n, 0) is not None
        report = Report()
        erase_redis(deps.states._r, "stam", SMALL_PATIENT, report)
        deps.vectors.erase_patient(SMALL_PATIENT)
        other = load_bundle(BUNDLES / "22bbe238-220e-495c-8abc-0ce3aa28a605.json").entries[:n]
        for e in other:
            process_entry(e.model_copy(update={"patient_id": SMALL_PATIENT}), deps)
        assert deps.states.version(SMALL_PATIENT) == n
        new = served()
        assert new and not (new & old), "served the erased patient's memories from the cache"
        current = {m for m in deps.states.load(SMALL_PATIENT).memories}
        assert new <= current
    finally:
        svc.close()
