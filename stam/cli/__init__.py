"""The ``stam`` command line.

  stam stack up|down|status     embedded broker (Tansu on SeaweedFS S3), Redis (AOF) and Milvus Lite on loopback;
                                up restarts only dead processes, status exits 1 when one is dead
  stam worker                   run the write-path worker (fused; --stages all: extract, link, impact, update)
  stam publish PATH...          publish FHIR R4 bundles/NDJSON, HL7 v2 messages or a MIMIC-IV folder
  stam listen mllp              HL7 v2 over MLLP, each message acknowledged once it is on a topic
  stam listen fhir              transitions out as FHIR R4B/R5 topic-based Subscription notifications (base /fhir)
  stam transitions              print transitions from the transitions topic
  stam state --patient ID       a patient's ACTIVE and HISTORY memories (--json: stable export shape; --html OUT: its
                                timeline page in one file)
  stam deadletters list|show|replay|dismiss   dead letters and the record gaps they leave in patients' records
  stam rebuild --patient ID     rebuild a patient's Redis and Milvus projections from the transitions topic
  stam erase --patient ID       erase a patient everywhere, verify, publish a receipt (--dry-run, --verify)
  stam deletion sweep           score archived memories with a calibrated gate; order deletions (--dry-run: list)
  stam query-worker             the query consumer (queries -> answers topics, HTTP POST /v1/query)
  stam token new --name N --role R  a query token with a scope (clinician, or service:<name> --patient ID...)
  stam ask --patient ID "Q"     evidence packet for a question (--as-of T, --json, --gate ...)
  stam gate build-set|calibrate the store gate's calibration
  stam serve [--engine llamacpp|vllm]  the language model behind an OpenAI-compatible endpoint (Ray Serve;
                                --lora NAME=PATH serves LoRA adapters by name)
  stam demo                     all of the above on one real Synthea patient
  stam demo-notes [--model M]   two real notes decomposed by the local language model (Ray Serve + llama.cpp)

The lab part (stam-lab, lab/: not what a deployment installs; without it these say so):
  stam train traces|lora        teacher traces over notes (split by patient); a write module's LoRA adapter
  stam eval state               write-time state diagnostics (MIMIC-IV or Synthea gold, ablation variants, plot)
  stam eval qa|questions        MIMIC-QA: STAM vs append-only, flat RAG, full context (evidence, reader F1/EM)
  stam deletion calibrate       the deletion gate's labels, scorer and threshold on a replayed store (deletes nothing)

Settings come from STAM_* environment variables; for any not set, the embedded stack's URLs
(<home>/stack.json) are used; when a process of it is not running, commands fail naming it (never a silent
fallback to a default address or a private store).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import metadata
from pathlib import Path

from pydantic import ValidationError

import stam
from stam import errors
from stam.cli import (
    deadletters,
    deletion,
    demo,
    erasure,
    lab,
    listen,
    publish,
    read_path,
    serve,
    stack,
    state,
    transitions,
    worker,
)
from stam.cli.context import load_settings, one_line
from stam.cli.transitions import consume_transitions
from stam.config import Settings
from stam.errors import StackError

__all__ = ["GROUPS", "consume_transitions", "build_parser", "load_settings", "main", "unreachable", "version"]

# One module per command group; each adds its commands with register(subparsers). In this order (the order of
# `stam --help`), then the lab part's commands (stam/cli/lab.py: registered from the lab where it is installed).
GROUPS = (stack, worker, publish, listen, read_path, serve, transitions, state, deadletters, erasure, deletion, demo)


def version() -> str:
    """The installed package's version (importlib.metadata), else stam.__version__ when the package defines one."""
    try:
        return metadata.version("stam")
    except metadata.PackageNotFoundError:
        return str(getattr(stam, "__version__", "unknown"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stam", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the version of stam and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    lab.register("stam", sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # deferred: stam.logs pulls in orjson (kept off `stam --help`)
    from stam.logs import configure

    try:
        configure(Settings(), logging.WARNING)
    except ValidationError as exc:  # contradictory settings (e.g. SASL without a password): one line per error
        for err in exc.errors():
            print(f"stam: settings: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    try:
        return int(args.fn(args))
    except StackError as exc:  # a stack process down, or one that cannot start: one line, no traceback
        print(f"stam: {exc}", file=sys.stderr)
        return 3
    except USERS_MISTAKES as exc:  # input or configuration the user gave, said by STAM on purpose
        print(f"stam: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        given = given_path(exc, args)
        if given is None:
            raise  # a file the code expected: a bug, its traceback
        missing, label = str(exc.filename), _label(args, given, sys.argv[1:] if argv is None else argv)
        print(f"stam: {missing} not found ({label}{'' if missing == given else f' {given}'})", file=sys.stderr)
        return 2
    except Exception as exc:
        service = unreachable(exc)
        if service is None:
            raise  # a bug: its traceback
        # A service named by STAM_* URLs that does not answer (a stack down, a wrong URL): one line, as a dead
        # process of the embedded stack is.
        print(f"stam: {service} unreachable ({type(exc).__name__}: {one_line(str(exc), 160)}); is it running "
              "(`stam stack status`, or the STAM_* URLs)?", file=sys.stderr)
        return 3


def _users_mistakes() -> tuple[type[Exception], ...]:
    return (errors.SourceError, errors.InputRefused, errors.SourceConfigError, errors.TokenConfigError,
            errors.KeyConfigError, errors.WeightsError, errors.ServeOptionError, errors.TrainingError,
            errors.LabNotInstalled, errors.UnknownStage, errors.DeadLetterError)


USERS_MISTAKES = _users_mistakes()
"""STAM's errors that name a user's input or configuration (a data folder that is not MIMIC-IV, a key file that
cannot be read, weights not installed...): one line, exit 2, when a command lets one through."""


def _paths(args: argparse.Namespace) -> dict[str, str]:
    """The command's arguments that may name files (given or defaulted): value -> option."""
    out: dict[str, str] = {}
    for name, value in vars(args).items():
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, str | Path) and str(v):
                out.setdefault(str(v), name.replace("_", "-"))
    return out


def given_path(exc: FileNotFoundError, args: argparse.Namespace) -> str | None:
    """The argument (a file or a folder) that the missing file is, or is under; None when the command line named
    neither (then the missing file is the code's business)."""
    if not exc.filename:
        return None
    missing = os.path.normpath(os.path.abspath(str(exc.filename)))
    for value in _paths(args):
        arg = os.path.normpath(os.path.abspath(value))
        if missing == arg or missing.startswith(arg.rstrip(os.sep) + os.sep):
            return value
    return None


def _label(args: argparse.Namespace, value: str, argv: list[str]) -> str:
    """How the command line gave ``value``: ``--option``, the positional argument's name, or an option's default."""
    name = _paths(args).get(value, "?")
    if f"--{name}" in argv or any(a.startswith(f"--{name}=") for a in argv):
        return f"--{name}"
    return name if value in argv else f"the default of --{name}"


def unreachable(exc: BaseException) -> str | None:
    """The service ``exc`` says could not be reached (Redis, the broker, Milvus), or None: connection failures
    only, not a server's refusal or a bug."""
    # deferred: redis, aiokafka, pymilvus are slow to import (kept off `stam --help`)
    import redis
    from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
    from pymilvus import MilvusException

    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return "Redis"
    if isinstance(exc, KafkaConnectionError | KafkaTimeoutError):
        return "the broker"
    if isinstance(exc, MilvusException) and (exc.code == MILVUS_CANNOT_CONNECT or "fail connecting" in
                                             str(exc.message).lower()):
        return "Milvus"
    return None


MILVUS_CANNOT_CONNECT = 2
"""pymilvus's code for a server it could not connect to (``Fail connecting to server on HOST:PORT``)."""
