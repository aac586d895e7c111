"""``stam deletion calibrate|label``: the deletion gate's labels, scorer and threshold on a replayed store.

Registered under the product's ``stam deletion`` group from this lab part's entry points (``stam.cli.deletion``;
see ``stam/cli/lab.py``): the replay of a MIMIC-IV or Synthea data set is the evaluation's (``stam_lab.eval``)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stam.cli.context import emit_report, table
from stam.cli.deletion import GUARANTEE
from stam_lab.cli.replay import add_replay_options, check_sources

if TYPE_CHECKING:
    from schemas import AtomicMemory
    from stam.deletion.judge import Label

    Types = dict[str, list[AtomicMemory]]


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_sources(args)  # before any model loads
    # deferred: stam.deletion.judge, stam.embedding pull in redis, numpy, prometheus_client (kept off `stam --help`)
    from stam.deletion.judge import agreement
    from stam.embedding import Embedder

    subjects = args.subjects.split(",") if args.subjects else None
    embedder = Embedder()
    types, kept = _candidates(args, subjects, embedder)
    labels, codes = _labels(args, types)
    report: dict[str, Any] = {"source": args.source, "subjects": subjects, "kept_by_rule": kept,
                              "labels": "+".join(sorted({x.source for x in labels})) or "none",
                              "codes_vs_labels": agreement(codes, labels)}
    labelled = {x.concept_type for x in labels}
    if getattr(args, "label_only", False):
        report["types"] = {"candidates": len(types), "labelled": len(labels),
                           "by_label": {e: sum(1 for x in labels if x.endurance.value == e)
                                        for e in ("safe-to-forget", "uncertain", "never-forget")}}
        # what is left for a judge (--judge-url) or a person: labels can be added to the file by hand
        report["unlabelled_types"] = sorted(t for t in types if t not in labelled)
        return emit_report(report, args.out)
    classes = {x.endurance.protected for x in labels if x.concept_type in types}
    if len(classes) < 2:
        have = "no" if not classes else ("only protected" if classes == {True} else "only safe-to-forget")
        print(f"stam deletion calibrate: the labels hold {have} candidate types; the head needs both safe and "
              f"protected ones (label more types: --judge-url, or add labels to --labels)", file=sys.stderr)
        return 2
    _calibrate(args, types, labels, embedder, report)
    rows = [{"where": f"{where} ({c})", **{k: v for k, v in d.items() if k != "memories"}}
            for where in ("calibration_split", "held_out", "store") for c, d in report[where].items()]
    print(table(rows, [("where", "where (criterion)"), ("tau", "tau"), ("deleted", "deleted"),
                       ("removed_share", "removed"), ("safe_recall", "safe recall"),
                       ("safe_precision", "safe precision"), ("never_forget_loss", "NF loss"),
                       ("uncertain_loss", "uncertain loss")]), file=sys.stderr)
    print(f"resplit check: {json.dumps(report['resplit'])}", file=sys.stderr)
    return emit_report(report, args.out)


def _candidates(args: argparse.Namespace, subjects: list[str] | None,
                embedder: Any) -> tuple[Types, dict[str, int]]:
    """The replay of --source on private stores (kept in --replay-dir when given) and the gate's candidate concept
    types in it, with what the keep rules held back."""
    # deferred: stam.deletion.run pulls in igraph, numpy, prometheus_client (kept off `stam --help`)
    from stam.deletion.run import candidate_types

    with tempfile.TemporaryDirectory(prefix="stam-deletion-") as work:
        print(f"replaying {args.source} ...", file=sys.stderr)
        if args.source == "mimic":
            # deferred: stam_lab.eval.state_eval pulls in igraph, prometheus_client, orjson (kept off `stam --help`)
            from stam_lab.eval.state_eval import replay_mimic

            run = replay_mimic(Path(args.mimic), subjects=subjects, tables=args.tables.split(","), variant="stam",
                               workdir=Path(args.replay_dir or work), embedder=embedder, keep=bool(args.replay_dir))
        else:
            # deferred: stam_lab.eval.synthea pulls in igraph, prometheus_client, orjson (kept off `stam --help`)
            from stam_lab.eval.synthea import replay_synthea

            run, _ = replay_synthea(Path(args.synthea), variant="stam", workdir=Path(args.replay_dir or work),
                                    patients=subjects, embedder=embedder, keep=bool(args.replay_dir))
        try:
            return candidate_types(run.deps.states.load(p) for p in sorted(run.entries))
        finally:
            run.close()


def _labels(args: argparse.Namespace, types: Types) -> tuple[list[Label], list[Label]]:
    """The candidate types' endurance labels (--labels read, the judge at --judge-url for the rest, else codes) and
    what codes say, for the agreement; --labels written as they come."""
    # deferred: tqdm is slow to import; stam.deletion.judge and others pull in igraph, numpy (kept off `stam --help`)
    from tqdm import tqdm

    from stam.deletion.judge import append_label, read_labels, write_labels
    from stam.deletion.run import label_types
    from stam.llm.client import LLMClient

    judge = LLMClient(args.judge_url, args.judge_model or "default", timeout_s=120) if args.judge_url else None
    path = Path(args.labels) if args.labels else None
    known = read_labels(path) if path is not None and path.exists() and not args.relabel else []
    if known:
        print(f"{len(known)} labels read from {path}", file=sys.stderr)
    if path is not None and (args.relabel or not path.exists()):
        path.write_text("")
    todo = sum(1 for t in types if t not in {x.concept_type for x in known}) if judge else 0
    if args.judge_limit:
        todo = min(todo, args.judge_limit)
    with tqdm(total=todo, desc=f"labelling ({judge.model if judge else 'codes only'})", unit=" types",
              file=sys.stderr, disable=not todo) as bar:
        labels, codes = label_types(types, judge=judge, known=known, limit=args.judge_limit, seed=getattr(args, "seed", 0),
                                    progress=lambda n, _total: bar.update(n - bar.n),
                                    on_label=(lambda x: append_label(path, x)) if path is not None else None)
    if path is not None and judge is None and not known:
        write_labels(path, labels)
    return labels, codes


def _calibrate(args: argparse.Namespace, types: Types, labels: list[Label], embedder: Any,
               report: dict[str, Any]) -> None:
    """The head trained and tau chosen at the first --alpha (the others: diagnostics), into ``report``; the gates
    written to --gate-out."""
    # deferred: stam.deletion.calibrate, stam.deletion.run pull in igraph, numpy, prometheus_client (kept off `stam --help`)
    from stam.deletion.calibrate import STRICT
    from stam.deletion.run import calibration_run

    alpha, *others = args.alpha
    embedded: dict[tuple[str, ...], Any] = {}

    def embed(texts: list[str]) -> Any:  # every alpha's run embeds the same memories: once is enough
        key = tuple(texts)
        if key not in embedded:
            embedded[key] = embedder.embed(texts)
        return embedded[key]

    run_report, gates = calibration_run(types, labels, embed, encoder=embedder.model_name,
                                        alpha=alpha, seed=args.seed, rounds=args.rounds)
    report |= run_report
    report["guarantee"] = GUARANTEE
    written = {alpha: gates}
    if others:  # the same head and split, the threshold at other risk levels: diagnostics beside the gate's
        report["other_alphas"] = {}
        for a in others:
            more, written[a] = calibration_run(types, labels, embed, encoder=embedder.model_name, alpha=a,
                                               seed=args.seed, rounds=args.rounds)
            report["other_alphas"][str(a)] = {k: more[k] for k in ("tau", "calibration_id", "calibration_split",
                                                                   "held_out", "store", "resplit")}
    if args.gate_out:
        report["gate"] = []
        for a, g in written.items():
            gate = g[STRICT]  # never-forget-only is the paper's diagnostic, never used to delete
            folder = Path(args.gate_out) if a == alpha else Path(f"{args.gate_out}-alpha{a}")
            gate.save(folder)
            report["gate"].append({"path": str(folder), **gate.spec.as_dict()})
            tau = gate.spec.as_dict()["tau"]
            print(f"gate written to {folder} (alpha {a}, {gate.spec.calibration_id}, tau "
                  f"{tau}{': deletes nothing' if tau is None else ''})", file=sys.stderr)


def _label_options(q: argparse.ArgumentParser) -> None:
    add_replay_options(q, source="synthea")
    q.add_argument("--judge-url", help="OpenAI-compatible endpoint of the label judge (e.g. `stam serve`'s "
                   "http://127.0.0.1:8000/v1); without it, labels come from codes and types they do not decide "
                   "are left out")
    q.add_argument("--judge-model", help="model name to ask the judge endpoint for")
    q.add_argument("--labels", help="JSON-lines label file: the labels in it are used (unless --relabel) and the "
                   "judge labels only the types it lacks, appending each label as it comes (a run can be resumed)")
    q.add_argument("--relabel", action="store_true", help="label again even if --labels exists")
    q.add_argument("--judge-limit", type=int, default=0, metavar="N", help="judge at most N unlabelled types, a "
                   "seeded random sample (the rest stay out of the calibration; a store has thousands of types)")
    q.add_argument("--replay-dir", help="keep the replay in this folder and reuse it next time, for the same patients "
                   "(and MIMIC-IV tables): a replay of many MIMIC-IV patients with every table takes tens of minutes "
                   "here")


def register_calibrate(d: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam deletion calibrate``."""
    q = d.add_parser("calibrate", help="replay a store, label its candidates' concept types, train the scorer, "
                     "choose tau on the sealed calibration split and report the diagnostics",
                     description="Replays MIMIC-IV patients or Synthea bundles on private stores, takes the gate's "
                     "candidates (archived memories the record does not need), labels their concept types (the "
                     "blinded judge at --judge-url, else what codes say), splits types train/dev/calibration, "
                     "trains the head, picks tau by conformal risk control (strict; never-forget-only as a "
                     "diagnostic) and prints the paper's diagnostics (JSON on stdout and --out, a table on stderr). "
                     "Deletes nothing. " + GUARANTEE)
    _label_options(q)
    q.add_argument("--alpha", type=float, nargs="+", default=[0.01], help="the risk level of the conformal bound "
                   "(default 0.01); more values report the same head's threshold at those levels too (diagnostics; "
                   "with --gate-out, each one's gate goes to DIR-alpha<A>)")
    q.add_argument("--seed", type=int, default=0, help="seed of the type splits and the head's training")
    q.add_argument("--rounds", type=int, default=200, help="random re-splits for the guarantee check")
    q.add_argument("--out", help="also write the JSON report here")
    q.add_argument("--gate-out", metavar="DIR", help="write the calibrated gate (head.npz, gate.json: the strict "
                   "criterion's tau) here, for `stam deletion sweep --gate`")
    q.set_defaults(fn=cmd_calibrate)


def register_label(d: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam deletion label``: the first step of ``calibrate`` alone."""
    q = d.add_parser("label", help="replay a store and label its candidates' concept types (the judge, else "
                     "codes), resumable; no training, no threshold",
                     description="The first step of `calibrate` alone: replays MIMIC-IV patients or Synthea bundles "
                     "on private stores, takes the gate's candidates and labels their concept types (the blinded "
                     "judge at --judge-url, else codes), appending to --labels; `calibrate --labels` then uses them. "
                     "JSON report (label counts, codes versus judge) on stdout.")
    _label_options(q)
    q.add_argument("--out", help="also write the JSON report here")
    q.set_defaults(fn=cmd_calibrate, label_only=True)
