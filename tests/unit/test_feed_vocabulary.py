"""The hospital-feed benchmark's warm vocabulary: the concept vectors it puts in the shared cache are the ones a
worker's embedder finds there (same keys, same vectors), so a warm run embeds nothing the feed brings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.hospital_feed import Vocabulary
from stam.backends.redis_cache import RedisVectorCache
from stam.embedding import Embedder
from stam.transport import local_redis_client, stop_local_redis


def test_a_worker_finds_the_shared_vocabulary(tmp_path: Path, small_bundle: Any) -> None:
    client = local_redis_client(tmp_path / "vocab.rdb")
    try:
        vocabulary = Vocabulary(small_bundle.entries)
        assert len(vocabulary.texts) > 10
        worker = Embedder(shared=RedisVectorCache(client, prefix="stam"))  # as stam.compose.build_deps makes it
        worker.embed_concepts(vocabulary.texts[:3])  # nothing shared yet: embedded here
        assert (worker.shared_hits, worker.misses) == (0, 3)

        vocabulary.share(client, "stam")
        rest = vocabulary.texts[3:]
        got = worker.embed_concepts(rest)
        assert worker.shared_hits == len(rest) and worker.misses == 3  # all from the cache, none embedded
        np.testing.assert_allclose(got, vocabulary.vectors[3:], atol=1e-6)
    finally:
        stop_local_redis(client)
