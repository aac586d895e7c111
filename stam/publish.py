"""Publishing record entries to the entries topic, sealed for their patient and keyed by the patient's pseudonym
(``stam.crypto``: the same key keeps each patient in order, and erasing the patient's data key erases every copy)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, push_to_gateway
from pydantic import ValidationError

from schemas import DeadLetter, RecordEntry
from schemas.limits import MAX_ENTRY_BYTES
from stam.config import Settings
from stam.crypto import Sealer, sealer_for
from stam.deadletter_payload import bounded_value
from stam.deadletters import subject
from stam.errors import InputRefused, MessageTooLarge, SourceError
from stam.integrity import source_keys
from stam.metrics import DEAD_LETTERS
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult, detect, format_names, formats
from stam.transport import PRODUCER_BATCH_BYTES, kafka_producer
from topology import topics as t
from topology.admin import ensure_topics

log = logging.getLogger("stam.publish")

PUSH_JOB = "stam-publish"


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


PUBLISH_LINGER_MS = 20
"""How long the publisher's producer gathers entries into a batch before sending it (see ``Publisher``)."""

ACK_LINGER_MS = 5
"""The linger of a publisher whose every entry is awaited on its own before the sender hears back (the MLLP
listener: one message in flight per connection, acknowledged once its entries are on the topic): a lone entry
waits out the whole linger, so it stays short there."""


