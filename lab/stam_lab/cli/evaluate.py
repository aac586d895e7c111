"""``stam eval state|qa|gate|questions``: the instruments of the paper's evaluation."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from stam.cli.context import LazyBar, emit_report, table
from stam.sources.mimic import TABLES as MIMIC_TABLES
from stam_lab.cli.replay import add_replay_options, check_sources
from stam_lab.eval.mimic_qa import PER_PATIENT as MIMIC_QA_PER_PATIENT
from stam_lab.eval.mimic_qa import balanced_sample, build_questions, read_jsonl, write_jsonl
from stam_lab.eval.provenance import stamp


def cmd_eval_state(args: argparse.Namespace) -> int:
    check_sources(args)  # before any model loads

    # deferred: stam.embedding, stam_lab.eval.state_eval and others pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.embedding import Embedder
    from stam_lab.eval.state_eval import VARIANTS, evaluate_mimic
    from stam_lab.eval.synthea import evaluate_synthea

    variants = list(VARIANTS) if args.variant == "all" else args.variant.split(",")
    subjects = args.subjects.split(",") if args.subjects else None
    tables = args.tables.split(",")
    head: dict[str, Any] = ({"eval": "state", "source": "mimic-iv", "mimic": args.mimic, "subjects": subjects,
                             "tables": tables} if args.source == "mimic" else
                            {"eval": "state", "source": "synthea-r4", "synthea": args.synthea, "patients": subjects})
    embedder = Embedder()
    reports: list[dict[str, Any]] = []
    for variant in variants:
        bar = LazyBar(desc=f"replaying ({variant})", unit=" entries", disable=args.quiet, mininterval=0.5)
        progress = bar.to

        with tempfile.TemporaryDirectory(prefix="stam-eval-") as work:
            common: dict[str, Any] = {"variant": variant, "workdir": Path(work), "embedder": embedder,
                                      "progress": progress, "samples_per_patient": args.samples,
                                      "timeline_patient": args.timeline_patient}
            if args.source == "mimic":
                reports.append(evaluate_mimic(Path(args.mimic), subjects=subjects, tables=tables, **common))
            else:
                reports.append(evaluate_synthea(Path(args.synthea), patients=subjects, **common))
        bar.close()
        if args.out:  # after each variant, so a long run keeps what it has measured
            Path(args.out).write_text(json.dumps(stamp({**head, "reports": reports}), indent=2) + "\n")
    rows = [{"variant": r["variant"], "recall": r["pairs"]["recall"], "archived": r["pairs"]["archived"],
             "ceiling": r["pairs"]["impact_ceiling"], "false": r["false_archival"]["rate"],
             "ended": r.get("ended", {}).get("in_history"), "fraction": r["archived_fraction"],
             "pit": r.get("point_in_time", {}).get("agreement"),
             "pit_int": r.get("point_in_time", {}).get("interval_agreement"),
             "pairs": r["pairs"]["total"], "entries": r["entries"], "seconds": r["seconds"]} for r in reports]
    print(table(rows, [("variant", "variant"), ("recall", "pair recall"), ("archived", "old archived"),
                        ("ceiling", "impact ceiling"), ("false", "false archival"), ("ended", "ended in HISTORY"),
                        ("fraction", "archived frac"), ("pit", "point-in-time"), ("pit_int", "pit intervals"),
                        ("pairs", "gold pairs"), ("entries", "entries"), ("seconds", "s")]), file=sys.stderr)
    out = {**head, "reports": reports}
    if args.plot:
        # deferred: stam_lab.eval.plots (kept off `stam --help`)
        from stam_lab.eval.plots import plot_timeline

        series = [(r["variant"], r["timeline"]["points"]) for r in reports if r.get("timeline")]
        if series:
            title = f"ACTIVE and HISTORY over clinical time: one {head['source']} patient"
            out["plot"] = str(plot_timeline(series, Path(args.plot), title=title))
            print(f"plot: {out['plot']}", file=sys.stderr)
    return emit_report(stamp(out), args.out)


def cmd_eval_qa(args: argparse.Namespace) -> int:
    # deferred: stam.read.reader, stam_lab.eval.qa_run pull in igraph, numpy, prometheus_client (kept off `stam --help`)
    from stam.read.reader import LocalReader, OpenAIReader
    from stam_lab.eval.qa_run import READER_SYSTEM, evaluate_qa

    root = Path(args.mimic)
    source = read_jsonl(args.questions) if args.questions else build_questions(root, per_patient=args.per_patient,
                                                                               seed=args.seed)
    questions = [q for q in source if q.split == args.split and (not args.types or q.qtype in args.types)]
    patients = sorted({q.patient_id for q in questions})[: args.patients or None]
    questions = [q for q in questions if q.patient_id in set(patients)]
    if args.limit:
        questions = balanced_sample(questions, args.limit, seed=args.seed)
    tables = tuple(args.tables.split(",")) if args.tables else None
    reader: Any = None
    if args.reader_url:
        reader = OpenAIReader(args.reader_url, args.reader_model, api_key=os.environ.get("STAM_READER_API_KEY", ""),
                              timeout_s=600.0, max_tokens=64, system=READER_SYSTEM)
    elif args.reader_local:
        reader = LocalReader(args.reader_local, system=READER_SYSTEM)
    bar = LazyBar(desc="replaying", unit=" entries", disable=args.quiet, mininterval=0.5)
    progress = bar.to
    answers = LazyBar(desc="answering", unit=" answers", disable=args.quiet or reader is None, mininterval=1.0)
    answered = answers.to

    gate = None
    if args.deletion_gate:
        # deferred: stam.deletion.gate pulls in numpy (kept off `stam --help`)
        from stam.deletion.gate import Gate

        try:
            gate = Gate.load(Path(args.deletion_gate))
        except ValueError as exc:
            print(f"stam eval qa: {exc}", file=sys.stderr)
            return 2
        if args.replay_dir and not (Path(args.replay_dir) / "stam").is_dir():
            print("stam eval qa: --deletion-gate deletes from the replay; keep one first (a run without "
                  "--deletion-gate and the same --replay-dir), it is then used through a copy", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="stam-eval-qa-") as work:
        workdir = Path(args.replay_dir or work)
        if gate is not None and args.replay_dir and (workdir / "stam").is_dir():
            # Deletion changes the stores: a kept replay is used through a copy, and stays as it was.
            shutil.copytree(workdir / "stam", Path(work) / "stam")
            workdir = Path(work)
        report = evaluate_qa(root, questions, workdir=workdir, budget=args.budget,
                             rag_k=args.rag_k, tables=tables, progress=progress, reader=reader, match=args.match,
                             keep_rows=args.rows, answer_progress=answered, keep_replay=bool(args.replay_dir),
                             systems=args.systems, deletion_gate=gate)
    bar.close()
    answers.close()
    rows = [{"system": name, **{k: v for k, v in s.items() if not isinstance(v, dict)}}
            for name, s in report["systems"].items()]
    columns = [("system", "system"), ("evidence_recall", "evidence recall"), ("type_macro_recall", "type-macro"),
               ("all_evidence", "all evidence"), ("tokens_mean", "tokens mean"), ("tokens_median", "tokens median")]
    if reader is not None:
        columns += [("f1", "F1"), ("em", "EM"), ("type_macro_f1", "type-macro F1")]
    print(table(rows, columns), file=sys.stderr)
    if "matching" in report:
        print(f"context matching: {report['matching']}", file=sys.stderr)
    out = {"eval": "qa", "mimic": str(root), "split": args.split, **report}
    if args.plot:
        # deferred: stam_lab.eval.plots (kept off `stam --help`)
        from stam_lab.eval.plots import plot_score_vs_tokens

        score = "f1" if reader is not None else "evidence_recall"
        out["plot"] = str(plot_score_vs_tokens(report["systems"], Path(args.plot), score=score,
                                               title=f"MIMIC-QA ({args.split}, {len(questions)} questions): "
                                               f"{score.replace('_', ' ')} vs served tokens"))
        print(f"plot: {out['plot']}", file=sys.stderr)
    return emit_report(stamp(out), args.out)


def cmd_eval_gate(args: argparse.Namespace) -> int:
    check_sources(args)  # before any model loads

    # deferred: stam.compose, stam.embedding and others pull in pymilvus, igraph, redis (kept off `stam --help`)
    from stam.compose import local_query_service
    from stam.embedding import Embedder
    from stam.read.reader import LocalReader, OpenAIReader
    from stam.read.store_gate import StoreGate, calibrate, write_gate_file
    from stam.read.tokens import load_tokenizer
    from stam_lab.eval.gate_eval import labelled_samples, mimic_samples, report, synthea_items
    from stam_lab.eval.qa_run import READER_SYSTEM
    from stam_lab.eval.state_eval import replay_mimic

    reader: Any = (OpenAIReader(args.reader_url, args.reader_model, timeout_s=600.0, max_tokens=64,
                                system=READER_SYSTEM) if args.reader_url
                   else LocalReader(args.reader_local, system=READER_SYSTEM))

    def answer(question: str, evidence: str) -> str:
        if hasattr(reader, "answer_sync"):
            return str(reader.answer_sync(question, evidence))
        return str(asyncio.run(reader.answer(question, evidence)))

    embedder = Embedder()
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    gate = StoreGate()
    out: dict[str, Any] = {"eval": "gate", "reader": reader.name, "lambdas": args.lambdas}
    samples: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="stam-eval-gate-") as work:
        if args.mimic:
            root = Path(args.mimic)
            questions = [q for q in build_questions(root, per_patient=args.per_patient) if q.split == args.split]
            random.Random(args.seed).shuffle(questions)
            subjects = sorted({q.patient_id for q in questions})
            run = replay_mimic(root, subjects=subjects, tables=args.tables.split(","), variant="stam",
                               workdir=Path(args.replay_dir or work) / "stam", embedder=embedder,
                               keep=bool(args.replay_dir))
            try:
                svc = local_query_service(run.deps, embedder=embedder, tokenizer=tokenizer, gate=gate)
                got, rows = mimic_samples(svc, questions, answer, limit=args.limit)
            finally:
                run.close()
            samples += got
            out["mimic"] = report(got, args.lambdas) | {"split": args.split, "rows": rows if args.rows else None}
        if args.synthea:
            run, items = synthea_items(Path(args.synthea), Path(work) / "synthea", embedder, patients=None,
                                       per_patient=args.per_patient)
            try:
                random.Random(args.seed).shuffle(items)
                svc = local_query_service(run.deps, embedder=embedder, tokenizer=tokenizer, gate=gate)
                got, rows = labelled_samples(svc, items, answer, limit=args.limit)
            finally:
                run.close()
            samples += got
            out["synthea"] = report(got, args.lambdas) | {"rows": rows if args.rows else None}
    if not samples:
        print("stam eval gate: give --mimic and/or --synthea", file=sys.stderr)
        return 2
    out["both"] = report(samples, args.lambdas)
    chosen = calibrate(samples, args.lambdas[0])
    out["chosen"] = chosen.as_dict()
    if args.write:
        write_gate_file(Path(args.write), chosen, source=f"stam eval gate ({reader.name})")
        out["written"] = args.write
    return emit_report(stamp(out), args.out)


def cmd_eval_questions(args: argparse.Namespace) -> int:
    subjects = args.subjects.split(",") if args.subjects else None
    questions = build_questions(Path(args.mimic), per_patient=args.per_patient, seed=args.seed, subjects=subjects)
    write_jsonl(questions, Path(args.out))
    print(json.dumps(stamp({"questions": len(questions), "out": args.out,
                      "by_type": dict(sorted(Counter(q.qtype for q in questions).items())),
                      "by_split": dict(sorted(Counter(q.split for q in questions).items())),
                      "patients": len({q.patient_id for q in questions})}), indent=2))
    return 0


def cmd_eval_lifecycle(args: argparse.Namespace) -> int:
    check_sources(args)  # before any model loads

    # deferred: stam.embedding, stam_lab.eval.lifecycle and others pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.embedding import Embedder
    from stam_lab.eval import lifecycle
    from stam_lab.eval.state_eval import replay_mimic
    from stam_lab.eval.synthea import replay_synthea

    subjects = args.subjects.split(",") if args.subjects else None
    if args.replay and args.source != "mimic":
        print("stam eval lifecycle: --replay keeps a MIMIC-IV replay; Synthea's bundles replay in a minute",
              file=sys.stderr)
        return 2
    bar = LazyBar(desc="replaying", unit=" entries", disable=args.quiet, mininterval=0.5)
    progress = bar.to
    with tempfile.TemporaryDirectory(prefix="stam-eval-") as work:
        if args.source == "mimic":
            root = Path(args.mimic)
            run = replay_mimic(root, subjects=subjects, tables=args.tables.split(","), variant="stam",
                               workdir=Path(args.replay) if args.replay else Path(work), embedder=Embedder(),
                               progress=progress, keep=bool(args.replay))
            gold = lifecycle.mimic_gold(root, subjects)
        else:
            run, raws = replay_synthea(Path(args.synthea), variant="stam", workdir=Path(work), patients=subjects,
                                       embedder=Embedder(), progress=progress)
            gold = lifecycle.synthea_gold(raws)
        run.close()
        bar.close()
        report = lifecycle.evaluate(gold, dict(run.events), samples=args.samples, seed=args.seed)
    out = {"eval": "lifecycle", "source": args.source, "subjects": subjects,
           "entries": sum(len(v) for v in run.entries.values()), "replay_seconds": round(run.seconds, 1), **report}
    if args.replay:  # the code that wrote a kept replay may be older than this evaluation's (a before/after pair)
        written = json.loads((Path(args.replay) / "replay.json").read_text()).get("written_by")
        out["replay_written_by"] = written or "not recorded (a replay kept before replays named their commit)"
    rows = [{"at": name, **{k: out[name][k] for k in ("times", "precision", "recall", "active_units", "gold_units",
                                                      "active_from_ended_admission")}}
            for name in ("latest", "sampled")]
    print(table(rows, [("at", "at"), ("times", "times"), ("precision", "precision"), ("recall", "recall"),
                       ("active_units", "ACTIVE units"), ("gold_units", "gold units"),
                       ("active_from_ended_admission", "from ended admissions")]), file=sys.stderr)
    return emit_report(stamp(out), args.out)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("eval", help="evaluation: write-time state diagnostics (MIMIC-IV, Synthea), MIMIC-QA with "
                       "baselines and a reader, plots",
                       description="Instruments of the paper's evaluation (sections 4-6, appendices A-F).")
    ev = p.add_subparsers(dest="eval_command", required=True)
    _register_state(ev)
    _register_lifecycle(ev)
    _register_qa(ev)
    _register_gate(ev)
    _register_questions(ev)


def _register_state(ev: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam eval state``: write-time state diagnostics against gold read from the data."""
    q = ev.add_parser("state", help="replay MIMIC-IV patients or Synthea bundles and diagnose the state against "
                      "gold read from the data",
                      description="Gold from the data, never from STAM: MIMIC-IV POE Change and D/C links, pharmacy "
                      "stops, repeated labs; Synthea medication renewals and stops, condition abatements, repeated "
                      "observations. Supersession-pair recall, impact-candidate ceiling, false archival, ended facts "
                      "in HISTORY, archived fraction, point-in-time agreement. Prints a table on stderr and the JSON "
                      "report on stdout (and --out); --plot draws one patient's ACTIVE/HISTORY over time.")
    add_replay_options(q, source="mimic")
    q.add_argument("--plot", help="write a PNG of one patient's ACTIVE/HISTORY sizes over time, per variant")
    q.add_argument("--timeline-patient", default="auto",
                   help="the patient of the timeline (default: the one with the most transitions)")
    q.add_argument("--variant", default="stam", help="stam, semantic-only, no-relations, rule-measurement-dose, "
                   "rule-non-episodic, append-only; comma-separated, or 'all'")
    q.add_argument("--samples", type=int, default=10, help="point-in-time samples per patient")
    q.add_argument("--out", help="also write the JSON report here")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_eval_state)


