"""Publishing record entries to the entries topic, keyed by patient id (keeps each patient in order)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas import DeadLetter, RecordEntry
from stam.config import Settings
from stam.errors import SourceError
from stam.integrity import source_keys
from stam.metrics import DEAD_LETTERS
from stam.sources.fhir_ndjson import load_ndjson
from stam.sources.fhir_r4 import iter_bundle_files, load_bundle
from stam.sources.mimic import MimicResult, is_mimic_root, iter_mimic
from topology import topics as t
from topology.admin import bootstrap, ensure_topics


@dataclass
class PublishSummary:
    sent: int = 0
    skipped: int = 0
    dead_lettered: int = 0
    patients: set[str] = field(default_factory=set)
    seconds: float = 0.0
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per source format: sent, skipped, dead_lettered, and the source's own detail (tables, message types)."""

    def source(self, name: str) -> dict[str, Any]:
        return self.sources.setdefault(name, {"sent": 0, "skipped": 0, "dead_lettered": 0})

    def as_dict(self) -> dict[str, object]:
        return {"sent": self.sent, "skipped": self.skipped, "dead_lettered": self.dead_lettered,
                "patients": len(self.patients), "seconds": round(self.seconds, 3), "sources": self.sources}


class Publisher:
    """Sends entries keyed by patient id; with ``source_system``, each is signed with that configured source's
    secret (headers ``stam-source``, ``stam-signature``: stam/integrity.py)."""

    def __init__(self, settings: Settings, source_system: str | None = None) -> None:
        self.settings = settings
        self.source_system = source_system
        self._keys = source_keys(settings) if source_system else None
        if self._keys is not None and source_system is not None:
            self._keys.sign_headers(source_system, b"")  # an unknown source is refused before anything is sent
        self._producer = AIOKafkaProducer(bootstrap_servers=bootstrap(settings), linger_ms=5,
                                          max_batch_size=256 * 1024, acks="all")

    async def __aenter__(self) -> Publisher:
        await ensure_topics(self.settings)
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    async def send_entries(self, entries: Iterable[RecordEntry], summary: PublishSummary, *,
                           rate: float | None = None, progress: Callable[[int], None] | None = None) -> None:
        topic = t.ENTRIES.name(self.settings.topic_prefix)
        start = time.monotonic()
        futures = []
        for entry in entries:
            if rate:
                wait = start + summary.sent / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            value = entry.model_dump_json().encode()
            headers = (self._keys.sign_headers(self.source_system, value)
                       if self._keys is not None and self.source_system else None)
            futures.append(await self._producer.send(topic, key=entry.patient_id.encode(), value=value,
                                                     headers=headers))
            summary.sent += 1
            summary.source(entry.source)["sent"] += 1
            summary.patients.add(entry.patient_id)
            if progress:
                progress(summary.sent)
        await asyncio.gather(*futures)

    async def dead_letter(self, raw: bytes, source: str, exc: Exception, summary: PublishSummary, *,
                          where: str | None = None) -> None:
        """Dead-letter one unit of input with its bytes; ``where`` (file, file:line) leads the error text."""
        error = f"{where}: {exc}" if where else str(exc)
        letter = DeadLetter(stage=f"publish:{source}", value=base64.b64encode(raw).decode(),
                            error_type=type(exc).__name__, error=error[:4000], failed_at=datetime.now(UTC))
        await self._producer.send_and_wait(t.DEAD_LETTERS.name(self.settings.topic_prefix),
                                           value=letter.model_dump_json().encode())
        summary.dead_lettered += 1
        summary.source(source)["dead_lettered"] += 1
        DEAD_LETTERS.labels(stage=f"publish:{source}", error_type=type(exc).__name__).inc()


FORMATS = ("auto", "fhir-bundle", "fhir-ndjson", "hl7v2", "mimic-iv")


