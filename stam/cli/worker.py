"""``stam worker``: the write-path stages (extract, link, impact, update) in one Faust process."""

from __future__ import annotations

import argparse
import sys

from stam.cli.context import load_settings
from stam.errors import PortInUse, StagesBacklog, UnknownStage


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
    except (PortInUse, StagesBacklog) as exc:
        print(f"stam worker: {exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run the write-path workers (Faust)",
                       description="Runs the write-path stages in one process (all four by default). Probes on "
                       "STAM_WEB_HOST:STAM_WEB_PORT (GET /healthz, /readyz), metrics on "
                       "STAM_METRICS_HOST:STAM_METRICS_PORT. A port already taken stops it with one line (exit 2).")
    p.add_argument("--loglevel", default="info", help="debug, info, warning, error or critical (default: info)")
    p.add_argument("--stages", default=None, help="comma-separated subset of extract,link,impact,update (default: "
                   "all); give each stage group its own consumer group with STAM_APP_ID. fused: the whole write "
                   "path in one agent, from the entries topic to the transitions topic in one hop")
    p.set_defaults(fn=cmd_worker)
