"""Source identity: which configured source system an entry comes from, proven by a signature.

``RecordEntry.source`` is free text a producer writes (the format, e.g. ``fhir-r4``); anyone who can reach the
broker can write anything there. The identity the write path trusts comes from here instead:

- Source systems are configured (``STAM_SOURCES``: a JSON object ``{"name": "secret", ...}``, or
  ``STAM_SOURCES_FILE``: a JSON file of the same shape, readable by its owner only).
- A producer signs each entry: HMAC-SHA256 with its source's secret over ``stam-entry-v1``, the source name and
  the exact value bytes, sent in the Kafka headers ``stam-source`` (the name) and ``stam-signature`` (hex).
  ``stam publish --source-system NAME`` does this.
- The extract stage verifies it (:meth:`SourceKeys.verify`) and stamps the verified name on every memory of the
  entry (``AtomicMemory.source_system``); later stages read it from there (their topics are internal).
- ``STAM_REQUIRE_SIGNED_ENTRIES`` (default: on when any source is configured): an unsigned entry is
  dead-lettered. Off (the embedded dev stack), an unsigned entry is applied with no source identity (``None``,
  shown as ``unsigned``). A signed entry whose signature does not verify, or that names a source that is not
  configured, is dead-lettered either way.

The rule the update stage enforces (:func:`archive_refusal`): an entry may end (archive) a fact of another
source system only by clinical supersession between two signed systems (a newer value of the same concept);
retracting (``entered-in-error``) or amending a source resource (same ``source_ref``, or ``replaces`` /
``discontinues`` references) needs the fact's own source system, and an unsigned entry never ends a fact of a
signed source. A refused archival leaves the fact where it was; the entry is still applied and the refusal is
recorded on its transition (``refused``) and counted (``stam_archive_refused_total``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import ENDING_ROLES, Archive, AtomicMemory, Reason, RecordEntry
from stam.errors import SignatureError, SourceConfigError

log = logging.getLogger("stam.integrity")

SOURCE_HEADER = "stam-source"
SIGNATURE_HEADER = "stam-signature"
UNSIGNED = "unsigned"
_DOMAIN = b"stam-entry-v1\n"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")

RESOURCE_ROLES = ENDING_ROLES


def valid_source_name(name: str) -> bool:
    return bool(_NAME.match(name)) and name != UNSIGNED


def signature(secret: bytes, source: str, value: bytes) -> str:
    return hmac.new(secret, _DOMAIN + source.encode("ascii") + b"\n" + value, hashlib.sha256).hexdigest()


def _header_items(headers: Any) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    items: Iterable[Any] = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for k, v in items:
        key = k.decode("latin-1") if isinstance(k, bytes) else str(k)
        out.append((key, v if isinstance(v, bytes) else str(v).encode() if v is not None else b""))
    return out


@dataclass(frozen=True)
class SourceKeys:
    """The configured source systems and their secrets; signs (producers) and verifies (the extract stage)."""

    secrets: Mapping[str, bytes] = field(default_factory=dict)
    require_signed: bool = False

    def sign_headers(self, source: str, value: bytes) -> list[tuple[str, bytes]]:
        secret = self.secrets.get(source)
        if secret is None:
            raise SourceConfigError(f"source system {source!r} is not configured (STAM_SOURCES / STAM_SOURCES_FILE "
                                    f"name: {', '.join(sorted(self.secrets)) or 'none configured'})")
        return [(SOURCE_HEADER, source.encode("ascii")),
                (SIGNATURE_HEADER, signature(secret, source, value).encode("ascii"))]

    def verify(self, headers: Any, value: bytes) -> str | None:
        """The verified source system of an entry, or None (unsigned, allowed only when signing is not
        required). Raises :class:`SignatureError` with the reason otherwise."""
        items = _header_items(headers)
        sources = [v for k, v in items if k == SOURCE_HEADER]
        sigs = [v for k, v in items if k == SIGNATURE_HEADER]
        if not sources and not sigs:
            if self.require_signed:
                raise SignatureError("unsigned entry: signing is required (STAM_REQUIRE_SIGNED_ENTRIES); "
                                     f"send headers {SOURCE_HEADER} and {SIGNATURE_HEADER}")
            return None
        if len(sources) != 1 or len(sigs) != 1:
            raise SignatureError(f"expected exactly one {SOURCE_HEADER} and one {SIGNATURE_HEADER} header, got "
                                 f"{len(sources)} and {len(sigs)}")
        try:
            name = sources[0].decode("ascii")
            given = sigs[0].decode("ascii")
        except UnicodeDecodeError:
            raise SignatureError("source or signature header is not ASCII") from None
        secret = self.secrets.get(name) if valid_source_name(name) else None
        if secret is None:
            raise SignatureError(f"entry signed by a source system that is not configured: {name[:64]!r}")
        if not hmac.compare_digest(signature(secret, name, value).encode(), given.encode()):
            raise SignatureError(f"bad signature for source system {name!r}")
        return name


def parse_sources(raw: str, where: str) -> dict[str, bytes]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise SourceConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SourceConfigError(f'{where}: expected a JSON object {{"source-name": "secret", ...}}')
    out: dict[str, bytes] = {}
    for name, secret in data.items():
        if not valid_source_name(name):
            raise SourceConfigError(f"{where}: source name {name[:64]!r} must be 1-64 characters of A-Z a-z 0-9 . _ "
                                    f": - (and not {UNSIGNED!r})")
        if not isinstance(secret, str) or len(secret) < 16:
            raise SourceConfigError(f"{where}: the secret of {name!r} must be a string of at least 16 characters")
        out[name] = secret.encode()
    return out


def load_source_keys(sources: str | None, sources_file: Path | None, require_signed: bool | None) -> SourceKeys:
    """Source systems from ``STAM_SOURCES`` (JSON) and/or ``STAM_SOURCES_FILE``; signing is required by default
    when any is configured."""
    secrets: dict[str, bytes] = {}
    if sources_file is not None:
        try:
            mode = os.stat(sources_file).st_mode
            text = Path(sources_file).read_text()
        except OSError as exc:
            raise SourceConfigError(f"STAM_SOURCES_FILE {sources_file}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("STAM_SOURCES_FILE %s is readable by others than its owner (chmod 600 it)", sources_file)
        secrets.update(parse_sources(text, f"STAM_SOURCES_FILE {sources_file}"))
    if sources:
        secrets.update(parse_sources(sources, "STAM_SOURCES"))
    return SourceKeys(secrets=secrets, require_signed=bool(secrets) if require_signed is None else require_signed)


def source_keys(settings: Any) -> SourceKeys:
    secret = settings.sources.get_secret_value() if settings.sources is not None else None
    return load_source_keys(secret, settings.sources_file, settings.require_signed_entries)


def stamp(memories: Sequence[AtomicMemory], source_system: str | None) -> tuple[AtomicMemory, ...]:
    """The memories with the verified source identity of their entry (``None``: unsigned)."""
    return tuple(m if m.source_system == source_system else m.model_copy(update={"source_system": source_system})
                 for m in memories)


def archive_refusal(entry: RecordEntry, new: AtomicMemory, old: AtomicMemory, archive: Archive) -> str | None:
    """Why ``new`` (of ``entry``) may not archive ``old``; None when it may. See the module's rule."""
    by, owner = new.source_system, old.source_system
    if by == owner:
        return None
    shown_by, shown_owner = by or UNSIGNED, owner or UNSIGNED
    if by is None:
        return f"an unsigned entry cannot end a fact of signed source system {shown_owner!r}"
    referenced = {r.target for r in entry.references if r.role in RESOURCE_ROLES}
    if archive.reason is Reason.ENTERED_IN_ERROR:
        return (f"entered-in-error from source system {shown_by!r} cannot retract a fact of "
                f"{shown_owner!r}")
    if old.source_ref and (old.source_ref == new.source_ref or old.source_ref in referenced):
        return (f"source system {shown_by!r} cannot amend resource {old.source_ref!r} of source system "
                f"{shown_owner!r}")
    return None
