"""Dead letters an operator can see and handle, and the record gaps they leave in a patient's record.

A dead letter is identified by where it sits on the dead-letter topic: ``<partition>:<offset>`` (stable for
the topic's life). When a stage dead-letters an entry of a known patient (the payload's ``patient_id`` or
``entry.patient_id``, else the message key), the patient carries a :class:`RecordGap` next to its state
(``RedisStateStore.record_gap``): ``stam state`` and every evidence packet say the record is incomplete
until the entry is replayed and applied (the update stage removes the gap in the transaction that applies
the entry), or the gap is dismissed with a reason. A dead letter of no known patient (a publisher's bad
file, a message whose payload and key name no patient) leaves no gap; it is still listed.

``replay`` re-publishes a dead letter to the topic it came from: its original bytes when they pass that
topic's schema (the fault was outside the message: an outage, a bug since fixed), or a corrected payload
(``value``) that passes it. Bytes that fail the schema are refused: replaying them would only dead-letter
them again. A publisher's dead letter (a bad input file) is refused: fix the file and publish it again.
"""

from __future__ import annotations

import base64
import binascii
import getpass
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from schemas import DeadLetter, ExtractedEntry, ImpactedEntry, LinkedEntry, RecordEntry
from schemas.query import RecordGap
from stam.backends.redis_state import RedisStateStore
from stam.config import Settings
from stam.crypto import Sealer, sealer_for
from stam.errors import DeadLetterError, Erased, SealBroken, SourceConfigError
from stam.integrity import source_keys
from stam.transport import kafka_consumer
from topology import topics as t

MAX_ID = 512
"""Longest patient id a gap is recorded for (the wire schema's limit); a longer key names no patient."""

NO_GAP_STAGES = frozenset({"query"})
"""Stages whose dead letters are not record entries (a question that failed leaves no gap in a record)."""

STAGE_MODELS: dict[str, type[BaseModel]] = {
    t.ENTRIES.suffix: RecordEntry, t.EXTRACTED.suffix: ExtractedEntry, t.LINKED.suffix: LinkedEntry,
    t.IMPACTED.suffix: ImpactedEntry,
}


def letter_id(partition: int, offset: int) -> str:
    return f"{partition}:{offset}"


def parse_id(text: str) -> tuple[int, int]:
    part, sep, off = text.partition(":")
    if not sep or not part.isdigit() or not off.isdigit():
        raise DeadLetterError(f"not a dead letter id: {text!r} (expected PARTITION:OFFSET, as `stam deadletters "
                              "list` prints)")
    return int(part), int(off)