class Publisher:
    """Sends entries sealed for their patient and keyed by its pseudonym (``stam.crypto``); with
    ``source_system``, each is signed with that configured source's secret (headers ``stam-source``,
    ``stam-signature`` over the plaintext entry: stam/integrity.py)."""

    def __init__(self, settings: Settings, source_system: str | None = None, sealer: Sealer | None = None, *,
                 linger_ms: int = PUBLISH_LINGER_MS) -> None:
        self.settings = settings
        self._sealer = sealer
        self.source_system = source_system
        self._keys = source_keys(settings) if source_system else None
        if self._keys is not None and source_system is not None:
            self._keys.sign_headers(source_system, b"")  # an unknown source is refused before anything is sent
        # By default a 20 ms linger: on the embedded durable broker each batch is one S3 object (a PUT of the batch
        # and one of its partition's watermark, then a LIST and a GET for every reader), so fewer, larger batches
        # cost less. On the hospital feed at 400 entries/s (one fused worker, back to back with 5 ms) it halved the
        # entries topic's objects and cut SeaweedFS CPU per entry by a quarter and the latency with it
        # (docs/embedded-stack.md). The MLLP listener keeps 5 ms (ACK_LINGER_MS).
        self._producer = kafka_producer(settings, linger_ms=linger_ms, max_batch_size=PRODUCER_BATCH_BYTES,
                                        acks="all")

    async def __aenter__(self) -> Publisher:
        try:
            await ensure_topics(self.settings)
            await self._producer.start()
        except BaseException:
            await self._producer.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    @property
    def sealer(self) -> Sealer:
        """The deployment's key store, opened when the first entry goes out (not for a run that sends nothing)."""
        if self._sealer is None:
            self._sealer = sealer_for(self.settings)
        return self._sealer

    async def send_entries(self, entries: Iterable[RecordEntry], summary: PublishSummary, *,
                           rate: float | None = None, progress: Callable[[int], None] | None = None) -> None:
        topic = t.ENTRIES.name(self.settings.topic_prefix)
        start = time.monotonic()
        futures = []
        for entry in self._keyed(entries):
            if rate:
                wait = start + summary.sent / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            value = entry.model_dump_json().encode()
            # Sources build entries through the schema, but a copy with an updated field is not re-validated:
            # what goes out is checked against the schema's limits once more, as the extract stage will.
            problem: Exception | None = None
            if len(value) > MAX_ENTRY_BYTES:
                problem = MessageTooLarge(f"entry is {len(value):,} bytes serialized; the limit is {MAX_ENTRY_BYTES:,}")
            else:
                try:
                    RecordEntry.model_validate_json(value)
                except ValidationError as exc:
                    problem = exc
            if problem is not None:
                await self.dead_letter(value, entry.source, problem, summary, where=entry.source_ref)
                continue
            headers = (self._keys.sign_headers(self.source_system, value)
                       if self._keys is not None and self.source_system else None)
            futures.append(await self._producer.send(topic, key=self.sealer.message_key(entry.patient_id),
                                                     value=self.sealer.seal(entry.patient_id, value), headers=headers))
            summary.sent += 1
            summary.source(entry.source)["sent"] += 1
            summary.patients.add(entry.patient_id)
            if progress:
                progress(summary.sent)
        await asyncio.gather(*futures)

    def _keyed(self, entries: Iterable[RecordEntry], chunk: int = 512) -> Iterator[RecordEntry]:
        """The entries, in order, with every patient's data key made and durable before its first entry is sealed:
        keys are made for a chunk's new patients at once, then one wait for Redis's fsync (``KeyStore.durable``)."""
        it = iter(entries)
        while batch := list(islice(it, chunk)):
            for pid in dict.fromkeys(e.patient_id for e in batch):
                self.sealer.keys.key_for_sealing(pid)
            self.sealer.durable()
            yield from batch

    async def dead_letter(self, raw: bytes, source: str, exc: Exception, summary: PublishSummary, *,
                          where: str | None = None, file: str | None = None, line: int | None = None,
                          byte_offset: int | None = None) -> None:
        """Dead-letter one unit of input with its bytes (a bounded excerpt, digest and size when large, with
        ``file`` and ``line``/``byte_offset`` pointing to the whole); ``where`` (file, file:line) leads the
        error text."""
        error = f"{where}: {exc}" if where else str(exc)
        letter = DeadLetter(stage=f"publish:{source}", error_type=type(exc).__name__, error=error[:4000],
                            failed_at=datetime.now(UTC), source_file=file, source_line=line,
                            source_byte_offset=byte_offset,
                            **bounded_value(raw))
        value, key = letter.model_dump_json().encode(), None
        patient = subject(letter)[0]
        if patient is not None:  # an entry of a known patient: sealed for it, like the entry would have been
            key, value = self.sealer.message_key(patient), self.sealer.seal(patient, value)
            self.sealer.durable()
        await self._producer.send_and_wait(t.DEAD_LETTERS.name(self.settings.topic_prefix), key=key, value=value)
        summary.dead_lettered += 1
        summary.source(source)["dead_lettered"] += 1
        DEAD_LETTERS.labels(stage=f"publish:{source}", error_type=type(exc).__name__).inc()

    async def dead_letter_bad(self, bad: BadInput, source: str, summary: PublishSummary) -> None:
        await self.dead_letter(bad.raw, source, SourceError(bad.error), summary, where=bad.source, file=bad.file,
                               line=bad.line, byte_offset=bad.byte_offset)


FORMATS = ("auto", *format_names())
"""The ``--format`` choices: ``auto`` (detected per path), then the registered formats (``stam.sources.base``)."""


def detect_format(path: Path) -> str:
    """The name of the first registered format that claims an existing path (in order: ``mimic-iv`` for a
    MIMIC-IV folder (hosp/), ``fhir-ndjson`` for .ndjson files or folders holding them, ``hl7v2`` for .hl7
    files or folders holding them, or a file starting with ``MSH``), else ``fhir-bundle``."""
    return detect(path).name


