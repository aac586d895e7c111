"""Read-path benchmark: query latency with and without the store gate, and served tokens, on a synthetic load.

Load (see :mod:`benchmarks.synthetic`): ``--patients`` patients of ``--memories`` memories each, shaped like the
coded reasoner's output: supersession chains of ~300 coded concepts (labs, vitals, medications, conditions,
procedures), stopped medications and resolved conditions, so about ``--history-fraction`` of the memories are in
HISTORY. Embedding millions of texts with MiniLM would take hours, so the vocabulary's concept-level embedding
texts (``"observation: Hemoglobin"``) are embedded once and each memory gets its concept's vector: exactly what the
write path stores for a coded memory. Each patient's state goes to a real Redis server with one ``commit_many``
and its vectors to a Milvus Lite server with ``place`` (the embedded stack of :mod:`stam.stack`). ``--reuse``
keeps the data already loaded in ``--home`` for the same configuration.

Queries: question templates over the vocabulary (about a concept in the patient's record, with and without
history cues, or free phrasing), a random patient each (seeded), through ``QueryService.answer`` with no reader.
Three arms: gate ``auto`` (threshold ``--threshold``), ``active`` (HISTORY never served) and ``both`` (always).

- ``cold``: the first query of ``--cold-sample`` patients, arms in turn: the patient's memory records read from
  Redis into its timeline, concept vectors from the shared concept cache the write path fills (no Milvus call
  for coded memories). The other patients' timelines are then warmed the same way (it stops early if the
  machine runs below ``--min-free-gb``).
- ``warm``: ``--queries`` queries, each asked in all three arms (order rotated), twice: with the question
  embedded per query (embedder without cache: the realistic case for distinct questions) and with the question
  embedding cached.
- ``tokens``: served packet tokens per arm, the gate's HISTORY-skip rate and the tokens it saves against
  always serving both stores.

Prints one JSON object (stdout); progress goes to stderr. ``goal_p99_under_50ms`` is for warm ``auto`` with
the question embedded per query.

Usage: python -m benchmarks.read_path [--patients 1000] [--memories 2000] [--queries 2000] [--home DIR] [--reuse]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from benchmarks.synthetic import Chain, Concept, build_patient, plan_patient, question, vocabulary
from schemas.query import GateMode, QueryRequest
from stam import stack
from stam.backends.base import Commit
from stam.backends.milvus import MilvusVectorStore
from stam.backends.redis_cache import RedisVectorCache
from stam.backends.redis_state import RedisStateStore
from stam.embedding import Embedder
from stam.read.service import QueryService, TimelineCache
from stam.read.store_gate import DEFAULT_THRESHOLD, StoreGate
from stam.read.tokens import Tokenizer, load_tokenizer
from stam_lab.eval.provenance import stamp

ARMS = (GateMode.AUTO, GateMode.ACTIVE, GateMode.BOTH)
MARKER = "stam-bench:read_path:loaded"
COMMIT_BATCH = 8
GOAL_MS = 50.0


def _log(msg: str) -> None:
    print(f"[read_path {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(values: list[float]) -> dict[str, float]:
    """Percentiles of durations given in seconds, in milliseconds."""
    if not values:
        return {}
    arr = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3), "p95_ms": round(float(np.percentile(arr, 95)), 3),
            "p99_ms": round(float(np.percentile(arr, 99)), 3), "mean_ms": round(float(arr.mean()), 3),
            "max_ms": round(float(arr.max()), 3), "n": len(values)}


def _proc_mb(pid: int | str, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _mem_available_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        return None
    return None


def _pid(i: int) -> str:
    return f"bench-p{i:05d}"


# --- load --------------------------------------------------------------------------------------------------


def load(args: argparse.Namespace, client: redis.Redis, vectors: MilvusVectorStore, vocab: list[Concept],
         concept_vectors: np.ndarray, plans: list[list[Chain]]) -> dict[str, Any]:
    writer = RedisStateStore(client, cache_size=1)
    times = {"build_s": 0.0, "redis_s": 0.0, "milvus_s": 0.0}
    history = total = 0
    started = time.perf_counter()
    for lo in range(0, args.patients, COMMIT_BATCH):
        batch = range(lo, min(lo + COMMIT_BATCH, args.patients))
        t0 = time.perf_counter()
        built = [build_patient(i, _pid(i), plans[i], concept_vectors, seed=args.seed) for i in batch]
        t1 = time.perf_counter()
        writer.commit_many([Commit(patient_id=s.patient_id, expected_version=0, state=s,
                                   changed=list(s.memories.values()), outboxes={}) for s, _ in built])
        t2 = time.perf_counter()
        for s, rows in built:
            vectors.place(s.patient_id, rows)
        t3 = time.perf_counter()
        times["build_s"] += t1 - t0
        times["redis_s"] += t2 - t1
        times["milvus_s"] += t3 - t2
        for s, _ in built:
            c = s.counts()
            history += c["history"]
            total += c["active"] + c["history"]
        done, step = batch.stop, max(1, args.patients // 20)
        if done // step > batch.start // step or done == args.patients:
            el = time.perf_counter() - started
            _log(f"loaded {done}/{args.patients} patients in {el:.1f}s (eta {el / done * (args.patients - done):.0f}s)")
    t = time.perf_counter()
    vectors.flush()
    times["milvus_flush_s"] = time.perf_counter() - t
    seconds = time.perf_counter() - started
    out = {k: round(v, 2) for k, v in times.items()} | {
        "seconds": round(seconds, 2), "memories": total, "memories_per_s": round(total / seconds, 1),
        "history_fraction_actual": round(history / max(total, 1), 4)}
    client.set(MARKER, json.dumps(_fingerprint(args) | {"load": out}))
    return out


def _fingerprint(args: argparse.Namespace) -> dict[str, Any]:
    return {"patients": args.patients, "memories": args.memories, "history_fraction": args.history_fraction,
            "seed": args.seed, "memory_ids": "patient-scoped"}


# --- queries -----------------------------------------------------------------------------------------------


def make_service(url: str, vectors: MilvusVectorStore, embedder: Embedder, tokenizer: Tokenizer,
                 args: argparse.Namespace) -> QueryService:
    """A query service whose timeline cache can hold every patient."""
    states = RedisStateStore(redis.Redis.from_url(url), cache_size=1)
    return QueryService(states=states, vectors=vectors, embedder=embedder, tokenizer=tokenizer,
                        gate=StoreGate(args.threshold), cache=TimelineCache(args.patients * args.memories + 1))


def ask(loop: asyncio.AbstractEventLoop, svc: QueryService, req: QueryRequest) -> tuple[float, Any]:
    t0 = time.perf_counter()
    answer = loop.run_until_complete(svc.answer(req))
    elapsed = time.perf_counter() - t0
    if not answer.ok or answer.packet is None:
        raise RuntimeError(f"query {req.request_id} failed: {answer.error}")
    return elapsed, answer.packet


def make_request(args: argparse.Namespace, rid: str, i: int, q: str, arm: GateMode) -> QueryRequest:
    """The question ``q`` to patient ``i`` in gate arm ``arm``, with the run's k."""
    return QueryRequest(request_id=rid, patient_id=_pid(i), question=q, gate=arm, k_active=args.k_active,
                        k_history=args.k_history)


