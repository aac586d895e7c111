"""Point-in-time benchmark: ``as_of`` queries on every MIMIC-IV demo patient, loaded with every table.

Each patient is replayed through the write-path stages (all tables: admissions to ICU events, ~300k entries for the
100 demo patients; kept in ``--replay-dir`` and reused when it is there). Then, per patient, ``--samples`` clinical
times are drawn (seeded) from the times the patient's record changes, and at each one:

- **the read path answers** a question asked at that time through ``as_of`` (``QueryService.packet``: the
  patient's timeline viewed at T), about a lab item, an order or the latest admission of the patient, in turn;
  its latency is recorded (``cold``: the patient's first query, which reads the timeline from Redis and its
  vectors; ``warm``: the rest) and any failure counted;
- **the state it answers from agrees with the log**: the timeline's view at T is compared, memory by memory
  (exists, store), with the state replayed from the transition log (:func:`stam.read.asof.state_at_time`, the
  reference); disagreements are counted;
- **the log replay's own cost** (what every ``as_of`` query paid before the timeline, on top of reading the
  patient's partition of the transitions topic) is timed on the same points.

Prints one JSON object: failures, disagreements, latency percentiles (all, cold, warm, and for the largest
patients), the replay's cost, the query process's memory. Usage::

    python -m benchmarks.asof [--replay-dir DIR] [--samples 20] [--patients N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from schemas import Store, StoredMemory
from schemas.query import QueryRequest
from stam.backends import rows
from stam.backends.redis_cache import RedisVectorCache
from stam.compose import local_query_service
from stam.embedding import Embedder
from stam.read.asof import state_at_time
from stam.sources.mimic import TABLES
from stam_lab.eval.provenance import stamp
from stam_lab.eval.state_eval import replay_mimic

MIMIC = Path(__file__).resolve().parents[2] / "shared" / "data" / "mimic-iv-demo-2.2"


def _log(msg: str) -> None:
    print(f"[asof {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 2), "p95_ms": round(float(np.percentile(arr, 95)), 2),
            "p99_ms": round(float(np.percentile(arr, 99)), 2), "max_ms": round(float(arr.max()), 2), "n": len(values)}


def _rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _questions(run: Any, pid: str) -> list[str]:
    """A few questions a clinician would ask of this patient: its most frequent lab items, an order, admissions."""
    labs: dict[str, int] = {}
    drugs: dict[str, int] = {}
    for e in run.entries[pid]:
        if e.entry_id.startswith("mimic-iv:labevents:") and e.codes and e.codes[0].display:
            labs[e.codes[0].display] = labs.get(e.codes[0].display, 0) + 1
        elif e.entry_id.startswith("mimic-iv:pharmacy:") and len(e.codes) > 1 and e.codes[1].display:
            drugs[e.codes[1].display] = drugs.get(e.codes[1].display, 0) + 1
    out = [f"What is the most recent {name} value?" for name, _ in sorted(labs.items(), key=lambda x: -x[1])[:3]]
    out += [f"Is {name} an active medication order?" for name, _ in sorted(drugs.items(), key=lambda x: -x[1])[:2]]
    out += ["Which active medication order was started most recently?", "What is the current hospital admission?"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mimic", default=str(MIMIC))
    ap.add_argument("--replay-dir", default=".stam/bench/mimic-all", help="kept replay (made when missing)")
    ap.add_argument("--samples", type=int, default=20, help="clinical times per patient")
    ap.add_argument("--patients", type=int, default=0, help="first N patients (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true", default=True,
                    help="compare with the log replay at every point (default on)")
    ap.add_argument("--no-reference", dest="reference", action="store_false")
    return ap.parse_args(argv)


def share_concepts(run: Any) -> RedisVectorCache:
    """Fill the shared concept cache (Redis) with the replay's concept vectors, as the write path would have: the
    query process is not the writer, it starts with no concept vector of its own and finds them there."""
    cache = RedisVectorCache(run._client)
    writer = Embedder(shared=cache)
    texts = sorted({e.memory.embed_text for evs in run.events.values() for e in evs
                    if e.memory is not None and e.memory.concept is not None and e.memory.embed_text})
    t0 = time.perf_counter()
    writer.embed_concepts(texts)
    _log(f"{len(texts)} concept texts in the shared cache ({writer.shared_hits} already there, "
         f"{time.perf_counter() - t0:.0f} s)")
    return cache


def backfill_rows(run: Any, patients: list[str]) -> None:
    """A replay made before timeline rows were kept has records only: write each patient's rows as the write path
    now does with every commit (a pure function of the records), so the read path reads rows."""
    backfilled = 0
    for pid in patients:
        if run.deps.states.timeline_rows(pid) is None:
            stored = [StoredMemory.model_validate_json(r) for r in run.deps.states.records(pid)[1]]
            run._client.hset(f"stam:{{{pid}}}:tl", mapping={s.memory.memory_id: rows.encode(s) for s in stored})
            backfilled += 1
    if backfilled:
        _log(f"timeline rows written for {backfilled} patients replayed before rows were kept")


@dataclass
class Tally:
    """What the queries found: latencies (cold, warm, per patient), the log replay's cost, failures and
    disagreements with the log."""

    cold: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    replay_cost: list[float] = field(default_factory=list)
    per_patient: dict[str, list[float]] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)
    disagreements: int = 0
    checked_points: int = 0
    checked_memories: int = 0
    examples: list[str] = field(default_factory=list)


def check_against_log(svc: Any, pid: str, events: list[Any], t: datetime, tally: Tally) -> None:
    """Compare the timeline's view at ``t`` with the state replayed from the transition log, memory by memory."""
    t0 = time.perf_counter()
    ref = state_at_time(pid, events, t)
    tally.replay_cost.append(time.perf_counter() - t0)
    tl, _ = svc.timeline(pid)
    view = tl.view(t)
    got = {tl.ids[i]: Store.HISTORY if view.history[i] else Store.ACTIVE for i in np.flatnonzero(view.present)}
    want = {m: s.store for m, s in ref.memories.items()}
    tally.checked_points += 1
    tally.checked_memories += len(want)
    if got != want:
        tally.disagreements += 1
        if len(tally.examples) < 5:
            diff = sorted(m for m in set(got) | set(want) if got.get(m) != want.get(m))
            tally.examples.append(f"{pid} at {t.isoformat()}: {len(diff)} memories differ, e.g. {diff[:3]}")