async def publish_paths(settings: Settings, paths: Iterable[str | Path], *, fmt: str = "auto",
                        rate: float | None = None, progress: Callable[[int], None] | None = None,
                        subjects: Iterable[str] | None = None,
                        tables: Iterable[str] | None = None, source_system: str | None = None,
                        summary: PublishSummary | None = None) -> PublishSummary:
    """Publish files or folders, each in its detected (or given) format; bad input is dead-lettered.
    ``source_system``: sign every entry as this configured source system.

    ``subjects`` and ``tables`` select MIMIC-IV patients and tables (ignored by other formats). A path that
    does not exist, an empty file or a file that is no clinical input at all is refused first
    (:func:`check_paths`, ``InputRefused``), before anything is sent. ``summary`` (made when not given) is
    filled as entries are sent, so a caller interrupted midway knows how many were. Formats are published
    one after the other, in registry order.
    """
    summary = summary if summary is not None else PublishSummary()
    started = time.monotonic()
    groups: dict[str, list[Path]] = {}
    for p in map(Path, paths):
        groups.setdefault(detect_format(p) if fmt == "auto" and p.exists() else fmt, []).append(p)
    known = format_names()
    unknown = set(groups) - {"auto", *known}
    if unknown:
        raise SourceError(f"unknown format {sorted(unknown)}; known: {', '.join(known)}")
    check_paths([p for ps in groups.values() for p in ps])
    options = LoadOptions(subjects=tuple(map(str, subjects)) if subjects is not None else None,
                          tables=tuple(tables) if tables is not None else None)
    async with Publisher(settings, source_system=source_system) as pub:
        for source_format in formats():
            if source_format.name not in groups:
                continue
            for result in source_format.load(groups[source_format.name], options):
                await _publish_result(pub, result, source_format, summary, rate=rate, progress=progress)
    summary.seconds = time.monotonic() - started
    return summary


async def _publish_result(pub: Publisher, result: SourceResult, source_format: SourceFormat,
                          summary: PublishSummary, *, rate: float | None,
                          progress: Callable[[int], None] | None) -> None:
    """One batch of a source: its bad inputs dead-lettered, its skips counted, its own detail added to the
    summary (under the format's source name), then its entries sent."""
    source = source_format.source_name
    for bad in result.bad:
        await pub.dead_letter_bad(bad, source, summary)
    _skipped(summary, source, result.skipped)
    summary.source(source).update(result.detail())
    await pub.send_entries(result.entries, summary, rate=rate, progress=progress)


_BINARY = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"%PDF", b"PK\x03\x04", b"\x1f\x8b", b"BM", b"\x7fELF")


