"""Log output: plain text (default) or one JSON object per line (``STAM_LOG_FORMAT=json``).

A JSON line carries ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``exc`` (the traceback, when
there is one), and any ``extra={...}`` fields the call passed (``stam publish`` logs its counts so). The
messages are the same as in text: INFO logs never carry a patient identifier in either format.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from stam.config import Settings

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is written out.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


def handler(settings: Settings, stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) with the configured format."""
    h = logging.StreamHandler(stream or sys.stderr)
    if settings.log_format == "json":
        h.setFormatter(JsonFormatter())
    else:
        h.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))
    return h


def configure(settings: Settings, level: int | str = logging.WARNING) -> None:
    """Root logging of a command-line process (the workers' logging is set up by Faust: :func:`faust_logging`).
    Text: ``logging.basicConfig`` (a no-op where handlers exist). JSON: a JSON handler on stderr, once."""
    if settings.log_format != "json":
        logging.basicConfig(level=level)
        return
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        root.addHandler(handler(settings))
    root.setLevel(level)


def faust_worker(app: Any, settings: Settings, loglevel: str = "info") -> Any:
    """A ``faust.Worker`` for ``app`` with the configured logging and without Faust's terminal spinner.

    With a level of WARNING or above, Faust keeps a start-up spinner that is advanced by every log record: it sets
    the root logger to DEBUG and adds a DEBUG handler, for the life of the process. Every debug call of aiokafka
    and Faust (one per message sent) then builds a LogRecord that no handler prints: 6% of a busy worker's samples
    in a py-spy profile of the whole MIMIC-IV demo. Without the spinner the root logger keeps the level asked."""
    # deferred: faust is slow to import
    import faust

    worker = faust.Worker(app, loglevel=loglevel, **faust_logging(settings, loglevel))
    worker.spinner = None
    return worker


def faust_logging(settings: Settings, loglevel: str = "info") -> dict[str, Any]:
    """Keyword arguments of ``faust.Worker`` for the configured format. Text keeps Faust's own (coloured) output;
    JSON replaces its handler and turns off its start-up banner, so stdout and stderr carry JSON lines only."""
    if settings.log_format != "json":
        return {}
    return {"logging_config": {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["default"], "level": loglevel.upper()},
    }, "quiet": True}
