"""Source identity through the real worker (issue 13, repro 10): a forged ``entered-in-error`` cannot retract
another system's fact; the fact's own (signed) source can; a bad signature is dead-lettered with the reason.

A real Synthea patient with an active "History of cardiac arrest" is streamed signed as source ``ehr-a``; the
worker runs with two configured sources and signing not required (the dev-stack mode, so an unsigned entry is
applied, without the power to end a signed source's fact).
"""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import timedelta
from typing import Any

import pytest
from pydantic import SecretStr

from schemas import RecordEntry, Store
from stam.backends.redis_state import RedisStateStore
from stam.integrity import SIGNATURE_HEADER, SOURCE_HEADER, signature
from stam.publish import Publisher, PublishSummary
from stam.transport import kafka_producer, redis_client
from tests.conftest import BUNDLES, need_data
from tests.integration.broker import _dead_letters, collect_outputs
from tests.integration.conftest import _stam_process
from topology import topics as t

pytestmark = pytest.mark.integration

BUNDLE = BUNDLES / "22bbe238-220e-495c-8abc-0ce3aa28a605.json"
SECRETS = {"ehr-a": "ehr-a-secret-0123456789abcdef", "lab-b": "lab-b-secret-0123456789abcdef"}


@pytest.fixture(scope="module")
def signed_worker(stack_settings: Any) -> Any:
    with _stam_process(stack_settings, "worker", "worker-signed.log", STAM_SOURCES=json.dumps(SECRETS),
                       STAM_REQUIRE_SIGNED_ENTRIES="false") as proc:
        yield proc


async def _send(settings: Any, entries: list[RecordEntry], source: str | None) -> None:
    s = settings.model_copy(update={"sources": SecretStr(json.dumps(SECRETS))})
    async with Publisher(s, source_system=source) as pub:
        await pub.send_entries(entries, PublishSummary())


async def _send_raw(settings: Any, entry: RecordEntry, headers: list[tuple[str, bytes]]) -> None:
    producer = kafka_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(t.ENTRIES.name(settings.topic_prefix), key=entry.patient_id.encode(),
                                     value=entry.model_dump_json().encode(), headers=headers)
    finally:
        await producer.stop()


def _forged(entry: RecordEntry, tag: str) -> RecordEntry:
    recorded = (entry.recorded_at or entry.effective_at)
    return entry.model_copy(update={"entry_id": f"{entry.entry_id}:{tag}", "status": "entered-in-error",
                                    "recorded_at": recorded + timedelta(days=1) if recorded else None})


def test_only_the_facts_own_source_can_retract_it(stack_settings: Any, signed_worker: Any) -> None:
    need_data()
    from stam.sources.fhir_r4 import load_bundle

    entries = load_bundle(BUNDLE).entries
    arrest = next(e for e in entries if any("cardiac arrest" in (c.display or "") for c in e.codes))
    assert arrest.status == "active"
    pid = arrest.patient_id
    states = RedisStateStore(redis_client(stack_settings), prefix=stack_settings.collection_prefix)

    asyncio.run(_send(stack_settings, entries, "ehr-a"))
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in entries}, timeout=240))
    assert {e.entry_id for e in entries} <= {x["entry_id"] for x in transitions}, "signed entries not all applied"

    def fact() -> Any:
        found = [s for s in states.load(pid).by_source(arrest.source_ref or "")
                 if s.memory.entry_id == arrest.entry_id]
        assert len(found) == 1
        return found[0]

    before = fact()
    assert before.store is Store.ACTIVE and before.memory.source_system == "ehr-a"

    unsigned, other = _forged(arrest, "forged-unsigned"), _forged(arrest, "forged-lab-b")
    bad_sig = _forged(arrest, "forged-bad-signature")
    asyncio.run(_send(stack_settings, [unsigned], None))
    asyncio.run(_send(stack_settings, [other], "lab-b"))
    wrong = signature(b"not-the-secret-of-ehr-a-000000", "ehr-a", bad_sig.model_dump_json().encode())
    asyncio.run(_send_raw(stack_settings, bad_sig, [(SOURCE_HEADER, b"ehr-a"), (SIGNATURE_HEADER, wrong.encode())]))
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {unsigned.entry_id, other.entry_id}, timeout=120))

    # Both forged entries were recorded (a memory in HISTORY each) but ended nothing of ehr-a.
    for forged, by in ((unsigned, None), (other, "lab-b")):
        mine = [x for x in transitions if x["entry_id"] == forged.entry_id]
        assert [x["kind"] for x in mine] == ["added"], mine
        assert mine[0]["memory"]["source_system"] == by
        assert [r["memory_id"] for r in mine[0]["refused"]] == [before.memory.memory_id]
        assert mine[0]["refused"][0]["reason"] == "entered-in-error"
    assert fact().store is Store.ACTIVE, "a forged entered-in-error archived another source's fact"

    # The wrong signature is dead-lettered with the reason (by the default worker's one stage, fused), and applied
    # nowhere.
    letters = [d for d in asyncio.run(_dead_letters(stack_settings)) if d["stage"] == "fused"
               and bad_sig.entry_id.encode() in base64.b64decode(d["value"])]
    assert len(letters) == 1 and letters[0]["error_type"] == "SignatureError"
    assert "bad signature for source system 'ehr-a'" in letters[0]["error"]
    assert bad_sig.entry_id not in {x["entry_id"] for x in transitions}

    # The fact's own source retracts it.
    own = _forged(arrest, "retracted-by-ehr-a")
    asyncio.run(_send(stack_settings, [own], "ehr-a"))
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {own.entry_id}, timeout=120))
    mine = [x for x in transitions if x["entry_id"] == own.entry_id]
    assert sorted(x["kind"] for x in mine) == ["added", "archived"]
    after = fact()
    assert after.store is Store.HISTORY and after.reason is not None and after.reason.value == "entered-in-error"
