"""``stam deadletters list|show|replay|dismiss``: dead letters and the record gaps they leave."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from stam.cli.context import load_settings, one_line, table
from stam.errors import DeadLetterError


def cmd_deadletters(args: argparse.Namespace) -> int:
    """list|show|replay|dismiss: read the dead-letter topic from offset 0; act on one dead letter by its id."""
    settings = load_settings(needs=("broker", "redis"))  # first: no stack, no imports of the stores

    # deferred: redis, aiokafka are slow to import; stam.deadletters and others pull in igraph (kept off `stam --help`)
    import redis
    from aiokafka.errors import KafkaError

    from stam import deadletters as dl
    from stam.backends.redis_state import RedisStateStore
    from stam.transport import redis_client

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an unreachable broker is said in one line below
    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    try:
        if args.action == "list":
            if args.id:
                raise DeadLetterError("`list` takes no id (filters: --patient, --stage, --status)")
        elif not args.id:
            raise DeadLetterError(f"`{args.action}` needs a dead letter id (PARTITION:OFFSET, from `list`)")
        else:
            dl.parse_id(args.id)
        value = None
        if args.action == "replay" and args.value_file:
            try:
                value = Path(args.value_file).read_bytes()
            except OSError as exc:
                raise DeadLetterError(f"cannot read --value-file {args.value_file}: {exc.strerror}") from None
        if args.action == "dismiss" and not (args.reason and args.reason.strip()):
            raise DeadLetterError("dismiss needs --reason (why the entry may stay out of the record)")
        letters = dl.with_status(asyncio.run(dl.read_letters(settings)), states)
        if args.action == "list":
            rows = [x for x in letters
                    if (args.patient is None or x.patient_id == args.patient)
                    and (args.stage is None or (x.letter is not None and x.letter.stage == args.stage))
                    and (args.status is None or x.status.startswith(args.status))]
            if args.json:
                print(json.dumps([x.summary() for x in rows], indent=2))
            elif not rows:
                print("no dead letters" + (" matching the filters" if len(letters) else ""))
            else:
                print(table([{**x.summary(), "patient_id": x.patient_id or "(unknown: no gap)",
                               "entry_id": x.entry_id or "-", "error": one_line(x.summary()["error"], 60),
                               "failed_at": x.letter.failed_at.strftime("%Y-%m-%d %H:%M:%S") if x.letter else ""}
                              for x in rows],
                             [("id", "id"), ("status", "status"), ("stage", "stage"), ("error_type", "error"),
                              ("patient_id", "patient"), ("entry_id", "entry"), ("failed_at", "failed at"),
                              ("error", "reason")]))
            return 0
        item = dl.find(letters, args.id)
        if args.action == "show":
            print(json.dumps(dl.show(item), indent=2, default=str))
            return 0
        if args.action == "replay":
            plan = dl.plan_replay(item, settings, value)
            sent = asyncio.run(dl.publish_replay(settings, plan, dl.signed(settings, plan, args.source_system)))
            log = dl.record_replay(states, item, plan, sent, by=args.by)
            print(json.dumps({"id": item.id, **log, "patient_id": item.patient_id, "entry_id": plan.entry_id,
                              "note": "the gap closes when the worker applies the entry"
                              if item.patient_id else "no gap: patient unknown"}))
            return 0
        print(json.dumps({"id": item.id, "patient_id": item.patient_id, "entry_id": item.entry_id,
                          **dl.dismiss(states, item, args.reason, by=args.by)}))
        return 0
    except DeadLetterError as exc:
        print(f"stam deadletters {args.action}: {exc}", file=sys.stderr)
        return 2
    except (KafkaError, redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        where = "Redis" if isinstance(exc, redis.RedisError) else "broker"
        print(f"stam deadletters {args.action}: {where} unreachable ({type(exc).__name__}: {one_line(str(exc), 120)})"
              f"; is the stack up (`stam stack status`)?", file=sys.stderr)
        return 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("deadletters", help="list, show, replay or dismiss dead letters (and the record gaps they "
                       "leave)",
                       description="list: every dead letter on the dead-letter topic from offset 0, with its id "
                       "(PARTITION:OFFSET), stage, error, patient and entry, and status (open: the patient's record "
                       "has a gap; replayed; applied; dismissed; superseded; no gap: patient unknown). show ID: the "
                       "decoded value, error and coordinates. replay ID: publish the original bytes again to the "
                       "topic they came from, when they pass its schema (a fault outside the message, since "
                       "fixed), or --value-file with a corrected payload; a publisher's bad file is refused (fix "
                       "it and publish it again). The gap closes when the worker applies the entry. dismiss ID "
                       "--reason R: close the gap without applying the entry; who, when and why are kept.")
    p.add_argument("action", choices=["list", "show", "replay", "dismiss"],
                   help="list, show ID, replay ID or dismiss ID (see above)")
    p.add_argument("id", nargs="?", default=None, help="dead letter id, PARTITION:OFFSET (show, replay, dismiss)")
    p.add_argument("--patient", default=None, help="list: only this patient's dead letters")
    p.add_argument("--stage", default=None, help="list: only this stage's (extract, link, impact, update, "
                   "publish:fhir-r4...)")
    p.add_argument("--status", default=None, help="list: only this status (open, replayed, applied, dismissed...)")
    p.add_argument("--json", action="store_true", help="list: JSON")
    p.add_argument("--value-file", default=None, help="replay: a corrected payload (JSON) instead of the original")
    p.add_argument("--source-system", default=None, help="replay to the entries topic: sign the entry as this "
                   "configured source system (where entries must be signed; a dead letter keeps no headers)")
    p.add_argument("--reason", default=None, help="dismiss: why the entry may stay out of the record (required)")
    p.add_argument("--by", default=None, help="replay, dismiss: who (default: the OS user)")
    p.set_defaults(fn=cmd_deadletters)
