"""Query token scopes, function by function (stam/read/scopes.py); the endpoint is tested in
tests/integration/test_query_scopes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.query import QueryRequest
from stam.errors import TokenConfigError
from stam.read.scopes import concealed_not_found, load_token_scopes, new_token, token_hash


def test_tokens_authenticate_to_their_scope(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    ward = new_token(path, "ward", "clinician", None)
    svc = new_token(path, "svc", "service:billing", ["p1"])
    assert path.stat().st_mode & 0o077 == 0
    assert ward not in path.read_text() and token_hash(ward) in path.read_text()
    scopes = load_token_scopes(path, "shared-token")
    g = scopes.authenticate(f"Bearer {ward}")
    assert g is not None and g.allows("p1") and g.allows("anyone")
    g = scopes.authenticate(f"Bearer {svc}")
    assert g is not None and g.allows("p1") and not g.allows("p2")
    shared = scopes.authenticate("Bearer shared-token")
    assert shared is not None and shared.role == "clinician"
    for header in (None, "", f"bearer {ward}", ward, "Bearer ", f"Bearer {ward}x", "Bearer é",
                   "Bearer \udcff\udcfe", f"Bearer {ward}" + " " * 5000):
        assert scopes.authenticate(header) is None, header


@pytest.mark.parametrize("content", [
    "not json", "[]", '{"tokens": {}}', '{"tokens": [1]}',
    json.dumps({"tokens": [{"name": "a", "role": "clinician", "sha256": "xyz"}]}),
    json.dumps({"tokens": [{"name": "a", "role": "nurse", "sha256": "0" * 64}]}),
    json.dumps({"tokens": [{"name": "a", "role": "service:x", "sha256": "0" * 64}]}),
    json.dumps({"tokens": [{"name": "a", "role": "clinician", "sha256": "0" * 64, "patients": ["p"]}]}),
    json.dumps({"tokens": [{"name": "a", "role": "clinician", "sha256": "0" * 64}] * 2}),
])
def test_a_bad_token_file_is_refused_with_the_reason(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(TokenConfigError, match="STAM_QUERY_TOKENS_FILE"):
        load_token_scopes(path, None)


def test_the_concealed_answer_does_not_depend_on_the_patient_existing() -> None:
    req = QueryRequest(request_id="r", patient_id="p", question="q")
    a, b = concealed_not_found(req), concealed_not_found(req)
    assert a.error_kind == "not_found" and a.latency_ms == 0 and a.answered_at.microsecond == 0
    assert a.model_dump(exclude={"answered_at"}) == b.model_dump(exclude={"answered_at"})
