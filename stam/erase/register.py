"""The erasure register, and the report an erasure's steps fill in.

- **A marker**: a keyed digest of the id in the set ``<prefix>:erased`` (never the id), so ``stam rebuild`` refuses
  to bring the patient back from the transition log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

import redis

from stam.config import Settings
from stam.erase.topics import Crypto


@dataclass
class Report:
    """What each step of an erasure removed (counts), how (a sentence per store) and in how many seconds."""

    removed: dict[str, int] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _register_digest(client: redis.Redis, prefix: str, patient_id: str, *, create: bool) -> str | None:
    """HMAC-SHA256 of the id under a random key kept in Redis: the register holds no id, and a digest cannot be
    matched against a list of ids without that key."""
    salt_key = f"{prefix}:erased:key"
    salt = client.get(salt_key)
    if salt is None:
        if not create:
            return None
        client.setnx(salt_key, os.urandom(32))
        salt = client.get(salt_key)
    assert salt is not None
    raw = salt if isinstance(salt, bytes) else str(salt).encode()
    return hmac.new(raw, patient_id.encode(), hashlib.sha256).hexdigest()


def mark_erased(client: redis.Redis, prefix: str, patient_id: str) -> None:
    digest = _register_digest(client, prefix, patient_id, create=True)
    client.sadd(f"{prefix}:erased", digest)  # type: ignore[arg-type]


class ErasureRegister:
    """Which patients were erased (the register, or a shredded data key): for the paths that could bring one back
    from the transition log (``stam rebuild``, the worker's recovery after a store loss)."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self._client = client
        self._prefix = settings.collection_prefix
        self._crypto = Crypto(settings, client)

    def erased(self, patient_id: str) -> bool:
        digest = _register_digest(self._client, self._prefix, patient_id, create=False)
        if digest is not None and self._client.sismember(f"{self._prefix}:erased", digest):
            return True
        return self._crypto.erased(patient_id)


def is_erased(settings: Settings, client: redis.Redis, patient_id: str) -> bool:
    """True when the patient was erased (the register, or a shredded data key)."""
    return ErasureRegister(settings, client).erased(patient_id)
