"""Limits of a record entry, enforced by the schema (so by every stage and by the publisher).

The broker refuses a message over ``BROKER_MESSAGE_BYTES`` (the producers' ``max_request_size``, 1 MiB by
default). A record entry travels on the entries topic and again inside every stage payload, which adds its
atomic memories (the free text of an entry kept verbatim is one memory: its text a second time), relations
and impact candidates. An entry of at most ``MAX_ENTRY_BYTES`` serialized leaves those payloads room under
the broker limit; one that still does not fit is dead-lettered by the stage that could not send it.

Ids (``patient_id``, ``entry_id``, ``source_ref``) are printable ASCII (space to ``~``), without leading or
trailing space; ``patient_id`` fits Milvus's ``VARCHAR(256)`` partition-key field with room to spare. Ids may
still hold characters that mean something to a store (``:``, ``{``, ``*``, ``[``, quotes, backslashes):
every key and filter built from an id escapes it (``stam.backends``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

BROKER_MESSAGE_BYTES = 1_048_576
"""The producers' (aiokafka's default ``max_request_size``) and the embedded broker's message limit."""

MAX_ENTRY_BYTES = 262_144
"""A serialized RecordEntry (UTF-8 JSON) is at most 256 KiB."""

MAX_TEXT_CHARS = 100_000
"""An entry's free text is at most 100,000 characters."""

MAX_PATIENT_ID = 128
MAX_ID = 256
"""Longest ``patient_id`` (Milvus partition key field is VARCHAR(256)); longest ``entry_id``/``source_ref``."""

ID_PATTERN = r"^[!-~](?:[ -~]*[!-~])?$"
"""Printable ASCII, no leading or trailing space (no control characters, no non-ASCII)."""

DEAD_LETTER_VALUE_BYTES = 262_144
"""A dead letter keeps the original bytes up to this size; a larger original keeps an excerpt of
``DEAD_LETTER_EXCERPT_BYTES``, its sha256, its size and a pointer to where the whole is (topic/partition/
offset, or file and line/byte offset)."""

DEAD_LETTER_EXCERPT_BYTES = 65_536

PatientId = Annotated[str, Field(min_length=1, max_length=MAX_PATIENT_ID, pattern=ID_PATTERN,
                                 description=f"Patient id: printable ASCII, 1-{MAX_PATIENT_ID} characters, no "
                                 "leading/trailing space")]
EntryId = Annotated[str, Field(min_length=1, max_length=MAX_ID, pattern=ID_PATTERN,
                               description=f"Printable ASCII, 1-{MAX_ID} characters, no leading/trailing space")]