def _register_lifecycle(ev: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam eval lifecycle``: ACTIVE orders and medications against the rows at sampled times."""
    q = ev.add_parser("lifecycle", help="does ACTIVE mean true now: ACTIVE orders and medications against what the "
                      "raw tables say is active at sampled clinical times",
                      description="Every table of the chosen MIMIC-IV patients (or the Synthea bundles) through the "
                      "write path, then, at each patient's latest clinical time and at --samples sampled times, the "
                      "precision and recall of ACTIVE medication and order memories against the rows (admission "
                      "open, not discontinued by a D/C or a Change, inside the pharmacy window; Synthea: "
                      "MedicationRequest status, Encounter periods), and the ACTIVE ones from an admission already "
                      "discharged. Gold from the data only (lab/stam_lab/eval/lifecycle.py).")
    add_replay_options(q, source="mimic")
    q.set_defaults(tables=",".join(MIMIC_TABLES))
    q.add_argument("--samples", type=int, default=20, help="sampled clinical times per patient (default 20)")
    q.add_argument("--seed", type=int, default=0, help="seed of the sampled times")
    q.add_argument("--replay", help="keep the MIMIC-IV replay in this folder and reuse it when it holds the patients "
                   "(all tables; the whole demo takes about an hour here)")
    q.add_argument("--out", help="also write the JSON report here")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_eval_lifecycle)


def _register_qa(ev: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam eval qa``: MIMIC-QA, STAM against the baselines, with a reader's F1/EM."""
    q = ev.add_parser("qa", help="MIMIC-QA: STAM versus append-only, flat RAG, full context (evidence, tokens, "
                      "and a reader's F1/EM)",
                      description="Replays the split's patients (every MIMIC-IV table unless --tables) under "
                      "STAM, then for each question, asked at its clinical time (as_of), measures what each system "
                      "serves a reader: STAM, STAM with HISTORY always served, append-only (the same memories, none "
                      "ever ended, cosine top-k), STAM's read path over that append-only state, flat RAG over the "
                      "entries, full context. Reported: gold-evidence recall, tokens, paired tests against STAM, "
                      "and items STAM served as current that the rows say were replaced. With --reader-url (an "
                      "OpenAI-compatible endpoint such as `stam serve`) or --reader-local (a packaged GGUF model in "
                      "process), the same reader answers from every system's context: token F1, exact match, "
                      "McNemar/bootstrap/sign-flip against STAM. --match runs STAM again at a comparator's median "
                      "context size (appendix C.5).")
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2", help="MIMIC-IV folder (hosp/, icu/)")
    q.add_argument("--split", default="test", choices=["train", "dev", "test"],
                   help="the questions' split (default test)")
    q.add_argument("--questions", help="a question set (JSONL from `stam eval questions`) instead of building one")
    q.add_argument("--types", nargs="+", help="only these question types")
    q.add_argument("--limit", type=int, default=0, help="N questions after the other filters, a seeded sample with "
                   "the question types in equal shares (0: all)")
    q.add_argument("--tables", help="MIMIC-IV tables to replay, comma-separated (default: every table the loader "
                   "reads, the distractors a real record has)")
    q.add_argument("--replay-dir", help="keep the replay in this folder and reuse it next time (a replay of the "
                   "whole demo with every table takes most of an hour here)")
    q.add_argument("--systems", nargs="+", help="systems to run (default: stam, stam-both, append-only, "
                   "append-only+threads, flat-rag, full-context; also the rendering controls stam-no-facts and "
                   "stam-neutral); stam always runs")
    q.add_argument("--patients", type=int, default=0, help="first N patients of the split (0: all)")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT,
                   help="questions per patient when the set is built (default %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="seed of the question set and of --limit's sample "
                   "(default 0)")
    q.add_argument("--budget", type=int, default=4000, help="full-context token budget")
    q.add_argument("--rag-k", type=int, default=16, help="flat RAG: entries retrieved per question (default 16)")
    q.add_argument("--reader-url", help="OpenAI-compatible base URL of the reader (e.g. http://127.0.0.1:8000/v1)")
    q.add_argument("--reader-model", default="qwen2.5-coder-1.5b-instruct-q4_k_m", help="model name at --reader-url")
    q.add_argument("--reader-local", help="packaged GGUF model run in process by llama.cpp "
                   "(qwen2.5-coder-1.5b-instruct-q4_k_m or qwen2.5-coder-0.5b-instruct-q4_k_m)")
    q.add_argument("--match", choices=["append-only", "flat-rag", "full-context"],
                   help="also run STAM at this system's median context size")
    q.add_argument("--rows", action="store_true", help="keep every question's row (answers, tokens) in the report")
    q.add_argument("--deletion-gate", metavar="DIR", help="a calibrated deletion gate (`stam deletion calibrate "
                   "--gate-out`): after the other systems, its sweep is applied to the replay and STAM reads again "
                   "as stam+deletion, paired with stam (what deletion costs in answers, saves in memories and tokens)")
    q.add_argument("--plot", help="write a PNG of each system's score versus served tokens")
    q.add_argument("--out", help="also write the JSON report here")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.set_defaults(fn=cmd_eval_qa)


