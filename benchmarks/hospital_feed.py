"""Hospital-feed benchmark: the MIMIC-IV demo patients interleaved by clinical time, as a hospital's feed arrives.

Every patient's entries are read with all their tables (``stam.sources.mimic``), each patient's timeline is
aligned to start at the same moment (de-identification shifts every patient's dates by its own offset, so raw
MIMIC-IV times hardly overlap; aligned, the 100 patients are in hospital together), and the entries are merged by
that time, each patient's own order kept. The first ``--entries`` of that feed go through the embedded stack
(Tansu, Redis, Milvus Lite) and the write-path worker processes, in these runs, each on a fresh stack:

- ``one_worker``: published flat out to one worker;
- ``two_workers``: the same, two worker processes sharing the consumer groups (the partitions split);
- ``one_worker_at_rate``: published at a fixed rate (``--rate``; default 80% of what ``one_worker`` reached), to
  show whether the lag stays bounded below saturation;
- ``faust_floor``: the four Faust hops doing nothing (``benchmarks.faust_floor``), on the same machine in the same
  run, with messages of the feed's mean ImpactedEntry size; ``write_path_floor_ratio`` is ``one_worker``'s
  entries/s over the floor's.

Each worker first applies ``--warmup`` entries of other patients (model load, group join), which are not measured.
Then the concept vectors of the measured feed are put in the stack's shared concept cache (Redis): a hospital's
vocabulary is embedded once and the cache outlives workers and restarts, so a steady-state feed meets few new
concepts (``--cold-vocabulary``: left empty, every new concept is embedded during the measurement, as on a
deployment's first day; the first 10,000 entries bring ~1,100 concepts the warm-up did not).

Per run: entries/s from the first publish to the last entry's first transition, the end-to-end latency of each entry
(p50/p99) and its p50 and maximum per half second of publishing (``latency_by_half_second``: a stall of the write path
shows as a run of slow half seconds; ``slowest_half_second_p50_s``), the lag (entries published and not yet applied)
sampled every second, how many entries each stage had handed on at each second (where a backlog sits), the stage
p50/p99 from the workers' histograms (warm-up subtracted, workers summed) and each stage's hop wait p50/p99
(``hop_wait``: from a message's produce to its stage starting on it), the stale-redo ratio (entries whose link and
impact the updater redid / entries updated: the share of work the link and impact agents did not carry), and each
worker's peak RSS, and the CPU seconds every process spent (the stack's, the workers', this driver's; per entry too).
``cpu_bound_ratio`` is the floor's CPU per entry over the write path's: where both runs keep every core busy, it is
the ratio the write path's own work leaves room for on this machine. Prints JSON on stdout.

``--stages all fused`` measures both write paths in the same run: the four stages over their topics (``all``, the
default) and the one-hop path (``stam worker --stages fused``), whose keys end in ``_fused``; the fixed-rate runs
of both at the same rate, or with ``--load 0.5 0.8`` each at those fractions of its own flat-out rate. Each run
records its consumer fetch wait (``STAM_CONSUMER_FETCH_WAIT_MS``, else the write path's default).

Usage: python -m benchmarks.hospital_feed [--entries 20000] [--warmup 2000] [--rate R] [--runs one two rate floor]
       [--stages all fused] [--load 0.5 0.8] [--cold-vocabulary]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.write_path import CpuMeter, hist_quantile, vmhwm_mb
from stam.net import free_port
from stam.stack import EMBEDDED_PARTITIONS
from stam.transport import kafka_consumer
from stam_lab.eval.provenance import stamp

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data"))
MIMIC = DATA / "mimic-iv-demo-2.2"


# --- the feed -------------------------------------------------------------------------------------------------

def _when(entry: Any) -> datetime | None:
    return entry.effective_at or entry.recorded_at


def interleave(patients: Sequence[Sequence[Any]]) -> list[Any]:
    """Each patient's entries (in its own order) merged by time since the patient's first entry. An entry without
    a time keeps the time of the entry before it, so a patient's order never changes."""

    def keyed(i: int, entries: Sequence[Any]) -> Iterator[tuple[timedelta, int, int, Any]]:
        times = [t for e in entries if (t := _when(e)) is not None]
        start = min(times) if times else None
        last = timedelta(0)
        for n, e in enumerate(entries):
            t = _when(e)
            if t is not None and start is not None:
                last = max(last, t - start)  # never earlier than the entry before: the patient's order holds
            yield last, i, n, e

    merged = heapq.merge(*(keyed(i, es) for i, es in enumerate(patients)), key=lambda x: (x[0], x[1], x[2]))
    return [e for _, _, _, e in merged]


