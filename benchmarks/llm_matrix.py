"""The write-model comparison of issue 19: the 0.5B student, the 0.5B with its LoRA adapters and the 1.5B
teacher, each on llama.cpp and on vLLM, scored the same way.

For each configuration it runs, in its own process:
- ``benchmarks.llm_notes`` on the six gold notes (their patients are never trained on): extraction precision,
  recall, F1; link+update calls per new memory; seconds per note;
- ``benchmarks.llm_agreement run`` on the held-out notes and judgement calls of ``--traces``,
then ``benchmarks.llm_agreement compare`` against the teacher's configuration (``--teacher``, by default the
1.5B on the engine that wrote the traces), paired against the base 0.5B on the same engine.

Each result is a file under ``--out`` and a configuration whose file exists is not run again, so the matrix
(hours on a 2-core CPU) can be stopped and continued; an agreement run cut off midway goes on from the notes and
calls its journal (``NAME.agree.json.journal``) already holds. The summary (JSON, stdout and ``summary.json``) has one row
per configuration.

Usage: python -m benchmarks.llm_matrix --traces runs/traces-1.5b --adapters runs/adapters [--out runs/bench-llm]
       [--only 0.5b-vllm,1.5b-vllm] [--notes 100] [--gold-notes 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from stam_lab.eval.provenance import stamp

STUDENT = "qwen2.5-coder-0.5b-instruct-q4_k_m"
TEACHER = "qwen2.5-coder-1.5b-instruct-q4_k_m"


def configs(adapters: Path | None) -> dict[str, list[str]]:
    """Name -> the model/engine/adapter arguments both benchmarks take."""
    out: dict[str, list[str]] = {}
    for engine in ("llamacpp", "vllm"):
        out[f"0.5b-{engine}"] = ["--model", STUDENT, "--engine", engine]
        if adapters is not None:
            out[f"0.5b+lora-{engine}"] = ["--model", STUDENT, "--engine", engine,
                                          "--lora", f"extract={adapters / 'extract'}",
                                          "--lora", f"update={adapters / 'update'}",
                                          "--extract-model", "extract", "--judge-model", "update"]
        out[f"1.5b-{engine}"] = ["--model", TEACHER, "--engine", engine]
    return out


def _run(cmd: list[str], out: Path) -> bool:
    """Run a benchmark writing JSON on stdout into ``out`` (kept only if it succeeded)."""
    print("$ " + " ".join(cmd), file=sys.stderr)
    part = out.with_suffix(".part")
    with part.open("w") as fh:
        rc = subprocess.call(cmd, stdout=fh)
    report = report_of(part.read_text()) if rc == 0 else None
    if report is None:
        print(f"{out.name}: exit {rc}{'' if rc else ', no JSON report'}; kept as {part.name}", file=sys.stderr)
        return False
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.chmod(0o600)
    part.unlink()
    return True


def report_of(text: str) -> dict[str, Any] | None:
    """The JSON report in a benchmark's stdout. Ray's log monitor can print a line of its own there at shutdown
    (``(raylet) Task ServeController.graceful_shutdown failed...``); such lines go to stderr, not into the
    report."""
    decoder = json.JSONDecoder()
    for i, line in enumerate(lines := text.splitlines(keepends=True)):
        if line.startswith("{"):
            try:
                report, _ = decoder.raw_decode("".join(lines[i:]))
            except ValueError:
                continue
            noise = "".join(lines[:i]).strip()
            if noise:
                print(noise, file=sys.stderr)
            return report if isinstance(report, dict) else None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, required=True, help="folder written by stam train traces")
    ap.add_argument("--adapters", type=Path, default=None, help="folder with extract/ and update/ adapters")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-llm"))
    ap.add_argument("--teacher", default="1.5b-vllm", help="configuration whose answers are the reference")
    ap.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    ap.add_argument("--notes", type=int, default=100, help="held-out notes for agreement (default 100)")
    ap.add_argument("--judgements", type=int, default=100, help="held-out judgement calls (default 100)")
    ap.add_argument("--gold-notes", type=int, default=0, help="first N gold notes (0: all six)")
    ap.add_argument("--skip-gold", action="store_true", help="agreement only")
    args = ap.parse_args(argv)
    if args.adapters is not None and not all((args.adapters / m / "adapter_config.json").is_file()
                                             for m in ("extract", "update")):
        print(f"llm_matrix: {args.adapters} needs extract/ and update/ adapter folders (stam train lora)",
              file=sys.stderr)
        return 2
    table = configs(args.adapters)
    only = [c for c in args.only.split(",") if c]
    unknown = set(only) - set(table)
    if unknown or args.teacher not in table:
        print(f"llm_matrix: unknown configuration {sorted(unknown) or args.teacher} (known: {', '.join(table)})",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    for name in only or list(table):
        gold, agree = args.out / f"{name}.gold.json", args.out / f"{name}.agree.json"
        if not args.skip_gold and not gold.exists():
            _run([py, "-m", "benchmarks.llm_notes", *table[name], "--notes", str(args.gold_notes)], gold)
        if not agree.exists():
            cmd = [py, "-m", "benchmarks.llm_agreement", "run", "--traces", str(args.traces), *table[name],
                   "--notes", str(args.notes), "--judgements", str(args.judgements), "--out", str(agree)]
            print("$ " + " ".join(cmd), file=sys.stderr)
            if subprocess.call(cmd, stdout=subprocess.DEVNULL) != 0:
                print(f"{agree.name}: failed", file=sys.stderr)
    summary = stamp(summarise(args.out, table, args.teacher))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


def summarise(out: Path, table: dict[str, list[str]], teacher: str) -> dict[str, Any]:
    """One row per configuration from the files present."""
    from benchmarks import llm_agreement

    rows: dict[str, Any] = {}
    ref = out / f"{teacher}.agree.json"
    agreement: dict[str, Any] = {}
    if ref.exists():
        for engine in ("llamacpp", "vllm"):
            runs = [out / f"{n}.agree.json" for n in table if n.endswith(engine) and (out / f"{n}.agree.json").exists()]
            base = out / f"0.5b-{engine}.agree.json"
            if not runs:
                continue
            scores = llm_agreement.score(argparse.Namespace(teacher=ref, runs=runs, resamples=2000, seed=0,
                                                            baseline=base if base.exists() else None))
            for path, r in scores["runs"].items():
                agreement[Path(path).name.removesuffix(".agree.json")] = r
    for name in table:
        row: dict[str, Any] = {}
        gold = out / f"{name}.gold.json"
        if gold.exists():
            g = json.loads(gold.read_text())
            row["gold"] = {"notes": g["notes"], "dead_lettered": g["dead_lettered_notes"], **g["extraction"],
                           "link_update_calls_per_new_memory": g["link_update_calls_per_new_memory"],
                           "seconds_per_note": g["seconds_per_note"]["mean"]}
        if name in agreement:
            a = agreement[name]
            row["agreement"] = {"notes_vs_teacher": a["extraction"], "judgements_vs_teacher_traces": a["judgement"],
                                "seconds_per_note": a["seconds_per_note"]}
        if row:
            rows[name] = row
    return {"benchmark": "llm_matrix", "teacher": teacher, "configurations": rows}


if __name__ == "__main__":
    raise SystemExit(main())
