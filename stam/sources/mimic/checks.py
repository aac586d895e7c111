"""A check of a MIMIC-IV load against the state it produced: every POE 'Change' and 'D/C' order ended the order it
names (:func:`poe_check`, used by the integration tests and the ingest benchmark)."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


def poe_check(export: Callable[[str], dict[str, Any]], root: str | Path,
              subjects: set[str] | None = None) -> dict[str, Any]:
    """Check every POE 'Change' and 'D/C' order of the selected patients against their exported state
    (``export(subject_id)`` returns the ``stam state --json`` shape):

    - a 'Change' order X of Y: no memory of order Y is left ACTIVE, and one of them is in HISTORY with
      reason ``superseded`` and successor = the memory of X;
    - a 'D/C' order Z of Y: no memory of order Y is left ACTIVE and Z's memory is in HISTORY.

    Returns counts (``change_ok``, ``change_wrong``, ``dc_ok``, ``dc_wrong``, ``*_target_not_in_data``) and up
    to ten examples of wrong ones.
    """
    with gzip.open(Path(root) / "hosp" / "poe.csv.gz", "rt", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["transaction_type"] in ("Change", "D/C")
                and (subjects is None or r["subject_id"] in subjects)]
    by_subject: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_subject.setdefault(r["subject_id"], []).append(r)
    out: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    for subject, orders in by_subject.items():
        ex = export(subject)
        mems = ex["active"] + ex["history"]
        by_entry: dict[str, list[dict[str, Any]]] = {}
        by_order: dict[str, list[dict[str, Any]]] = {}
        for m in mems:
            by_entry.setdefault(m["source_entry_id"], []).append(m)
            ref = m["source_ref"] or ""
            if "/poe-" in ref:
                by_order.setdefault(ref.split("/poe-", 1)[1], []).append(m)
        for r in orders:
            kind = "change" if r["transaction_type"] == "Change" else "dc"
            new = by_entry.get(f"mimic-iv:poe:{r['poe_id']}", [])
            olds = by_order.get(r["discontinue_of_poe_id"], [])
            if not new:
                out[f"{kind}_missing_entry"] += 1
                continue
            if not olds:
                out[f"{kind}_target_not_in_data"] += 1
                continue
            still_active = [m for m in olds if m["store"] == "active"]
            if kind == "change":
                linked = [m for m in olds if m["reason"] == "superseded" and m["successor_id"] == new[0]["memory_id"]]
                good = not still_active and bool(linked)
            else:
                good = not still_active and new[0]["store"] == "history"
            out[f"{kind}_{'ok' if good else 'wrong'}"] += 1
            if not good and len(failures) < 10:
                failures.append({"poe_id": r["poe_id"], "of": r["discontinue_of_poe_id"], "kind": kind,
                                 "old": [(m["store"], m["reason"], m["source_entry_id"]) for m in olds]})
    return {"counts": dict(sorted(out.items())), "examples_of_wrong": failures}
