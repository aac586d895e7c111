"""``stam publish PATH...``: FHIR R4 bundles/NDJSON, HL7 v2 messages or a MIMIC-IV folder to the entries topic."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from stam.cli.context import LazyBar, load_settings
from stam.errors import InputRefused, SourceConfigError
from stam.sources.base import format_names
from stam.sources.mimic import TABLES as MIMIC_TABLES


async def _until_interrupted(work: Any) -> bool:
    """Run ``work``; True when Ctrl-C (SIGINT) stopped it. The signal is recorded, not only turned into a
    cancellation: a library that swallows the cancellation must not make an interrupted run look complete."""

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        await task
    except asyncio.CancelledError:
        if not interrupted:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return interrupted


def cmd_publish(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker",))  # first: no stack, no imports of the stores

    # deferred: aiokafka is slow to import; stam.integrity, stam.publish pull in igraph, redis (kept off `stam --help`)
    from aiokafka.errors import KafkaError

    from stam.integrity import source_keys
    from stam.publish import PublishSummary, publish_paths, report

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an unreachable broker is said in one line below
    logging.getLogger("stam.publish").setLevel(logging.INFO)  # the run's counts, one line at the end (report)
    bar = LazyBar(desc="publishing", unit=" entries", disable=args.quiet, mininterval=0.5)
    progress, close_bar = bar.to, bar.close

    subjects = args.subjects.split(",") if args.subjects else None
    tables = args.tables.split(",") if args.tables else None
    summary = PublishSummary()
    try:
        if args.source_system is None and source_keys(settings).require_signed:
            raise SourceConfigError("signed entries are required (STAM_SOURCES / STAM_REQUIRE_SIGNED_ENTRIES): pass "
                                    "--source-system NAME, or the workers dead-letter every entry")
        interrupted = asyncio.run(_until_interrupted(publish_paths(
            settings, args.paths, fmt=args.format, rate=args.rate, progress=progress, subjects=subjects,
            tables=tables, summary=summary, source_system=args.source_system)))
        if interrupted:
            raise KeyboardInterrupt
    except SourceConfigError as exc:
        close_bar()
        print(f"stam publish: {exc}", file=sys.stderr)
        return 2
    except InputRefused as exc:
        close_bar()
        print(f"stam publish: {exc}; nothing was sent", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        close_bar()
        print(f"stam publish: interrupted after {summary.sent} entries sent ({summary.dead_lettered} "
              "dead-lettered); re-running the same command is safe: entry ids are deterministic and the workers "
              "skip entries already applied", file=sys.stderr)
        report(settings, summary, "interrupted", log_line=False)  # the line above has the counts
        return 130
    except (KafkaError, OSError) as exc:
        close_bar()
        print(f"stam publish: cannot reach the broker at {settings.broker_url} ({type(exc).__name__}); "
              f"{summary.sent} entries sent. Is the stack up (stam stack status)?", file=sys.stderr)
        report(settings, summary, "broker_unreachable", log_line=False)
        return 1
    finally:
        close_bar()
    print(json.dumps(summary.as_dict()))
    report(settings, summary, "ok" if summary.dead_lettered == 0 else "dead_lettered")
    return 0 if summary.dead_lettered == 0 else 2


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("publish", help="publish FHIR R4 bundles or NDJSON, HL7 v2 messages or a MIMIC-IV folder "
                       "to the entries topic",
                       description="Sends record entries keyed by patient id; input that cannot be parsed or "
                       "validated goes to the dead-letter topic with its bytes and the reason. Prints a JSON "
                       "summary (sent, skipped, dead-lettered, per source). Exit status 2 when anything was "
                       "dead-lettered, or when a path does not exist or is an empty or non-clinical file (refused "
                       "in one line, nothing sent); 1 when the broker cannot be reached; 130 on Ctrl-C (says how "
                       "many entries were sent; re-running is safe). Limits: an entry is at most 256 KiB "
                       "serialized, its text 100,000 characters, ids printable ASCII (patient id up to 128 "
                       "characters); input over them is dead-lettered.")
    p.add_argument("paths", nargs="+", help="bundle files, folders of *.json bundles, *.ndjson files or "
                   "bulk-export folders, .hl7 files or folders of them, a MIMIC-IV folder (with hosp/, icu/)")
    # stam.publish.FORMATS, without importing the publisher (and its stores) to build the parser: every
    # command, `stam --help` too, builds it
    p.add_argument("--format", choices=["auto", *format_names()], default="auto",
                   help="input format (default: detected per path)")
    p.add_argument("--rate", type=float, default=None, help="entries per second (default: unlimited)")
    p.add_argument("--subjects", default=None, help="MIMIC-IV: comma-separated subject_ids (default: all)")
    p.add_argument("--tables", default=None, help="MIMIC-IV: comma-separated tables (default: all of "
                   + ", ".join(MIMIC_TABLES) + ")")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--source-system", default=None, help="sign every entry as this source system, with its secret "
                   "from STAM_SOURCES / STAM_SOURCES_FILE (required where the workers require signed entries)")
    p.set_defaults(fn=cmd_publish)
