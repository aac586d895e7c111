"""HL7 v2 messages (ADT, ORU/OUL, ORM/OML/OMG, RDE, RDS, PPR, MDM, VXU, BAR/DFT, REF) -> record entries.

Every message either maps to at least one :class:`RecordEntry` or becomes a :class:`BadInput` (the publisher
dead-letters it) whose reason starts with the message type, e.g. ``"SIU^S12 scheduling message ..."``. A
message that carries no clinical fact (scheduling, merges, demographics-only updates, account purges) is a
bad input, not a silent skip: :func:`parse_message` either returns entries or raises. ``Hl7Result.skipped``
counts *segments* of mapped messages that were deliberately left out (an OBX with no value, an embedded
image, a registry-administrative OBX...), by reason.

Rules (documented here because the publisher and the reasoner rely on them):

* Patient id: ``hl7v2:<authority>:<id>`` from the first PID-3 repetition with a non-empty CX.1 that is not a
  social-security number (CX.5 ``SS``); ``<authority>`` is CX.4's namespace id (HD.1), else its universal id
  (HD.2), else ``local``; ``:`` in the authority is percent-encoded. A message whose PID-3 yields no such
  identifier, or that names two different patients, is bad.
* Times: HL7 DTM ``YYYY[MM[DD[HH[MM[SS[.S...]]]]]][+/-ZZZZ]`` -> aware datetime; a time without an offset is
  taken as UTC. Up to four fraction digits directly after the seconds (``2004062916460000``) are read as a
  fraction. A malformed time in a field that is used makes the message bad.
* Codes: ``LN`` -> LOINC, ``SCT``/``SNOMED`` -> SNOMED CT, ``I10``/``I10C`` -> ICD-10-CM, ``I9``/``I9C`` ->
  ICD-9-CM, ``RXNORM`` -> RxNorm, ``NDC``, ``CVX``, ``MVX``, ``C4``/``CPT``, ``UCUM``, ``HL7nnnn`` -> the
  v2 table; any other named system -> ``urn:hl7v2:coding-system:<name>``; a code with no system is local to
  its sender: ``urn:hl7v2:local:<MSH-3>``.
* Entry ids: ``hl7v2:<source_ref>:<digest(MSH-10, segment position, mapped content)>``: replaying a message
  gives the same ids. ``recorded_at`` is MSH-7. ``attributes`` carry ``hl7_message`` (e.g. ``ORU^R01``),
  ``hl7_control_id``, ``hl7_segment`` and coded, non-identifying details; never names.
* Mapping by message family: ADT visit events -> ``Encounter`` (PV1; ``Encounter/<PV1-19>``; A03 finished,
  A05/A14 planned, cancel events A11/A23/A27/A38 ``entered-in-error`` so only that visit is retracted, other
  events in-progress or finished when PV1-45 is set) plus DG1 ``Condition``, AL1/IAM ``AllergyIntolerance``,
  PR1 ``Procedure``, OBX ``Observation``; ORU/OUL OBR -> ``DiagnosticReport`` with its OBX; ORM/OML/OMG OBR ->
  ``ServiceRequest``; RDE RXE (or RXO) -> ``MedicationRequest/<ORC-2|ORC-3>`` (status from ORC-1, else
  ORC-5; XO/XX/RP/RU with ORC-8 add a ``replaces`` reference); PPR PRB -> ``Condition/<PRB-4>`` (PC3 or
  PRB-1 DE -> resolved); MDM TXA + text OBX -> ``DocumentReference/<TXA-12>``; VXU RXA -> ``Immunization``
  (RXA-20 RE/NA -> not-done, RXA-21 D -> entered-in-error). OBX-11 X/N, OBX without a value, and non-text
  value types (ED, RP...) are skipped; OBX-11 D/W -> entered-in-error; NTE text goes to the entry it follows.
* Dispenses (RDS RXD) become ``MedicationStatement`` entries (the patient has the drug; category
  MEDICATION in the coded reasoner) with ``attributes["medication_event"] = "dispense"``.
* Refused whole (dead letters): SIU scheduling, ADT identity operations (A40/A41/A45/A47...), A29, BAR^P02,
  unsupported types, and messages whose segments yield no clinical fact (e.g. A28/A31 with PID/PV1 only).

Layout: ``tables`` (vocabulary and status tables), ``parsing`` (bytes -> segments), ``message`` (the header, the
patient and the helpers every segment is mapped with), one module per segment group (``visits``: PV1/DG1/PR1;
``allergies_problems``: AL1/IAM/PRB; ``results``: report OBR/OBX and MDM documents; ``orders``: order OBR and the
pharmacy/immunization segments of an ORC group), ``mapping`` (:class:`Mapper`: a message walked, segments -> entries)
and this module (files -> :class:`Hl7Result`, the ``FORMAT`` of the source registry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hl7.exceptions import ParseException
from pydantic import ValidationError

from schemas import RecordEntry
from stam.errors import SourceError
from stam.sources.base import BadInput, LoadOptions, SourceFormat, SourceResult, folder_has
from stam.sources.fhir_r4 import sort_clinically
from stam.sources.hl7v2.mapping import Mapper
from stam.sources.hl7v2.parsing import decode_message, parse_dtm, segments_of, split_messages
from stam.sources.hl7v2.tables import NDC, SOURCE

_EPOCH = datetime(1, 1, 1, tzinfo=UTC)

# What the hl7 library and our mapping can raise on malformed input; all of it becomes SourceError.
_FAULTS: tuple[type[Exception], ...] = (ParseException, ValueError, TypeError, KeyError, IndexError,
                                        AttributeError, AssertionError, OverflowError, RecursionError)


@dataclass
class Hl7Result(SourceResult):
    """Entries of HL7 v2 messages; ``skipped``: segments of mapped messages left out on purpose, by reason."""

    by_type: dict[str, dict[str, int]] = field(default_factory=dict)
    """Message type (``ORU^R01``) -> ``messages``, ``mapped``, ``entries``, ``bad``."""

    def detail(self) -> dict[str, Any]:
        return {"message_types": self.by_type}


class _Hl7Error(SourceError):
    """A SourceError that remembers the message type it was raised for (for the per-type counts)."""

    def __init__(self, reason: str, message_type: str = "unknown") -> None:
        super().__init__(reason)
        self.message_type = message_type


# --- public API -------------------------------------------------------------------------------------------

def _parse(raw: bytes) -> tuple[list[RecordEntry], dict[str, int], str]:
    mapper: Mapper | None = None
    try:
        segs = segments_of(decode_message(raw))
        mapper = Mapper(segs)
        entries = mapper.run()
    except SourceError as exc:
        mtype = mapper.mtype if mapper is not None else "unknown"
        reason = str(exc) if str(exc).startswith(mtype) or mtype == "unknown" else f"{mtype}: {exc}"
        raise _Hl7Error(reason, mtype) from exc
    except _FAULTS as exc:
        mtype = mapper.mtype if mapper is not None else "unknown"
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        detail = (f"entry failed validation: {first['loc']} {first['msg']}" if first is not None
                  else f"{type(exc).__name__}: {exc}")
        raise _Hl7Error(f"{mtype}: cannot be mapped: {detail}"[:2000], mtype) from exc
    return entries, mapper.skipped, mapper.mtype


def parse_message(raw: bytes, where: str) -> list[RecordEntry]:
    """Record entries of one HL7 v2 message (at least one, in clinical-time order), or SourceError with the
    reason (which starts with the message type when MSH-9 could be read)."""
    try:
        entries = _parse(raw)[0]
    except SourceError as exc:
        exc.add_note(f"HL7 v2 message from {where}")
        raise
    sort_clinically(entries)
    return entries


def hl7_files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in (".hl7", ".txt")))
        else:
            out.append(p)
    return out


def load_hl7(paths: Iterable[str | Path]) -> Hl7Result:
    """Entries of HL7 v2 files or folders (``*.hl7``, ``*.txt``) in the order their messages were sent (MSH-7; files
    in name order, then messages in file order, where times tie), each message's entries in clinical-time order; one
    file may hold several messages. Every message is counted once: mapped (>= 1 entry) or bad (dead letter).

    Messages, not clinical times, order a visit: an A03's and an A13's PV1 carry the visit's admit time, yet the
    discharge comes after the orders of the stay and its cancellation after the discharge."""
    result = Hl7Result()

    def count(mtype: str, key: str, n: int = 1) -> None:
        row = result.by_type.setdefault(mtype, {"messages": 0, "mapped": 0, "entries": 0, "bad": 0})
        row[key] += n

    for path in hl7_files(paths):
        try:
            data = path.read_bytes()
        except OSError as exc:
            result.bad.append(BadInput(path.name, b"", type(exc).__name__, f"cannot read file: {exc}",
                                       file=str(path)))
            count("unknown", "messages")
            count("unknown", "bad")
            continue
        messages = split_messages(data)
        if not messages:
            result.bad.append(BadInput(path.name, data, "SourceError", "file holds no HL7 message (empty)",
                                       file=str(path)))
            count("unknown", "messages")
            count("unknown", "bad")
            continue
        for index, raw in enumerate(messages, start=1):
            where = path.name if len(messages) == 1 else f"{path.name}:{index}"
            try:
                entries, skipped, mtype = _parse(raw)
            except _Hl7Error as exc:
                result.bad.append(BadInput(where, raw, "SourceError", str(exc)[:2000], file=str(path)))
                count(exc.message_type, "messages")
                count(exc.message_type, "bad")
                continue
            count(mtype, "messages")
            count(mtype, "mapped")
            count(mtype, "entries", len(entries))
            result.entries.extend(entries)
            for reason, n in skipped.items():
                result.skipped[reason] = result.skipped.get(reason, 0) + n
    result.entries.sort(key=lambda e: e.recorded_at or e.effective_at or _EPOCH)  # stable: ties keep file order
    return result


def _detects(path: Path, head: bytes) -> bool:
    if path.is_dir():
        return folder_has(path, "*.hl7")
    return path.suffix in (".hl7", ".hl7v2") or head.startswith(b"MSH")


def _load(paths: list[Path], options: LoadOptions) -> Iterator[SourceResult]:
    yield load_hl7(paths)


FORMAT = SourceFormat(name="hl7v2", detects=_detects, load=_load, label="HL7 v2", suffixes=(".hl7", ".hl7v2", ".txt"),
                      signatures=(b"MSH",))
"""HL7 v2: ``.hl7``/``.hl7v2`` files or a file starting with ``MSH``, or folders holding ``.hl7`` files (a
folder's ``.txt`` files are read too)."""


__all__ = ["FORMAT", "NDC", "SOURCE", "Hl7Result", "hl7_files", "load_hl7", "parse_dtm", "parse_message", "split_messages"]
