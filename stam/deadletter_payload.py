"""Dead letters that always fit on the dead-letter topic: the original bytes when small, else a bounded
excerpt with the sha256 and size of the whole (the pointer to the whole is the caller's: topic/partition/
offset, or file and line/byte offset). Used by the workers (``Runtime.dead_letter``) and the publisher."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from schemas.limits import DEAD_LETTER_EXCERPT_BYTES, DEAD_LETTER_VALUE_BYTES

KEY_BYTES = 1024


def bounded_value(raw: bytes) -> dict[str, Any]:
    """DeadLetter fields for ``raw``: ``value`` (base64, whole or excerpt), ``truncated``, ``value_bytes``,
    ``value_sha256``."""
    fields: dict[str, Any] = {"value_bytes": len(raw), "value_sha256": hashlib.sha256(raw).hexdigest()}
    if len(raw) <= DEAD_LETTER_VALUE_BYTES:
        return {**fields, "value": base64.b64encode(raw).decode(), "truncated": False}
    return {**fields, "value": base64.b64encode(raw[:DEAD_LETTER_EXCERPT_BYTES]).decode(), "truncated": True}


def bounded_key(key: bytes | None) -> tuple[str | None, bytes | None]:
    """(the DeadLetter ``key`` field, the Kafka key to send the letter with): a key over 1 KiB is cut to its
    first 1 KiB in the letter and replaced by its sha256 as the Kafka key."""
    if key is None:
        return None, None
    if len(key) <= KEY_BYTES:
        return base64.b64encode(key).decode(), key
    return base64.b64encode(key[:KEY_BYTES]).decode(), hashlib.sha256(key).hexdigest().encode()
