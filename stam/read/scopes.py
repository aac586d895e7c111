"""Query tokens with scopes: who may read which patients over the query HTTP endpoint.

A token carries one role:

- ``clinician``: every patient;
- ``service:<name>``: only the patients listed for it (``patients``).

Tokens are configured in a JSON file (``STAM_QUERY_TOKENS_FILE``; ``stam token new`` generates a token and
appends its entry)::

    {"tokens": [{"name": "ward-app", "role": "clinician", "sha256": "<hex of sha256(token)>"},
                {"name": "billing", "role": "service:billing", "patients": ["p1", "p2"], "sha256": "..."}]}

Only the SHA-256 of each token is kept (tokens are 256-bit random strings, so a fast hash is enough: there is
nothing to guess a preimage from); a presented token is hashed and compared with every configured hash in
constant time. ``STAM_QUERY_TOKEN`` (one shared token) still works and is a ``clinician`` token.

A caller gets exactly the same answer (status and body, see :func:`concealed_not_found`) for a patient that
does not exist as for one its token may not read, so 404 versus 200 tells it nothing about other patients.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas.query import QueryAnswer, QueryRequest
from stam.errors import TokenConfigError

CLINICIAN = "clinician"
SERVICE_PREFIX = "service:"
NOT_FOUND_MESSAGE = "no memory for this patient that this token may read"


@dataclass(frozen=True)
class Grant:
    """What one token may read."""

    name: str
    role: str
    patients: frozenset[str] | None
    """None: every patient."""

    def allows(self, patient_id: str) -> bool:
        return self.patients is None or patient_id in self.patients


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _grant(item: Any, where: str) -> tuple[bytes, Grant]:
    if not isinstance(item, dict):
        raise TokenConfigError(f"{where}: each token is an object with name, role, sha256 (and patients)")
    name, role, digest, patients = item.get("name"), item.get("role"), item.get("sha256"), item.get("patients")
    if not isinstance(name, str) or not name:
        raise TokenConfigError(f"{where}: a token needs a name")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise TokenConfigError(f"{where}: token {name!r}: sha256 must be 64 lowercase hex digits")
    if role == CLINICIAN:
        if patients is not None:
            raise TokenConfigError(f"{where}: token {name!r}: a clinician reads every patient; drop 'patients'")
        return bytes.fromhex(digest), Grant(name, role, None)
    if isinstance(role, str) and role.startswith(SERVICE_PREFIX) and len(role) > len(SERVICE_PREFIX):
        if not isinstance(patients, list) or not all(isinstance(p, str) and p for p in patients):
            raise TokenConfigError(f"{where}: token {name!r}: role {role!r} needs 'patients', a list of patient ids")
        return bytes.fromhex(digest), Grant(name, role, frozenset(patients))
    raise TokenConfigError(f"{where}: token {name!r}: role must be {CLINICIAN!r} or 'service:<name>', got {role!r}")


class TokenScopes:
    """The configured tokens; :meth:`authenticate` maps an Authorization header to its grant."""

    def __init__(self, grants: Sequence[tuple[bytes, Grant]]) -> None:
        self._grants = list(grants)

    def __bool__(self) -> bool:
        return bool(self._grants)

    def authenticate(self, header: str | None) -> Grant | None:
        """The grant of a ``Bearer <token>`` header, or None (missing, malformed, not ASCII, unknown)."""
        if not header or not header.isascii() or not header.startswith("Bearer ") or len(header) > 4096:
            return None
        presented = hashlib.sha256(header[len("Bearer "):].encode("ascii")).digest()
        found = None
        for digest, grant in self._grants:  # every hash compared, in constant time: no early exit
            if hmac.compare_digest(digest, presented):
                found = grant
        return found


def load_token_scopes(tokens_file: Path | None, shared_token: str | None) -> TokenScopes:
    grants: list[tuple[bytes, Grant]] = []
    if shared_token:
        grants.append((hashlib.sha256(shared_token.encode("utf-8")).digest(),
                       Grant("STAM_QUERY_TOKEN", CLINICIAN, None)))
    if tokens_file is not None:
        where = f"STAM_QUERY_TOKENS_FILE {tokens_file}"
        try:
            data = json.loads(Path(tokens_file).read_text())
        except OSError as exc:
            raise TokenConfigError(f"{where}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise TokenConfigError(f"{where}: not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            raise TokenConfigError(f'{where}: expected {{"tokens": [...]}}')
        grants.extend(_grant(item, where) for item in data["tokens"])
        names = [g.name for _, g in grants]
        if len(set(names)) != len(names):
            raise TokenConfigError(f"{where}: token names must be unique")
    return TokenScopes(grants)


def scopes_of(settings: Any) -> TokenScopes:
    shared = settings.query_token.get_secret_value() if settings.query_token is not None else None
    return load_token_scopes(settings.query_tokens_file, shared)


def new_token(tokens_file: Path, name: str, role: str, patients: Sequence[str] | None) -> str:
    """A new random token: its entry is appended to ``tokens_file`` (created 0600), the token returned (shown
    once, never stored)."""
    token = "stam_" + secrets.token_urlsafe(32)
    item: dict[str, Any] = {"name": name, "role": role, "sha256": token_hash(token)}
    if patients is not None:
        item["patients"] = list(patients)
    data: dict[str, Any] = {"tokens": []}
    if tokens_file.exists():
        data = json.loads(tokens_file.read_text())
    data["tokens"].append(item)
    for i, entry in enumerate(data["tokens"]):
        _grant(entry, f"{tokens_file} token {i}")
    if len({e["name"] for e in data["tokens"]}) != len(data["tokens"]):
        raise TokenConfigError(f"{tokens_file}: a token named {name!r} exists already")
    tokens_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = tokens_file.with_suffix(tokens_file.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, tokens_file)
    return token


def concealed_not_found(req: QueryRequest) -> QueryAnswer:
    """The one answer for 'no such patient' and 'not yours to read': nothing in it depends on whether the patient
    exists (no latency; the time to the second)."""
    return QueryAnswer(request_id=req.request_id, patient_id=req.patient_id, ok=False, error=NOT_FOUND_MESSAGE,
                       error_kind="not_found", answered_at=datetime.now(UTC).replace(microsecond=0), latency_ms=0.0)
