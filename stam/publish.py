"""Publishing record entries to the entries topic, keyed by patient id (keeps each patient in order)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import AIOKafkaProducer

from schemas import DeadLetter, RecordEntry
from stam.config import Settings
from stam.errors import SourceError
from stam.sources.fhir_ndjson import load_ndjson
from stam.sources.fhir_r4 import iter_bundle_files, load_bundle
from topology import topics as t
from topology.admin import bootstrap, ensure_topics


@dataclass
class PublishSummary:
    sent: int = 0
    skipped: int = 0
    dead_lettered: int = 0
    patients: set[str] = field(default_factory=set)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {"sent": self.sent, "skipped": self.skipped, "dead_lettered": self.dead_lettered,
                "patients": len(self.patients), "seconds": round(self.seconds, 3)}


class Publisher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
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
            futures.append(await self._producer.send(topic, key=entry.patient_id.encode(),
                                                     value=entry.model_dump_json().encode()))
            summary.sent += 1
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


def detect_format(path: Path) -> str:
    """``fhir-ndjson`` for .ndjson files or folders holding them, else ``fhir-bundle``."""
    if path.is_dir():
        return "fhir-ndjson" if any(path.glob("*.ndjson")) else "fhir-bundle"
    return "fhir-ndjson" if path.suffix == ".ndjson" else "fhir-bundle"


async def publish_paths(settings: Settings, paths: Iterable[str | Path], *, fmt: str = "auto",
                        rate: float | None = None,
                        progress: Callable[[int], None] | None = None) -> PublishSummary:
    """Publish files or folders, each in its detected (or given) format; bad input is dead-lettered."""
    summary = PublishSummary()
    started = time.monotonic()
    bundles: list[Path] = []
    ndjson: list[Path] = []
    for p in map(Path, paths):
        (ndjson if (detect_format(p) if fmt == "auto" else fmt) == "fhir-ndjson" else bundles).append(p)
    async with Publisher(settings) as pub:
        if ndjson:
            result = load_ndjson(ndjson)
            for bad in result.bad:
                await pub.dead_letter(bad.raw, "fhir-ndjson", SourceError(bad.error), summary, where=bad.source)
            summary.skipped += sum(result.skipped.values())
            await pub.send_entries(result.entries, summary, rate=rate, progress=progress)
        await _publish_bundles(pub, bundles, summary, rate=rate, progress=progress)
    summary.seconds = time.monotonic() - started
    return summary


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
        summary.skipped += sum(result.skipped.values())
        await pub.send_entries(result.entries, summary, rate=rate, progress=progress)
