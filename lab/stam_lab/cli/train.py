"""``stam train``: teacher traces and LoRA adapters for the write modules (lab/stam_lab/training)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from stam.errors import ServeOptionError, TrainingError, WeightsError
from stam.net import free_port
from stam_lab.training.lora import Recipe, check_traces, train

DEFAULT_TEACHER = "qwen2.5-coder-1.5b-instruct-q4_k_m"
DEFAULT_STUDENT = "qwen2.5-coder-0.5b-instruct-q4_k_m"
GOLD = Path("benchmarks/gold/synthea_notes.json")


def _default_notes_dir() -> Path:
    shared = Path(os.environ.get("STAM_SHARED_DATA", "../shared/data"))
    return shared / "synthea-bulk-10p"



def cmd_traces(args: argparse.Namespace) -> int:
    # deferred: stam_lab.training.teacher pulls in prometheus_client (kept off `stam --help`)
    from stam_lab.training.teacher import NOTES_FILE, collect, excluded_patients

    notes_dir = args.notes_dir or _default_notes_dir()
    if not (notes_dir / NOTES_FILE).is_file():
        print(f"stam train traces: {notes_dir / NOTES_FILE} not found (give --notes-dir)", file=sys.stderr)
        return 2
    gold = args.exclude_gold if args.exclude_gold is not None else ([GOLD] if GOLD.is_file() else [])
    missing = [g for g in gold if not g.is_file()]
    if missing:
        print(f"stam train traces: --exclude-gold {missing[0]} not found", file=sys.stderr)
        return 2
    exclude = excluded_patients(notes_dir, gold)
    print(f"excluding {len(exclude)} patients of the gold notes ({', '.join(map(str, gold)) or 'none given'})",
          file=sys.stderr)
    url, stop = args.teacher_url, None
    if not url:
        # deferred: stam.serving.app, stam.serving.config and others pull in fastapi (kept off `stam --help`)
        from stam.serving.app import run
        from stam.serving.config import ServingConfig
        from stam.serving.options import local_engine

        try:
            engine = local_engine(args.engine, args.teacher_model, n_ctx=args.n_ctx)
        except (WeightsError, ServeOptionError) as exc:
            print(f"stam train traces: {exc}", file=sys.stderr)
            return 2
        port = free_port()
        print(f"starting the teacher {args.teacher_model} ({args.engine}, Ray Serve) on port {port}", file=sys.stderr)
        run(ServingConfig(engine=engine, port=port), blocking=False, num_cpus=2)
        url = f"http://127.0.0.1:{port}/v1"

        def stop() -> None:
            # deferred: optional ray (stam[llm]), not installed everywhere (kept off `stam --help`)
            import ray
            from ray import serve

            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # kill PID (a service manager's stop) ends the run as Ctrl-C does

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        manifest = collect(notes_dir, args.out, url=url, model=args.teacher_model, notes=args.notes,
                           per_patient=args.per_patient, exclude=exclude, val_fraction=args.val_fraction,
                           seed=args.seed, resume=args.resume, patients_at_once=args.patients_at_once,
                           parallel=args.parallel)
    except TrainingError as exc:
        print(f"stam train traces: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stam train traces: stopped; the finished patients are kept in {args.out} "
              "(the same command with --resume goes on)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if stop is not None:
            stop()
    summary = {s: {k: v for k, v in d.items() if k in ("notes", "traces")} | {"patients": len(d["patients"])}
               for s, d in manifest["splits"].items()}
    print(json.dumps({"out": str(args.out), "teacher": manifest["teacher"], "seconds": manifest["seconds"],
                      "splits": summary, "failed": len(manifest["failed"])}))
    return 0


def cmd_lora(args: argparse.Namespace) -> int:
    # deferred: stam.llm.convert (kept off `stam --help`)
    from stam.llm.convert import ensure_hf

    try:
        check_traces(args.module, args.traces)
    except TrainingError as exc:
        print(f"stam train lora: {exc}", file=sys.stderr)
        return 2
    try:
        base = ensure_hf(args.base) if args.base_dir is None else args.base_dir
    except WeightsError as exc:
        print(f"stam train lora: {exc}", file=sys.stderr)
        return 2
    recipe = Recipe(rank=args.rank, alpha=args.alpha, dropout=args.dropout, learning_rate=args.lr,
                    warmup_ratio=args.warmup, max_grad_norm=args.clip, batch_size=args.batch, epochs=args.epochs,
                    max_steps=args.max_steps, max_length=args.max_length, seed=args.seed)
    out = args.out or Path(f"adapters/{args.module}")
    try:
        report = train(args.module, args.traces, base, out, recipe, base_name=args.base if args.base_dir is None
                       else args.base_dir.name, max_train=args.max_train, max_val=args.max_val)
    except TrainingError as exc:
        print(f"stam train lora: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("train", help="teacher traces and LoRA adapters for the write modules",
                       description="Fine-tune the write modules (the paper's appendix 'Write-Module Fine-Tuning'): "
                       "record a teacher's validated calls over chosen notes, then train one LoRA adapter per "
                       "module on the student. Traces and adapters list the patients they come from.")
    tsub = p.add_subparsers(dest="train_command", required=True)
    t = tsub.add_parser("traces", help="run a teacher over notes; write train/val traces split by patient",
                        description="Each chosen patient's coded history and notes go through the write-path stages "
                        "on private stores; every validated model call of the teacher is recorded. Without "
                        "--teacher-url the packaged --teacher-model is served here (llama.cpp).")
    t.add_argument("--out", type=Path, required=True, help="folder for train.jsonl, val.jsonl, manifest.json")
    t.add_argument("--teacher-url", default="", help="any OpenAI-compatible endpoint (base URL ending in /v1)")
    t.add_argument("--teacher-model", default=DEFAULT_TEACHER, help=f"model name (default {DEFAULT_TEACHER})")
    t.add_argument("--notes-dir", type=Path, default=None,
                   help="FHIR bulk-export folder with DocumentReference.000.ndjson (default "
                   "$STAM_SHARED_DATA/synthea-bulk-10p, else ../shared/data/synthea-bulk-10p)")
    t.add_argument("--notes", type=int, default=120, help="notes to run the teacher on (default 120)")
    t.add_argument("--per-patient", type=int, default=20, help="latest notes per patient (default 20; Synthea's "
                   "export here has 1,215 notes of 13 patients)")
    t.add_argument("--exclude-gold", type=Path, nargs="*", default=None,
                   help=f"gold files whose notes' patients are never chosen (default {GOLD} when present)")
    t.add_argument("--val-fraction", type=float, default=0.1, help="share of patients for validation (default 0.1)")
    t.add_argument("--seed", type=int, default=0, help="seed of the patient order and of the split (default 0)")
    t.add_argument("--n-ctx", type=int, default=4096, help="context of the local teacher (llama.cpp)")
    t.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp",
                   help="engine of the local teacher: llamacpp (default) or vllm (make vllm-setup; batches the "
                   "calls of --patients-at-once and --parallel)")
    t.add_argument("--patients-at-once", type=int, default=1,
                   help="patients run side by side, each on its own stores (default 1)")
    t.add_argument("--parallel", type=int, default=1, help="judgements of one note in flight together (default 1)")
    t.add_argument("--resume", action="store_true",
                   help="go on with the unfinished run in --out (same options): finished patients are kept "
                   "(Ctrl-C or SIGTERM stops a run after the current entries)")
    t.set_defaults(fn=cmd_traces)

    r = Recipe()
    lo = tsub.add_parser("lora", help="train one write module's LoRA adapter on traces (peft)",
                         description="The paper's recipe by default; CUDA when torch sees a GPU, else CPU. Prints "
                         "a JSON report (steps, seconds per step, peak memory, losses) and writes it beside "
                         "the adapter.")
    lo.add_argument("--module", required=True, choices=["extract", "update"],
                    help="extract: extraction calls; update: the link+update judgement (one call here)")
    lo.add_argument("--traces", type=Path, required=True, help="a folder written by stam train traces")
    lo.add_argument("--out", type=Path, default=None, help="adapter folder (default adapters/MODULE)")
    lo.add_argument("--base", default=DEFAULT_STUDENT, help=f"packaged student model (default {DEFAULT_STUDENT})")
    lo.add_argument("--base-dir", type=Path, default=None, help="an HF model folder instead of a packaged model")
    lo.add_argument("--rank", type=int, default=r.rank, help=f"LoRA rank (default {r.rank})")
    lo.add_argument("--alpha", type=int, default=r.alpha, help=f"LoRA scaling alpha (default {r.alpha})")
    lo.add_argument("--dropout", type=float, default=r.dropout, help=f"LoRA dropout (default {r.dropout})")
    lo.add_argument("--lr", type=float, default=r.learning_rate, help=f"learning rate (default {r.learning_rate})")
    lo.add_argument("--warmup", type=float, default=r.warmup_ratio, help="share of steps warming up")
    lo.add_argument("--clip", type=float, default=r.max_grad_norm, help="gradient-norm clipping")
    lo.add_argument("--batch", type=int, default=r.batch_size, help="effective batch (accumulated)")
    lo.add_argument("--epochs", type=int, default=r.epochs, help=f"at most this many epochs (default {r.epochs})")
    lo.add_argument("--max-steps", type=int, default=0, help="stop after N optimiser steps (0: epochs decide)")
    lo.add_argument("--max-length", type=int, default=r.max_length, help="longer examples are dropped")
    lo.add_argument("--max-train", type=int, default=0,
                    help="train on a seeded sample of at most N traces (0: all; a CPU pays seconds per example)")
    lo.add_argument("--max-val", type=int, default=64,
                    help="validation loss over at most N traces (default 64; 0: all)")
    lo.add_argument("--seed", type=int, default=r.seed, help="seed of the initialisation, the shuffle and samples")
    lo.set_defaults(fn=cmd_lora)