def cold_pass(args: argparse.Namespace, loop: asyncio.AbstractEventLoop, svc: QueryService, rng: random.Random,
              sample: list[int], plans: list[list[Chain]], vocab: list[Concept]) -> dict[GateMode, list[float]]:
    """The first query of each sampled patient (records from Redis, concept vectors from the shared cache), the arms
    in turn: latencies per arm."""
    _log(f"cold pass: first query of {len(sample)} patients (records from Redis, concept vectors from the shared "
         "cache)")
    cold: dict[GateMode, list[float]] = {a: [] for a in ARMS}
    started = time.perf_counter()
    for n, i in enumerate(sample):
        arm = ARMS[n % len(ARMS)]
        elapsed, _ = ask(loop, svc, make_request(args, f"cold-{n}", i, question(rng, plans[i], vocab), arm))
        cold[arm].append(elapsed)
        if (n + 1) % max(1, len(sample) // 5) == 0:
            _log(f"  cold {n + 1}/{len(sample)} ({time.perf_counter() - started:.1f}s)")
    return cold


def warm_timelines(svc: QueryService, rest: list[int], min_free_gb: float, warm_set: list[int]) -> None:
    """Load the timelines of the ``rest`` of the patients into ``warm_set``, until the machine runs short of memory."""
    _log(f"warming the timelines of the other {len(rest)} patients")
    for n, i in enumerate(rest):
        if n % 50 == 0:
            avail = _mem_available_gb()
            if avail is not None and avail < min_free_gb:
                _log(f"WARNING: {avail:.1f} GB left: warming stops at {n} patients (--min-free-gb)")
                break
        svc.timeline(_pid(i))
        warm_set.append(i)


@dataclass
class WarmPass:
    """What the warm passes measured: latencies per mode and arm; question embedding times, packet tokens and items
    per arm, and the auto gate's decisions (the question_embedded pass only)."""

    embed_s: list[float] = field(default_factory=list)
    warm: dict[str, dict[GateMode, list[float]]] = field(default_factory=lambda: {
        "question_embedded": {a: [] for a in ARMS}, "question_cached": {a: [] for a in ARMS}})
    tokens: dict[GateMode, list[int]] = field(default_factory=lambda: {a: [] for a in ARMS})
    items: dict[GateMode, list[int]] = field(default_factory=lambda: {a: [] for a in ARMS})
    gate_reasons: Counter[str] = field(default_factory=Counter)
    skipped: int = 0

    def count_packet(self, arm: GateMode, packet: Any) -> None:
        """A packet's tokens and items, and in the auto arm why the gate served history or not."""
        self.tokens[arm].append(packet.tokens)
        self.items[arm].append(len(packet.items))
        if arm is GateMode.AUTO:
            self.skipped += not packet.gate.serve_history
            g = packet.gate
            self.gate_reasons["history_cue" if g.cue else "history_empty" if g.s_history is None
                              else "margin_served" if g.serve_history else "margin_skipped"] += 1


def warm_passes(args: argparse.Namespace, loop: asyncio.AbstractEventLoop, svc: QueryService,
                queries: list[tuple[int, int, str]], plain: Embedder, cached: Embedder) -> WarmPass:
    """Every query in every arm, twice: the question embedded per query, then found in the embedder's cache."""
    out = WarmPass()
    for mode, embedder in (("question_embedded", plain), ("question_cached", cached)):
        _log(f"warm pass ({mode}): {args.queries} queries x {len(ARMS)} arms")
        svc.embedder = embedder
        started = time.perf_counter()
        for n, i, q in queries:
            if mode == "question_embedded":
                t0 = time.perf_counter()
                plain.embed([q])
                out.embed_s.append(time.perf_counter() - t0)
            for k in range(len(ARMS)):
                arm = ARMS[(n + k) % len(ARMS)]
                elapsed, packet = ask(loop, svc, make_request(args, f"{mode}-{n}-{arm.value}", i, q, arm))
                out.warm[mode][arm].append(elapsed)
                if mode == "question_embedded":
                    out.count_packet(arm, packet)
            if (n + 1) % max(1, args.queries // 5) == 0:
                _log(f"  {mode} {n + 1}/{args.queries} ({time.perf_counter() - started:.1f}s)")
    return out


def run_queries(args: argparse.Namespace, url: str, vectors: MilvusVectorStore, plans: list[list[Chain]],
                vocab: list[Concept], cached: Embedder, concept_vectors: np.ndarray) -> dict[str, Any]:
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    # The query process starts with no vector of its own: concept vectors come from the shared cache the write
    # path fills (Redis), every question is embedded.
    plain = Embedder(cache_size=0, shared=RedisVectorCache(redis.Redis.from_url(url)))
    svc = make_service(url, vectors, plain, tokenizer, args)
    loop = asyncio.new_event_loop()
    rng = random.Random(f"{args.seed}:queries")

    # Warm the model and tokenizer on a throwaway question (not a patient touch).
    plain.embed(["warm-up question"])
    tokenizer.count("warm-up")
    rss_before = _proc_mb("self", "VmRSS")

    order = list(range(args.patients))
    rng.shuffle(order)
    sample = order[: args.cold_sample]
    cold = cold_pass(args, loop, svc, rng, sample, plans, vocab)
    warm_set = list(sample)
    warm_timelines(svc, order[len(sample):], args.min_free_gb, warm_set)
    rss_warm = _proc_mb("self", "VmRSS")

    queries = []
    for n in range(args.queries):
        i = rng.choice(warm_set)
        queries.append((n, i, question(rng, plans[i], vocab)))
    cached.embed([q for _, _, q in queries])  # the cached arm finds every question in the cache
    measured = warm_passes(args, loop, svc, queries, plain, cached)
    loop.close()
    return queries_report(args, svc, tokenizer, cold, measured, warm_set=warm_set, queries=len(queries),
                          rss_before=rss_before, rss_warm=rss_warm)


def queries_report(args: argparse.Namespace, svc: QueryService, tokenizer: Tokenizer, cold: dict[GateMode, list[float]],
                   measured: WarmPass, *, warm_set: list[int], queries: int, rss_before: float | None,
                   rss_warm: float | None) -> dict[str, Any]:
    """The queries' part of the report: latencies, tokens per arm, the gate's skips, the query process's memory."""
    tokens, items = measured.tokens, measured.items
    mean_tok = {a: float(np.mean(tokens[a])) for a in ARMS}
    warm_auto = _pct(measured.warm["question_embedded"][GateMode.AUTO])
    rss_after = _proc_mb("self", "VmRSS")
    cache_mb = (rss_warm or 0) - (rss_before or 0)
    return {
        "embedding_ms": {"question": _pct(measured.embed_s), "note": "MiniLM on one question; inside question_embedded"},
        "cold": {a.value: _pct(cold[a]) for a in ARMS},
        "warm": {mode: {a.value: _pct(v[a]) for a in ARMS} for mode, v in measured.warm.items()},
        "tokens": {
            "per_arm": {a.value: {"mean": round(mean_tok[a], 1), "median": float(np.median(tokens[a])),
                                  "items_mean": round(float(np.mean(items[a])), 2)} for a in ARMS},
            "history_skip_rate": round(measured.skipped / max(queries, 1), 4),
            "gate_reasons_auto": dict(measured.gate_reasons),
            "saved_gate_vs_both_pct": round(100 * (1 - mean_tok[GateMode.AUTO] / mean_tok[GateMode.BOTH]), 2)
            if mean_tok[GateMode.BOTH] else None,
            "tokenizer": tokenizer.name,
        },
        "warm_patients": len(warm_set), "warm_capped_by_memory": len(warm_set) < args.patients,
        "query_process": {"rss_mb": rss_after, "peak_rss_mb": _proc_mb("self", "VmHWM"),
                          "rss_before_warmup_mb": rss_before,
                          "warm_caches_mb_per_patient": round(cache_mb / max(len(warm_set), 1), 3),
                          "timeline_loads": svc.cache.loads, "timeline_memories": svc.cache.memories()},
        "goal_p99_under_50ms": bool(warm_auto and warm_auto["p99_ms"] < GOAL_MS),
        "goal_basis": "warm, gate auto, question embedded per query, no reader",
    }


# --- main --------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=1000)
    parser.add_argument("--memories", type=int, default=2000, help="memories per patient")
    parser.add_argument("--queries", type=int, default=2000, help="warm queries (each asked in every arm)")
    parser.add_argument("--history-fraction", type=float, default=0.4)
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="store-gate margin threshold (auto arm)")
    parser.add_argument("--k-active", type=int, default=8)
    parser.add_argument("--k-history", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads for the embedding model; default 1 as the query worker sets them "
                        "(STAM_QUERY_THREADS); 0: torch's default")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="numpy BLAS threads (the projection's matrix-vector product); default 1 as the query "
                        "worker; 0: as the process has them")
    parser.add_argument("--min-free-gb", type=float, default=4.0,
                        help="stop warming more patients when the machine has less memory available than this "
                        "(a warm patient of 2,000 memories holds ~3 MB of vectors and ids; records are fetched per query)")
    parser.add_argument("--home", type=Path, default=None, help="stack home (kept, stack left running)")
    parser.add_argument("--reuse", action="store_true", help="keep data already loaded in --home for this config")
    parser.add_argument("--cold-sample", type=int, default=200,
                        help="patients whose first query is measured cold; the rest are warmed before the warm pass")
    parser.add_argument("--load-only", action="store_true",
                        help="load (into --home) and stop; a later --reuse run measures queries on a quiet machine")
    args = parser.parse_args()
    if not 0 <= args.history_fraction < 1:
        parser.error("--history-fraction must be in [0, 1)")
    return args