def query_patient(svc: Any, run: Any, pid: str, points: list[datetime], reference: bool, tally: Tally) -> None:
    """Ask the patient's questions at each of ``points`` (the first one cold), each checked against the log."""
    events = run.events[pid]
    questions = _questions(run, pid)
    svc.cache.forget(pid)
    lat: list[float] = []
    for k, t in enumerate(points):
        req = QueryRequest(request_id=f"{pid}-{k}", patient_id=pid, question=questions[k % len(questions)], as_of=t)
        t0 = time.perf_counter()
        try:
            svc.packet(req)
        except Exception as exc:
            tally.failures.append({"patient": pid, "as_of": t.isoformat(), "question": req.question,
                                   "error": f"{type(exc).__name__}: {exc}"[:300],
                                   "where": traceback.format_exc(limit=-2)[-600:]})
            continue
        dt = time.perf_counter() - t0
        (tally.cold if k == 0 else tally.warm).append(dt)
        lat.append(dt)
        if reference:
            check_against_log(svc, pid, events, t, tally)
    tally.per_patient[pid] = lat


def report(args: argparse.Namespace, patients: list[str], sizes: dict[str, int], tally: Tally, *, replay_s: float,
           rss_before: float | None, timeline_cache_memories: int) -> dict[str, Any]:
    """The JSON the benchmark prints."""
    largest = sorted(patients, key=lambda p: -sizes[p])[:5]
    cold, warm = tally.cold, tally.warm
    return {
        "benchmark": "asof", "patients": len(patients), "entries": sum(sizes.values()),
        "samples_per_patient": args.samples, "queries": len(cold) + len(warm) + len(tally.failures),
        "failures": len(tally.failures), "failure_examples": tally.failures[:5],
        "agreement_with_log_replay": {"points": tally.checked_points, "memories": tally.checked_memories,
                                      "points_disagreeing": tally.disagreements, "examples": tally.examples},
        "latency": {"all": _pct(cold + warm), "cold_first_query_of_patient": _pct(cold), "warm": _pct(warm)},
        "largest_patients": {p: {"entries": sizes[p], **_pct(tally.per_patient.get(p, []))} for p in largest},
        "log_replay_per_query": _pct(tally.replay_cost),
        "replay_seconds": round(replay_s, 1), "rss_mb": {"before_queries": rss_before, "after": _rss_mb()},
        "timeline_cache_memories": timeline_cache_memories,
        "measured_at": datetime.now().isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    embedder = Embedder()
    started = time.perf_counter()
    workdir = Path(args.replay_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"replay (or reuse) of every patient with every table in {workdir}")
    run = replay_mimic(Path(args.mimic), subjects=None, tables=TABLES, variant="stam", workdir=workdir,
                       embedder=embedder, keep=True,
                       progress=lambda n: _log(f"{n} entries") if n % 20000 < 256 else None)
    replay_s = time.perf_counter() - started
    patients = sorted(run.events, key=lambda p: (len(p), p))[: args.patients or None]
    sizes = {p: len(run.entries[p]) for p in patients}
    cache = share_concepts(run)
    backfill_rows(run, patients)
    reader_embedder = Embedder(shared=cache)
    _log(f"{len(patients)} patients, {sum(sizes.values())} entries; querying")
    svc = local_query_service(run.deps, embedder=reader_embedder)
    rng = random.Random(args.seed)
    tally = Tally()
    rss_before = _rss_mb()
    try:
        for n, pid in enumerate(patients, start=1):
            times = sorted({e.clinical_time for e in run.events[pid] if e.clinical_time is not None})
            points = sorted(rng.sample(times, min(args.samples, len(times))))
            query_patient(svc, run, pid, points, args.reference, tally)
            if n % 10 == 0:
                _log(f"{n}/{len(patients)} patients, {len(tally.failures)} failures, {tally.disagreements} "
                     "disagreements")
    finally:
        run.close()
    out = report(args, patients, sizes, tally, replay_s=replay_s, rss_before=rss_before,
                 timeline_cache_memories=svc.cache.memories())
    print(json.dumps(stamp(out), indent=2))
    return 0 if not tally.failures and not tally.disagreements else 1


if __name__ == "__main__":
    raise SystemExit(main())
