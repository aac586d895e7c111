"""Agreement of a write model with its teacher on held-out work: does the student (the 0.5B, with or without its
adapters) answer what the teacher (the 1.5B that wrote the training traces) would?

Two steps, so that each configuration runs once and any pair can be compared:

``run``: one configuration (packaged model, engine, adapters) over
- extraction of held-out notes: the latest ``--per-patient`` notes of each patient who is in neither split of
  the traces (``--traces``: its ``manifest.json``; with Synthea's 13 note patients here these are the patients
  of the gold notes, never trained on), ``--notes`` in all, through ``ModelReasoner.extract`` exactly as the
  write path calls it (schema-constrained, grounded, de-duplicated);
- the held-out link+update calls: every link+update prompt of the traces' validation patients, sent as the
  teacher saw it (the teacher's own reply is in the trace).
It writes the facts, judgements, seconds and tokens per item to ``--out`` (JSON). Each finished item goes to
``OUT.journal`` first, so a run stopped midway goes on from there when the same command is given again.

``compare``: a reference run (``--teacher``: the teacher's own run over the same notes) against each other run:
- extraction: facts matched one-to-one by name words (Dice >= 0.5, as ``benchmarks/llm_notes.py`` scores the
  gold set); micro precision/recall/F1 of the student's facts against the teacher's, status agreement over the
  matched pairs;
- judgement: against the teacher's traced reply, the share of calls with the same verdict on the new fact
  (current/past), the same set of ended facts, and the same links (number and type), and all three at once;
- 95% CIs by bootstrap over notes (over calls for judgements), and for each run against ``--baseline`` a paired
  bootstrap CI of the difference (the same resampled notes for both), so "the adapter helps" is a statement
  with an interval, not two numbers side by side.

Usage:
  python -m benchmarks.llm_agreement run --traces DIR --model M [--engine vllm] [--lora extract=PATH ...]
         [--extract-model extract] [--judge-model update] --out runs/agree-NAME.json
  python -m benchmarks.llm_agreement compare --teacher runs/agree-1.5b.json [--baseline runs/agree-0.5b.json]
         runs/agree-*.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.llm_notes import match
from stam.net import free_port
from stam_lab.eval.provenance import stamp
from tests.conftest import DATA

BULK = DATA / "synthea-bulk-10p"
_NUMBERED = re.compile(r"^(\d+)\. ")


def current_count(messages: list[dict[str, str]]) -> int:
    """How many CURRENT facts a link+update prompt numbers (``prompts.judge_messages``' layout)."""
    n, inside = 0, False
    for line in messages[-1]["content"].splitlines():
        if line == "CURRENT:":
            inside = True
        elif line.startswith("PAST"):
            inside = False
        elif inside and _NUMBERED.match(line):
            n += 1
    return n


def call_key(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def held_out_notes(traces: Path, notes: int, per_patient: int, seed: int) -> tuple[dict[str, list[str]], set[str]]:
    """Patient -> NDJSON lines of held-out notes, and the patients the traces were written from."""
    from stam_lab.training.teacher import choose_notes

    manifest = json.loads((traces / "manifest.json").read_text())
    seen = {p for s in manifest["splits"].values() for p in s["patients"]}
    return choose_notes(BULK, notes=notes, per_patient=per_patient, exclude=seen, seed=seed), seen


class Journal:
    """The rows of a ``run`` as they finish, in ``OUT.journal`` (JSON lines, mode 0600: note facts), so that a run
    stopped midway (Ctrl-C, a kill, the end of a session) goes on from where it was: the same command skips the
    rows already there. The first line is the run's header (model, engine, adapters, prompt versions, the notes
    and calls chosen); a journal with another header is refused rather than mixed in. Removed once the report is
    written."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.path = out.with_name(out.name + ".journal")
        self.done: dict[str, dict[int, dict[str, Any]]] = {"note": {}, "judgement": {}}
        self.walls: dict[str, dict[int, float]] = {"note": {}, "judgement": {}}
        """Per kind, per run segment: seconds from the segment's start of that kind to its last finished row."""
        self.segment = 1
        if self.path.exists():
            lines = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
            if not lines or lines[0].get("header") != header:
                raise SystemExit(f"llm_agreement: {self.path} is another run's journal (model, adapters, prompts, "
                                 f"notes or calls differ); remove it to start again")
            for row in lines[1:]:
                self.done[row["kind"]][row["i"]] = row["row"]
                walls = self.walls[row["kind"]]
                walls[row["segment"]] = max(walls.get(row["segment"], 0.0), row["t"])
                self.segment = max(self.segment, row["segment"] + 1)
            print(f"llm_agreement: resuming {self.path.name}: {len(self.done['note'])} notes and "
                  f"{len(self.done['judgement'])} judgement calls already done", file=sys.stderr)
        else:
            self.path.write_text(json.dumps({"header": header}) + "\n")
            self.path.chmod(0o600)

    def phase(self, kind: str, pool: ThreadPoolExecutor, fn: Callable[[int], dict[str, Any]], n: int) -> None:
        """Run ``fn`` over the rows of ``kind`` not yet done, appending each as it finishes."""
        started = time.perf_counter()
        futures = {pool.submit(fn, i): i for i in range(n) if i not in self.done[kind]}
        try:
            with self.path.open("a") as fh:
                for fut in as_completed(futures):
                    i, row = futures[fut], fut.result()
                    t = round(time.perf_counter() - started, 1)
                    self.done[kind][i] = row
                    self.walls[kind][self.segment] = t
                    fh.write(json.dumps({"kind": kind, "i": i, "segment": self.segment, "t": t, "row": row}) + "\n")
                    fh.flush()
                    k = len(self.done[kind])
                    if kind == "note":
                        print(f"[extract {k}/{n}] {row['seconds']}s facts={len(row['facts'])}", file=sys.stderr)
                    elif k % 10 == 0 or k == n:
                        print(f"[judge {k}/{n}]", file=sys.stderr)
        except BaseException:  # Ctrl-C, a kill, a bug: what has not started does not start
            for fut in futures:
                fut.cancel()
            raise

    def rows(self, kind: str) -> list[dict[str, Any]]:
        return [self.done[kind][i] for i in sorted(self.done[kind])]

    def wall(self, kind: str) -> float:
        """Wall seconds of the finished rows of ``kind``, summed over the run's segments."""
        return round(sum(self.walls[kind].values()), 1)


def held_out_entries(args: argparse.Namespace) -> list[Any]:
    """The held-out notes (patients the traces never saw) as record entries; their text is not left on disk."""
    from stam.sources.fhir_ndjson import load_ndjson

    chosen, seen = held_out_notes(args.traces, args.notes, args.per_patient, args.seed)
    assert not set(chosen) & seen, "a held-out note of a patient the traces come from"
    lines = [line for ls in chosen.values() for line in ls]
    with tempfile.TemporaryDirectory(prefix="stam-agree-") as tmp:  # note text: not left beside the report
        (Path(tmp) / "DocumentReference.000.ndjson").write_text("\n".join(lines) + "\n")
        return list(load_ndjson([Path(tmp)]).entries)


def extract_row(client: Any, models: dict[str, str], entry: Any) -> dict[str, Any]:
    """One note's extraction by the served model: its facts (or the error), seconds and token usage."""
    from stam.errors import ReasoningError
    from stam.reasoning.language_model import ModelReasoner

    one = ModelReasoner(client, parallel=1, models=models)  # its own usage: tokens per note, kept on resume
    t = time.perf_counter()
    try:
        mems = one.extract(entry)
        facts = [[m.category.value, (m.embed_text or m.text).split(": ", 1)[-1], m.status or ""]
                 for m in mems if m.category.value != "note"]
        error = None
    except ReasoningError as exc:
        facts, error = [], str(exc)[:300]
    return {"note": entry.entry_id, "facts": facts, "error": error, "seconds": round(time.perf_counter() - t, 2),
            "usage": one.usage["extraction"].as_dict()}


def judgement_row(client: Any, trace: Any, *, max_tokens: int, model: str | None) -> dict[str, Any]:
    """One recorded link+update call asked of the served model: its reply (or the raw text it could not parse),
    the teacher's, seconds and tokens."""
    from stam.reasoning import prompts

    n_current = current_count(trace.messages)
    t = time.perf_counter()
    r = client.chat(trace.messages, schema=prompts.judgement_schema(n_current), schema_name="Judgement",
                    max_tokens=max_tokens, model=model)
    try:
        reply: dict[str, Any] | None = prompts.Judgement.model_validate_json(r.content).model_dump()
    except ValueError:
        reply = None
    return {"call": call_key(trace.messages), "reply": reply, "raw": None if reply else r.content[:500],
            "teacher": json.loads(trace.reply), "seconds": round(time.perf_counter() - t, 2),
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from stam.llm.client import LLMClient
    from stam.reasoning.language_model import ModelReasoner
    from stam.reasoning.traces import read_traces
    from stam.serving.app import run as serve_app
    from stam.serving.config import ServingConfig
    from stam.serving.options import local_engine, parse_loras

    entries = held_out_entries(args)
    judge = [t for t in read_traces(args.traces / "val.jsonl") if t.module == "update"][: args.judgements or None]

    loras = parse_loras(args.lora)
    models = {"extraction": args.extract_model, "link+update": args.judge_model}
    port = free_port()
    client = LLMClient(f"http://127.0.0.1:{port}/v1", args.model, timeout_s=1800, retries=1,
                       max_concurrency=args.concurrency)
    reasoner = ModelReasoner(client, parallel=1, models=models)
    journal = Journal(args.out, {
        "model": args.model, "engine": args.engine, "loras": loras, "adapters": models, "prompts": reasoner.prompts,
        "traces": str(args.traces), "seed": args.seed, "notes": [e.entry_id for e in entries],
        "calls": [call_key(t.messages) for t in judge]})
    engine = local_engine(args.engine, args.model, n_ctx=args.n_ctx, loras=loras)
    t0 = time.perf_counter()
    serve_app(ServingConfig(engine=engine, port=port), blocking=False, num_cpus=2, log_to_driver=False)
    serve_start_s = time.perf_counter() - t0

    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            journal.phase("note", pool, lambda i: extract_row(client, models, entries[i]), len(entries))
            journal.phase("judgement", pool, lambda i: judgement_row(
                client, judge[i], max_tokens=reasoner.judge_max_tokens, model=args.judge_model or None), len(judge))
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    report = stamp(run_report(args, journal, loras=loras, models=models, prompts=reasoner.prompts,
                              serve_start_s=serve_start_s))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.chmod(0o600)  # note facts: patient data
    journal.path.unlink()
    print(json.dumps({k: v for k, v in report.items() if k not in ("notes", "judgements")}))
    return 0


def run_report(args: argparse.Namespace, journal: Journal, *, loras: Any, models: dict[str, str], prompts: Any,
               serve_start_s: float) -> dict[str, Any]:
    """The run's report (before its provenance): what was served, the wall times, the usage, and every row."""
    notes_out, calls_out = journal.rows("note"), journal.rows("judgement")
    return {
        "benchmark": "llm_agreement", "model": args.model, "engine": args.engine, "loras": loras,
        "adapters": {k: v for k, v in models.items() if v}, "prompts": prompts,
        "traces": str(args.traces), "seed": args.seed, "concurrency": args.concurrency,
        "serve_start_s": round(serve_start_s, 1), "runs": journal.segment,
        "extraction_wall_s": journal.wall("note"), "judgement_wall_s": journal.wall("judgement"),
        "usage": {"extraction": {k: round(sum(r["usage"][k] for r in notes_out), 3)
                                 for k in ("calls", "prompt_tokens", "completion_tokens", "seconds")},
                  "link+update": {"calls": len(calls_out),
                                  "prompt_tokens": sum(c["prompt_tokens"] for c in calls_out),
                                  "completion_tokens": sum(c["completion_tokens"] for c in calls_out)}},
        "notes": notes_out, "judgements": calls_out,
    }


# --- compare ----------------------------------------------------------------------------------------------


def note_counts(student: list[list[str]], teacher: list[list[str]]) -> tuple[int, int, int, int]:
    """(matched, student facts, teacher facts, matched with the same status)."""
    pairs = match([tuple(f) for f in student], [tuple(f) for f in teacher])  # type: ignore[misc]
    return len(pairs), len(student), len(teacher), sum(student[i][2] == teacher[j][2] for i, j in pairs)


def f1(rows: list[tuple[int, int, int, int]]) -> float:
    tp, ns, nt = sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)
    return 2 * tp / (ns + nt) if ns + nt else 1.0


def judged(student: dict[str, Any] | None, teacher: dict[str, Any]) -> dict[str, bool]:
    if student is None:
        return {"verdict": False, "ended": False, "links": False, "all": False}
    same = {"verdict": student["new_is"] == teacher["new_is"],
            "ended": {e["n"] for e in student["ended"]} == {e["n"] for e in teacher.get("ended", [])},
            "links": {(x["n"], x["type"]) for x in student["links"]}
            == {(x["n"], x["type"]) for x in teacher.get("links", [])}}
    return same | {"all": all(same.values())}


def ci(values: list[float], lo: float = 0.025, hi: float = 0.975) -> list[float]:
    v = sorted(values)
    return [round(v[int(lo * (len(v) - 1))], 3), round(v[int(hi * (len(v) - 1))], 3)]


def compare(args: argparse.Namespace) -> int:
    print(json.dumps(stamp(score(args)), indent=1))
    return 0


def score(args: argparse.Namespace) -> dict[str, Any]:
    """The ``compare`` step's report (``teacher``, ``runs``, ``baseline``, ``resamples``, ``seed``)."""
    teacher = json.loads(args.teacher.read_text())
    ref = {r["note"]: r["facts"] for r in teacher["notes"] if r["error"] is None}
    runs = {str(p): json.loads(p.read_text()) for p in args.runs}
    baseline = str(args.baseline) if args.baseline else None
    if baseline and baseline not in runs:
        runs[baseline] = json.loads(args.baseline.read_text())
    # Notes every run answered and the teacher answered: the paired sample.
    notes = sorted(set(ref).intersection(*({r["note"] for r in run["notes"]} for run in runs.values())))
    rng = random.Random(args.seed)
    boots = [[rng.randrange(len(notes)) for _ in notes] for _ in range(args.resamples)]
    per: dict[str, list[tuple[int, int, int, int]]] = {}
    out: dict[str, Any] = {"benchmark": "llm_agreement.compare", "teacher": str(args.teacher),
                           "teacher_model": teacher["model"], "teacher_engine": teacher["engine"],
                           "notes": len(notes), "resamples": args.resamples, "runs": {}}
    for name, run in runs.items():
        facts = {r["note"]: r for r in run["notes"]}
        rows = [note_counts(facts[n]["facts"] if facts[n]["error"] is None else [], ref[n]) for n in notes]
        per[name] = rows
        tp, ns, nt, st = (sum(r[k] for r in rows) for k in range(4))
        calls = run["judgements"]
        agree = [judged(c["reply"], c["teacher"]) for c in calls]
        jboots = [[rng.randrange(len(agree)) for _ in agree] for _ in range(args.resamples)] if agree else []
        seconds = [r["seconds"] for r in run["notes"]]
        out["runs"][name] = {
            "model": run["model"], "engine": run["engine"], "adapters": run["adapters"],
            "extraction": {"precision": round(tp / max(ns, 1), 3), "recall": round(tp / max(nt, 1), 3),
                           "f1": round(f1(rows), 3), "f1_ci95": ci([f1([rows[i] for i in b]) for b in boots]),
                           "status_agreement": round(st / max(tp, 1), 3), "student_facts": ns, "teacher_facts": nt,
                           "failed_notes": sum(facts[n]["error"] is not None for n in notes)},
            # How many of the teacher's replies end or link anything: where none do, agreement on them is only
            # agreement on saying nothing.
            "judgement": {"calls": len(agree), "invalid": sum(c["reply"] is None for c in calls),
                          "teacher_ending": sum(bool(c["teacher"].get("ended")) for c in calls),
                          "teacher_linking": sum(bool(c["teacher"].get("links")) for c in calls)} | {
                k: {"agreement": round(sum(a[k] for a in agree) / len(agree), 3),
                    "ci95": ci([sum(agree[i][k] for i in b) / len(b) for b in jboots])}
                for k in ("verdict", "ended", "links", "all") if agree},
            "seconds_per_note": round(sum(seconds) / max(len(seconds), 1), 2),
            "extraction_wall_s": run["extraction_wall_s"], "concurrency": run["concurrency"],
        }
    if baseline:
        base = per[baseline]
        for name, rows in per.items():
            if name == baseline:
                continue
            diffs = [f1([rows[i] for i in b]) - f1([base[i] for i in b]) for b in boots]
            out["runs"][name]["extraction"]["f1_minus_baseline"] = {
                "baseline": baseline, "difference": round(f1(rows) - f1(base), 3), "ci95": ci(diffs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run", help="one configuration over the held-out notes and judgement calls")
    r.add_argument("--traces", type=Path, required=True, help="folder written by stam train traces")
    r.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    r.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    r.add_argument("--lora", action="append", default=[], metavar="NAME=PATH")
    r.add_argument("--extract-model", default="", help="adapter name for extraction calls")
    r.add_argument("--judge-model", default="", help="adapter name for link+update calls")
    r.add_argument("--notes", type=int, default=100)
    r.add_argument("--per-patient", type=int, default=17)
    r.add_argument("--judgements", type=int, default=0, help="first N held-out judgement calls (0: all)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--concurrency", type=int, default=4, help="calls in flight (vLLM batches them)")
    r.add_argument("--n-ctx", type=int, default=4096)
    r.add_argument("--out", type=Path, required=True)
    r.set_defaults(fn=run)
    c = sub.add_parser("compare", help="agreement of runs with the teacher's run, paired bootstrap CIs")
    c.add_argument("--teacher", type=Path, required=True)
    c.add_argument("--baseline", type=Path, default=None, help="run the others are compared with (paired)")
    c.add_argument("--resamples", type=int, default=2000)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("runs", type=Path, nargs="+")
    c.set_defaults(fn=compare)
    args = ap.parse_args(argv)
    if args.step == "run" and not BULK.is_dir():
        print(json.dumps({"skipped": f"shared data not found at {BULK}"}))
        return 0
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
