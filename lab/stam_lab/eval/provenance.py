"""Where a measurement came from: the command, the commit and the machine, written into its JSON report.

Every benchmark (``benchmarks/``) and every ``stam eval`` report passes its JSON through :func:`stamp` before
printing or writing it, so the report says which command produced it, from which commit (and whether tracked files
had uncommitted changes), on what machine and when. The documentation's tables are generated from such reports
(``make figures``, ``benchmarks/figures.py``), so a figure always names the run that produced it.

The report's own keys are kept as they are; the provenance is one more key, ``provenance``, first in the object.
A report that is a list (one benchmark run per configuration) becomes ``{"provenance": ..., "results": [...]}``.

Standard library only: ``benchmarks/lora_device.py`` runs on machines with nothing but torch installed, and
``stam eval`` in a container, where there is no git: the commit is then ``null`` and ``version`` is the installed
package's.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this code runs from (where ``git`` is asked for the commit)."""

REQUIRED = ("command", "commit", "machine", "when")
"""The keys a report the documentation cites must carry, none of them empty (``commit`` is null where the code did
not run from a git checkout: such a report is not citable)."""


def command(argv: Sequence[str] | None = None, main_module: str | None = None) -> str:
    """The command line as a person would type it again: ``python -m benchmarks.x --flag`` for a module run with
    ``-m``, else the program's name (``stam eval qa ...``) and its arguments."""
    argv = list(sys.argv if argv is None else argv)
    if main_module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_module = spec.name if spec is not None else None
    if main_module:
        head = ["python", "-m", main_module.removesuffix(".__main__")]
    else:
        head = [os.path.basename(argv[0])] if argv else []
    return shlex.join(head + argv[1:])


def git_commit(root: Path = SOURCE_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}``: the checkout's HEAD and whether tracked files differ
    from it (untracked files do not count: they are not code that ran unless imported, and results written during
    a run would otherwise mark it dirty)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "dirty": None if status is None else bool(status)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """What the numbers depend on: cores (and those this process may use), memory, CPU model, Python, the OS, and
    the load average when the report was written (other jobs on the machine slow a run down)."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cores": os.cpu_count(), "cores_usable": usable, "memory_gib": _memory_gib(), "cpu": _cpu_model(),
            "python": platform.python_version(), "platform": platform.platform(), "loadavg_1_5_15": load}


def _version() -> str | None:
    try:
        return version("stam")
    except Exception:  # noqa: BLE001 - not installed (a bare checkout on PYTHONPATH)
        return None


def provenance(argv: Sequence[str] | None = None, main_module: str | None = None) -> dict[str, Any]:
    """The provenance of a report written now by this process."""
    git = git_commit()
    return {"command": command(argv, main_module), "commit": git["commit"], "dirty": git["dirty"],
            "version": _version(), "machine": machine(),
            "when": datetime.now(UTC).isoformat(timespec="seconds")}


def stamp(report: Any, argv: Sequence[str] | None = None, main_module: str | None = None) -> dict[str, Any]:
    """``report`` with its provenance: a dict keeps its keys (``provenance`` first; one it already has is
    replaced), anything else (a list of runs) goes under ``results``."""
    prov = provenance(argv, main_module)
    if isinstance(report, dict):
        return {"provenance": prov, **{k: v for k, v in report.items() if k != "provenance"}}
    return {"provenance": prov, "results": report}


def missing(report: Any) -> list[str]:
    """The provenance a report lacks for the documentation to cite it (``["provenance"]`` when it has none, else
    each required key that is absent or empty, and each missing machine fact): empty when it is complete."""
    prov = report.get("provenance") if isinstance(report, dict) else None
    if not isinstance(prov, dict):
        return ["provenance"]
    gaps = [k for k in REQUIRED if prov.get(k) in (None, "", {})]
    if isinstance(prov.get("machine"), dict):
        gaps += [f"machine.{k}" for k in ("cores", "memory_gib", "cpu", "python") if prov["machine"].get(k) is None]
    return gaps
