"""HL7 v2 bytes -> segments: decoding (MSH-18 character sets, UTF-16 BOMs), splitting a file into messages,
separators checked, fields unescaped into :class:`Segment` (``[field][repetition][component][subcomponent]``),
and HL7 DTM times."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import hl7

from stam.errors import SourceError
from stam.ids import digest
from stam.sources.hl7v2.tables import (
    BLANK,
    CHARSETS,
    DTM_PATTERN,
    ENVELOPE,
    MAX_ID,
    MSH_START,
    SEGMENT_ID,
    UNESCAPE_MAP,
    Reps,
)

# --- one parsed segment -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """One segment, fields as [field][repetition][component][subcomponent] strings, already unescaped."""

    name: str
    fields: tuple[Reps, ...]  # fields[0] is the segment id; MSH-n is fields[n] as for every segment
    pos: int

    def reps(self, n: int) -> Reps:
        return self.fields[n] if 0 < n < len(self.fields) else ()

    def get(self, n: int, comp: int = 1, sub: int = 1, rep: int = 1) -> str:
        reps = self.reps(n)
        if rep > len(reps) or comp > len(reps[rep - 1]):
            return ""
        subs = reps[rep - 1][comp - 1]
        return subs[sub - 1].strip() if sub <= len(subs) else ""

    def text(self, n: int, rep: int = 1) -> str:
        """A whole repetition as text (components joined with ``^``), for free-text fields."""
        reps = self.reps(n)
        if rep > len(reps):
            return ""
        return "^".join("&".join(subs) for subs in reps[rep - 1]).strip("^ ")

    def texts(self, n: int) -> list[str]:
        return [t for t in (self.text(n, i) for i in range(1, len(self.reps(n)) + 1)) if t.strip()]

    def comps(self, n: int, rep: int = 1) -> tuple[tuple[str, ...], ...]:
        reps = self.reps(n)
        return reps[rep - 1] if rep <= len(reps) else ()


def component(comps: Sequence[Sequence[str]], i: int, joined: bool = False) -> str:
    if i > len(comps):
        return ""
    subs = comps[i - 1]
    return ("&".join(subs) if joined else (subs[0] if subs else "")).strip()


# --- low-level helpers ------------------------------------------------------------------------------------

def safe_id(value: str) -> str:
    value = " ".join(value.split())
    return value if len(value) <= MAX_ID else f"{value[:60]}~{digest(value, size=8)}"


def parse_dtm(value: str, where: str) -> datetime | None:
    """HL7 DTM/TS -> aware datetime (UTC when the value has no offset); '' -> None."""
    value = value.strip()
    if not value:
        return None
    m = DTM_PATTERN.fullmatch(value)
    if m is None:
        raise SourceError(f"bad HL7 date/time {value[:40]!r} in {where}")
    year, month, day, hour, minute, second, frac, offset = m.groups()
    try:
        tz: timezone = UTC
        if offset:
            hh, mm = int(offset[1:3]), int(offset[3:5])
            if hh > 23 or mm > 59:
                raise ValueError(f"offset {offset} out of range")
            delta = timedelta(hours=hh, minutes=mm)
            tz = timezone(-delta if offset[0] == "-" else delta)
        micro = int((frac or "0").ljust(6, "0")[:6])
        parsed = datetime(int(year), int(month or 1), int(day or 1), int(hour or 0), int(minute or 0),
                          int(second or 0), micro, tzinfo=tz)
        parsed.astimezone(UTC)  # out of range once in UTC (year 1 east of Greenwich): refuse it here
        return parsed
    except (ValueError, OverflowError) as exc:
        raise SourceError(f"bad HL7 date/time {value[:40]!r} in {where}: {exc}") from exc


def decode_message(raw: bytes) -> str:
    data = raw.strip(b"\x0b\x1c\x00 \t\r\n")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as exc:
            raise SourceError(f"message has a UTF-16 byte order mark but is not UTF-16: {exc}") from exc
    data = data.removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    # Not UTF-8: use the character set MSH-18 names, else ISO 8859-1 (the usual legacy default).
    head = data.split(b"\r", 1)[0].split(b"\n", 1)[0].decode("latin-1")
    codec = "latin-1"
    if len(head) > 3:
        msh = head.split(head[3])
        if len(msh) > 17:
            codec = CHARSETS.get(msh[17].split("~")[0].strip().upper(), "latin-1")
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        raise SourceError(f"message is not valid UTF-8 nor valid {codec} (MSH-18): {exc}") from exc


def segments_of(text: str) -> list[Segment]:
    lines = [line.strip().lstrip("\ufeff") for line in text.replace("\r\n", "\r").replace("\n", "\r").split("\r")]
    lines = [line for line in lines if line and line[:3] not in ENVELOPE]
    if not lines:
        raise SourceError("empty message")
    if not lines[0].startswith("MSH"):
        raise SourceError(f"the message does not start with an MSH segment (starts with {lines[0][:20]!r})")
    if sum(1 for line in lines if line.startswith("MSH")) > 1:
        raise SourceError("more than one MSH segment: one message per call (load_hl7 splits files on MSH)")
    head = lines[0]
    if len(head) < 8:
        raise SourceError(f"MSH segment too short: {head!r}")
    sep = head[3]
    end = head.find(sep, 4)
    encoding = head[4:end] if end > 0 else ""
    if (sep.isalnum() or sep.isspace() or end < 0 or not 2 <= len(encoding) <= 5
            or len(set(encoding + sep)) != len(encoding) + 1 or any(c.isalnum() or c.isspace() for c in encoding)):
        raise SourceError(f"MSH-1/MSH-2 separators {head[3:9]!r} are invalid")
    message = hl7.parse("\r".join(lines))

    def unescape(leaf: Any) -> str:
        return str(message.unescape(str(leaf), UNESCAPE_MAP)).replace("\r", "\n")

    out: list[Segment] = []
    for pos, seg in enumerate(message):
        name = str(seg[0][0]) if len(seg) and len(seg[0]) else ""
        if not SEGMENT_ID.fullmatch(name):
            raise SourceError(f"segment {pos + 1} has an invalid segment id {name[:10]!r}")
        fields: list[Reps] = [((((name,),),))]
        for index, fld in enumerate(seg[1:], start=1):
            if name == "MSH" and index in (1, 2):
                fields.append((((str(fld[0]),),),))
                continue
            reps: list[tuple[tuple[str, ...], ...]] = []
            for rep in fld:
                if isinstance(rep, str):
                    reps.append(((unescape(rep),),))
                    continue
                reps.append(tuple((unescape(c),) if isinstance(c, str) else tuple(unescape(s) for s in c)
                                  for c in rep))
            fields.append(tuple(reps))
        out.append(Segment(name, tuple(fields), pos))
    return out


def split_messages(data: bytes) -> list[bytes]:
    """The messages of a file (split where a segment starts with MSH), original bytes kept."""
    starts = [m.start() for m in MSH_START.finditer(data)]
    if not starts:
        return [data] if data.strip(BLANK) else []
    prefix = data[:starts[0]]
    if not any(line.strip(BLANK) and line.strip(BLANK)[:3] not in (b"FHS", b"BHS")
               for line in re.split(rb"[\r\n]", prefix)):
        starts[0] = 0  # a BOM, MLLP start byte or batch header travels with the first message
    else:
        starts.insert(0, 0)  # anything else before the first MSH is a unit of its own (a dead letter)
    return [data[a:b] for a, b in zip(starts, [*starts[1:], len(data)], strict=True)]


