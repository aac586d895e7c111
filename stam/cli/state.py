"""``stam state --patient ID``: a patient's ACTIVE and HISTORY memories, and the record gaps dead letters left;
``--html out.html``: the timeline page (docs/timeline.md) as one file, its data and scripts inlined."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stam.cli.context import load_settings
from stam.errors import PageInputError


def cmd_state(args: argparse.Namespace) -> int:
    if args.html is not None:
        return cmd_state_html(args)
    if args.as_of is not None or args.start is not None or args.end is not None:
        print("stam: --as-of, --from and --to go with --html (the text and JSON exports are the state now)",
              file=sys.stderr)
        return 2
    settings = load_settings(needs=("redis",))  # first: no stack, no imports of the stores

    # deferred: stam.backends.redis_state, stam.deadletters and others pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.backends.redis_state import RedisStateStore
    from stam.deadletters import gap_line
    from stam.export import export_state, render_text
    from stam.transport import redis_client

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


def cmd_state_html(args: argparse.Namespace) -> int:
    """The timeline page of the patient with its data inlined (every memory up to ``page.MAX_ITEMS``, or those of
    ``--from``/``--to``; the state as of ``--as-of``): a file to share that opens without a worker."""
    # deferred: stam.read.page pulls in igraph, redis, numpy (kept off `stam --help`)
    from stam.read import page

    try:
        window = page.window_of({"from": args.start or "", "to": args.end or "", "as_of": args.as_of or ""},
                                names={"from": "--from", "to": "--to", "as_of": "--as-of"})
    except PageInputError as exc:
        print(f"stam: {exc}", file=sys.stderr)
        return 2
    settings = load_settings(needs=("redis",))

    # deferred: stam.backends.redis_state, stam.deadletters and others pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.backends.redis_state import RedisStateStore
    from stam.deadletters import gap_line
    from stam.transport import redis_client

    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    tl = page.load_timeline(states, args.patient)
    gaps = states.gaps(args.patient)
    if len(tl) == 0:
        gap = gap_line(gaps)
        print(f"no state for patient {args.patient}" + (f" ({gap})" if gap else ""), file=sys.stderr)
        return 1
    data = page.page_data(tl, window, gaps, details=lambda ids: states.memories(args.patient, ids),
                          first_view=page.MAX_ITEMS)
    try:
        args.html.write_text(page.export_html(args.patient, data), encoding="utf-8")
    except OSError as exc:
        print(f"stam: cannot write {args.html}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    c = data["counts"]
    print(f"{args.html}: {c['shown']} memories in {len(data['threads'])} threads, {c['transitions']} transitions"
          + (" (the latest only: the record holds more)" if data["truncated"] else ""))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("state", help="a patient's ACTIVE and HISTORY memories")
    p.add_argument("--patient", required=True, help="the patient's id")
    p.add_argument("--json", action="store_true", help="the stable export shape (see README)")
    p.add_argument("--limit", type=int, default=None, help="text mode: at most N memories per store")
    p.add_argument("--html", type=Path, default=None, metavar="OUT",
                   help="write the timeline page with its data inlined to OUT (opens without a worker)")
    p.add_argument("--as-of", default=None, metavar="TIME",
                   help="with --html: the state at this clinical time (ISO 8601 with its offset)")
    p.add_argument("--from", dest="start", default=None, metavar="TIME",
                   help="with --html: only the memories from this clinical time (default: the whole record)")
    p.add_argument("--to", dest="end", default=None, metavar="TIME", help="with --html: ... up to this one")
    p.set_defaults(fn=cmd_state)
