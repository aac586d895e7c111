"""What a question asks of time: deterministic intent and time-expression parsing.

``parse(question, now)`` returns an :class:`Intent`: one *kind* (what to take from a concept's values over time)
and the times the question names, resolved against the patient's clinical clock ``now`` (the query's ``as_of``,
else the latest clinical time in the patient's record):

========================  =====================================================================  =============
kind                      asked as                                                               history
========================  =====================================================================  =============
``current``               latest, most recent, current, now (the default)                        no
``previous``              the value before the latest, previous, prior                           yes
``first``                 first, earliest, initial, baseline                                     yes
``highest`` / ``lowest``  highest, maximum, peak / lowest, minimum, nadir                        yes
``count``                 how many, number of                                                    yes
``change``                change, trend, over time, increase, decrease, since the first          yes
``history``               history, ever, all values, list of                                     yes
``started``               started / ordered / begun most recently, newest order                  no
``stopped``               discontinued / stopped / changed most recently                         yes
``active``                is X (still) active, is the patient (still) on X                       yes
``changed_into``          what X was changed into, replaced by, switched to                      yes
``most_frequent``         most frequent, most common, most often                                 yes
``discharge``             what changed at discharge, which orders the discharge ended            yes
``age`` / ``sex``         how old, age; sex, gender (the patient's demographics)                 no
``admission``             when admitted / discharged, discharged to where, length of stay        yes
========================  =====================================================================  =============

**The encounter** (``scope``): "this admission", "the current stay", "during the stay", "since admission" (``stay``:
the admission current at the question's time, from its start to its discharge); "within the first day / 24 hours /
N hours (of the admission | of the prescription)" (``first``, ``hours`` long, ``scope_of`` admission or order);
"at hour N of the stay" (``hour``: the point N hours after the admission's start); "at discharge" (``discharge``);
"at admission" (``admission``). The read path resolves them against the encounter's own records
(:mod:`stam.read.encounters`), never against a guess. A category the question names ("diagnoses", "procedures",
"medications", "administrations") is kept in ``category`` for lists and counts over an encounter.

Times: ISO dates and date-times (``2148-01-28``, ``2148-01-28 20:06[:00]``, ``2148-01-28T20:06``), US dates
(``01/28/2148``), month names (``January 28, 2148``, ``28 Jan 2148``, ``Jan 2148``), years after a preposition
(``in 1939``); with ``as of`` / ``on`` / ``at`` (a point: a date alone means the end of that day), ``before`` /
``until`` / ``by`` (a point and the window's end), ``after`` / ``since`` (the window's start), ``between X and
Y``; relative: ``yesterday``, ``today``, ``N hours/days/weeks/months/years ago``, ``in the last/past N
<unit>``, ``last/past <unit>``, ``last 24 hours``. Naive times are UTC (the record's clock). A question that names
no time has none: the query's own ``as_of`` (or now) applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

KINDS = ("current", "previous", "first", "highest", "lowest", "count", "change", "history", "started",
         "stopped", "active", "changed_into", "most_frequent", "discharge", "age", "sex", "admission")
NEEDS_HISTORY = frozenset({"previous", "first", "highest", "lowest", "count", "change", "history", "stopped",
                           "changed_into", "active", "most_frequent", "discharge", "admission"})
SCOPES = ("stay", "first", "hour", "discharge", "admission")
"""Encounter scopes a question can name (see the module doc)."""
"""Kinds whose answer needs HISTORY ("is X still active" is answered "no" by the order that ended)."""


@dataclass(frozen=True)
class Intent:
    kind: str = "current"
    cue: str | None = None
    """The words that decided the kind."""
    at: datetime | None = None
    """The point in time the question asks about (None: the query's as_of, or now)."""
    about: datetime | None = None
    """A time that names which fact is meant ("the heparin order of <time>"), not the point to look from."""
    start: datetime | None = None
    """Window start (inclusive): only values from then on."""
    end: datetime | None = None
    """Window end (exclusive): only values before it."""
    time_text: str | None = None
    """The time expression as written."""
    orders: bool = False
    """The question is about orders/prescriptions (not administrations)."""
    medications: bool = False
    """The question is about medications as a category (medications, drugs, orders, prescriptions)."""
    scope: str | None = None
    """The encounter the question is about (:data:`SCOPES`), resolved by the read path; None: none named."""
    scope_of: str = "admission"
    """What a ``first`` scope counts from: the ``admission`` or the named ``order`` (its prescription)."""
    hours: float | None = None
    """The length of a ``first`` scope, or the hour of an ``hour`` scope."""
    scope_text: str | None = None
    """The encounter words as written ("this admission", "within the first day")."""
    category: str | None = None
    """A category of facts the question names (condition, procedure, medication, administration)."""
    stay: str | None = None
    """Filled by the read path: which encounter a scope resolved to, as the facts say it ("this admission,
    2145-07-03 14:00 to 2145-07-10 12:00")."""

    @property
    def needs_history(self) -> bool:
        return self.kind in NEEDS_HISTORY or self.start is not None or self.scope in ("stay", "first", "hour",
                                                                                        "discharge")

    def describe(self) -> str:
        parts = [self.kind]
        if self.scope is not None:
            parts.append(f"scope {self.scope}" + (f" {self.hours:g}h" if self.hours is not None else "")
                         + (f" of the {self.scope_of}" if self.scope == "first" else ""))
        if self.at is not None:
            parts.append(f"at {_show(self.at)}")
        if self.about is not None:
            parts.append(f"about {_show(self.about)}")
        if self.start is not None:
            parts.append(f"from {_show(self.start)}")
        if self.end is not None:
            parts.append(f"before {_show(self.end)}")
        return " ".join(parts)


def _show(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M")


# --- kinds ---------------------------------------------------------------------------------------------------

_R = re.IGNORECASE
_KIND_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((k, re.compile(p, _R)) for k, p in (
    ("sex", r"\b(?:sex|gender)\b|\bmale\s+or\s+female\b"),
    ("age", r"\bhow\s+old\b|\b(?:the\s+)?(?:patient'?s\s+)?age\b(?!\s+in\s+the\s+anchor)"),
    ("admission", r"\bwhen\s+(?:was|were|did)\s+(?:the\s+patient|he|she|they)\s+(?:get\s+)?(?:admitted|discharged)\b"
                  r"|\b(?:admission|discharge)\s+(?:time|date)\b|\bwhere\s+(?:was|were|did)\s+(?:the\s+patient|he|she|"
                  r"they)\s+(?:get\s+)?discharged\b|\bdischarge\s+(?:location|disposition|destination)\b"
                  r"|\bdischarged\s+to\s+where\b|\blength\s+of\s+(?:the\s+)?stay\b"),
    ("discharge", r"\bwhat\s+changed\s+(?:at|with|on)\s+(?:the\s+(?:patient'?s\s+)?)?discharge\b"
                  r"|\b(?:ended|stopped|discontinued)\s+(?:at|by|with|on)\s+(?:the\s+(?:patient'?s\s+)?)?discharge\b"
                  r"|\bdid\s+the\s+discharge\s+end\b|\bthe\s+discharge\s+ended\b"),
    ("changed_into", r"\b(?:chang(?:ed|e)|switch(?:ed)?|convert(?:ed)?)\s+(?:in)?to\b|\breplaced\s+(?:by|with)\b"
                     r"|\bwhat\s+replaced\b"),
    ("started", r"\b(?:started|ordered|begun|began|initiated|prescribed|added)\s+most\s+recently\b"
                r"|\bmost\s+recently\s+(?:started|ordered|begun|initiated|prescribed|added)\b"
                r"|\b(?:newest|latest|most\s+recent)\s+(?:medication\s+)?(?:order|prescription)s?\b"
                r"|\blast\s+(?:started|ordered|prescribed)\b"),
    ("stopped", r"\bmost\s+recently\s+(?:discontinued|stopped|changed|ended|held|cancell?ed)\b"
                r"|\b(?:discontinued|stopped|changed|ended)\s+most\s+recently\b"
                r"|\blast\s+(?:discontinued|stopped)\b|\bwhich\s+\w+\s+(?:was|were)\s+(?:discontinued|stopped)\b"),
    ("count", r"\bhow\s+many\b|\bnumber\s+of\b|\bhow\s+often\b|\bcount\s+of\b"),
    ("previous", r"\bbefore\s+the\s+(?:latest|last|most\s+recent|current)\b|\bprevious(?:ly)?\b|\bprior\s+(?:value|"
                 r"result|reading|measurement|level|one|dose)\b|\bpreceding\b|\bsecond[-\s]+(?:to[-\s]+)?last\b"
                 r"|\bone\s+before\b|\blast\s+but\s+one\b"),
    ("change", r"\bchang\w*\b|\btrend\w*\b|\bover\s+time\b|\bincreas\w*\b|\bdecreas\w*\b|\bwent\s+(?:up|down)\b"
               r"|\bsince\s+the\s+first\b|\bcompared?\s+(?:to|with)\b|\bimprov\w*\b|\bworsen\w*\b|\bcourse\b"),
    ("highest", r"\bhighest\b|\bmaximum\b|\bmax\b|\bpeak\b|\blargest\b|\bgreatest\b|\bworst\b"),
    ("lowest", r"\blowest\b|\bminimum\b|\bmin\b|\bnadir\b|\bsmallest\b"),
    ("first", r"\bfirst\b|\bearliest\b|\binitial(?:ly)?\b|\bbaseline\b|\boriginal(?:ly)?\b"),
    ("most_frequent", r"\bmost\s+(?:frequent(?:ly)?|common(?:ly)?|often)\b"),
    ("active", r"\bstill\b|\b(?:is|are|was|were)\s+(?:the\s+patient\s+|he\s+|she\s+)?(?:currently\s+|now\s+|presently\s+)?"
               r"(?:on|taking|receiving|getting)\b|\b(?:is|are)\b.*\bcurrent(?:ly)?\s+(?:active|ordered|running)\b"
               r"|\b(?:is|was|are|were)\b.*\bactive\b(?!\s+medication\s+orders?\s+was)"),
    ("history", r"\bhistory\b|\bhistorical\b|\bever\b|\ball\s+(?:the\s+)?(?:values|results|readings|orders|"
                r"measurements|doses)\b|\blist\s+(?:of|all)\b|\bpast\s+(?:values|results|orders)\b|\bused\s+to\b"
                r"|\bformerly\b|\bno\s+longer\b"),
    ("current", r"\blatest\b|\bmost\s+recent\b|\blast\b|\bcurrent(?:ly)?\b|\bnow\b|\bpresent\b|\btoday\b"),
))
_ORDERS = re.compile(r"\border(?:s|ed)?\b|\bprescri\w*\b", _R)
_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((c, re.compile(p, _R)) for c, p in (
    ("condition", r"\bdiagnos[ei]s\b|\bconditions\b|\bproblems\b|\bicd\s+codes?\b"),
    ("procedure", r"\bprocedures\b"),
    ("administration", r"\b(?:medication|drug)s?\s+(?:was|were)\s+(?:given|administered)\b|\badministrations\b"
                       r"|\bdoses\s+(?:given|administered)\b|\bwhich\s+(?:medication|drug)\s+was\s+(?:given|administered)\b"),
    ("medication", r"\bmedications\b|\bmedication\s+orders\b|\bdrugs\b|\bprescriptions\b"),
))
_STAY = r"(?:hospital\s+)?(?:admission|stay|hospitali[sz]ation|encounter|visit|inpatient\s+stay)"
_SCOPES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((k, re.compile(p, _R)) for k, p in (
    ("hour", r"\bat\s+hour\s+(\d+)\s+(?:of|into)\s+(?:the\s+|this\s+|her\s+|his\s+|the\s+current\s+)?" + _STAY + r"\b"
             r"|\b(\d+)\s+hours?\s+into\s+(?:the\s+|this\s+|her\s+|his\s+)?" + _STAY + r"\b"),
    ("first", r"\b(?:within|during|in|over|on)\s+(?:the\s+)?first\s+(?:(\d+|one|two|three|four|five|six|seven|twelve|"
              r"twenty-four|forty-eight)\s+)?(hour|day)s?\b(?:\s+(?:of|after|since)\s+(?:the\s+|this\s+|its\s+|her\s+|his\s+)?"
              r"(?:(prescription|order|medication|drug)|" + _STAY + r")\b)?"),
    ("discharge", r"\b(?:at|on|upon|by)\s+(?:the\s+(?:time\s+of\s+)?)?(?:(?:patient'?s|her|his)\s+)?discharge\b"),
    ("admission", r"\b(?:at|on|upon)\s+(?:the\s+(?:time\s+of\s+)?)?(?:(?:patient'?s|her|his)\s+)?admission\b"),
    ("stay", r"\b(?:this|the\s+current|the\s+present|the\s+latest|current|her|his)\s+" + _STAY + r"\b"
             r"|\bduring\s+(?:the|this)\s+" + _STAY + r"\b|\bsince\s+(?:the\s+|her\s+|his\s+)?(?:admission|"
             r"being\s+admitted|(?:he|she|the\s+patient)\s+was\s+admitted)\b|\bof\s+the\s+" + _STAY + r"\b"),
))
_MEDICATIONS = re.compile(r"\bmedications?\b|\bmedicines?\b|\bdrugs?\b|\bmeds\b|\border(?:s|ed)?\b|"
                          r"\bprescri\w*\b", _R)


# --- times ---------------------------------------------------------------------------------------------------

_MONTHS = {m: i + 1 for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                                           "nov", "dec"))}
_MONTH = r"(jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|" \
         r"oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