def feed_stats(feed: Sequence[Any]) -> dict[str, Any]:
    """How interleaved a feed is: patients, and the mean run of consecutive entries of one patient."""
    runs, prev = 0, None
    for e in feed:
        if e.patient_id != prev:
            runs, prev = runs + 1, e.patient_id
    return {"entries": len(feed), "patients": len({e.patient_id for e in feed}),
            "mean_same_patient_run": round(len(feed) / runs, 2) if runs else 0.0}


def load_feed(subjects: Sequence[str] | None) -> list[Any]:
    from stam.sources.mimic import iter_mimic

    return interleave([batch for batch in iter_mimic(MIMIC, subjects=subjects) if batch])


# --- the stack with N workers -------------------------------------------------------------------------------

@contextmanager
def stack_with_workers(home: Path, n: int, stages: str = "all") -> Iterator[
        tuple[Any, list[tuple[subprocess.Popen[bytes], int]], dict[str, int]]]:
    """The embedded stack in ``home`` with topics and ``n`` write-path worker processes (one consumer group, each
    ``stam worker --stages stages``); yields the settings, the workers with their metrics ports, and the stack's
    process ids by name."""
    from stam import stack
    from topology.admin import ensure_topics

    info = stack.up(home)
    workers: list[tuple[subprocess.Popen[bytes], int]] = []
    logs = []
    try:
        settings = stack.settings(info, home, web_port=0)
        asyncio.run(ensure_topics(settings))
        for i in range(n):
            port = free_port()
            env = dict(os.environ, STAM_HOME=str(home), STAM_BROKER_URL=info.broker_url,
                       STAM_REDIS_URL=info.redis_url, STAM_MILVUS_URI=info.milvus_uri, STAM_WEB_PORT="0",
                       STAM_METRICS_PORT=str(port))
            log = open(home / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            workers.append((subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning",
                                              "--stages", stages],
                                             cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), port))
        yield settings, workers, {name: p.pid for name, p in info.processes.items()}
    finally:
        for proc, _ in workers:
            proc.terminate()
        for proc, _ in workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
        stack.down(home)


_BUCKET = re.compile(r'(stam_stage_seconds|stam_hop_wait_seconds)_bucket\{le="([^"]+)",stage="(\w+)"\} (\S+)')
_WRITE_BUCKET = re.compile(r'^(stam_commit_seconds|stam_delivery_seconds)_bucket\{le="([^"]+)"(?:,store="(\w+)")?\} (\S+)',
                           re.M)


def _metrics(port: int) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def scrape(ports: Sequence[int]) -> dict[str, Any]:
    """Stage time, hop wait, and the update's writes and delivery (``writes``: milvus, redis, delivery) histogram
    buckets, the stale-redo counter and what the updater did with the link and impact work
    (``stam_update_reads_total``), summed over the workers."""
    buckets: dict[str, dict[float, float]] = {}
    waits: dict[str, dict[float, float]] = {}
    writes: dict[str, dict[float, float]] = {}
    reads: dict[str, float] = {}
    redo = 0.0
    for port in ports:
        text = _metrics(port)
        for m in _BUCKET.finditer(text):
            family = buckets if m.group(1) == "stam_stage_seconds" else waits
            stage = family.setdefault(m.group(3), {})
            stage[float(m.group(2))] = stage.get(float(m.group(2)), 0.0) + float(m.group(4))
        for m in _WRITE_BUCKET.finditer(text):
            step = writes.setdefault(m.group(3) or "delivery", {})
            step[float(m.group(2))] = step.get(float(m.group(2)), 0.0) + float(m.group(4))
        found = re.search(r"^stam_stale_redo_total (\S+)", text, re.M)
        redo += float(found.group(1)) if found else 0.0
        for m in re.finditer(r'^stam_update_reads_total\{reads="(\w+)"\} (\S+)', text, re.M):
            reads[m.group(1)] = reads.get(m.group(1), 0.0) + float(m.group(2))
    return {"buckets": buckets, "waits": waits, "writes": writes, "stale_redo": redo, "reads": reads}


