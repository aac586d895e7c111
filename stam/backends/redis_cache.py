"""The shared concept-embedding cache in Redis (keys ``<prefix>:emb:<model>:<text digest>``).

Holds vectors of coded concept descriptions only, which are not patient data; a worker that starts, or a
second worker, reuses what another already embedded."""

from __future__ import annotations

from collections.abc import Sequence

import redis


def as_bytes(value: bytes | str | None) -> bytes | None:
    if value is None:
        return None
    return value if isinstance(value, bytes) else value.encode()


class RedisVectorCache:
    def __init__(self, client: redis.Redis, *, prefix: str = "stam") -> None:
        self._r = client
        self._prefix = prefix

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return [as_bytes(v) for v in self._r.mget([f"{self._prefix}:{k}" for k in keys])]

    def set_many(self, items: dict[str, bytes]) -> None:
        if items:
            self._r.mset({f"{self._prefix}:{k}": v for k, v in items.items()})
