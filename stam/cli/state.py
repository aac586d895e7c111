"""``stam state --patient ID``: a patient's ACTIVE and HISTORY memories, and the record gaps dead letters left."""

from __future__ import annotations

import argparse
import json
import sys

from stam.cli.common import load_settings


def cmd_state(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("redis",))  # first: no stack, no imports of the stores

    from stam.compose import redis_client
    from stam.deadletters import gap_line
    from stam.export import export_state, render_text
    from stam.stores.redis_state import RedisStateStore

    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    state = states.load(args.patient)
    gaps = states.gaps(args.patient)
    if state.version == 0:
        gap = gap_line(gaps)
        print(f"no state for patient {args.patient}" + (f" ({gap}; see `stam deadletters list --patient`)"
                                                         if gap else ""), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**export_state(state), "gaps": [g.model_dump(mode="json") for g in gaps]}, indent=2))
    else:
        gap = gap_line(gaps)
        if gap:
            print(f"{gap}  (`stam deadletters list --patient {args.patient}`)")
            for g in gaps:
                print(f"  - entry {g.entry_id or '(unknown id)'}: {g.stage}, {g.error_type}; dead letter "
                      f"{g.dead_letter}" + (", replayed, not applied yet" if g.replayed_at else ""))
        print(render_text(state, limit=args.limit))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("state", help="a patient's ACTIVE and HISTORY memories")
    p.add_argument("--patient", required=True, help="the patient's id")
    p.add_argument("--json", action="store_true", help="the stable export shape (see README)")
    p.add_argument("--limit", type=int, default=None, help="text mode: at most N memories per store")
    p.set_defaults(fn=cmd_state)
