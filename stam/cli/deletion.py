"""``stam deletion sweep``: a deployment's archived memories scored with a calibrated gate, the deletions ordered.

``stam deletion calibrate|label`` (the gate calibrated on a replayed data set) are the lab part's: registered from
it where it is installed (``stam_lab/cli/calibrate.py``; see ``stam/cli/lab.py``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from stam.cli.context import emit_report, load_settings, table
from stam.cli.lab import register as register_lab

GUARANTEE = ("What tau guarantees, as narrowly as the paper states it: if the concept types the gate meets are "
             "exchangeable with the calibration types, the expected deletion loss over a new concept type is at "
             "most alpha, loss measured against the endurance labels (judge or codes). Safe-to-forget types add "
             "no loss, so this is not a per-class bound on protected types; it bounds neither deletion precision "
             "nor any memory's clinical risk, and it is only as good as the labels.")


def cmd_sweep(args: argparse.Namespace) -> int:
    # deferred: stam.deletion.gate pulls in numpy (kept off `stam --help`)
    from stam.deletion.gate import Gate

    try:
        gate = Gate.load(Path(args.gate))
    except ValueError as exc:
        print(f"stam deletion sweep: {exc}", file=sys.stderr)
        return 2
    # deferred: stam.backends.redis_state, stam.deletion.sweep and others pull in igraph, redis (kept off `stam --help`)
    from stam.backends.redis_state import RedisStateStore
    from stam.deletion.sweep import orders, publish_orders, scan, wait_applied
    from stam.embedding import Embedder
    from stam.transport import redis_client

    settings = load_settings(needs=("redis",) if args.dry_run else ("redis", "broker"))
    for name in ("pymilvus", "pymilvus.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    known = states.patients()
    patients = args.patient or known
    unknown = sorted(set(patients) - set(known))
    if unknown:
        print(f"stam deletion sweep: {len(unknown)} of the patients named have no state here", file=sys.stderr)
        return 2
    embedder = Embedder(settings.embedding_model)
    if embedder.model_name != gate.spec.encoder:
        print(f"stam deletion sweep: the gate scores {gate.spec.encoder} embeddings; this deployment embeds with "
              f"{embedder.model_name}", file=sys.stderr)
        return 2
    # deferred: tqdm is slow to import (kept off `stam --help`)
    from tqdm import tqdm

    swept, all_orders = [], []
    for one in tqdm(scan(states, embedder.embed, gate, patients), total=len(patients), desc="sweeping",
                    unit=" patients", file=sys.stderr, disable=len(patients) < 2):
        swept.append(one)
        all_orders.extend(orders(one, gate))
    memories = sum(x.memories for x in swept)
    chosen = sum(len(x.chosen) for x in swept)
    kept: dict[str, int] = {}
    for x in swept:
        for k, v in x.kept.items():
            kept[k] = kept.get(k, 0) + v
    report: dict[str, Any] = {
        "gate": gate.spec.as_dict(), "dry_run": args.dry_run, "patients": len(swept), "memories": memories,
        "history": sum(x.history for x in swept), "candidates": sum(x.candidates for x in swept),
        "kept_by_rule": kept, "delete": chosen, "delete_share": round(chosen / memories, 6) if memories else 0.0,
        "orders": len(all_orders), "by_patient": [x.summary() for x in swept],
        "guarantee": GUARANTEE,
    }
    if args.list:
        report["memories_to_delete"] = [
            {"patient_id": x.patient_id, "memory_id": s.memory.memory_id, "category": s.memory.category.value,
             "text": s.memory.text, "reason": s.reason.value if s.reason else None, "score": round(score, 6)}
            for x in swept for s, score in x.chosen]
    print(table([x.summary() for x in swept],
                [("patient_id", "patient"), ("memories", "memories"), ("history", "history"),
                 ("candidates", "candidates"), ("delete", "delete")]), file=sys.stderr)
    if gate.spec.as_dict()["tau"] is None:
        print("the gate's tau is infinite (no threshold met alpha on its calibration split): it deletes nothing",
              file=sys.stderr)
    if not args.dry_run and all_orders:
        report["sent"] = asyncio.run(publish_orders(settings, all_orders))
        print(f"{report['sent']} deletion orders sent ({chosen} memories); the update stage applies them",
              file=sys.stderr)
        if args.wait > 0:
            gone, left = wait_applied(states, all_orders, args.wait)
            report["applied"] = {"deleted": gone, "not_deleted": left}
            print(f"deleted {gone}; not deleted {left} (kept by the update stage, or not applied within "
                  f"{args.wait:.0f} s)" if left else f"deleted {gone}", file=sys.stderr)
    elif args.dry_run:
        print(f"dry run: {chosen} of {memories} memories would be deleted; nothing sent", file=sys.stderr)
    return emit_report(report, args.out)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("deletion", help="the conservative deletion gate: calibrate it on a replayed store, then "
                       "sweep a deployment's archived memories with it",
                       description="The paper's deletion gate (section 3.5). " + GUARANTEE)
    d = p.add_subparsers(dest="deletion_command", required=True)
    register_lab("deletion", d)  # calibrate, label: the lab part's (stam/cli/lab.py)

    w = d.add_parser("sweep", help="score this deployment's archived memories with a calibrated gate and order "
                     "the deletions (--dry-run: only list them)",
                     description="Reads every patient's state (or --patient's), takes the gate's candidates "
                     "(archived memories no keep rule holds: not before-current, not a thread's start, not related "
                     "to an ACTIVE memory, not coded never-forget: diagnoses, allergies, procedures, immunizations, "
                     "lab results), scores them with the gate's head and orders those scored at or over tau "
                     "deleted: orders go to stam.deletions.v1 and the update stage applies them as `deleted` "
                     "transitions (Redis, Milvus and source texts forget the memory; `stam rebuild` and as_of "
                     "reads honour it). JSON report on stdout, a table on stderr. " + GUARANTEE)
    w.add_argument("--gate", required=True, metavar="DIR", help="a gate written by `stam deletion calibrate "
                   "--gate-out`")
    w.add_argument("--dry-run", action="store_true", help="list what would go; send nothing")
    w.add_argument("--patient", action="append", help="sweep this patient only (repeatable); default: all")
    w.add_argument("--list", action="store_true", help="list each memory to delete (patient data) in the report")
    w.add_argument("--wait", type=float, default=0.0, metavar="S", help="after sending, wait up to S seconds "
                   "for the update stage to apply the orders and report what went")
    w.add_argument("--out", help="also write the JSON report here")
    w.set_defaults(fn=cmd_sweep)
