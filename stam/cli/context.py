"""What the command groups share: the settings (environment, then the running embedded stack), the query service,
reports and tables."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stam.config import Settings
from stam.errors import StackError

SERVICES = {"broker": ("broker_url", ("s3", "broker")), "redis": ("redis_url", ("redis",)),
            "milvus": ("milvus_uri", ("milvus",))}
"""What a command may need: the setting naming it, and the embedded stack's processes that serve it."""


def load_settings(needs: Iterable[str] = tuple(SERVICES)) -> Settings:
    """Settings from the environment, completed by the running embedded stack where env is silent: its addresses,
    and its topics' partition count wherever its broker is the one used (``STAM_PARTITIONS`` may only repeat it).

    ``needs``: the services the command uses (broker, redis, milvus). One the environment does not name
    (``STAM_BROKER_URL``, ``STAM_REDIS_URL``, ``STAM_MILVUS_URI``) must come from a stack recorded in the home;
    where there is none this refuses (:class:`StackError`, one line) rather than fall back to a default address
    or to a private store created in the home (an empty store answers "no memory for patient")."""
    # deferred: stam.stack (kept off `stam --help`)
    from stam import stack

    base = Settings()
    given = {fld for fld, _ in SERVICES.values() if os.environ.get(f"STAM_{fld.upper()}")}
    # The processes whose URL the environment does not give must run: a dead one is named, never replaced by
    # a default address or a private store (StackError, one line).
    needed = tuple(proc for fld, procs in SERVICES.values() if fld not in given for proc in procs)
    info = stack.require(base.home, needed)
    if info is None:
        missing = [f"STAM_{SERVICES[n][0].upper()}" for n in SERVICES if n in needs and SERVICES[n][0] not in given]
        if missing:
            raise StackError(f"no stack in {base.home} (STAM_HOME) and {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set; run `stam stack up` first "
                             "(or set them)")
        return base
    overrides: dict[str, Any] = {}
    for fld, value in (("broker_url", info.broker_url), ("redis_url", info.redis_url),
                       ("milvus_uri", info.milvus_uri)):
        if fld not in given:
            overrides[fld] = value
    if info.partitions is not None and overrides.get("broker_url", base.broker_url) == info.broker_url:
        # The stack's topics were made with its count; a worker or publisher with another would compute other
        # partitions for a patient than the broker's (the deletion sweep does) and declare other topics.
        if os.environ.get("STAM_PARTITIONS") and base.partitions != info.partitions:
            raise StackError(f"STAM_PARTITIONS is {base.partitions}, but the embedded stack in {base.home} made its "
                             f"topics with {info.partitions} partitions; unset it (a count is chosen when a new "
                             "stack is first started)")
        overrides["partitions"] = info.partitions
    return base.model_copy(update=overrides)


def stack_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"STAM_BROKER_URL": settings.broker_url, "STAM_REDIS_URL": settings.redis_url,
                "STAM_MILVUS_URI": settings.resolved_milvus_uri(), "STAM_HOME": str(settings.home)})
    return env


def query_service(settings: Settings) -> Any:
    # deferred: workers.query_consumer, workers.runtime pull in pymilvus, igraph, aiohttp (kept off `stam --help`)
    from workers.query_consumer import build_service
    from workers.runtime import Runtime

    return build_service(settings, Runtime(settings=settings, topics=None, writes=False))  # type: ignore[arg-type]


def one_line(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = [title for _, title in columns]
    body = [["" if r.get(key) is None else f"{r[key]:.3f}" if isinstance(r.get(key), float) else str(r[key])
             for key, _ in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *body])


def emit_report(report: dict[str, Any], path: str | None) -> int:
    """An eval report: to ``path`` when given, and to stdout."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


class LazyBar:
    """A progress bar (tqdm, on stderr) drawn from the first progress reported: a command that stops before any
    work (a missing folder, the stack down) says why in one line, with no empty bar before it."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._bar: Any = None

    def to(self, done: int) -> None:
        """``done`` items in all so far (the progress callbacks' convention)."""
        if self._bar is None:
            if done <= 0:
                return
            # deferred: tqdm is slow to import (kept off `stam --help`)
            from tqdm import tqdm

            self._bar = tqdm(file=sys.stderr, **self._kwargs)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
