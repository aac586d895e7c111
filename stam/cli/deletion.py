"""``stam deletion calibrate``: the deletion gate's labels, scorer and threshold on a replayed store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stam.cli.common import add_replay_options, emit_report, table

GUARANTEE = ("What tau guarantees, as narrowly as the paper states it: if the concept types the gate meets are "
             "exchangeable with the calibration types, the expected deletion loss over a new concept type is at "
             "most alpha, loss measured against the endurance labels (judge or codes). Safe-to-forget types add "
             "no loss, so this is not a per-class bound on protected types; it bounds neither deletion precision "
             "nor any memory's clinical risk, and it is only as good as the labels.")


def cmd_calibrate(args: argparse.Namespace) -> int:
    import tempfile

    from stam.deletion.judge import agreement, read_labels, write_labels
    from stam.deletion.run import calibration_run, candidate_types, label_types
    from stam.embedding import Embedder
    from stam.llm.client import LLMClient

    subjects = args.subjects.split(",") if args.subjects else None
    embedder = Embedder()
    with tempfile.TemporaryDirectory(prefix="stam-deletion-") as work:
        print(f"replaying {args.source} ...", file=sys.stderr)
        if args.source == "mimic":
            from stam.eval.state import replay_mimic

            run = replay_mimic(Path(args.mimic), subjects=subjects, tables=args.tables.split(","), variant="stam",
                               workdir=Path(work), embedder=embedder)
        else:
            from stam.eval.synthea import replay_synthea

            run, _ = replay_synthea(Path(args.synthea), variant="stam", workdir=Path(work), patients=subjects,
                                    embedder=embedder)
        try:
            types, kept = candidate_types(run.deps.states.load(p) for p in sorted(run.entries))
        finally:
            run.close()
    judge = LLMClient(args.judge_url, args.judge_model or "default", timeout_s=120) if args.judge_url else None
    if args.labels and Path(args.labels).exists() and not args.relabel:
        labels, codes = read_labels(Path(args.labels)), label_types(types)[1]
        print(f"labels read from {args.labels}", file=sys.stderr)
    else:
        from tqdm import tqdm

        with tqdm(total=len(types), desc=f"labelling ({'judge ' + judge.model if judge else 'codes only'})",
                  unit=" types", file=sys.stderr, disable=judge is None) as bar:
            labels, codes = label_types(types, judge=judge, progress=lambda n, _total: bar.update(n - bar.n))
        if args.labels:
            write_labels(Path(args.labels), labels)
    report: dict[str, Any] = {"source": args.source, "subjects": subjects, "kept_by_rule": kept,
                              "labels": "judge" if any(x.source == "judge" for x in labels) else "codes",
                              "codes_vs_labels": agreement(codes, labels)}
    report |= calibration_run(types, labels, embedder.embed, encoder=embedder.model_name, alpha=args.alpha,
                              seed=args.seed, rounds=args.rounds)
    report["guarantee"] = GUARANTEE
    rows = [{"where": f"{where} ({c})", **{k: v for k, v in d.items() if k != "memories"}}
            for where in ("calibration_split", "held_out", "store") for c, d in report[where].items()]
    print(table(rows, [("where", "where (criterion)"), ("tau", "tau"), ("deleted", "deleted"),
                       ("removed_share", "removed"), ("safe_recall", "safe recall"),
                       ("safe_precision", "safe precision"), ("never_forget_loss", "NF loss"),
                       ("uncertain_loss", "uncertain loss")]), file=sys.stderr)
    print(f"resplit check: {json.dumps(report['resplit'])}", file=sys.stderr)
    return emit_report(report, args.out)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("deletion", help="the conservative deletion gate (being built: calibration only; nothing "
                       "is deleted yet)",
                       description="The paper's deletion gate (section 3.5). " + GUARANTEE)
    d = p.add_subparsers(dest="deletion_command", required=True)
    q = d.add_parser("calibrate", help="replay a store, label its candidates' concept types, train the scorer, "
                     "choose tau on the sealed calibration split and report the diagnostics",
                     description="Replays MIMIC-IV patients or Synthea bundles on private stores, takes the gate's "
                     "candidates (archived memories the record does not need), labels their concept types (the "
                     "blinded judge at --judge-url, else what codes say), splits types train/dev/calibration, "
                     "trains the head, picks tau by conformal risk control (strict; never-forget-only as a "
                     "diagnostic) and prints the paper's diagnostics (JSON on stdout and --out, a table on stderr). "
                     "Deletes nothing. " + GUARANTEE)
    add_replay_options(q, source="synthea")
    q.add_argument("--judge-url", help="OpenAI-compatible endpoint of the label judge (e.g. `stam serve`'s "
                   "http://127.0.0.1:8000/v1); without it, labels come from codes and types they do not decide "
                   "are left out")
    q.add_argument("--judge-model", help="model name to ask the judge endpoint for")
    q.add_argument("--labels", help="JSON-lines label file: read if it exists (unless --relabel), else written")
    q.add_argument("--relabel", action="store_true", help="label again even if --labels exists")
    q.add_argument("--alpha", type=float, default=0.01, help="the risk level of the conformal bound (default 0.01)")
    q.add_argument("--seed", type=int, default=0, help="seed of the type splits and the head's training")
    q.add_argument("--rounds", type=int, default=200, help="random re-splits for the guarantee check")
    q.add_argument("--out", help="also write the JSON report here")
    q.set_defaults(fn=cmd_calibrate)
