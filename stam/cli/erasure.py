"""``stam rebuild`` (a patient's stores from the transitions topic) and ``stam erase`` (a patient everywhere,
verified, with a receipt)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from stam.cli.context import load_settings
from stam.config import Settings


async def _patient_transitions(settings: Settings, patient_id: str) -> list[Any]:
    # deferred: stam.read.asof pulls in igraph, redis, numpy (kept off `stam --help`)
    from stam.read.asof import read_patient_transitions

    return await read_patient_transitions(settings, patient_id)


def cmd_rebuild(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker", "redis", "milvus"))  # first: no stack, no imports of the stores

    # deferred: stam.compose, stam.rebuild pull in pymilvus, igraph, redis (kept off `stam --help`)
    from stam.compose import build_deps
    from stam.rebuild import rebuild

    if _refuse_erased(settings, args.patient):
        return 1
    deps = build_deps(settings)
    if deps.states.load(args.patient).version != 0:
        print(f"patient {args.patient} already has state; erase it first (rebuild writes into empty stores)",
              file=sys.stderr)
        return 1
    events = asyncio.run(_patient_transitions(settings, args.patient))
    if not events:
        print(f"no transitions for patient {args.patient}", file=sys.stderr)
        return 1
    state = rebuild(args.patient, events, deps)
    print(json.dumps({"patient_id": args.patient, "transitions": len(events), "state_version": state.version,
                      **state.counts()}))
    return 0


def _refuse_erased(settings: Settings, patient_id: str) -> bool:
    """An erased patient is never rebuilt from the transition log (the erasure register, or a shredded key)."""
    # deferred: stam.erase, stam.transport pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.erase import is_erased
    from stam.transport import redis_client

    if is_erased(settings, redis_client(settings), patient_id):
        print("this patient was erased (see its receipt on the audit topic); rebuild refuses", file=sys.stderr)
        return True
    return False


def cmd_erase(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker", "redis", "milvus"))  # first: no stack, no imports of the stores

    # deferred: stam.erase pulls in igraph, redis, numpy (kept off `stam --help`)
    from stam import erase

    for name in ("pymilvus", "pymilvus.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if not args.patient.strip():
        print("stam erase: --patient must name a patient", file=sys.stderr)
        return 2
    try:
        if args.verify:
            out: dict[str, Any] = erase.scan(settings, args.patient, args.sample_text)
            print(json.dumps(out, indent=2))
            return 0 if out["verified"] else 1
        training = _training(args)
        if args.dry_run:
            plan = erase.plan(settings, args.patient)
            plan["training"] = training
            print(json.dumps(plan, indent=2) if args.json else
                  "would erase: " + ", ".join(f"{k} {v}" for k, v in plan["counts"].items())
                  + f"; topics: {plan['topics']}")
            return 0
        result = erase.erase(settings, args.patient, request_id=args.request_id, samples=args.sample_text)
    except Exception as exc:  # noqa: BLE001 - one line for the operator; the erasure can be run again
        print(f"stam erase: failed: {type(exc).__name__}: {str(exc).replace(args.patient, '<patient>')[:300]} "
              "(running it again is safe)", file=sys.stderr)
        return 1
    receipt = result["receipt"]
    if args.json:
        print(json.dumps({"receipt": receipt, "published": result["published"], "scan": result["scan"],
                          "training": training}, indent=2))
    else:
        print(json.dumps(receipt, indent=2))
        where = {k: v for k, v in result["scan"]["where"].items() if v and result["scan"]["residuals"].get(k)}
        if where:
            print("residuals: " + json.dumps(where), file=sys.stderr)
    if training["adapters"] or training["trace_sets"]:
        print(f"stam erase: {len(training['adapters'])} adapter(s) and {len(training['trace_sets'])} trace set(s) "
              "learnt from this patient; retrain them without it: " + json.dumps(training), file=sys.stderr)
    if not result["published"]:
        print("stam erase: the receipt could not be published to the audit topic (printed above)", file=sys.stderr)
        return 3
    return 0 if receipt["verification"]["verified"] else 1


def _training(args: argparse.Namespace) -> dict[str, list[str]]:
    """Adapters and trace sets under --training-dir that learnt from the patient (stam train records them)."""
    # deferred: stam.erase.lineage pulls in igraph, redis, numpy (kept off `stam --help`)
    from stam.erase.lineage import trained_on

    return trained_on(args.patient, args.training_dir)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("rebuild", help="rebuild a patient's stores from the transitions topic")
    p.add_argument("--patient", required=True, help="the patient's id (its stores must be empty; an erased "
                   "patient is refused)")
    p.set_defaults(fn=cmd_rebuild)

    p = sub.add_parser("erase", help="erase a patient everywhere, verify with an independent scan, publish a receipt",
                       description="Removes the patient from Redis (every key by exact name, the patients set; then "
                       "the append-only file and the RDB snapshot are rewritten), Milvus (delete, flush; Milvus Lite "
                       "rewrites the collection, a server compacts), JSON Lines files under STAM_HOME and the gate's "
                       "calibration set (lines naming the patient), log files (the id redacted), and shreds the "
                       "patient's data key when crypto-shredding is installed. Then scans Redis, Milvus, every topic "
                       "from offset 0 and every file under STAM_HOME for the id and sample texts, and publishes a "
                       "receipt without patient data on the audit topic. Exit status: 0 verified, 1 residuals or "
                       "failure, 3 receipt not published.")
    p.add_argument("--patient", required=True, help="the patient's id")
    p.add_argument("--request-id", default=None, help="the caller's reference of the request, kept on the receipt")
    p.add_argument("--dry-run", action="store_true", help="count what would be removed, per store; change nothing")
    p.add_argument("--verify", action="store_true", help="only scan for the id and --sample-text texts; change "
                   "nothing (exit 0 when no residual)")
    p.add_argument("--sample-text", nargs="*", default=[], metavar="TEXT",
                   help="texts of the patient to search for besides the id (erase also picks distinctive ones)")
    p.add_argument("--json", action="store_true", help="print the receipt, the scan and whether it was published")
    p.add_argument("--training-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="where adapters and teacher traces are kept (repeatable): those that learnt from the "
                   "patient are listed (model weights cannot forget one patient: retrain them without it)")
    p.set_defaults(fn=cmd_erase)
