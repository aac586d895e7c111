"""``stam stack up|down|status``: the embedded broker, Redis and Milvus Lite on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from stam.cli.context import load_settings
from stam.config import Settings


def cmd_stack(args: argparse.Namespace) -> int:
    # deferred: stam.stack (kept off `stam --help`)
    from stam import stack

    home = Settings().home
    if args.action == "up":
        info = stack.up(home)
        settings = load_settings()
        # deferred: topology.admin pulls in redis, aiokafka (kept off `stam --help`)
        from topology.admin import ensure_topics

        asyncio.run(ensure_topics(settings))
        print(json.dumps({"broker_url": info.broker_url, "redis_url": info.redis_url,
                          "milvus_uri": info.milvus_uri, "broker_storage": info.broker_storage,
                          "redis_fsync": info.redis_fsync, "partitions": settings.partitions,
                          "started": info.restarted}, indent=2))
    elif args.action == "down":
        print("stopped (data kept in " + str(home) + ")" if stack.down(home) else "no stack running")
    else:
        procs = stack.status(home)
        if not procs:
            print(f"no stack in {home}")
            return 1
        print(json.dumps(procs, indent=2))
        dead = [n for n, p in procs.items() if not p["alive"]]
        if dead:
            print(f"not running: {', '.join(dead)}; `stam stack up` restarts them", file=sys.stderr)
        return 1 if dead else 0
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stack", help="start, stop or show the embedded stack")
    p.add_argument("action", choices=["up", "down", "status"],
                   help="up: start the processes not running and create the topics; down: stop them (data is "
                   "kept); status: show them (exit status 1 when one is not running)")
    p.set_defaults(fn=cmd_stack)
