"""The state store writes only what an entry changes (the graph as snapshot + change log): on a real MIMIC-IV patient
with every table, applied one entry per commit as an interleaved feed does, the state read back from Redis is the
state a full snapshot gives, and the one the transition log rebuilds."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import ImpactedEntry
from stam.backends import redis_state
from stam.backends.redis_state import RedisStateStore
from stam.export import export_state
from stam.patient_state import PatientState
from stam.rebuild import replay
from tests.conftest import DATA

pytestmark = pytest.mark.integration

MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"  # the smallest demo patient: 265 entries over 11 tables


def test_snapshot_plus_log_reads_back_the_state_a_full_snapshot_and_the_log_give(
        deps: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC}")
    from stam.sources.mimic import iter_mimic
    from stam.stages import extract_stage, update_batch

    monkeypatch.setattr(redis_state, "COMPACT_MIN", 64)  # several compactions within one small patient
    entries = next(iter(iter_mimic(MIMIC, subjects=[PATIENT])))
    assert len(entries) > 200
    client = deps.states._r
    glog = deps.states._key(PATIENT, "glog")
    events, lengths = [], []
    for e in entries:
        x = extract_stage(e, deps)
        impacted = ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={}, state_version=0,
                                 deferred=True)
        events.extend(update_batch([impacted], deps)[0].transitions)
        lengths.append(client.llen(glog))
    live = deps.states.load(PATIENT)
    assert live.counts()["relations"] > 50 and live.counts()["history"] > 50
    # The log grew entry by entry and was folded into a snapshot several times.
    folds = sum(1 for a, b in zip(lengths, lengths[1:], strict=False) if b < a)
    assert folds >= 2 and max(lengths) >= 64 and client.exists(deps.states._key(PATIENT, "graph"))

    fresh = RedisStateStore(client).load(PATIENT)  # no cache: snapshot + log from Redis
    assert fresh.graph_log == client.llen(glog)
    records = [s.model_dump_json().encode() for s in live.memories.values()]
    full = PatientState.restore(PATIENT, live.version, live.graph_snapshot(), records)
    rebuilt = replay(PATIENT, events)
    want = export_state(live)
    assert export_state(fresh) == want
    assert export_state(full) == want
    assert export_state(rebuilt) == want
    for mid in live.memories:
        assert fresh.neighbours(mid) == live.neighbours(mid)
    assert fresh.graph.get_edgelist() == full.graph.get_edgelist()
    assert fresh.graph.vs["name"] == full.graph.vs["name"]