def load_or_reuse(args: argparse.Namespace, home: Path, client: redis.Redis, vectors: MilvusVectorStore,
                  vocab: list[Concept], concept_vectors: np.ndarray, plans: list[list[Chain]]) -> dict[str, Any]:
    """The load's report: the data already in ``home`` when ``--reuse`` and it was loaded with this configuration,
    else a fresh load (refused when ``home`` holds other patient data)."""
    marker = client.get(MARKER)
    previous = json.loads(marker) if marker else None
    if args.reuse and previous and all(previous.get(k) == v for k, v in _fingerprint(args).items()):
        _log("reusing the loaded data")
        return dict(previous["load"] | {"reused": True})
    if client.scard("stam:patients"):
        raise SystemExit(f"{home} already holds patient data (loaded: {previous and _fingerprint_of(previous)});"
                         " pass --reuse with the same configuration or use a fresh --home")
    _log(f"loading {args.patients} x {args.memories} memories")
    return load(args, client, vectors, vocab, concept_vectors, plans) | {"reused": False}


def config(args: argparse.Namespace, vocab: list[Concept]) -> dict[str, Any]:
    """The report's ``config``: the load's fingerprint, the query settings and the machine's threads and load."""
    return _fingerprint(args) | {
        "queries": args.queries, "threshold": args.threshold, "k_active": args.k_active,
        "k_history": args.k_history, "vocabulary": len(vocab), "cpus": os.cpu_count(),
        "torch_threads": _torch_threads(), "blas_threads": _blas_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "stores": "redis-server + Milvus Lite server (stam.stack)", "reader": None}