def _register_gate(ev: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam eval gate``: the store gate calibrated with a reader."""
    q = ev.add_parser("gate", help="calibrate the store gate with a reader on MIMIC-QA and Synthea",
                      description="For the questions whose wording does not ask for the past (the only ones the "
                      "threshold decides), the reader answers from the ACTIVE-only packet and from the packet with "
                      "both stores; they agree when ACTIVE alone does as well (MIMIC-QA: token F1 against the rows' "
                      "answer at least as high; Synthea, questions derived from the stored state: the same answer). "
                      "Reports, per lambda, the threshold minimising disagreement - lambda * skip rate, with its "
                      "skip rate, disagreement and served tokens, per source and for both; --write saves the first "
                      "lambda's threshold as a gate file (STAM_GATE_FILE).")
    q.add_argument("--mimic", help="MIMIC-IV folder (questions of --split, every table replayed)")
    q.add_argument("--split", default="train", choices=["train", "dev", "test"],
                   help="MIMIC-IV: the questions' split (default train)")
    q.add_argument("--replay-dir", help="keep/reuse the MIMIC-IV replay here")
    q.add_argument("--synthea", help="folder of Synthea FHIR bundles (questions derived from their state)")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT,
                   help="questions per patient (default %(default)s)")
    q.add_argument("--limit", type=int, default=120, help="questions answered by the reader per source")
    q.add_argument("--seed", type=int, default=0, help="seed of the questions' order (default 0)")
    q.add_argument("--lambda", dest="lambdas", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.5, 1.0],
                   help="quality/serving trade-offs reported; the first is chosen (default 0.0 0.1 0.2 0.5 1.0)")
    q.add_argument("--reader-url", help="OpenAI-compatible base URL of the reader")
    q.add_argument("--reader-model", default="qwen2.5-coder-1.5b-instruct-q4_k_m",
                   help="model name at --reader-url (default %(default)s)")
    q.add_argument("--reader-local", default="qwen2.5-coder-0.5b-instruct-q4_k_m",
                   help="packaged GGUF model run in process (when no --reader-url)")
    q.add_argument("--write", help="write the first lambda's calibrated threshold to this gate file")
    q.add_argument("--rows", action="store_true", help="keep every question's answers in the report")
    q.add_argument("--out", help="also write the JSON report here")
    q.set_defaults(fn=cmd_eval_gate)


def _register_questions(ev: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stam eval questions``: the MIMIC-QA question set as JSONL."""
    q = ev.add_parser("questions", help="build the deterministic MIMIC-QA question set (JSONL)")
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2", help="MIMIC-IV folder (hosp/, icu/)")
    q.add_argument("--subjects", help="comma-separated subject_ids (default: all)")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT,
                   help="questions per patient (default %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="seed of the choices among candidates (default 0)")
    q.add_argument("--out", default="mimic-qa.jsonl", help="the JSONL file to write (default %(default)s)")
    q.set_defaults(fn=cmd_eval_questions)
