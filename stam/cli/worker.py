"""``stam worker``: the write path in one Faust process: the fused path (one agent, one hop) by default, or the four
stages (extract, link, impact, update) or a subset of them."""

from __future__ import annotations

import argparse
import sys

from stam.cli.context import load_settings
from stam.errors import FourStagesRunning, PortInUse, StagesBacklog, UnknownStage


def cmd_worker(args: argparse.Namespace) -> int:
    # deferred: workers.main pulls in pymilvus, igraph, faust (kept off `stam --help`)
    from workers.main import parse_stages, run

    try:
        stages = parse_stages(args.stages)
    except UnknownStage as exc:
        print(f"stam worker: {exc}", file=sys.stderr)
        return 2
    settings = load_settings(needs=("broker", "redis", "milvus"))
    sys.argv = [sys.argv[0], "worker", "-l", args.loglevel]
    try:
        run(settings, loglevel=args.loglevel, stages=stages)
    except (PortInUse, FourStagesRunning, StagesBacklog) as exc:
        print(f"stam worker: {exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run the write-path workers (Faust)",
                       description="Runs the write path in one process: by default the fused path, one agent from the "
                       "entries topic to the transitions topic in one broker hop; --stages all runs the four stages "
                       "over their topics. Probes on STAM_WEB_HOST:STAM_WEB_PORT (GET /healthz, /readyz), metrics on "
                       "STAM_METRICS_HOST:STAM_METRICS_PORT. A port already taken stops it with one line (exit 2); so "
                       "does a fused worker whose consumer group has four-stage workers alive or their work left "
                       "behind (docs/operations.md).")
    p.add_argument("--loglevel", default="info", help="debug, info, warning, error or critical (default: info)")
    p.add_argument("--stages", default=None, help="fused (the default): the whole write path in one agent, from the "
                   "entries topic to the transitions topic in one hop; all: the four stages (extract, link, impact, "
                   "update) over their topics; or a comma-separated subset of extract,link,impact,update: give each "
                   "stage group its own consumer group with STAM_APP_ID")
    p.set_defaults(fn=cmd_worker)