def main() -> None:
    args = parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    home = args.home or Path(tempfile.mkdtemp(prefix="stam-read-bench-"))
    _log(f"stack home {home}")
    info = stack.up(home)
    try:
        client = redis.Redis.from_url(info.redis_url)
        vocab = vocabulary()
        t0 = time.perf_counter()
        embedder = Embedder()
        if args.blas_threads:  # after the model load, which brings more BLAS libraries into the process
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=args.blas_threads, user_api="blas")
        concept_vectors = embedder.embed([c.embed_text for c in vocab])
        vocab_embed_s = time.perf_counter() - t0
        plans = [plan_patient(i, vocab, memories=args.memories, history_fraction=args.history_fraction,
                              seed=args.seed) for i in range(args.patients)]
        vectors = MilvusVectorStore(info.milvus_uri, dim=concept_vectors.shape[1])
        loaded = load_or_reuse(args, home, client, vectors, vocab, concept_vectors, plans)
        loaded["vocab_embed_s"] = round(vocab_embed_s, 2)
        # The write path keeps every coded concept's vector in the shared concept cache; so does the load.
        embedder.shared = RedisVectorCache(client)
        embedder.share([c.embed_text for c in vocab], concept_vectors)
        if args.load_only:
            print(json.dumps(stamp({"config": _fingerprint(args), "load": loaded}), indent=2))
            return
        result = run_queries(args, info.redis_url, vectors, plans, vocab, embedder, concept_vectors)
        mem = client.info("memory")
        report = {
            "config": config(args, vocab),
            "load": loaded,
            "redis": {"used_memory_human": mem.get("used_memory_human"), "used_memory": mem.get("used_memory")},
            "milvus_server_rss_mb": _proc_mb(info.pids["milvus"], "VmRSS"),
        } | result
        print(json.dumps(stamp(report), indent=2))
    finally:
        if args.home is None:
            stack.down(home)
            shutil.rmtree(home, ignore_errors=True)


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _blas_threads() -> dict[str, int]:
    from threadpoolctl import threadpool_info

    return {Path(d["filepath"]).name: int(d["num_threads"]) for d in threadpool_info() if d.get("user_api") == "blas"}


def _fingerprint_of(previous: dict[str, Any]) -> dict[str, Any]:
    return {k: previous.get(k) for k in ("patients", "memories", "history_fraction", "seed")}


if __name__ == "__main__":
    main()