def detect_format(path: Path) -> str:
    """``mimic-iv`` for a MIMIC-IV folder (hosp/, icu/), ``fhir-ndjson`` for .ndjson files or folders holding
    them, ``hl7v2`` for .hl7 files or folders holding them (or a file starting with ``MSH``), else
    ``fhir-bundle``."""
    if path.is_dir():
        if is_mimic_root(path):
            return "mimic-iv"
        if any(path.glob("*.ndjson")):
            return "fhir-ndjson"
        return "hl7v2" if any(path.glob("*.hl7")) else "fhir-bundle"
    if path.suffix == ".ndjson":
        return "fhir-ndjson"
    if path.suffix in (".hl7", ".hl7v2"):
        return "hl7v2"
    try:
        with path.open("rb") as fh:
            head = fh.read(3)
    except OSError:
        return "fhir-bundle"
    return "hl7v2" if head == b"MSH" else "fhir-bundle"


async def publish_paths(settings: Settings, paths: Iterable[str | Path], *, fmt: str = "auto",
                        rate: float | None = None, progress: Callable[[int], None] | None = None,
                        subjects: Iterable[str] | None = None,
                        tables: Iterable[str] | None = None, source_system: str | None = None) -> PublishSummary:
    """Publish files or folders, each in its detected (or given) format; bad input is dead-lettered.
    ``source_system``: sign every entry as this configured source system.

    ``subjects`` and ``tables`` select MIMIC-IV patients and tables (ignored by other formats).
    """
    summary = PublishSummary()
    started = time.monotonic()
    groups: dict[str, list[Path]] = {}
    for p in map(Path, paths):
        groups.setdefault(detect_format(p) if fmt == "auto" else fmt, []).append(p)
    unknown = set(groups) - set(FORMATS)
    if unknown:
        raise SourceError(f"unknown format {sorted(unknown)}; known: {', '.join(FORMATS[1:])}")
    async with Publisher(settings, source_system=source_system) as pub:
        if "fhir-ndjson" in groups:
            result = load_ndjson(groups["fhir-ndjson"])
            for bad in result.bad:
                await pub.dead_letter(bad.raw, "fhir-ndjson", SourceError(bad.error), summary, where=bad.source)
            _skipped(summary, "fhir-ndjson", result.skipped)
            await pub.send_entries(result.entries, summary, rate=rate, progress=progress)
        if "hl7v2" in groups:
            from stam.sources.hl7v2 import load_hl7

            hl7 = load_hl7(groups["hl7v2"])
            for bad in hl7.bad:
                await pub.dead_letter(bad.raw, "hl7v2", SourceError(bad.error), summary, where=bad.source)
            _skipped(summary, "hl7v2", hl7.skipped)
            summary.source("hl7v2")["message_types"] = hl7.by_type
            await pub.send_entries(hl7.entries, summary, rate=rate, progress=progress)
        for root in groups.get("mimic-iv", []):
            mimic = MimicResult()
            for entries in iter_mimic(root, subjects=subjects, tables=tables, result=mimic):
                await pub.send_entries(entries, summary, rate=rate, progress=progress)
            for bad in mimic.bad:
                await pub.dead_letter(bad.raw, "mimic-iv", SourceError(bad.error), summary, where=bad.source)
            summary.source("mimic-iv")["tables"] = mimic.counts()
        await _publish_bundles(pub, groups.get("fhir-bundle", []), summary, rate=rate, progress=progress)
    summary.seconds = time.monotonic() - started
    return summary


def _skipped(summary: PublishSummary, source: str, skipped: dict[str, int]) -> None:
    summary.skipped += sum(skipped.values())
    summary.source(source)["skipped"] += sum(skipped.values())
    if skipped:
        summary.source(source)["skipped_detail"] = dict(skipped)


async def publish_bundles(settings: Settings, paths: Iterable[str | Path], *, rate: float | None = None,
                          progress: Callable[[int], None] | None = None) -> PublishSummary:
    return await publish_paths(settings, paths, fmt="fhir-bundle", rate=rate, progress=progress)


async def _publish_bundles(pub: Publisher, paths: Iterable[Path], summary: PublishSummary, *,
                           rate: float | None, progress: Callable[[int], None] | None) -> None:
    for path in iter_bundle_files(paths):
        try:
            result = load_bundle(path)
        except SourceError as exc:
            await pub.dead_letter(Path(path).read_bytes() if Path(path).is_file() else b"", "fhir-r4", exc,
                                  summary, where=Path(path).name)
            continue
        _skipped(summary, "fhir-r4", result.skipped)
        await pub.send_entries(result.entries, summary, rate=rate, progress=progress)
