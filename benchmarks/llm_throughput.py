"""Throughput of the serving engines at 1, 4 and 8 concurrent requests (``make bench-llm-throughput``).

Each engine is started as users start it (``stam serve --engine llamacpp|vllm``, a subprocess with its own Ray) on
the same packaged model; the requests are the reasoner's real extraction prompt on real Synthea notes (one note per
request, schema-constrained, greedy, ``--max-tokens`` each), sent by ``--concurrency`` client threads at a time.
Reports per engine and level: requests, completion tokens per second of wall time (all requests together),
latency p50/p95, and the engine's own seconds per request. vLLM batches concurrent requests in one engine; the
llama.cpp replica serialises them (one context per replica), so its latency grows with the queue.

Usage: python -m benchmarks.llm_throughput [--engines llamacpp vllm] [--levels 1 4 8] [--requests 8]
       [--max-tokens 128] [--model qwen2.5-coder-0.5b-instruct-q4_k_m]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stam.net import free_port
from stam.serving.check import stop, wait_up
from stam_lab.eval.provenance import stamp
from tests.conftest import DATA

NOTES = DATA / "synthea-bulk-10p" / "DocumentReference.000.ndjson"


def notes(n: int) -> list[str]:
    out = []
    for line in NOTES.read_text().splitlines():
        text = base64.b64decode(json.loads(line)["content"][0]["attachment"]["data"]).decode()
        if 800 <= len(text) <= 4000:
            out.append(text)
        if len(out) == n:
            break
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 2)


def run_engine(engine: str, model: str, levels: list[int], requests: int, max_tokens: int) -> dict[str, Any]:
    from stam.llm.client import LLMClient
    from stam.reasoning import prompts

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"stam-llm-throughput-{engine}-{port}.log"
    cmd = [sys.executable, "-m", "stam.cli", "serve", "--engine", engine, "--model", model, "--port", str(port)]
    if engine == "vllm":
        cmd.append("--eager")
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict[str, Any] = {"engine": engine, "model": model}
    try:
        wait_up(url, proc, started + 900)
        result["load_s"] = round(time.monotonic() - started, 1)
        schema = prompts.schema(prompts.Extraction)
        texts = notes(requests)
        client = LLMClient(url, model, timeout_s=1800, retries=0, max_concurrency=max(levels))
        client.chat(prompts.extract_messages(texts[0]), schema=schema, schema_name="Extraction", max_tokens=8)  # warm
        for level in levels:
            def one(text: str) -> tuple[float, int, float]:
                t0 = time.perf_counter()
                r = client.chat(prompts.extract_messages(text), schema=schema, schema_name="Extraction",
                                max_tokens=max_tokens)
                return time.perf_counter() - t0, r.completion_tokens, r.seconds

            t0 = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                rows = list(pool.map(one, texts))
            wall = time.perf_counter() - t0
            latencies = [r[0] for r in rows]
            tokens = sum(r[1] for r in rows)
            result[f"c{level}"] = {"requests": len(rows), "completion_tokens": tokens, "wall_s": round(wall, 1),
                                   "tokens_per_s": round(tokens / wall, 2), "latency_p50_s": pct(latencies, 0.5),
                                   "latency_p95_s": pct(latencies, 0.95)}
            print(f"{engine} c={level}: {result[f'c{level}']}", file=sys.stderr)
    except Exception as exc:  # the JSON says what failed; the server's log has the cause
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log"] = str(log)
    finally:
        stop(proc)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["llamacpp", "vllm"], choices=["llamacpp", "vllm"])
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per level (distinct notes)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    args = ap.parse_args(argv)
    out = {"benchmark": "llm_throughput", "cores": os.cpu_count(), "max_tokens": args.max_tokens,
           "engines": [run_engine(e, args.model, args.levels, args.requests, args.max_tokens) for e in args.engines]}
    print(json.dumps(stamp(out)))
    return 0 if not any("error" in e for e in out["engines"]) else 1


if __name__ == "__main__":
    sys.exit(main())