_CLOCK = r"(?:[ T,]+(?:at\s+)?(\d{1,2}):(\d{2})(?::(\d{2}))?)?"
_DATE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("iso", re.compile(r"\b(\d{4})-(\d{2})-(\d{2})" + _CLOCK, _R)),
    ("us", re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})" + _CLOCK, _R)),
    ("mdy", re.compile(r"\b" + _MONTH + r"\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{4})" + _CLOCK, _R)),
    ("dmy", re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+" + _MONTH + r",?\s+(\d{4})" + _CLOCK, _R)),
    ("my", re.compile(r"\b" + _MONTH + r",?\s+(\d{4})\b", _R)),
    ("y", re.compile(r"\b(?:in|since|before|after|during|until|by|of)\s+(\d{4})\b", _R)),
)
_UNITS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1),
          "week": timedelta(weeks=1), "month": timedelta(days=30), "year": timedelta(days=365)}
_UNIT = r"(minute|hour|day|week|month|year)s?"
_NUM = r"(\d+|a|an|one|two|three|four|five|six|seven|eight|nine|ten|twelve|twenty-four|forty-eight)"
_NUMS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "twelve": 12, "twenty-four": 24, "forty-eight": 48}
_AGO = re.compile(r"\b" + _NUM + r"\s+" + _UNIT + r"\s+ago\b", _R)
_LAST_N = re.compile(r"\b(?:in\s+|during\s+|over\s+|within\s+)?(?:the\s+)?(?:last|past|previous)\s+" + _NUM + r"\s+"
                     + _UNIT + r"\b", _R)