def _or(items: list[str]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def check_paths(paths: Iterable[Path]) -> None:
    """Refuse a user's own mistakes before anything is sent: a path that does not exist, an empty file, a
    folder with nothing to publish, a file that is no clinical input (an image, an archive, a README: a
    file without a suffix of a registered format (.json/.ndjson/.hl7...) that does not start like one: JSON,
    HL7). Malformed clinical input (bad JSON, wrong shape) is not refused here: it is dead-lettered with its
    reason."""
    registered = formats()
    by_name = sorted(registered, key=lambda f: f.name)
    suffixes = {s for f in registered for s in f.suffixes}
    signatures = tuple(s for f in registered for s in f.signatures)
    for p in paths:
        if not p.exists():
            raise InputRefused(f"{p}: no such file or folder")
        if p.is_dir():
            if not (any(f.detects(p, b"") for f in registered) or any(f.suffix in suffixes for f in p.iterdir())):
                folders = [f.label for f in by_name if not f.suffixes]
                raise InputRefused(f"{p}: folder holds no {_or([f.suffixes[0] for f in by_name if f.suffixes])} files"
                                   + (f" (nor {_or(folders)})" if folders else ""))
            continue
        with p.open("rb") as fh:
            head = fh.read(512)
        if not head.strip():
            raise InputRefused(f"{p}: empty file")
        if head.startswith(_BINARY):
            raise InputRefused(f"{p}: not clinical input (a binary file: image, archive or executable)")
        start = head.lstrip(b"\xef\xbb\xbf \t\r\n")
        if p.suffix.lower() not in suffixes and not start.startswith(signatures):
            raise InputRefused(f"{p}: not clinical input (expected {_or([f.label for f in by_name if f.suffixes])})")


def _skipped(summary: PublishSummary, source: str, skipped: dict[str, int]) -> None:
    summary.skipped += sum(skipped.values())
    summary.source(source)["skipped"] += sum(skipped.values())
    if skipped:
        summary.source(source)["skipped_detail"] = dict(skipped)


async def publish_bundles(settings: Settings, paths: Iterable[str | Path], *, rate: float | None = None,
                          progress: Callable[[int], None] | None = None) -> PublishSummary:
    return await publish_paths(settings, paths, fmt="fhir-bundle", rate=rate, progress=progress)


def report(settings: Settings, summary: PublishSummary, outcome: str, *, log_line: bool = True) -> None:
    """Make a run's counts visible after the process is gone: one structured log line at INFO (``extra`` fields
    in JSON logs, ``key=value`` in text), and with ``STAM_PUSHGATEWAY_URL`` the ``stam_publisher_*`` metrics
    pushed to a Prometheus Pushgateway (job ``stam-publish``, grouped by host; each run replaces the last).
    ``outcome``: ``ok``, ``dead_lettered``, ``interrupted`` or ``broker_unreachable``; ``log_line=False`` where the
    command's own one-line error already carries the counts. No patient identifier anywhere: patients are
    counted, not named."""
    counts = {"sent": summary.sent, "skipped": summary.skipped, "dead_lettered": summary.dead_lettered,
              "patients": len(summary.patients), "seconds": round(summary.seconds, 3)}
    if log_line:
        log.info("publish finished: outcome=%s %s", outcome, " ".join(f"{k}={v}" for k, v in counts.items()),
                 extra={"event": "publish_finished", "outcome": outcome, **counts,
                        "sources": {name: {k: v for k, v in src.items() if k in ("sent", "skipped", "dead_lettered")}
                                    for name, src in summary.sources.items()}})
    if settings.pushgateway_url:
        try:
            push_counts(settings.pushgateway_url, summary, outcome)
        except Exception as exc:  # noqa: BLE001 - the run itself is done; say why the push failed, in one line
            log.warning("publish counts not pushed to %s (%s: %s)", settings.pushgateway_url, type(exc).__name__,
                        " ".join(str(exc).split())[:200])


def publisher_registry(summary: PublishSummary, outcome: str) -> Any:
    """The ``stam_publisher_*`` metrics of one run, in a registry of their own (what is pushed)."""
    reg = CollectorRegistry()
    entries = Counter("stam_publisher_entries", "Entries of the last `stam publish` run, by source format and "
                      "outcome (sent, skipped, dead_lettered)", ["source", "outcome"], registry=reg)
    for name, src in summary.sources.items():
        for what in ("sent", "skipped", "dead_lettered"):
            entries.labels(source=name, outcome=what).inc(int(src.get(what, 0)))
    if not summary.sources:
        for what in ("sent", "skipped", "dead_lettered"):
            entries.labels(source="none", outcome=what).inc(0)
    Gauge("stam_publisher_patients", "Patients of the last `stam publish` run", registry=reg).set(
        len(summary.patients))
    Gauge("stam_publisher_seconds", "Duration of the last `stam publish` run", registry=reg).set(summary.seconds)
    Gauge("stam_publisher_last_run_timestamp_seconds", "When the last `stam publish` run ended",
          registry=reg).set_to_current_time()
    Gauge("stam_publisher_last_run_ok", "1 when the last `stam publish` run sent everything, else 0 (outcome "
          "label)", ["outcome"], registry=reg).labels(outcome=outcome).set(1 if outcome == "ok" else 0)
    return reg


def push_counts(url: str, summary: PublishSummary, outcome: str, *, timeout: float = 5.0) -> None:
    push_to_gateway(url, job=PUSH_JOB, registry=publisher_registry(summary, outcome),
                    grouping_key={"instance": socket.gethostname()}, timeout=timeout)
