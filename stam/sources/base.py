"""What every source format shares: :class:`BadInput`, one result type (:class:`SourceResult`), and the
ordered registry of :class:`SourceFormat` that ``stam publish`` detects and loads paths with.

A format is a name (the ``--format`` value), a cheap ``detects(path, head)`` (``head``: the file's first
bytes, ``b""`` for a folder) and a ``load(paths, options)`` that yields :class:`SourceResult` batches: one
for a whole load, one per file, or one per patient for a format too large to hold at once. The publisher
dead-letters each batch's ``bad``, counts its ``skipped``, adds its ``detail()`` to the run's summary and
sends its ``entries``; it knows no format by name.

Detection asks the formats in registry order and the first that claims a path wins; a path none claims is
:data:`FALLBACK` (a FHIR bundle: its loader dead-letters what is not one, with the reason). The built-in
formats live with their sources (``FORMAT`` in ``stam.sources.mimic``, ``fhir_ndjson``, ``hl7v2``,
``fhir_r4``) and are registered in that order the first time the registry is read; :func:`register` adds
another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import RecordEntry


@dataclass(frozen=True)
class BadInput:
    """One unit of input that could not become an entry, kept whole for the dead-letter topic."""

    source: str
    raw: bytes
    error_type: str
    error: str
    file: str | None = None
    """Pointer to the whole input: the file, and the line (1-based) or byte offset of ``raw`` in it."""
    line: int | None = None
    byte_offset: int | None = None


@dataclass
class SourceResult:
    """What a source made of (part of) its input: entries in clinical-time order, the inputs that could not
    become entries (dead-lettered), and what was left out on purpose (``skipped``, by resource type or
    reason). Formats with more to say extend it and override :meth:`detail`."""

    entries: list[RecordEntry] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    bad: list[BadInput] = field(default_factory=list)

    def detail(self) -> dict[str, Any]:
        """The format's own counts for the run's summary (message types, tables...); merged in as they come."""
        return {}


@dataclass(frozen=True)
class LoadOptions:
    """Selections a format may honour (MIMIC-IV reads only these patients and tables; others ignore them)."""

    subjects: tuple[str, ...] | None = None
    tables: tuple[str, ...] | None = None


Detects = Callable[[Path, bytes], bool]
Load = Callable[[list[Path], LoadOptions], Iterable[SourceResult]]


@dataclass(frozen=True)
class SourceFormat:
    name: str
    """The ``--format`` value, e.g. ``hl7v2``."""
    detects: Detects
    """Whether an existing path is in this format: ``(path, head)``, ``head`` the first bytes of a file
    (up to :data:`HEAD_BYTES`, ``b""`` for a folder or an unreadable file). Must be cheap and never raise."""
    load: Load
    """The paths' entries and bad inputs, as one or more batches."""
    label: str
    """What the format is called in a user's error message: ``"HL7 v2"``, ``"a MIMIC-IV hosp/"``."""
    suffixes: tuple[str, ...] = ()
    """File suffixes of its input (the first is named in messages); none for a folder format such as MIMIC-IV.
    A file with one of them, or a folder holding one, is not refused as non-clinical before loading."""
    signatures: tuple[bytes, ...] = ()
    """How its files start (after a BOM and blanks): a file without a known suffix that starts so is not
    refused as non-clinical."""
    source: str = ""
    """The name in its dead letters' stage (``publish:<source>``) and in the run's per-source counts; the
    format's name when empty (``fhir-bundle`` says ``fhir-r4``, as its entries do)."""

    @property
    def source_name(self) -> str:
        return self.source or self.name


HEAD_BYTES = 512
FALLBACK = "fhir-bundle"
_BUILTIN = ("stam.sources.mimic", "stam.sources.fhir_ndjson", "stam.sources.hl7v2", "stam.sources.fhir_r4")
_REGISTRY: list[SourceFormat] = []


def _ensure_builtin() -> None:
    if not _REGISTRY:
        _REGISTRY.extend(importlib.import_module(m).FORMAT for m in _BUILTIN)


def register(fmt: SourceFormat, *, before: str | None = None) -> SourceFormat:
    """Add a format to the registry: last, or just before the format named ``before`` (detection asks the
    formats in order, so a format whose files another format would also claim goes before that one)."""
    _ensure_builtin()
    names = [f.name for f in _REGISTRY]
    if fmt.name == "auto":
        raise ValueError("'auto' means detected per path: it cannot name a source format")
    if fmt.name in names:
        raise ValueError(f"source format {fmt.name!r} is already registered")
    _REGISTRY.insert(names.index(before) if before is not None else len(_REGISTRY), fmt)
    return fmt


def unregister(name: str) -> None:
    _ensure_builtin()
    _REGISTRY[:] = [f for f in _REGISTRY if f.name != name]


def formats() -> tuple[SourceFormat, ...]:
    """The registered formats, in detection order."""
    _ensure_builtin()
    return tuple(_REGISTRY)


def format_names() -> tuple[str, ...]:
    """Format names in alphabetical order (the ``--format`` choices after ``auto``, and error messages)."""
    return tuple(sorted(f.name for f in formats()))


def get_format(name: str) -> SourceFormat:
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def read_head(path: Path) -> bytes:
    """The first :data:`HEAD_BYTES` bytes of a file; ``b""`` for a folder or a file that cannot be read."""
    if path.is_dir():
        return b""
    try:
        with path.open("rb") as fh:
            return fh.read(HEAD_BYTES)
    except OSError:
        return b""


def detect(path: Path) -> SourceFormat:
    """The first registered format that claims an existing path, else :data:`FALLBACK`."""
    head = read_head(path)
    for fmt in formats():
        if fmt.detects(path, head):
            return fmt
    return get_format(FALLBACK)


def folder_has(path: Path, *patterns: str) -> bool:
    """Whether a folder directly holds a file matching one of the glob patterns (for ``detects``)."""
    return path.is_dir() and any(any(path.glob(p)) for p in patterns)