_LAST_UNIT = re.compile(r"\b(?:in\s+|during\s+|over\s+)?(?:the\s+)?(?:last|past)\s+" + _UNIT + r"\b", _R)
_YESTERDAY = re.compile(r"\byesterday\b", _R)
_TODAY = re.compile(r"\btoday\b", _R)


@dataclass(frozen=True)
class _Found:
    start: int
    end: int
    when: datetime
    day_only: bool
    """Only a date (or month, year) was given: the point is the end of that period."""
    period_end: datetime
    text: str


def _dt(y: int, mo: int, d: int, hh: str | None, mm: str | None, ss: str | None) -> datetime | None:
    try:
        return datetime(y, mo, d, int(hh or 0), int(mm or 0), int(ss or 0), tzinfo=UTC)
    except ValueError:
        return None


def _month_end(y: int, mo: int) -> datetime:
    return datetime(y + (mo == 12), mo % 12 + 1, 1, tzinfo=UTC)


def find_times(text: str) -> list[_Found]:
    """Every absolute time expression, left to right, non-overlapping."""
    found: list[_Found] = []
    taken: list[tuple[int, int]] = []
    for name, pat in _DATE_PATTERNS:
        for m in pat.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue
            g = m.groups()
            when: datetime | None
            if name == "iso":
                when = _dt(int(g[0]), int(g[1]), int(g[2]), g[3], g[4], g[5])
            elif name == "us":
                when = _dt(int(g[2]), int(g[0]), int(g[1]), g[3], g[4], g[5])
            elif name == "mdy":
                when = _dt(int(g[2]), _MONTHS[g[0][:3].lower()], int(g[1]), g[3], g[4], g[5])
            elif name == "dmy":
                when = _dt(int(g[2]), _MONTHS[g[1][:3].lower()], int(g[0]), g[3], g[4], g[5])
            elif name == "my":
                y, mo = int(g[1]), _MONTHS[g[0][:3].lower()]
                found.append(_Found(m.start(), m.end(), datetime(y, mo, 1, tzinfo=UTC), True, _month_end(y, mo),
                                    m.group(0)))
                taken.append((m.start(), m.end()))
                continue
            else:
                y = int(g[0])
                if not 1800 <= y <= 2300:
                    continue
                found.append(_Found(m.start(1), m.end(1), datetime(y, 1, 1, tzinfo=UTC), True,
                                    datetime(y + 1, 1, 1, tzinfo=UTC), m.group(1)))
                taken.append((m.start(1), m.end(1)))
                continue
            if when is None:
                continue
            day_only = name in ("iso", "us", "mdy", "dmy") and g[-3] is None
            found.append(_Found(m.start(), m.end(), when, day_only,
                                when + timedelta(days=1) if day_only else when, m.group(0)))
            taken.append((m.start(), m.end()))
    return sorted(found, key=lambda f: f.start)


