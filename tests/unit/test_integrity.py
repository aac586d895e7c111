"""Source signatures and the source-identity rule of archival, function by function (stam/integrity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import Archive, AtomicMemory, Category, Coding, Reason, RecordEntry, Reference
from stam.errors import SignatureError, SourceConfigError
from stam.integrity import (
    SIGNATURE_HEADER,
    SOURCE_HEADER,
    SourceKeys,
    archive_refusal,
    load_source_keys,
)

KEYS = SourceKeys(secrets={"ehr-a": b"a" * 32, "lab-b": b"b" * 32}, require_signed=True)
VALUE = b'{"patient_id": "p1"}'


def test_a_signed_value_verifies_as_its_source() -> None:
    assert KEYS.verify(KEYS.sign_headers("ehr-a", VALUE), VALUE) == "ehr-a"
    assert KEYS.verify(dict(KEYS.sign_headers("lab-b", VALUE)), VALUE) == "lab-b"


@pytest.mark.parametrize("headers, value, why", [
    ([], VALUE, "unsigned entry"),
    (KEYS.sign_headers("ehr-a", VALUE), VALUE + b" ", "bad signature for source system 'ehr-a'"),
    ([(SOURCE_HEADER, b"lab-b"), KEYS.sign_headers("ehr-a", VALUE)[1]], VALUE, "bad signature"),
    ([(SOURCE_HEADER, b"nobody"), (SIGNATURE_HEADER, b"00")], VALUE, "not configured"),
    ([(SOURCE_HEADER, b"unsigned"), (SIGNATURE_HEADER, b"00")], VALUE, "not configured"),
    ([(SOURCE_HEADER, "\u00e9".encode()), (SIGNATURE_HEADER, b"00")], VALUE, "not ASCII"),
    ([KEYS.sign_headers("ehr-a", VALUE)[0]], VALUE, "exactly one"),
    (KEYS.sign_headers("ehr-a", VALUE) * 2, VALUE, "exactly one"),
])
def test_what_does_not_verify_is_refused_with_the_reason(headers: list, value: bytes, why: str) -> None:
    with pytest.raises(SignatureError, match=why):
        KEYS.verify(headers, value)


def test_unsigned_is_allowed_only_when_signing_is_not_required() -> None:
    relaxed = SourceKeys(secrets=KEYS.secrets, require_signed=False)
    assert relaxed.verify([], VALUE) is None
    assert relaxed.verify(None, VALUE) is None
    with pytest.raises(SignatureError, match="bad signature"):  # a bad signature is never waved through
        relaxed.verify(KEYS.sign_headers("ehr-a", VALUE), VALUE + b"x")


def test_configuration(tmp_path: Path) -> None:
    assert load_source_keys(None, None, None) == SourceKeys({}, False)
    assert load_source_keys(json.dumps({"ehr-a": "s" * 16}), None, None).require_signed
    assert not load_source_keys(json.dumps({"ehr-a": "s" * 16}), None, False).require_signed
    f = tmp_path / "sources.json"
    f.write_text(json.dumps({"lab-b": "t" * 20}))
    f.chmod(0o600)
    assert set(load_source_keys(json.dumps({"ehr-a": "s" * 16}), f, None).secrets) == {"ehr-a", "lab-b"}
    for bad in ("[1]", "{", json.dumps({"ehr-a": "short"}), json.dumps({"bad name": "s" * 16}),
                json.dumps({"unsigned": "s" * 16})):
        with pytest.raises(SourceConfigError):
            load_source_keys(bad, None, None)
    with pytest.raises(SourceConfigError, match="No such file"):
        load_source_keys(None, tmp_path / "missing.json", None)
    with pytest.raises(SourceConfigError, match="not configured"):
        KEYS.sign_headers("nobody", VALUE)


def _memory(mid: str, source: str | None, ref: str, code: str = "429007001") -> AtomicMemory:
    return AtomicMemory(memory_id=mid, patient_id="p1", entry_id=f"e-{mid}", position=0, category=Category.CONDITION,
                        text="Condition: History of cardiac arrest", concept=Coding(system="http://snomed.info/sct",
                        code=code), source_ref=ref, source_system=source)


def _entry(refs: tuple[Reference, ...] = ()) -> RecordEntry:
    return RecordEntry(patient_id="p1", entry_id="e-new", source="fhir-r4", text="x", references=refs)


@pytest.mark.parametrize("by, owner, new_ref, reason, refs, refused", [
    ("ehr-a", "ehr-a", "Condition/1", Reason.ENTERED_IN_ERROR, (), None),
    (None, None, "Condition/1", Reason.ENTERED_IN_ERROR, (), None),            # dev stack: all unsigned
    (None, "ehr-a", "Condition/1", Reason.ENTERED_IN_ERROR, (), "unsigned"),
    (None, "ehr-a", "Condition/9", Reason.SUPERSEDED, (), "unsigned"),         # not even by concept
    ("lab-b", "ehr-a", "Condition/1", Reason.ENTERED_IN_ERROR, (), "cannot retract"),
    ("lab-b", "ehr-a", "Condition/1", Reason.SUPERSEDED, (), "cannot amend"),  # a new version of its resource
    ("lab-b", "ehr-a", "Condition/9", Reason.STOPPED,
     (Reference(role="discontinues", target="Condition/1"),), "cannot amend"),
    ("lab-b", "ehr-a", "Condition/9", Reason.SUPERSEDED, (), None),            # a newer fact of the concept
    ("lab-b", None, "Condition/1", Reason.SUPERSEDED, (), "cannot amend"),
])
def test_archival_needs_the_facts_source_system(by: str | None, owner: str | None, new_ref: str, reason: Reason,
                                                refs: tuple[Reference, ...], refused: str | None) -> None:
    old = _memory("old", owner, "Condition/1")
    new = _memory("new", by, new_ref)
    why = archive_refusal(_entry(refs), new, old, Archive(memory_id="old", reason=reason))
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why
