"""Malformed and hostile inputs, for the tests and the chaos harness.

``hostile_inputs(n, seed)``: raw values for the entries topic, as ``(kind, bytes)``: random bytes, truncated
JSON, arrays and scalars, wrong types, missing fields, naive or reversed timestamps, invalid UTF-8, deep
nesting, text and entries over the limits, hostile ids (glob, brace, colon, quote, backslash, ``:outbox:``,
unicode, control characters, too long) and valid entries that carry hostile but legal ids. Every input is
either a legal entry (the worker applies it) or is dead-lettered with a reason; ``expected(kind)`` says which.
Entry ids are unique per input (``hostile-<seed>-<i>``) so an applied input can be found on the transitions
topic; a dead-lettered one is found by the sha256 of its bytes (``value_sha256``) or the entry id inside it.

``hostile_files(dir, n, seed)``: malformed files for ``stam publish`` (non-UTF-8, deep nesting, arrays and
scalars, ``"entry": null``, truncated JSON, NDJSON with one bad line among good ones, an invalid bundle over
the dead-letter limit, hostile ids, broken HL7), as ``(kind, path)``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SNOMED = "http://snomed.info/sct"
CONCEPTS = [("38341003", "Hypertensive disorder"), ("44054006", "Diabetes mellitus type 2"),
            ("195662009", "Acute viral pharyngitis"), ("10509002", "Acute bronchitis"),
            ("271737000", "Anemia"), ("55822004", "Hyperlipidemia")]

# Legal under the schema (printable ASCII) but meaningful to a store: globs, hash-tag braces, the outbox
# marker, quotes and backslashes (Milvus filters), percent signs (the key escape itself).
LEGAL_HOSTILE_IDS = ["[a-z]*", "*", "?", "x:outbox:y", "{p}", "a}b{c", 'q" or patient_id != "', "back\\slash",
                     "%41", "p'1", "a b", "../../etc", "MATCH *", "p\\*", "^x$"]
# Refused by the schema: non-ASCII, control characters, surrounding space, over 128 characters, empty.
ILLEGAL_IDS = ["ünïcode", "😀", "p\nq", "p\x00q", " p", "p ", "x" * 129, "", "\t"]

APPLIED_KINDS = frozenset({"legal_hostile_id", "nested_ok", "unicode_text"})


def expected(kind: str) -> str:
    """``applied`` or ``dead_letter``: what the write path must do with an input of this kind."""
    return "applied" if kind in APPLIED_KINDS else "dead_letter"


def entry_dict(patient_id: str, entry_id: str, rng: random.Random, **extra: Any) -> dict[str, Any]:
    code, display = rng.choice(CONCEPTS)
    d: dict[str, Any] = {"patient_id": patient_id, "entry_id": entry_id, "source": "hostile",
                         "resource_type": "Condition", "status": "active",
                         "effective_at": f"20{rng.randint(10, 24)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}T08:00:00Z",
                         "codes": [{"system": SNOMED, "code": code, "display": display}]}
    d.update(extra)
    return d


def _dump(d: Any) -> bytes:
    return json.dumps(d, ensure_ascii=False).encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def hostile_inputs(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` raw values for the entries topic, kinds in rotation, deterministic for a seed."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []
    makers = [
        "random_bytes", "truncated_json", "not_object", "wrong_types", "missing_fields", "naive_time",
        "reversed_time", "invalid_utf8", "deep_nesting", "huge_text", "oversized_entry", "illegal_id",
        "illegal_entry_id", "legal_hostile_id", "nested_ok", "unknown_field", "empty", "unicode_text",
        "no_content", "long_key",
    ]
    for i in range(n):
        kind = makers[i % len(makers)]
        eid = f"hostile-{seed}-{i}"
        pid = f"hostile-patient-{rng.randint(0, 9)}"
        if kind == "random_bytes":
            raw = rng.randbytes(rng.randint(1, 2048))
        elif kind == "truncated_json":
            full = _dump(entry_dict(pid, eid, rng))
            raw = full[: rng.randint(1, len(full) - 1)]
        elif kind == "not_object":
            raw = rng.choice([b"[]", b"[1,2,3]", b"42", b"null", b'"a string"', b"true",
                              _dump([entry_dict(pid, eid, rng)])])
        elif kind == "wrong_types":
            d = entry_dict(pid, eid, rng)
            field, value = rng.choice([("patient_id", 12345), ("codes", "not a list"), ("entry_id", None),
                                       ("effective_at", "yesterday"), ("text", {"a": 1}), ("codes", [1, 2]),
                                       ("attributes", []), ("value", "7 mg")])
            d[field] = value
            raw = _dump(d)
        elif kind == "missing_fields":
            d = entry_dict(pid, eid, rng)
            del d[rng.choice(["patient_id", "entry_id", "source"])]
            raw = _dump(d)
        elif kind == "naive_time":
            raw = _dump(entry_dict(pid, eid, rng, effective_at="2020-01-01T08:00:00"))
        elif kind == "reversed_time":
            raw = _dump(entry_dict(pid, eid, rng, effective_at="2020-01-02T08:00:00Z",
                                   effective_end="2020-01-01T08:00:00Z"))
        elif kind == "invalid_utf8":
            raw = _dump(entry_dict(pid, eid, rng, text="PLACEHOLDER")).replace(b"PLACEHOLDER", b"\xff\xfe\xc3(")
        elif kind == "deep_nesting":
            raw = _dump(entry_dict(pid, eid, rng)).replace(b'"source": "hostile"',
                                                           b'"source": "hostile", "attributes": {"x": '
                                                           + _nested(rng.randint(300, 5000)).encode() + b"}")
        elif kind == "huge_text":
            raw = _dump(entry_dict(pid, eid, rng, text="a" * rng.randint(100_001, 200_000)))
        elif kind == "oversized_entry":  # the reproduction 1: a display far over the entry limit
            d = entry_dict(pid, eid, rng)
            d["codes"][0]["display"] = "d" * rng.randint(270_000, 700_000)
            raw = _dump(d)
        elif kind == "illegal_id":
            raw = _dump(entry_dict(rng.choice(ILLEGAL_IDS + ["p" * rng.randint(257, 600)]), eid, rng))
        elif kind == "illegal_entry_id":
            raw = _dump(entry_dict(pid, rng.choice(["é" + eid, eid + "\n", "x" * 300]), rng))
        elif kind == "legal_hostile_id":
            raw = _dump(entry_dict(rng.choice(LEGAL_HOSTILE_IDS), eid, rng))
        elif kind == "nested_ok":
            raw = _dump(entry_dict(pid, eid, rng, attributes={"x": json.loads(_nested(rng.randint(2, 40)))}))
        elif kind == "unknown_field":
            raw = _dump(entry_dict(pid, eid, rng, surprise=True))
        elif kind == "empty":
            raw = b""
        elif kind == "unicode_text":
            raw = _dump(entry_dict(pid, eid, rng, text="Fièvre 39°C, 咳嗽, 😷 " + "ü" * rng.randint(1, 50)))
        elif kind == "no_content":
            d = entry_dict(pid, eid, rng)
            d["codes"] = []
            raw = _dump(d)
        else:  # long_key: an otherwise bad value under a key far larger than any id
            raw = b"{" + rng.randbytes(64)
        out.append((kind, raw))
    return out


def hostile_key(kind: str, raw: bytes) -> bytes:
    """The Kafka key to publish an input with: its patient id when it has a readable one, else bytes."""
    if kind == "long_key":
        return b"k" * 5000
    try:
        d = json.loads(raw)
        if isinstance(d, dict) and isinstance(d.get("patient_id"), str):
            return str(d["patient_id"]).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        pass
    return b"hostile"


def _bundle(patient_id: str, resources: list[dict[str, Any]]) -> dict[str, Any]:
    return {"resourceType": "Bundle", "type": "collection",
            "entry": [{"fullUrl": f"urn:uuid:{patient_id}", "resource": {"resourceType": "Patient", "id": patient_id}},
                      *({"fullUrl": f"urn:uuid:{r['id']}", "resource": r} for r in resources)]}


def _condition(rid: str, patient_id: str, code: str = "38341003", display: str = "Hypertensive disorder") -> dict[str, Any]:
    return {"resourceType": "Condition", "id": rid, "subject": {"reference": f"Patient/{patient_id}"},
            "code": {"coding": [{"system": SNOMED, "code": code, "display": display}]},
            "onsetDateTime": "2020-01-01T00:00:00Z"}


def hostile_files(directory: str | Path, n: int, seed: int = 0) -> list[tuple[str, Path]]:
    """Write ``n`` malformed input files under ``directory`` (kinds in rotation); return ``(kind, path)``.
    Every file is clinical-looking (so ``stam publish`` takes it) and holds at least one unit that must be
    dead-lettered; NDJSON files also hold good lines that must be published."""
    rng = random.Random(seed)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kinds = ["non_utf8", "deep_nesting", "json_array", "json_scalar", "entry_null", "entry_items_not_objects",
             "truncated", "ndjson_one_bad_line", "ndjson_deep_line", "large_invalid_bundle", "long_patient_id",
             "unicode_patient_id", "huge_display", "hl7_broken", "resource_not_object"]
    out: list[tuple[str, Path]] = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        pid = f"hf-{seed}-{i}"
        suffix = ".ndjson" if kind.startswith("ndjson") else ".hl7" if kind.startswith("hl7") else ".json"
        path = root / f"{i:05d}-{kind}{suffix}"
        good = _bundle(pid, [_condition(f"c-{seed}-{i}", pid)])
        if kind == "non_utf8":
            data = json.dumps(good).encode().replace(b"Hypertensive", b"Hyper\xff\xfetensive")
        elif kind == "deep_nesting":
            data = b'{"resourceType": "Bundle", "entry": ' + _nested(rng.randint(5_000, 100_000)).encode() + b"}"
        elif kind == "json_array":
            data = json.dumps([good]).encode()
        elif kind == "json_scalar":
            data = rng.choice([b"42", b'"Bundle"', b"null", b"true"])
        elif kind == "entry_null":
            data = json.dumps({"resourceType": "Bundle", "type": "collection", "entry": None}).encode()
        elif kind == "entry_items_not_objects":
            data = json.dumps({"resourceType": "Bundle", "type": "collection", "entry": [1, "x", None]}).encode()
        elif kind == "truncated":
            full = json.dumps(good).encode()
            data = full[: rng.randint(1, len(full) - 1)]
        elif kind == "ndjson_one_bad_line":
            lines = [json.dumps(_condition(f"n-{seed}-{i}-{j}", pid)).encode() for j in range(3)]
            lines.insert(1, b'{"resourceType": "Condition", "id": "bad", "onsetDateTime": 17')
            data = b"\n".join(lines) + b"\n"
        elif kind == "ndjson_deep_line":
            lines = [json.dumps(_condition(f"n-{seed}-{i}-{j}", pid)).encode() for j in range(2)]
            lines.insert(1, _nested(rng.randint(5_000, 50_000)).encode())
            data = b"\n".join(lines) + b"\n"
        elif kind == "large_invalid_bundle":  # over the dead-letter limit, and over the broker's message limit
            bad = _bundle(pid, [_condition(f"c-{seed}-{i}-{j}", pid) for j in range(4000)])
            bad["entry"][1]["resource"]["onsetDateTime"] = 17  # invalid
            data = json.dumps(bad).encode()
        elif kind == "long_patient_id":
            long_id = "p" * 300
            data = json.dumps(_bundle(long_id, [_condition(f"c-{seed}-{i}", long_id)])).encode()
        elif kind == "unicode_patient_id":
            uid = "ünï-" + pid
            data = json.dumps(_bundle(uid, [_condition(f"c-{seed}-{i}", uid)]), ensure_ascii=False).encode()
        elif kind == "huge_display":  # the reproduction 1, as a file
            data = json.dumps(_bundle(pid, [_condition(f"c-{seed}-{i}", pid, display="d" * 300_000)])).encode()
        elif kind == "hl7_broken":
            data = b"MSH|^~\\&|X|Y|||20200101||ADT^A01|1|P|2.5\rPID|||\xff\xfe||\rOBX|garbage"
        else:  # resource_not_object
            data = json.dumps({"resourceType": "Bundle", "type": "collection",
                               "entry": [{"resource": "Condition/1"}, {"resource": [1]}]}).encode()
        path.write_bytes(data)
        out.append((kind, path))
    return out
