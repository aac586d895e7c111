"""Property test at the worker edge: whatever bytes arrive on the entries topic, the extract agent's batch
handler (workers.stage_agent.run_batch with the real extract stage and coded reasoner) hands every message on
or dead-letters it; nothing escapes, nothing is lost, and order is kept."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import RecordEntry
from stam.crypto import KeyStore, Sealer
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.stages import extract_batch
from workers.stage_agent import run_batch

VALID = RecordEntry.model_validate({
    "patient_id": "p1", "entry_id": "e1", "source": "fhir-r4", "source_ref": "Observation/o1",
    "resource_type": "Observation", "effective_at": "2020-01-01T00:00:00+00:00", "status": "final",
    "codes": [{"system": "http://loinc.org", "code": "8302-2", "display": "Body Height"}],
    "value": {"value": 87.8, "unit": "cm"},
}).model_dump(mode="json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mutated_entries(draw: st.DrawFn) -> bytes:
    """A valid entry with one field replaced, removed, or one unknown field added."""
    doc = dict(VALID)
    key = draw(st.sampled_from(sorted(doc)))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        doc[key] = draw(json_values)
    elif action == "remove":
        doc.pop(key)
    else:
        doc[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return json.dumps(doc).encode()


messages = st.lists(st.binary(max_size=200) | mutated_entries() | st.just(json.dumps(VALID).encode()),
                    min_size=1, max_size=8)


class _Runtime:
    run_ahead = None  # no bound on extract: these tests run one stage

    def __init__(self) -> None:
        self.deps = SimpleNamespace(router=Router(CodedReasoner()))
        self.letters: list[int] = []

    sealer = Sealer(KeyStore(redis.Redis(port=1), bytes(32)))  # plain values only: opened without a key store

    async def dead_letter(self, event: Any, stage: str, exc: BaseException, opened: bytes | None = None) -> None:
        assert stage == "extract" and str(exc)
        self.letters.append(event.message.offset)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_every_message_is_handed_on_or_dead_lettered_in_order(values: list[bytes]) -> None:
    events = [SimpleNamespace(value=v, message=SimpleNamespace(topic="stam.entries.v1", partition=0, offset=i,
                                                               key=b"p1", value=v, timestamp=None))
              for i, v in enumerate(values)]
    runtime = _Runtime()
    handed: list[int] = []

    async def on_result(event: Any, result: Any) -> None:
        assert result.entry.patient_id and all(m.entry_id == result.entry.entry_id for m in result.memories)
        handed.append(event.message.offset)

    asyncio.run(run_batch(events, stage="extract", model=RecordEntry, fn=extract_batch, runtime=runtime,  # type: ignore[arg-type]
                          on_result=on_result))
    assert sorted(handed + runtime.letters) == list(range(len(values)))
    assert handed == sorted(handed)
    for i in handed:  # only what validates is handed on
        RecordEntry.model_validate_json(values[i])
