"""`stam deletion sweep` through the real stack: the orders go over the broker to the update stage in the worker
process, which applies them as ``deleted`` transitions; the log on the broker then rebuilds the same state.

The gate is test setup (a head trained on this patient's candidates to call observations safe, tau 0.5), as in
``test_deletion_apply.py``; what is tested is the path of an order and what the record keeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from schemas import TransitionKind
from stam.backends.milvus import MilvusVectorStore
from stam.backends.redis_state import RedisStateStore
from stam.embedding import Embedder
from stam.export import export_state
from stam.read.asof import read_patient_transitions
from stam.transport import redis_client
from tests.conftest import REPO, SMALL_PATIENT
from tests.integration.broker import _publish, collect_outputs
from tests.integration.deletion_gate import observation_gate

pytestmark = pytest.mark.integration


def _stam(s: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, STAM_HOME=str(s.home), STAM_BROKER_URL=s.broker_url, STAM_REDIS_URL=s.redis_url,
               STAM_MILVUS_URI=s.milvus_uri, STAM_PARTITIONS=str(s.partitions))
    return subprocess.run([sys.executable, "-m", "stam.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_a_sweep_deletes_through_the_update_stage_and_the_log_rebuilds_it(
        stack_settings: Any, worker: Any, small_bundle: Any, embedder: Embedder, tmp_path: Path) -> None:
    s = stack_settings
    asyncio.run(_publish(s, small_bundle.entries))
    asyncio.run(collect_outputs(s, {e.entry_id for e in small_bundle.entries}, timeout=420))
    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    before = states.load(SMALL_PATIENT)
    observation_gate(before, embedder, "test-gate", tmp_path / "gate")

    dry = _stam(s, "deletion", "sweep", "--gate", str(tmp_path / "gate"), "--dry-run", "--list")
    assert dry.returncode == 0, dry.stderr[-3000:]
    planned = json.loads(dry.stdout)
    assert planned["delete"] > 0 and planned["dry_run"] and "sent" not in planned
    assert len(planned["memories_to_delete"]) == planned["delete"]
    assert "would be deleted; nothing sent" in dry.stderr
    assert states.load(SMALL_PATIENT).version == before.version  # a dry run changes nothing

    done = _stam(s, "deletion", "sweep", "--gate", str(tmp_path / "gate"), "--wait", "180")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["applied"] == {"deleted": planned["delete"], "not_deleted": 0}, done.stderr[-2000:]
    assert worker.poll() is None, (s.home / "worker.log").read_text()[-3000:]
    gone = sorted(x["memory_id"] for x in planned["memories_to_delete"])
    after = states.load(SMALL_PATIENT)
    assert len(after.memories) == len(before.memories) - len(gone) and not set(gone) & set(after.memories)
    vectors = MilvusVectorStore(s.milvus_uri, dim=embedder.dim, prefix=s.collection_prefix)
    try:
        assert vectors.fetch_ids(SMALL_PATIENT, gone) == {}
    finally:
        vectors.close()

    events = asyncio.run(read_patient_transitions(s, SMALL_PATIENT))
    deleted = [e for e in events if e.kind is TransitionKind.DELETED]
    assert sorted(e.memory_id for e in deleted) == gone
    assert {e.gate.calibration_id for e in deleted if e.gate} == {"test-gate"}

    # The log is the record: the stores rebuilt from the broker's transitions equal the live state.
    live = export_state(after)
    states.erase_patient(SMALL_PATIENT)
    vectors = MilvusVectorStore(s.milvus_uri, dim=embedder.dim, prefix=s.collection_prefix)
    try:
        vectors.erase_patient(SMALL_PATIENT)
    finally:
        vectors.close()
    rebuilt = _stam(s, "rebuild", "--patient", SMALL_PATIENT)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert export_state(RedisStateStore(redis_client(s), prefix=s.collection_prefix).load(SMALL_PATIENT)) == live
