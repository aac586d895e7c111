"""Files: the files under STAM_HOME that name the patient, and the string values of Milvus Lite's files.

- **Files under STAM_HOME**: JSON Lines / NDJSON files (calibration sets, eval replays, and the calibration set the
  gate file names even outside STAM_HOME) lose every line that names the patient; ``*.log`` files have the id
  replaced by ``[erased]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from stam.config import Settings
from stam.erase.register import Report

REDACTED = b"[erased]"
TEXT_SUFFIXES = (".jsonl", ".ndjson")
LOG_SUFFIXES = (".log",)


def _gate_set(settings: Settings) -> Path | None:
    """The calibration set the gate file was calibrated from (it may lie outside STAM_HOME)."""
    gate = settings.resolved_gate_file()
    try:
        source = json.loads(gate.read_text()).get("source") if gate.is_file() else None
    except (OSError, ValueError):
        return None
    if not source:
        return None
    path = Path(source)
    return path if path.is_file() else None


def home_files(home: Path) -> list[Path]:
    """Every file under ``home`` (symbolic links left out), sorted; none when it is not a directory."""
    if not home.is_dir():
        return []
    return sorted(p for p in home.rglob("*") if p.is_file() and not p.is_symlink())


def jsonl_files(settings: Settings) -> list[Path]:
    """The JSON Lines / NDJSON files under STAM_HOME, and the calibration set the gate file names."""
    files = [p for p in home_files(settings.home) if p.suffix in TEXT_SUFFIXES]
    gate_set = _gate_set(settings)
    if gate_set is not None and gate_set.resolve() not in {p.resolve() for p in files}:
        files.append(gate_set)
    return files


def lines_naming(path: Path, quoted: bytes) -> int:
    """How many lines of the file hold ``quoted`` (0 when it cannot be read)."""
    try:
        return sum(1 for line in path.read_bytes().splitlines() if quoted in line)
    except OSError:
        return 0


def read_file(path: Path) -> bytes:
    """The file's bytes; none when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


def erase_files(settings: Settings, patient_id: str, report: Report) -> None:
    """The lines naming the patient out of the JSON Lines files, the id redacted in the log files, with what was
    changed in ``report``."""
    quoted = json.dumps(patient_id).encode()
    lines_removed = 0
    rewritten = 0
    for path in jsonl_files(settings):
        data = read_file(path)
        if quoted not in data:
            continue
        lines = data.splitlines(keepends=True)
        keep = [ln for ln in lines if quoted not in ln]
        lines_removed += len(lines) - len(keep)
        tmp = path.with_name(path.name + ".erase-tmp")
        tmp.write_bytes(b"".join(keep))
        os.chmod(tmp, path.stat().st_mode & 0o777)
        tmp.replace(path)
        rewritten += 1
    needle = patient_id.encode()
    redacted = 0
    for path in home_files(settings.home):
        if path.suffix not in LOG_SUFFIXES:
            continue
        data = read_file(path)
        if needle not in data:
            continue
        # In place, not by rename: a process appending to the log keeps its file.
        with path.open("r+b") as fh:
            fh.write(data.replace(needle, REDACTED))
            fh.truncate()
        redacted += 1
    report.removed["file_lines"] = lines_removed
    report.removed["files_rewritten"] = rewritten
    report.removed["files_redacted"] = redacted
    report.steps["files"] = (f"{lines_removed} lines naming the patient removed from {rewritten} JSON Lines files; "
                             f"the id redacted in {redacted} log files")


def parquet_strings(path: Path) -> Iterable[bytes]:
    """String values of a Parquet (Milvus Lite segment) or Arrow (its WAL) file: a compressed page may hide a
    value from a byte search."""
    # Deferred: pyarrow is a heavy import (it comes with Milvus Lite) that only the scan of Milvus's files needs.
    # deferred: pyarrow is slow to import
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":  # only the text columns (not the vectors)
            schema = pq.read_schema(path)
            text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
                    or pa.types.is_binary(f.type)]
            table = pq.read_table(path, columns=text)
        elif path.suffix == ".arrow":
            with pa.memory_map(str(path)) as src:
                try:
                    table = pa.ipc.open_file(src).read_all()
                except pa.ArrowInvalid:
                    src.seek(0)
                    table = pa.ipc.open_stream(src).read_all()
        else:
            return
    except Exception:  # noqa: BLE001 - a file being rewritten or not Arrow: the byte search still covers it
        return
    for col in table.columns:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_binary(col.type):
            for v in col.to_pylist():
                if v is not None:
                    yield v if isinstance(v, bytes) else str(v).encode()