def _before(text: str, pos: int, words: str) -> bool:
    return re.search(r"\b(?:" + words + r")\s*(?:the\s+)?(?:date\s+)?$", text[:pos], _R) is not None


def _times(question: str, now: datetime | None) -> dict[str, datetime | str | None]:
    out: dict[str, datetime | str | None] = {"at": None, "start": None, "end": None, "text": None}
    found = find_times(question)
    between = re.search(r"\bbetween\b", question, _R)
    if between and len(found) >= 2:
        a, b = found[0], found[1]
        out.update(start=a.when, end=b.period_end, at=b.period_end, text=question[a.start:b.end])
        return out
    for f in found:
        if _before(question, f.start, "before|until|till|prior to|by"):
            out.update(end=f.when, at=f.when, text=f.text)
        elif _before(question, f.start, "after|since|from"):
            out.update(start=f.when if not _before(question, f.start, "after") else f.period_end, text=f.text)
        elif _before(question, f.start, "on|in|during"):
            out.update(start=f.when, end=f.period_end, at=f.period_end, text=f.text)
        else:  # "as of", "at", or a bare time
            out.update(at=f.period_end if f.day_only else f.when, text=f.text)
        return out
    if now is None:
        return out
    m = _AGO.search(question)
    if m:
        when = now - _NUMS.get(m.group(1).lower(), 0) * _UNITS[m.group(2).lower()] if not m.group(1).isdigit() \
            else now - int(m.group(1)) * _UNITS[m.group(2).lower()]
        out.update(at=when, text=m.group(0))
        return out
    m = _LAST_N.search(question)
    if m:
        n = int(m.group(1)) if m.group(1).isdigit() else _NUMS.get(m.group(1).lower(), 1)
        out.update(start=now - n * _UNITS[m.group(2).lower()], text=m.group(0))
        return out
    m = _LAST_UNIT.search(question)
    if m:
        out.update(start=now - _UNITS[m.group(1).lower()], text=m.group(0))
        return out
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if _YESTERDAY.search(question):
        out.update(start=day - timedelta(days=1), end=day, at=day, text="yesterday")
    elif _TODAY.search(question):
        out.update(start=day, text="today")
    return out


