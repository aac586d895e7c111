"""The source-format registry (stam.sources.base): each built-in format claims its own shared-data samples and
no other format does; a format registered later is detected, accepted and published without touching
stam/publish.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas import RecordEntry
from stam import publish
from stam.errors import InputRefused
from stam.sources import base
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult
from tests.conftest import DATA

SAMPLES = {
    "fhir-bundle": ["synthea-r4-bundles", "synthea-r4-bundles/7bf5504f-bb24-43e0-b58f-f9c7d8a7a9aa.json"],
    "fhir-ndjson": ["synthea-bulk-10p", "synthea-bulk-10p/Condition.000.ndjson"],
    "hl7v2": ["hl7v2-samples", "hl7v2-samples/ADT-A01-01.hl7", "hl7v2-samples/LAB-ORU-1.hl7"],
    "mimic-iv": ["mimic-iv-demo-2.2"],
}


def test_the_built_in_formats_in_detection_order() -> None:
    assert [f.name for f in base.formats()] == ["mimic-iv", "fhir-ndjson", "hl7v2", "fhir-bundle"]
    assert publish.FORMATS == ("auto", "fhir-bundle", "fhir-ndjson", "hl7v2", "mimic-iv")
    assert base.get_format("fhir-bundle").source_name == "fhir-r4"  # its dead letters say publish:fhir-r4


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_format_claims_its_samples_and_no_other_does(name: str) -> None:
    for rel in SAMPLES[name]:
        path = DATA / rel
        if not path.exists():
            pytest.skip(f"shared data not found at {path}")
        head = base.read_head(path)
        assert [f.name for f in base.formats() if f.detects(path, head)] == [name], rel
        assert publish.detect_format(path) == name
        publish.check_paths([path])


def test_what_no_format_claims_falls_back_to_a_bundle(tmp_path: Path) -> None:
    odd = tmp_path / "export"
    odd.write_text('{"resourceType": "Bundle"}')
    assert [f.name for f in base.formats() if f.detects(odd, base.read_head(odd))] == []
    assert publish.detect_format(odd) == base.FALLBACK == "fhir-bundle"


def _entry(n: int) -> RecordEntry:
    return RecordEntry(patient_id="p1", entry_id=f"vitals:{n}", source="vitals-csv", source_ref=f"Observation/{n}",
                       resource_type="Observation", text=f"pulse {60 + n}")


def _load_vitals(paths: list[Path], options: LoadOptions) -> Iterator[SourceResult]:
    for path in paths:
        lines = path.read_bytes().splitlines()
        result = SourceResult(skipped={"header": 1})
        for n, line in enumerate(lines[1:], start=2):
            if line.startswith(b"pulse,"):
                result.entries.append(_entry(n))
            else:
                result.bad.append(BadInput(f"{path.name}:{n}", line, "SourceError", "not a pulse row",
                                           file=str(path), line=n))
        yield result


@pytest.fixture()
def vitals() -> Iterator[SourceFormat]:
    fmt = base.register(SourceFormat(
        name="vitals-csv", label="a vitals CSV", suffixes=(".vitals",), signatures=(b"kind,value",),
        detects=lambda path, head: path.suffix == ".vitals" or head.startswith(b"kind,value"), load=_load_vitals))
    try:
        yield fmt
    finally:
        base.unregister("vitals-csv")
    assert "vitals-csv" not in base.format_names()


class _FakePublisher:
    """Publisher's interface without a broker: records what would be sent and dead-lettered."""

    sent: list[RecordEntry] = []
    letters: list[tuple[str, BadInput]] = []

    def __init__(self, settings: Any, source_system: str | None = None) -> None:
        pass

    async def __aenter__(self) -> _FakePublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def dead_letter_bad(self, bad: BadInput, source: str, summary: publish.PublishSummary) -> None:
        self.letters.append((source, bad))
        summary.dead_lettered += 1
        summary.source(source)["dead_lettered"] += 1

    async def send_entries(self, entries: Any, summary: publish.PublishSummary, **_: Any) -> None:
        for e in entries:
            self.sent.append(e)
            summary.sent += 1
            summary.source(e.source)["sent"] += 1


def test_a_registered_format_is_detected_checked_and_published(vitals: SourceFormat, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "ward.vitals"
    a.write_text("kind,value\npulse,72\ntemp,37.1\npulse,80\n")
    b = tmp_path / "no-suffix"
    b.write_text("kind,value\npulse,64\n")
    assert publish.detect_format(a) == publish.detect_format(b) == "vitals-csv"
    assert "vitals-csv" in base.format_names()
    publish.check_paths([a, b])  # its suffix and its signature are clinical input now
    readme = tmp_path / "README"
    readme.write_text("# hi")
    with pytest.raises(InputRefused, match=r"expected a FHIR JSON bundle, FHIR NDJSON, HL7 v2 or a vitals CSV\)$"):
        publish.check_paths([readme])

    monkeypatch.setattr(publish, "Publisher", _FakePublisher)
    monkeypatch.setattr(_FakePublisher, "sent", [])
    monkeypatch.setattr(_FakePublisher, "letters", [])
    summary = asyncio.run(publish.publish_paths(None, [a, b]))  # type: ignore[arg-type]
    assert [e.entry_id for e in _FakePublisher.sent] == ["vitals:2", "vitals:4", "vitals:2"]
    assert [(s, bad.source, bad.raw) for s, bad in _FakePublisher.letters] == [("vitals-csv", "ward.vitals:3",
                                                                                b"temp,37.1")]
    assert summary.sent == 3 and summary.dead_lettered == 1 and summary.skipped == 2
    assert summary.sources["vitals-csv"]["skipped"] == 2

    with pytest.raises(ValueError, match="already registered"):
        base.register(vitals)


def test_an_unknown_format_is_refused_with_the_known_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(publish, "Publisher", _FakePublisher)
    f = tmp_path / "a.json"
    f.write_text("{}")
    from stam.errors import SourceError

    with pytest.raises(SourceError, match=r"unknown format \['csv'\]; known: fhir-bundle, fhir-ndjson, hl7v2, "
                                          r"mimic-iv$"):
        asyncio.run(publish.publish_paths(None, [f], fmt="csv"))  # type: ignore[arg-type]


def test_refusals_name_every_registered_format(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputRefused, match=r"folder holds no \.json, \.ndjson or \.hl7 files \(nor a MIMIC-IV "
                                           r"hosp/\)$"):
        publish.check_paths([tmp_path / "empty"])
    readme = tmp_path / "README.md"
    readme.write_text("# notes")
    with pytest.raises(InputRefused, match=r"not clinical input \(expected a FHIR JSON bundle, FHIR NDJSON or "
                                           r"HL7 v2\)$"):
        publish.check_paths([readme])
