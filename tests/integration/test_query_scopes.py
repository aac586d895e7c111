"""Query tokens with scopes and malformed requests, against the real query worker's HTTP endpoint (issue 13,
repro 10): a patient a token may not read gets the very answer a patient that does not exist gets; every
malformed request is a 4xx, never a 500."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from typing import Any

import pytest

from stam.net import free_port
from stam.read.scopes import new_token
from stam.transport import kafka_consumer, kafka_producer
from tests.conftest import SMALL_PATIENT
from tests.integration.broker import _publish, collect_outputs, opened
from tests.integration.conftest import _stam_process
from topology import topics as t

pytestmark = pytest.mark.integration

GHOST = "patient-that-does-not-exist-0001"


@pytest.fixture(scope="module")
def scoped(stack_settings: Any, worker: Any, small_bundle: Any) -> Any:
    """The small Synthea patient applied by the real worker; a query worker with three scoped tokens."""
    entries = small_bundle.entries
    asyncio.run(_publish(stack_settings, entries))
    transitions, _ = asyncio.run(collect_outputs(stack_settings, {e.entry_id for e in entries}, timeout=240))
    assert {e.entry_id for e in entries} <= {x["entry_id"] for x in transitions}
    path = stack_settings.home / "query-tokens.json"
    tokens = {"ward": new_token(path, "ward", "clinician", None),
              "small": new_token(path, "small", "service:small", [SMALL_PATIENT]),
              "ghost": new_token(path, "ghost", "service:ghost", [GHOST])}
    port = free_port()
    with _stam_process(stack_settings, "query-worker", "query-worker-scopes.log", STAM_QUERY_WEB_PORT=str(port),
                       STAM_QUERY_TOKENS_FILE=str(path), STAM_QUERY_KAFKA_REQUIRE_TOKEN="true") as proc:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (stack_settings.home / "query-worker-scopes.log").read_text()[-3000:]
            try:
                if _raw(port, "GET", "/v1/health")[0] == 200:
                    break
            except OSError:
                time.sleep(1)
        yield port, tokens


def _raw(port: int, method: str, path: str, body: bytes | None = None,
         headers: list[tuple[str, bytes]] = ()) -> tuple[int, bytes]:  # type: ignore[assignment]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path)
        for k, v in headers:
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)).encode())
        conn.endheaders()
        if body is not None:
            conn.send(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _ask(port: int, token: str, patient: str, request_id: str = "r-1") -> tuple[int, bytes]:
    body = json.dumps({"request_id": request_id, "patient_id": patient, "question": "What is the body height?",
                       "answer": False}).encode()
    return _raw(port, "POST", "/v1/query", body, [("Authorization", f"Bearer {token}".encode()),
                                                   ("Content-Type", b"application/json")])


def test_a_token_reads_only_its_patients_and_cannot_tell_who_exists(scoped: Any) -> None:
    port, tokens = scoped
    status, body = _ask(port, tokens["ward"], SMALL_PATIENT)
    assert status == 200 and json.loads(body)["ok"]
    status, body = _ask(port, tokens["small"], SMALL_PATIENT)
    assert status == 200 and json.loads(body)["packet"]["items"]

    for _ in range(5):  # the answers carry the time to the second; a pair that straddles a second is asked again
        seen = _ask(port, tokens["ghost"], SMALL_PATIENT)       # exists, not this token's
        missing = _ask(port, tokens["ghost"], GHOST)            # this token's, does not exist
        other = _ask(port, tokens["small"], GHOST)              # neither
        ward = _ask(port, tokens["ward"], GHOST)                # every patient's token, does not exist
        bodies = {seen[1].replace(SMALL_PATIENT.encode(), GHOST.encode()), missing[1], other[1], ward[1]}
        if len({json.loads(b)["answered_at"] for b in bodies}) == 1:
            break
    assert {seen[0], missing[0], other[0], ward[0]} == {404}
    assert len(bodies) == 1, bodies  # byte for byte, but for the patient id the caller sent
    answer = json.loads(missing[1])
    assert answer["error_kind"] == "not_found" and answer["latency_ms"] == 0
    assert _ask(port, "stam_not-a-token", SMALL_PATIENT)[0] == 401


def _malformed(rng: random.Random, token: str) -> list[tuple[str, bytes | None, list[tuple[str, bytes]]]]:
    auth = ("Authorization", f"Bearer {token}".encode())
    good = {"patient_id": SMALL_PATIENT, "question": "What is the body height?", "answer": False}
    cases: list[tuple[str, bytes | None, list[tuple[str, bytes]]]] = []
    # Tokens that are not ASCII, not UTF-8, empty, huge, in the wrong scheme.
    body = json.dumps(good).encode()
    for value in ("Bearer é-token".encode(), "Bearer 病人".encode(), b"Bearer \xff\xfe\x80", b"Bearer ",
                  b"Bearer", b"bearer " + token.encode(), token.encode(), b"Basic " + token.encode(),
                  b"Bearer " + b"x" * 8000, b"Bearer " + token.encode() + b"\xc3\xa9"):
        cases.append(("POST", body, [("Authorization", value)]))
    cases.append(("POST", body, []))
    # Bodies: not JSON, not UTF-8, deeply nested, not an object, wrong types, huge.
    for raw in (b"", b"{", b"null", b"[]", b"1", b'"s"', b"\xff\xfe{}", b'{"question": "\xff"}', b"[" * 100_000,
                b'{"a":' * 50_000 + b"1" + b"}" * 50_000, json.dumps({"visibility": {"entry_ids": [[[[[]]]]]}}).encode(),
                b"\x00" * 64, b"NaN", b'{"patient_id": "' + "é".encode("latin-1") + b'"}'):
        cases.append(("POST", raw, [auth]))
    deep = "[" * 3000 + '"q"' + "]" * 3000
    cases.append(("POST", f'{{"patient_id": "{SMALL_PATIENT}", "question": {deep}}}'.encode(), [auth]))
    fields = {"patient_id": [None, 1, [], {}, "", "x" * 600], "question": [None, 2, "", "q" * 5000, {"a": 1}],
              "k_active": ["many", -1, 10**30, 1.5, None], "k_history": [-5, "x", []],
              "as_of": ["yesterday", "2020-01-01T00:00:00", [], "9999-99-99"], "as_of_version": [-1, "v", 1.5],
              "gate": ["sometimes", 3], "token_budget": [0, "x"], "ranking": ["best"], "visibility": ["all", [1]],
              "labels": ["maybe"], "schema_version": [2, "1"], "request_id": ["", 5], "unknown_field": [1]}
    for name, values in fields.items():
        for v in values:
            cases.append(("POST", json.dumps({**good, name: v}).encode(), [auth]))
    cases.append(("POST", json.dumps({**good, "as_of": "2020-01-01T00:00:00+00:00", "as_of_version": 3}).encode(),
                  [auth]))
    # Random bytes, random JSON fragments.
    for _ in range(150):
        n = rng.choice((1, 8, 64, 512, 4096))
        cases.append(("POST", bytes(rng.randrange(256) for _ in range(n)), [auth]))
    for _ in range(100):
        doc: Any = {k: rng.choice([None, True, -1, 1e308, "é", [], {}, "x" * rng.randrange(1, 50)])
                    for k in rng.sample(sorted(fields), rng.randrange(1, 5))}
        cases.append(("POST", json.dumps(doc).encode(), [auth]))
    # Too large: 300 KB declared, and over aiohttp's 1 MiB.
    cases.append(("POST", json.dumps({**good, "question": "q" * 300_000}).encode(), [auth]))
    cases.append(("POST", b" " * (2 * 1024 * 1024), [auth]))
    # Wrong method.
    cases.append(("GET", None, [auth]))
    cases.append(("PUT", body, [auth]))
    return cases


def test_every_malformed_request_is_a_4xx(scoped: Any) -> None:
    port, tokens = scoped
    rng = random.Random(13)
    statuses: dict[int, int] = {}
    for method, body, headers in _malformed(rng, tokens["ward"]):
        status, _ = _raw(port, method, "/v1/query", body, headers)
        statuses[status] = statuses.get(status, 0) + 1
        assert 400 <= status < 500, (status, method, (body or b"")[:200], headers)
    assert statuses.get(413, 0) >= 2 and statuses.get(401, 0) >= 10 and statuses.get(400, 0) >= 200, statuses
    # ... and the endpoint still answers a good query.
    assert _ask(port, tokens["ward"], SMALL_PATIENT)[0] == 200


def test_queries_on_the_topic_are_answered_within_their_tokens_scope(stack_settings: Any, scoped: Any) -> None:
    _, tokens = scoped
    asks = {"k-none": (SMALL_PATIENT, None), "k-wrong": (SMALL_PATIENT, "stam_wrong"),
            "k-forbidden": (SMALL_PATIENT, tokens["ghost"]), "k-missing": (GHOST, tokens["ghost"]),
            "k-allowed": (SMALL_PATIENT, tokens["small"])}

    async def roundtrip() -> dict[str, dict[str, Any]]:
        producer = kafka_producer(stack_settings)
        await producer.start()
        try:
            for rid, (patient, token) in asks.items():
                body = {"request_id": rid, "patient_id": patient, "question": "What is the body height?",
                        "answer": False}
                await producer.send_and_wait(t.QUERIES.name(stack_settings.topic_prefix), key=patient.encode(),
                                             value=json.dumps(body).encode(),
                                             headers=[("authorization", f"Bearer {token}".encode())] if token else [])
        finally:
            await producer.stop()
        consumer = kafka_consumer(stack_settings, t.ANSWERS.name(stack_settings.topic_prefix),
                                  auto_offset_reset="earliest", group_id=None)
        await consumer.start()
        got: dict[str, dict[str, Any]] = {}
        try:
            end = time.monotonic() + 180
            while time.monotonic() < end and set(asks) - set(got):
                for recs in (await consumer.getmany(timeout_ms=500)).values():
                    for r in recs:
                        a = json.loads(opened(stack_settings, r.value))
                        if a["request_id"] in asks:
                            got[a["request_id"]] = a
        finally:
            await consumer.stop()
        return got

    got = asyncio.run(roundtrip())
    assert set(got) == set(asks)
    assert got["k-allowed"]["ok"] and got["k-allowed"]["packet"]["items"]
    assert [got[k]["error_kind"] for k in ("k-none", "k-wrong")] == ["invalid", "invalid"]
    forbidden, missing = got["k-forbidden"], got["k-missing"]
    assert forbidden["error_kind"] == missing["error_kind"] == "not_found"
    assert forbidden["error"] == missing["error"] and forbidden["latency_ms"] == missing["latency_ms"] == 0