def _valid_id(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID and value.strip() else None


def _payload(letter: DeadLetter) -> Any:
    try:
        return json.loads(base64.b64decode(letter.value, validate=True))
    except (ValueError, binascii.Error, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None


def subject(letter: DeadLetter) -> tuple[str | None, str | None]:
    """(patient id, entry id) the dead letter is about, each None when it cannot be told. The payload's own
    ``patient_id`` (an entry) or ``entry.patient_id`` (a stage payload) first, else the message key."""
    payload = _payload(letter)
    patient = entry = None
    if isinstance(payload, dict):
        nested = payload.get("entry")
        inner: dict[str, Any] = nested if isinstance(nested, dict) else payload
        patient = _valid_id(inner.get("patient_id"))
        entry = _valid_id(inner.get("entry_id"))
    if patient is None and letter.key is not None and not letter.stage.startswith("publish:"):
        try:
            patient = _valid_id(base64.b64decode(letter.key, validate=True).decode("utf-8"))
        except (ValueError, binascii.Error):
            patient = None
    return patient, entry


def entry_ids(raw: Any) -> tuple[str, str] | None:
    """(patient id, entry id) of a stage payload's entry (raw JSON bytes), None when it does not say."""
    try:
        payload = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return None
    entry = payload.get("entry") if isinstance(payload, dict) else None
    if not isinstance(entry, dict):
        return None
    patient, entry_id = _valid_id(entry.get("patient_id")), _valid_id(entry.get("entry_id"))
    return (patient, entry_id) if patient and entry_id else None


def gap_of(letter: DeadLetter, dead_letter: str) -> tuple[str, RecordGap] | None:
    """The patient and the record gap a dead letter leaves; None when it leaves none (no known patient, a
    publisher's input, a query)."""
    if letter.stage in NO_GAP_STAGES or letter.stage.startswith("publish:"):
        return None
    patient, entry = subject(letter)
    if patient is None:
        return None
    source = (f"{letter.topic}/{letter.partition}/{letter.offset}" if letter.topic is not None else None)
    return patient, RecordGap(entry_id=entry, stage=letter.stage, error_type=letter.error_type,
                              error=letter.error[:300], dead_letter=dead_letter, source=source,
                              failed_at=letter.failed_at)


def gap_line(gaps: Sequence[RecordGap]) -> str | None:
    """The one line that tells a reader the record is incomplete, e.g. ``record gap: 1 entry not applied
    (extract, ValidationError), since 2026-11-23 21:40 UTC``; None without gaps."""
    if not gaps:
        return None
    causes = list(dict.fromkeys(f"{g.stage}, {g.error_type}" for g in gaps))
    shown = "; ".join(causes[:3]) + (f"; {len(causes) - 3} more" if len(causes) > 3 else "")
    since = min(g.failed_at for g in gaps).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    n = len(gaps)
    return f"record gap: {n} {'entry' if n == 1 else 'entries'} not applied ({shown}), since {since}"


# --- reading the dead-letter topic ------------------------------------------------------------------------

@dataclass
class Listed:
    """One record of the dead-letter topic, with what is known about it."""

    id: str
    letter: DeadLetter | None
    """None when the record is not a dead letter this version can read (``raw`` holds its bytes)."""
    raw: bytes = b""
    patient_id: str | None = None
    entry_id: str | None = None
    status: str = "open"
    handled: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        d = self.letter
        return {"id": self.id, "status": self.status, "stage": d.stage if d else None,
                "error_type": d.error_type if d else "unreadable", "error": (d.error[:200] if d else ""),
                "patient_id": self.patient_id, "entry_id": self.entry_id,
                "source": (f"{d.topic}/{d.partition}/{d.offset}" if d and d.topic is not None else None),
                "failed_at": d.failed_at.isoformat() if d else None, "handled": self.handled or None}


async def read_letters(settings: Settings, *, timeout_s: float = 10.0, sealer: Sealer | None = None) -> list[Listed]:
    """Every record of the dead-letter topic, from offset 0 of every partition to its end now. Sealed letters
    are opened (``sealer``: the deployment's, by default); those of erased patients are left out."""
    sealer = sealer or sealer_for(settings)
    # deferred: aiokafka is slow to import; topology.admin only on this path
    from aiokafka import TopicPartition

    from topology.admin import read_to_end

    topic = t.DEAD_LETTERS.name(settings.topic_prefix)
    consumer = kafka_consumer(settings, enable_auto_commit=False, group_id=None,
                              request_timeout_ms=int(timeout_s * 1000))
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or [])
        if not parts:
            await consumer.topics()
            parts = sorted(consumer.partitions_for_topic(topic) or [])
        if not parts:
            return []
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[Listed] = []
        async for r in read_to_end(consumer, tps):
            try:
                raw = sealer.open(r.value or b"")
            except Erased:
                continue
            except SealBroken:
                raw = r.value or b""
            out.append(_listed(r.partition, r.offset, raw))
        return sorted(out, key=lambda x: tuple(int(n) for n in x.id.split(":")))
    finally:
        await consumer.stop()


def _listed(partition: int, offset: int, raw: bytes) -> Listed:
    try:
        letter = DeadLetter.model_validate_json(raw)
    except ValidationError:
        return Listed(id=letter_id(partition, offset), letter=None, raw=raw, status="unreadable")
    patient, entry = subject(letter)
    if letter.stage.startswith("publish:") or letter.stage in NO_GAP_STAGES:
        patient = None
    return Listed(id=letter_id(partition, offset), letter=letter, raw=raw, patient_id=patient, entry_id=entry)


def with_status(letters: list[Listed], states: RedisStateStore) -> list[Listed]:
    """Fill each dead letter's status from the gaps and the operators' log (one read per patient):

    - ``open``: the patient's record has a gap for it; ``replayed``: replayed, not applied yet;
    - ``applied``: the gap was closed by applying the entry; ``dismissed``: closed by an operator;
    - ``superseded``: a later dead letter of the same entry holds the gap;
    - ``no gap (patient unknown)``: nothing in a record points at it (a publisher's bad file, no patient id).
    """
    gaps: dict[str, dict[str, RecordGap]] = {}
    logs: dict[str | None, dict[str, str]] = {}
    for item in letters:
        if item.letter is None:
            continue
        pid = item.patient_id
        if pid not in logs:
            logs[pid] = states.gap_log(pid)
        if item.id in logs[pid]:
            item.handled = json.loads(logs[pid][item.id])
        if pid is None:
            item.status = f"{item.handled['action']} (no gap: patient unknown)" if item.handled else \
                "no gap (patient unknown)"
            continue
        if pid not in gaps:
            gaps[pid] = {g.dead_letter: g for g in states.gaps(pid)}
        gap = gaps[pid].get(item.id)
        if gap is not None:
            item.status = "replayed" if gap.replayed_at is not None else "open"
        elif item.handled.get("action") == "dismissed":
            item.status = "dismissed"
        elif item.entry_id is not None and any(g.entry_id == item.entry_id for g in gaps[pid].values()):
            item.status = "superseded"
        else:
            item.status = "applied" if item.handled.get("action") == "replayed" else "closed"
    return letters


def find(letters: Sequence[Listed], dead_letter: str) -> Listed:
    parse_id(dead_letter)
    for item in letters:
        if item.id == dead_letter:
            return item
    raise DeadLetterError(f"no dead letter {dead_letter} on the dead-letter topic (see `stam deadletters list`)")


def show(item: Listed) -> dict[str, Any]:
    """Everything about one dead letter: its coordinates, error, and its value decoded (JSON when it is)."""
    out = item.summary()
    d = item.letter
    if d is None:
        out["raw"] = item.raw.decode("utf-8", errors="replace")
        return out
    out["error"] = d.error
    raw = base64.b64decode(d.value)
    payload = _payload(d)
    out["value"] = payload if payload is not None else raw.decode("utf-8", errors="replace")
    out["value_bytes"] = len(raw)
    out["key"] = base64.b64decode(d.key).decode("utf-8", errors="replace") if d.key is not None else None
    return out


# --- replay and dismiss -------------------------------------------------------------------------------------

def _who(by: str | None) -> str:
    if by:
        return by
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER") or "unknown"


@dataclass(frozen=True)
class Replay:
    topic: str
    patient_id: str
    value: bytes
    """The plaintext payload (sealed for the patient when published)."""
    entry_id: str | None
    corrected: bool


def plan_replay(item: Listed, settings: Settings, value: bytes | None = None) -> Replay:
    """What a replay publishes, or a DeadLetterError saying why it cannot."""
    d = item.letter
    if d is None:
        raise DeadLetterError(f"dead letter {item.id} is not readable as a dead letter; nothing to replay")
    if d.stage.startswith("publish:"):
        raise DeadLetterError(f"dead letter {item.id} is a publisher's bad input ({d.error_type}: "
                              f"{d.error[:120]}); it never reached a topic: fix the file and run `stam publish` "
                              "on it again, then dismiss this dead letter")
    if d.truncated and value is None:
        raise DeadLetterError(f"dead letter {item.id} holds only an excerpt of the message; replay a corrected "
                              "payload with --value-file")
    suffix = (d.topic or "").removeprefix(f"{settings.topic_prefix}.")
    model = STAGE_MODELS.get(suffix)
    if d.topic is None or model is None or d.topic != f"{settings.topic_prefix}.{suffix}":
        raise DeadLetterError(f"dead letter {item.id} came from {d.topic or 'no topic'} (stage {d.stage}); only "
                              "entries of the write path (" + ", ".join(STAGE_MODELS) + ") are replayed")
    body = value if value is not None else base64.b64decode(d.value)
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
        what = "the corrected payload" if value is not None else "its original bytes"
        fix = "" if value is not None else "; replay a corrected payload with --value-file"
        raise DeadLetterError(f"dead letter {item.id}: {what} fail the {model.__name__} schema ({where}: "
                              f"{first.get('msg')}){fix}") from None
    entry: RecordEntry = parsed if isinstance(parsed, RecordEntry) else parsed.entry  # type: ignore[attr-defined]
    if item.patient_id is not None and entry.patient_id != item.patient_id:
        raise DeadLetterError(f"the corrected payload is about another patient than dead letter {item.id}; "
                              "a replay may not move an entry between patients")
    if value is not None and item.entry_id is not None and entry.entry_id != item.entry_id:
        raise DeadLetterError(f"the corrected payload has entry_id {entry.entry_id!r}, the dead letter's entry is "
                              f"{item.entry_id!r}: keep the entry id (its gap closes when that entry is applied)")
    return Replay(topic=d.topic, patient_id=entry.patient_id, value=body, entry_id=entry.entry_id,
                  corrected=value is not None)


def signed(settings: Settings, plan: Replay, source_system: str | None) -> list[tuple[str, bytes]] | None:
    """Headers signing a replayed entry as ``source_system`` (where entries must be signed: the dead letter does
    not keep the original's headers). Only the entries topic verifies signatures."""
    if source_system is None:
        return None
    if plan.topic != t.ENTRIES.name(settings.topic_prefix):
        raise DeadLetterError("--source-system signs entries; this dead letter goes back to a stage topic, which "
                              "carries no signature")

    try:
        return source_keys(settings).sign_headers(source_system, plan.value)
    except SourceConfigError as exc:
        raise DeadLetterError(str(exc)) from None


async def publish_replay(settings: Settings, plan: Replay, headers: list[tuple[str, bytes]] | None = None,
                         sealer: Sealer | None = None) -> tuple[int, int]:
    """Send the replay, sealed for its patient and keyed by the patient's pseudonym like every STAM message, and
    wait until the broker has it: (partition, offset)."""
    sealer = sealer or sealer_for(settings)
    key, value = sealer.message_key(plan.patient_id), sealer.seal(plan.patient_id, plan.value)
    # deferred: topology.admin pulls in aiokafka
    from topology.admin import producer

    async with producer(settings) as out:
        md = await out.send_and_wait(plan.topic, key=key, value=value, headers=headers)
        return md.partition, md.offset


def record_replay(states: RedisStateStore, item: Listed, plan: Replay, sent: tuple[int, int],
                  by: str | None = None) -> dict[str, Any]:
    log = {"action": "replayed", "by": _who(by), "at": datetime.now(UTC).isoformat(),
           "to": f"{plan.topic}/{sent[0]}/{sent[1]}", "corrected": plan.corrected}
    if item.patient_id is not None:
        states.gap_replayed(item.patient_id, item.id, plan.entry_id, json.dumps(log))
    else:
        states.dismiss_gap(None, item.id, json.dumps(log))
    return log


def dismiss(states: RedisStateStore, item: Listed, reason: str, by: str | None = None) -> dict[str, Any]:
    """Close the dead letter's gap (if any) with a reason, keeping who and when."""
    if not reason.strip():
        raise DeadLetterError("a dismissal needs a reason (--reason)")
    if item.letter is None:
        raise DeadLetterError(f"dead letter {item.id} is not readable as a dead letter")
    log = {"action": "dismissed", "by": _who(by), "at": datetime.now(UTC).isoformat(), "reason": reason.strip()}
    closed = states.dismiss_gap(item.patient_id, item.id, json.dumps(log))
    return {**log, "gap_closed": closed is not None}
