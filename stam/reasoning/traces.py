"""Teacher traces: every validated language-model call of the reasoner, one JSON line each.

A trace is what a write module's adapter learns from: the prompt (chat messages), the output schema's name, the
validated reply, the model and prompt version that produced it, and the entry and patient it was about. The
patient id is kept so that splits are by patient and so that erasing a patient can list the traces and the
adapters that learnt from it. Traces hold note text: they are patient data, written with mode 0600.

Recorded when asked (``STAM_LLM_TRACE_PATH``, or ``ModelReasoner(trace=TraceWriter(path))``); a cached reply,
which made no call, is not recorded again.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The reasoner's kinds of call, and the write module (adapter) each trains.
MODULE_OF = {"extraction": "extract", "link+update": "update"}
FIELDS = ("module", "purpose", "prompt_id", "model", "schema_name", "messages", "reply", "entry_id", "patient_id",
          "attempts")


@dataclass(frozen=True)
class Trace:
    module: str
    purpose: str
    prompt_id: str
    model: str
    schema_name: str
    messages: list[dict[str, str]]
    reply: str
    entry_id: str | None
    patient_id: str | None
    attempts: int

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FIELDS}


class TraceWriter:
    """Appends traces to a JSON-lines file (thread-safe; the reasoner calls from several threads)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fh = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.written = 0

    def __call__(self, trace: Trace) -> None:
        line = json.dumps(trace.as_dict(), ensure_ascii=False)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()
            self.written += 1

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_traces(path: Path) -> Iterator[Trace]:
    with Path(path).open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                yield Trace(**{f: data[f] for f in FIELDS})
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace ({exc})") from exc