def _scope(text: str) -> tuple[str | None, str, float | None, str | None]:
    """(scope, what a ``first`` scope counts from, hours, the words) of the first encounter expression."""
    for name, pat in _SCOPES:
        m = pat.search(text)
        if m is None:
            continue
        hours: float | None = None
        of = "admission"
        if name == "hour":
            hours = float(m.group(1) or m.group(2))
        elif name == "first":
            n = m.group(1)
            count = int(n) if n and n.isdigit() else _NUMS.get((n or "one").lower(), 1)
            hours = count * (24.0 if m.group(2).lower() == "day" else 1.0)
            of = "order" if m.group(3) else "admission"
        return name, of, hours, m.group(0)
    return None, "admission", None, None


def parse(question: str, now: datetime | None = None) -> Intent:
    """The intent of ``question``; relative times resolve against ``now`` (the patient's clinical clock)."""
    # Encounter words are taken first ("within the first day" is a scope, not "first"), then time expressions
    # ("last 24 hours" is a window, not "latest"); both are removed before the kind is decided.
    scope, scope_of, hours, scope_text = _scope(question)
    text = question.replace(scope_text, " ") if scope_text else question
    times = _times(text, now)
    if isinstance(times["text"], str):
        text = text.replace(times["text"], " ")
    kind, cue = "current", None
    for k, pat in _KIND_RULES:
        m = pat.search(text)
        if m:
            kind, cue = k, m.group(0)
            break
    at, start, end = times["at"], times["start"], times["end"]
    about = None
    if kind == "changed_into" and isinstance(at, datetime):
        # "the X order of <time>": the time names which order, not the point to look from
        about, at, start, end = at, None, None, None
    category = next((c for c, pat in _CATEGORIES if pat.search(question)), None)
    if scope == "discharge" and (kind in ("current", "change") and _DISCHARGE_CHANGES.search(text)
                                 or kind == "active" and category == "medication"):
        kind, cue = "discharge", scope_text  # "what changed at discharge", "which orders were still active then"
    return Intent(kind=kind, cue=cue, at=at if isinstance(at, datetime) else None, about=about,
                  start=start if isinstance(start, datetime) else None, end=end if isinstance(end, datetime) else None,
                  time_text=times["text"] if isinstance(times["text"], str) else None,
                  orders=_ORDERS.search(question) is not None,
                  medications=_MEDICATIONS.search(question) is not None, scope=scope, scope_of=scope_of,
                  hours=hours, scope_text=scope_text, category=category)


_DISCHARGE_CHANGES = re.compile(r"\bwhat\s+changed\b|\b(?:ended|stopped|discontinued)\b", _R)