def reads_of(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the updater did with the run's link and impact work (the four stages; empty for the one-hop path):
    entries and share per outcome, current, reused, patched or redone (:mod:`stam.stages.reads`)."""
    counts = {k: int(v - before["reads"].get(k, 0.0)) for k, v in after["reads"].items()}
    total = sum(counts.values())
    return {k: {"entries": n, "share": round(n / total, 3)} for k, n in sorted(counts.items())} if total else {}


def stage_quantiles(before: dict[str, Any], after: dict[str, Any], family: str = "buckets") -> dict[str, Any]:
    """p50/p99 per stage of the run (``after`` less ``before``): stage time (``buckets``), hop wait (``waits``), or
    the update's writes and delivery (``writes``: per batch for milvus and redis, per entry for delivery)."""
    out: dict[str, Any] = {}
    for stage, b in after[family].items():
        prior = before[family].get(stage, {})
        cum = sorted((le, c - prior.get(le, 0.0)) for le, c in b.items())
        p50, p99 = hist_quantile(cum, 0.5), hist_quantile(cum, 0.99)
        out[stage] = {"p50_ms": round(p50 * 1000, 3) if p50 is not None else None,
                      "p99_ms": round(p99 * 1000, 3) if p99 is not None else None, "n": int(cum[-1][1])}
    return out


# --- one run --------------------------------------------------------------------------------------------------

async def _follow(settings: Any, want: set[str], state: dict[str, Any],
                  quiet_s: float) -> None:
    """Consume transitions and dead letters until every wanted entry has one (or nothing moves for ``quiet_s``)."""
    from stam.crypto import sealer_for
    from topology import topics as t

    sealer = sealer_for(settings)
    # A short fetch wait: the embedded broker answers an empty fetch only when the wait ends (topology/fetching.py),
    # and aiokafka's default (500 ms) would add about half of it to every latency measured here.
    consumer = kafka_consumer(settings, t.TRANSITIONS.name(settings.topic_prefix),
                              t.DEAD_LETTERS.name(settings.topic_prefix), auto_offset_reset="earliest",
                              enable_auto_commit=False, group_id=None, fetch_max_wait_ms=10)
    await consumer.start()
    done: dict[str, float] = state["done"]
    last_move = time.monotonic()
    try:
        while not state["published"] or len(done) + state["dead"] < state["sent"]:
            batch = await consumer.getmany(timeout_ms=200)
            now = time.monotonic()
            for tp, records in batch.items():
                for rec in records:
                    data = json.loads(sealer.open(rec.value))
                    if tp.topic.endswith("deadletter.v1"):
                        state["dead"] += 1
                        continue
                    entry = data["entry_id"]
                    if entry in want:
                        state["transitions"] += 1
                    if entry in want and entry not in done:
                        done[entry] = now
                        last_move = now
                        # the last hop: from the transition's produce (its Kafka timestamp, the worker's send)
                        # to this consumer holding it (one host: one clock)
                        state["last_hop"].append(time.time() - rec.timestamp / 1000)
            if now - last_move > quiet_s and state["published"]:
                state["stalled"] = True
                return
    finally:
        await consumer.stop()


def half_seconds(sent_latency: Sequence[tuple[float, float]]) -> list[list[float | int]]:
    """``[t, entries, p50 s, max s]`` of the entries sent in each half second from ``t`` (seconds since the first
    publish), from (sent at, latency) pairs: where in a run its slow entries were sent."""
    bins: dict[int, list[float]] = {}
    for sent, latency in sent_latency:
        bins.setdefault(int(sent * 2), []).append(latency)
    return [[k / 2, len(v), round(float(np.percentile(v, 50)), 3), round(max(v), 3)] for k, v in sorted(bins.items())]


_DONE = re.compile(r'^stam_messages_total\{outcome="ok",stage="(\w+)"\} (\S+)', re.M)
STAGES = ("extract", "link", "impact", "update", "fused")


def stage_counts(ports: Sequence[int]) -> list[int]:
    """Messages each stage has handed on (``stam_messages_total{outcome="ok"}``), summed over the workers, in
    pipeline order."""
    counts = dict.fromkeys(STAGES, 0.0)
    for port in ports:
        text = _metrics(port)
        for m in _DONE.finditer(text):
            if m.group(1) in counts:
                counts[m.group(1)] += float(m.group(2))
    return [int(counts[s]) for s in STAGES]


async def _measure(settings: Any, entries: Sequence[Any], rate: float | None, quiet_s: float,
                   dead_before: int = 0, ports: Sequence[int] = ()) -> dict[str, Any]:
    """Publish ``entries`` (at ``rate``, or flat out) and follow them to their transitions. ``dead_before``: dead
    letters already on the topic (an earlier measurement's), not this one's. ``ports``: the workers' metrics
    ports, sampled every second for how far each stage has got."""
    from stam.publish import Publisher, PublishSummary

    want = {e.entry_id for e in entries}
    sent_at: dict[str, float] = {}
    state: dict[str, Any] = {"done": {}, "dead": -dead_before, "sent": 0, "published": False, "stalled": False,
                             "transitions": 0, "last_hop": []}
    lag: list[tuple[float, int, int]] = []
    per_stage: list[list[float | int]] = []
    base = await asyncio.to_thread(stage_counts, ports) if ports else []
    started = time.monotonic()

    def progress(n: int) -> None:
        sent_at[entries[n - 1].entry_id] = time.monotonic()
        state["sent"] = n

    async def sample() -> None:
        while True:
            t = round(time.monotonic() - started, 1)
            lag.append((t, state["sent"], len(state["done"]) + state["dead"]))
            if ports:
                now = await asyncio.to_thread(stage_counts, ports)
                per_stage.append([t, *(n - b for n, b in zip(now, base, strict=True))])
            await asyncio.sleep(1.0)

    follower = asyncio.create_task(_follow(settings, want, state, quiet_s))
    sampler = asyncio.create_task(sample())
    async with Publisher(settings) as pub:
        summary = PublishSummary()
        await pub.send_entries(entries, summary, rate=rate, progress=progress)
    published = time.monotonic() - started
    state["published"] = True
    await follower
    sampler.cancel()
    elapsed = max(state["done"].values(), default=started) - started
    latencies = [state["done"][e] - sent_at[e] for e in state["done"] if e in sent_at]
    # A burst's first entries: the first tenth sent, and when their transitions came (backpressure: first in, first
    # out, instead of after the whole burst was extracted).
    first_sent = sorted(sent_at, key=sent_at.__getitem__)[: max(1, len(sent_at) // 10)]
    first = [state["done"][e] - sent_at[e] for e in first_sent if e in state["done"]]
    behind = [s - d for _, s, d in lag]
    halves = half_seconds([(sent_at[e] - started, state["done"][e] - sent_at[e]) for e in state["done"] if e in sent_at])
    step = max(1, len(lag) // 60)
    return {
        "entries": len(entries), "sent": state["sent"], "applied": len(state["done"]), "dead_letters": state["dead"],
        "transitions": state["transitions"],
        "stalled": state["stalled"], "rate_asked": rate, "publish_seconds": round(published, 1),
        "seconds": round(elapsed, 1), "entries_per_s": round(len(state["done"]) / elapsed, 1) if elapsed else None,
        "latency_s": {"p50": round(float(np.percentile(latencies, 50)), 3),
                      "p99": round(float(np.percentile(latencies, 99)), 3)} if latencies else None,
        "latency_by_half_second": halves,
        "slowest_half_second_p50_s": max((h[2] for h in halves), default=None),
        "first_tenth_latency_s": {"p50": round(float(np.percentile(first, 50)), 3),
                                  "p99": round(float(np.percentile(first, 99)), 3)} if first else None,
        "first_transition_s": round(min(state["done"].values()) - started, 3) if state["done"] else None,
        "transitions_hop_ms": {"p50": round(float(np.percentile(state["last_hop"], 50)) * 1000, 1),
                               "p99": round(float(np.percentile(state["last_hop"], 99)) * 1000, 1)}
        if state["last_hop"] else None,
        "lag_entries": {"max": max(behind, default=0),
                        "at_end_of_publish": next((s - d for t, s, d in lag if t >= published), None),
                        "series_t_sent_done": lag[::step]},
        # Where the entries are: how many each stage has handed on by then (a stage far behind the one before
        # it is where the backlog sits).
        "stages_series_t_extract_link_impact_update_fused": per_stage[::max(1, len(per_stage) // 60)],
    }


class Vocabulary:
    """The concept texts of the measured feed and their vectors, computed once in this process: each run puts them
    in its fresh stack's shared concept cache (Redis), where a hospital's workers find a vocabulary they have met
    before (the cache outlives workers and restarts, and holds no patient data)."""

    def __init__(self, feed: Sequence[Any]) -> None:
        from stam.embedding import Embedder
        from stam.reasoning.coded import CodedReasoner

        coded = CodedReasoner()
        texts = {m.embed_text for e in feed for m in coded.extract(e) if m.concept is not None and m.embed_text}
        self.texts = sorted(texts)
        t0 = time.monotonic()
        self.embedder = Embedder()
        self.vectors = self.embedder.embed(self.texts)
        self.seconds = round(time.monotonic() - t0, 1)

    def share(self, client: Any, prefix: str) -> None:
        """Put the vectors in the shared concept cache of the Redis behind ``client`` (keys under ``prefix``)."""
        from stam.backends.redis_cache import RedisVectorCache

        self.embedder.shared = RedisVectorCache(client, prefix=prefix)
        self.embedder.share(self.texts, self.vectors)


def run(feed: Sequence[Any], warm: Sequence[Any], workers: int, rate: float | None, quiet_s: float,
        vocabulary: Vocabulary | None = None, write_path: str = "all") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stam-feed-") as tmp, stack_with_workers(Path(tmp), workers, write_path) as (
            settings, procs, stack_pids):
        ports = [p for _, p in procs]
        t0 = time.monotonic()
        warmed = asyncio.run(_measure(settings, warm, None, quiet_s=120))
        warmup = {"entries": len(warm), "applied": warmed["applied"], "seconds": round(time.monotonic() - t0, 1),
                  "vocabulary_shared": len(vocabulary.texts) if vocabulary else 0}
        if vocabulary is not None:
            from stam.transport import redis_client

            vocabulary.share(redis_client(settings), settings.collection_prefix)
        before = scrape(ports)
        cpu = CpuMeter({**stack_pids, **{f"worker-{i}": p.pid for i, (p, _) in enumerate(procs)},
                        "driver": os.getpid()})
        result = asyncio.run(_measure(settings, feed, rate, quiet_s, dead_before=warmed["dead_letters"], ports=ports))
        if warmed["stalled"] or result["stalled"]:  # the workers' logs go with the stack's temporary home
            for i in range(workers):
                tail = (Path(tmp) / f"worker-{i}.log").read_text(errors="replace").splitlines()[-40:]
                print(f"stalled: the last lines of worker-{i}'s log:", *tail, sep="\n  ", file=sys.stderr)
        spent = cpu.report(result["applied"])
        after = scrape(ports)
        stages = stage_quantiles(before, after)
        updated = stages.get("update", stages.get("fused", {})).get("n", 0)
        redo = after["stale_redo"] - before["stale_redo"]
        from stam.config import Settings
        from workers.main import FUSED_FETCH_WAIT_MS

        wait = os.environ.get("STAM_CONSUMER_FETCH_WAIT_MS") or (
            FUSED_FETCH_WAIT_MS if write_path == "fused" else Settings.model_fields["consumer_fetch_wait_ms"].default)
        return {"workers": workers, "write_path": write_path, "partitions": settings.partitions,
                "fetch_wait_ms": int(wait),
                "warmup": warmup, **result, "stages": stages,
                "hop_wait": stage_quantiles(before, after, "waits"),
                "writes": stage_quantiles(before, after, "writes"),
                "stale_redo": int(redo), "stale_redo_ratio": round(redo / updated, 3) if updated else None,
                "link_impact_reads": reads_of(before, after),
                "worker_peak_rss_mb": [vmhwm_mb(p.pid) for p, _ in procs], "cpu": spent}


def floor(messages: int, payload: int, fanout: int) -> dict[str, Any]:
    from benchmarks.faust_floor import floor_run

    return floor_run(argparse.Namespace(messages=messages, payload_bytes=payload, fanout=fanout),
                     os.environ.get("STAM_BROKER_STORAGE") or "s3")  # the write paths' storage (--broker-storage)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=20000, help="entries of the feed measured (from its start)")
    parser.add_argument("--warmup", type=int, default=2000, help="entries applied first as other patients")
    parser.add_argument("--rate", type=float, default=None,
                        help="entries/s of the fixed-rate run (default: 0.8 x the one-worker flat-out rate)")
    parser.add_argument("--subjects", default=None, help="comma-separated subject ids (default: all 100)")
    parser.add_argument("--runs", nargs="+", choices=["one", "two", "rate", "floor"],
                        default=["one", "two", "rate", "floor"])
    parser.add_argument("--load", nargs="+", type=float, default=None,
                        help="instead of one --rate: each write path at these fractions of its own flat-out rate in "
                             "this run (e.g. 0.5 0.8); keys one_worker_at_50pct, ...")
    parser.add_argument("--stages", nargs="+", default=["all"], choices=["all", "fused"],
                        help="the workers' write path, each measured in this run: all (the four stages over their "
                             "topics) and/or fused (one agent, one hop); a fused run's keys end in _fused")
    parser.add_argument("--quiet", type=float, default=180, help="give up after this many seconds without progress")
    parser.add_argument("--broker-storage", choices=["s3", "memory"], default=None,
                        help="where the embedded broker keeps its log in every run (the floor's too): s3 (SeaweedFS, "
                             "durable, as `stam stack up` runs it) or memory (nothing written: what the worker's path "
                             "costs without the embedded storage); default: STAM_BROKER_STORAGE, else s3")
    parser.add_argument("--redis-fsync", choices=["everysec", "always"], default=None,
                        help="the embedded Redis's appendfsync in every run: always (every write fsynced) or everysec "
                             "(a batch with a new patient's first entry waits up to 2 s for its data key to be on "
                             "disk); default: STAM_REDIS_FSYNC, else always (the stack's default)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="partitions of every topic of each run's stack (the floor's too); default: "
                             "STAM_PARTITIONS, else the embedded stack's own (stam.stack.EMBEDDED_PARTITIONS)")
    parser.add_argument("--cold-vocabulary", action="store_true",
                        help="leave the shared concept cache empty: every concept the warm-up did not bring is embedded "
                             "during the measurement, as on a deployment's first day (default: the feed's concept "
                             "vectors are put in the cache first, as a hospital's steady state finds them)")
    args = parser.parse_args()
    if args.partitions is not None and args.partitions < 1:
        parser.error(f"--partitions {args.partitions}: a partition count is 1 or more")
    return args


def rate_runs(args: argparse.Namespace, report: dict[str, Any], ones: dict[str, Any], feed: Sequence[Any],
              warm: Sequence[Any], vocabulary: Vocabulary | None) -> None:
    """The fixed-rate runs into ``report``: each write path at ``--load`` fractions of its own flat-out rate, or all
    at one rate (``--rate``, else 80% of the first write path's one-worker rate)."""
    for stages in args.stages:
        tail = "" if stages == "all" else f"_{stages}"
        if args.load:  # each write path at fractions of its own flat-out rate
            own = ones.get(stages, {}).get("entries_per_s")
            if not own:
                sys.exit("--load needs the one-worker run of each write path (--runs one rate)")
            for share in args.load:
                report[f"one_worker_at_{round(share * 100)}pct{tail}"] = {
                    "load": share, **run(feed, warm, 1, round(share * own, 1), args.quiet, vocabulary, stages)}
            continue
        first = ones.get(args.stages[0])  # one rate for every write path: the first one's 80% unless --rate
        rate = args.rate or (round(0.8 * first["entries_per_s"], 1) if first and first["entries_per_s"] else None)
        if rate is None:
            sys.exit("--rate is needed when the one-worker run is not part of this run")
        report[f"one_worker_at_rate{tail}"] = run(feed, warm, 1, rate, args.quiet, vocabulary, stages)


def floor_runs(report: dict[str, Any], ones: dict[str, Any], feed: Sequence[Any], one: dict[str, Any] | None) -> None:
    """The Faust floor with this feed's message sizes and fan-out into ``report``, and each write path against it."""
    from schemas import ImpactedEntry
    from stam.reasoning.coded import CodedReasoner

    sample = feed[:: max(1, len(feed) // 500)]
    coded = CodedReasoner()
    sizes = [len(ImpactedEntry(entry=e, memories=tuple(coded.extract(e)), relations=(), candidates={},
                               state_version=0).model_dump_json()) for e in sample]
    fanout = max(1, round(one["transitions"] / one["applied"])) if one and one.get("applied") else 2
    report["faust_floor"] = floor(len(feed), int(np.mean(sizes)), fanout)
    for stages, run_one in ones.items():
        if not run_one.get("entries_per_s"):
            continue
        tail = "" if stages == "all" else f"_{stages}"
        report[f"write_path_floor_ratio{tail}"] = round(
            run_one["entries_per_s"] / report["faust_floor"]["entries_per_s"], 3)
        # Where both runs keep every core busy (their cpu.cores_busy ~ cores), entries/s ~ cores / CPU per entry,
        # and the ratio of the CPU per entry is the best ratio this machine allows the write path: what its own
        # work (embedding, state, stores) costs on top of the hops.
        floor_ms = report["faust_floor"].get("cpu", {}).get("cpu_ms_per_entry_total")
        write_ms = run_one.get("cpu", {}).get("cpu_ms_per_entry_total")
        if floor_ms and write_ms:
            report[f"cpu_bound_ratio{tail}"] = round(floor_ms / write_ms, 3)


def main() -> None:
    args = parse_args()
    if not MIMIC.is_dir():
        sys.exit(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    t0 = time.monotonic()
    whole = load_feed(args.subjects.split(",") if args.subjects else None)
    feed = whole[: args.entries]
    # Warm-up: the entries right after the measured ones, as other patients (same codes, no shared state).
    warm = [e.model_copy(update={"patient_id": "warm-" + e.patient_id, "entry_id": "warm-" + e.entry_id})
            for e in whole[args.entries: args.entries + args.warmup]]
    if args.broker_storage:  # every stack.up of the run reads it, the floor's included
        os.environ["STAM_BROKER_STORAGE"] = args.broker_storage
    if args.redis_fsync:
        os.environ["STAM_REDIS_FSYNC"] = args.redis_fsync
    if args.partitions is not None:
        os.environ["STAM_PARTITIONS"] = str(args.partitions)
    report: dict[str, Any] = {"benchmark": "hospital_feed", "cpu_count": os.cpu_count(),
                              "broker_storage": os.environ.get("STAM_BROKER_STORAGE") or "s3",
                              "redis_fsync": os.environ.get("STAM_REDIS_FSYNC") or "always",
                              "partitions": int(os.environ.get("STAM_PARTITIONS") or EMBEDDED_PARTITIONS),
                              "feed": {**feed_stats(feed), "of_total": len(whole),
                                       "load_seconds": round(time.monotonic() - t0, 1)}}
    vocabulary = None
    if not args.cold_vocabulary and set(args.runs) - {"floor"}:
        vocabulary = Vocabulary(feed)
        report["vocabulary"] = {"concept_texts": len(vocabulary.texts), "embed_seconds": vocabulary.seconds}
    else:
        report["vocabulary"] = "cold"
    ones: dict[str, Any] = {}
    for stages in args.stages:
        tail = "" if stages == "all" else f"_{stages}"
        if "one" in args.runs:
            ones[stages] = report[f"one_worker{tail}"] = run(feed, warm, 1, None, args.quiet, vocabulary, stages)
        if "two" in args.runs:
            report[f"two_workers{tail}"] = run(feed, warm, 2, None, args.quiet, vocabulary, stages)
    if "rate" in args.runs:
        rate_runs(args, report, ones, feed, warm, vocabulary)
    if "floor" in args.runs:
        floor_runs(report, ones, feed, ones.get(args.stages[0]))
    print(json.dumps(stamp(report), indent=1))


if __name__ == "__main__":
    main()
