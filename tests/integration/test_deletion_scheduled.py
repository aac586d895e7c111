"""The scheduled deletion sweep: a worker started with ``STAM_DELETION_GATE`` and ``STAM_DELETION_SWEEP_S`` sweeps
the patients of its partitions on its own, and the update stage applies the orders, on the real stack.

The gate is test setup (a head trained on this patient's candidates, replayed on private stores first, to call
observations safe; tau 0.5), as in ``test_deletion_apply.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas import Store, TransitionKind
from stam.backends.redis_state import RedisStateStore
from stam.compose import local_deps
from stam.deletion.gate import Gate
from stam.deletion.sweep import scan
from stam.embedding import Embedder
from stam.net import free_port
from stam.read.asof import read_patient_transitions
from stam.stages import process_entry
from stam.transport import redis_client
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import _publish, collect_outputs
from tests.integration.conftest import _stam_process
from tests.integration.deletion_gate import observation_gate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gate_dir(tmp_path_factory: pytest.TempPathFactory, small_bundle: Any, embedder: Embedder) -> Path:
    work = tmp_path_factory.mktemp("gate")
    deps, client = local_deps(work / "milvus.db", work / "redis.rdb", embedder=embedder)
    try:
        for e in small_bundle.entries:
            process_entry(e, deps)
        observation_gate(deps.states.load(SMALL_PATIENT), embedder, "test-scheduled", work / "gate")
    finally:
        deps.vectors.close()
        client.shutdown()
    return work / "gate"


@pytest.fixture(scope="module")
def sweeping_worker(stack_settings: Any, gate_dir: Path) -> Iterator[Any]:
    with _stam_process(stack_settings, "worker", "worker.log", STAM_METRICS_PORT=str(free_port()),
                       STAM_DELETION_GATE=str(gate_dir), STAM_DELETION_SWEEP_S="5") as proc:
        yield proc


def test_the_worker_sweeps_on_its_schedule(stack_settings: Any, sweeping_worker: Any, small_bundle: Any,
                                           gate_dir: Path, embedder: Embedder) -> None:
    s = stack_settings
    asyncio.run(_publish(s, small_bundle.entries))
    asyncio.run(collect_outputs(s, {e.entry_id for e in small_bundle.entries}, timeout=420))
    states = RedisStateStore(redis_client(s), prefix=s.collection_prefix)
    deadline = time.monotonic() + 240
    while True:  # the next sweep finds nothing left to delete once the orders are applied
        left = next(scan(states, embedder.embed, Gate.load(gate_dir), [SMALL_PATIENT]))
        if not left.chosen or time.monotonic() > deadline:
            break
        time.sleep(2)
    log = (s.home / "worker.log").read_text(errors="replace")
    assert sweeping_worker.poll() is None, log[-3000:]
    assert not left.chosen, log[-3000:]
    assert "scheduled deletion sweep" in log and SMALL_PATIENT not in log
    deleted = [e for e in asyncio.run(read_patient_transitions(s, SMALL_PATIENT)) if e.kind is TransitionKind.DELETED]
    assert deleted and {e.gate.calibration_id for e in deleted if e.gate} == {"test-scheduled"}
    state = states.load(SMALL_PATIENT)
    assert not {e.memory_id for e in deleted} & set(state.memories)
    assert all(e.from_store is Store.HISTORY for e in deleted)
