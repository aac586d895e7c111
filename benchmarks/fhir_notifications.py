"""FHIR Subscriptions on the hospital feed: entry in to notification out, and the notification Bundles themselves.

A fresh embedded stack, one write-path worker and ``stam listen fhir`` (each its own process), and an aiohttp
receiver on loopback over HTTPS (its own certificate, trusted through ``STAM_FHIR_ENDPOINT_CAFILE``). One
``full-resource`` Subscription per topic and FHIR version (4 topics x R4B, R5). The feed is the MIMIC-IV demo's
hospital feed (``benchmarks.hospital_feed``: patients interleaved by clinical time) after one Synthea patient (its
conditions resolve, which MIMIC's billing diagnoses never do) and one whole MIMIC-IV admission (its discharge ends
its orders), published at ``--rate`` entries/s (below the
worker's capacity, so the figure is the pipeline's latency, not a backlog's), after ``--warmup`` entries of other
patients that are not measured (the model load, the groups' joins).

Latency of each event: from its entry published (the time just before the send) to its notification received
(the receiver's clock, the same machine); the event's entry is found through its Provenance (the entity's
identifier is a uuid5 of the entry id). Split at the transition's recorded time (Provenance.recorded): entry in to
transition applied, and transition applied to notification received. p50/p99/max, per topic too.

Evidence: three event notifications or more of each topic and version (the first of each kind of focus, see
``pick``), each checked by ``stam.fhir.validate``
(fhir.resources R4B/R5 and the IG's FHIRPath invariants), written with the figures to ``--out``
(``docs/results/fhir-notifications.json``). JSON summary on stdout.

``--demo``: the short version for ``make demo-fhir``: one Synthea patient, one R5 ``id-only`` Subscription to
``fact-superseded``; prints the handshake and the first notification received, then stops.

Usage: python -m benchmarks.fhir_notifications [--entries 1000] [--rate 10] [--warmup 300] [--out PATH] [--demo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.hospital_feed import MIMIC, load_feed, stack_with_workers
from benchmarks.write_path import REPO
from stam.net import free_port

VERSIONS = ("R4B", "R5")
MIMIC_PATIENT = "10019917"
"""One whole MIMIC-IV admission (267 entries: 41 medication orders, a discharge), published after the Synthea patient:
the feed's first entries hold no discharge (its patients are aligned to start together), this one does."""
SAMPLES = 3


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3) if s else 0.0


def _summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_s": _pct(values, 0.5), "p99_s": _pct(values, 0.99),
            "max_s": round(max(values), 3) if values else 0.0}


def _synthea_patient() -> list[Any]:
    from stam.sources.fhir_r4 import load_bundle
    from tests.conftest import SMALL_BUNDLE

    return list(load_bundle(SMALL_BUNDLE).entries)


def _start_notifier(settings: Any, home: Path, cafile: Path) -> tuple[subprocess.Popen[bytes], int, int, Any]:
    port, metrics = free_port(), free_port()
    env = dict(os.environ, STAM_HOME=str(home), STAM_BROKER_URL=settings.broker_url, STAM_REDIS_URL=settings.redis_url,
               STAM_MILVUS_URI=settings.milvus_uri, STAM_FHIR_PORT=str(port), STAM_METRICS_PORT=str(metrics),
               STAM_FHIR_ENDPOINT_CAFILE=str(cafile))
    log = open(home / "fhir.log", "wb")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "listen", "fhir", "--loglevel", "warning"], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise SystemExit((home / "fhir.log").read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return proc, port, metrics, log
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("stam listen fhir did not become ready: " + (home / "fhir.log").read_text()[-2000:])
        time.sleep(0.5)


async def _subscribe(base: str, receiver: Any, specs: list[tuple[str, str, str, bool]]) -> dict[str, str]:
    """(hook, topic, version, content, tls) -> subscription id by hook."""
    import aiohttp

    from stam.fhir.subscriptions import BACKPORT
    from stam.fhir.topics import TOPICS

    ids = {}
    async with aiohttp.ClientSession() as session:
        for hook, topic, version, content, tls in specs:  # type: ignore[misc]
            endpoint = receiver.url(hook, tls=tls)
            if version == "R5":
                body: dict[str, Any] = {
                    "resourceType": "Subscription", "status": "requested", "reason": "benchmark",
                    "topic": TOPICS[topic].url, "endpoint": endpoint, "content": content, "maxCount": 1,
                    "channelType": {"system": "http://terminology.hl7.org/CodeSystem/subscription-channel-type",
                                    "code": "rest-hook"}}
            else:
                body = {"resourceType": "Subscription", "status": "requested", "reason": "benchmark",
                        "criteria": TOPICS[topic].url,
                        "channel": {"type": "rest-hook", "endpoint": endpoint, "payload": "application/fhir+json",
                                    "_payload": {"extension": [{"url": BACKPORT + "backport-payload-content",
                                                                "valueCode": content}]}}}
            async with session.post(f"{base}/Subscription", json=body) as resp:
                created = await resp.json(content_type=None)
                if resp.status != 201:
                    raise SystemExit(f"subscription refused: {created}")
                ids[hook] = created["id"]
    await receiver.wait(lambda: all(receiver.of(h, "handshake") for h in ids), 60, "the handshakes")
    return ids


async def _publish_at(settings: Any, entries: list[Any], rate: float | None, sent: dict[str, float]) -> None:
    from stam.publish import Publisher, PublishSummary

    async with Publisher(settings) as pub:
        step = 1.0 / rate if rate else 0.0
        start = time.monotonic()
        chunk = max(1, int(rate / 10)) if rate else 500
        for i in range(0, len(entries), chunk):
            part = entries[i:i + chunk]
            if rate:
                await asyncio.sleep(max(0.0, start + i * step - time.monotonic()))
            now = time.time()
            for e in part:
                sent[e.entry_id] = now
            await pub.send_entries(part, PublishSummary())


def pick(bundles: list[dict[str, Any]], entry_of: dict[str, str]) -> list[dict[str, Any]]:
    """Evidence: the first notification of each kind of focus (its resource type, and the source of its entry: a
    FHIR resource keeps its id, HL7 v2 or MIMIC-IV gets a derived one), up to 5, then the earliest to make 3."""
    from stam.fhir.resources import ENTRY_SYSTEM

    def key(bundle: dict[str, Any]) -> tuple[str, str]:
        res = [e.get("resource") or {} for e in bundle["entry"][1:]]
        prov = next((r for r in res if r.get("resourceType") == "Provenance"), {})
        ident = (prov.get("entity") or [{}])[0].get("what", {}).get("identifier", {})
        entry = entry_of.get(ident.get("value", "")) if ident.get("system") == ENTRY_SYSTEM else None
        return (res[0].get("resourceType", "?") if res else "?", (entry or "?").split(":", 1)[0])

    chosen, seen = [], set()
    for b in bundles:
        if key(b) not in seen and len(chosen) < 5:
            seen.add(key(b))
            chosen.append(b)
    for b in bundles:
        if len(chosen) >= SAMPLES:
            break
        if b not in chosen:
            chosen.append(b)
    return chosen


def demo() -> int:
    from tests.integration.fhir_receiver import Receiver

    with tempfile.TemporaryDirectory(prefix="stam-demo-fhir-") as tmp:
        home = Path(tmp)
        receiver = Receiver(home)
        with stack_with_workers(home / "stack", 1) as (settings, _, _):
            proc, port, _, log = _start_notifier(settings, home / "stack", receiver.cert)
            base = f"http://127.0.0.1:{port}/fhir"
            try:
                async def run() -> None:
                    await receiver.start()
                    await _subscribe(base, receiver, [("demo", "fact-superseded", "R5", "id-only", False)])
                    print(f"subscribed to fact-superseded at {base} (R5, id-only); handshake received:")
                    print(json.dumps(receiver.of("demo", "handshake")[0].bundle, indent=1)[:1200])
                    entries = _synthea_patient()
                    print(f"publishing one Synthea patient ({len(entries)} entries) ...", flush=True)
                    await _publish_at(settings, entries, None, {})
                    await receiver.wait(lambda: receiver.of("demo", "event-notification"), 600, "a notification")
                    first = receiver.of("demo", "event-notification")[0]
                    print("the first notification received (application/fhir+json):")
                    print(json.dumps(first.bundle, indent=1))
                    await receiver.stop()

                asyncio.run(run())
            finally:
                proc.terminate()
                proc.wait(timeout=30)
                log.close()
    return 0


def read_feed(args: argparse.Namespace) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The Synthea patient, the admitted MIMIC-IV patient, the warm-up entries (not measured) and the whole measured
    feed (the Synthea patient, the admitted one, then the hospital's feed)."""
    from stam.sources.mimic import iter_mimic

    synthea = _synthea_patient()
    admitted = [e for batch in iter_mimic(MIMIC, subjects=[MIMIC_PATIENT]) for e in batch]
    hospital = [e for e in load_feed(None) if e.patient_id != MIMIC_PATIENT]
    warm = hospital[:args.warmup]
    feed = synthea + admitted + hospital[args.warmup:args.warmup + args.entries]
    return synthea, admitted, warm, feed


async def measure(settings: Any, receiver: Any, base: str, warm: list[Any], feed: list[Any], rate: float | None,
                  sent: dict[str, float]) -> float:
    """Warm the worker up, subscribe to every topic in every version, publish the feed at ``rate`` and wait until
    the notifications stop coming: seconds from the first entry published."""
    from stam.fhir.topics import TOPICS
    from tests.integration.broker import collect_outputs

    await _publish_at(settings, warm, None, {})  # not measured: the worker loads, joins, applies
    await collect_outputs(settings, {warm[-1].entry_id}, timeout=1200)
    await receiver.start()
    specs = [(f"{t}-{v}", t, v, "full-resource", True) for t in TOPICS for v in VERSIONS]
    await _subscribe(base, receiver, specs)  # type: ignore[arg-type]
    t0 = time.monotonic()
    await _publish_at(settings, feed, rate, sent)
    await collect_outputs(settings, {feed[-1].entry_id}, timeout=1800)
    last = -1
    while len(receiver.got) != last:  # until the notifications stop coming
        last = len(receiver.got)
        await asyncio.sleep(5)
    await receiver.stop()
    return time.monotonic() - t0


@dataclass
class Received:
    """What the notifications received show: latencies (total, to the transition, from it to the notification, per
    topic), the event bundles per subscription, validation problems and the events counted."""

    lat: dict[str, list[float]]
    per_topic: dict[str, list[float]]
    candidates: dict[str, list[dict[str, Any]]]
    problems: list[str]
    events: int


def read_notifications(got: list[Any], entry_of: dict[str, str], sent: dict[str, float]) -> Received:
    """Validate every notification received and time each event's entry: its Provenance names the entry and when its
    transition was recorded."""
    from datetime import datetime

    from stam.fhir.resources import ENTRY_SYSTEM
    from stam.fhir.topics import TOPICS
    from stam.fhir.validate import check_notification

    out = Received(lat={"total": [], "to_applied": [], "applied_to_notified": []},
                   per_topic={t: [] for t in TOPICS}, candidates={}, problems=[], events=0)
    for r in got:
        version = r.hook.rsplit("-", 1)[1]
        topic = r.hook.rsplit("-", 1)[0]
        bad = check_notification(r.bundle, version)  # type: ignore[arg-type]
        out.problems.extend(f"{r.hook}: {p}" for p in bad)
        if r.type != "event-notification":
            continue
        out.events += len(r.numbers)
        out.candidates.setdefault(r.hook, []).append(r.bundle)
        for e in r.bundle["entry"][1:]:
            res = e.get("resource") or {}
            if res.get("resourceType") != "Provenance":
                continue
            ident = res["entity"][0]["what"].get("identifier", {})
            entry_id = entry_of.get(ident.get("value")) if ident.get("system") == ENTRY_SYSTEM else None
            if entry_id is None or entry_id not in sent:
                continue
            applied = datetime.fromisoformat(res["recorded"]).timestamp()
            out.lat["total"].append(r.at - sent[entry_id])
            out.lat["to_applied"].append(applied - sent[entry_id])
            out.lat["applied_to_notified"].append(r.at - applied)
            out.per_topic[topic].append(r.at - sent[entry_id])
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from stam.fhir.resources import derived_id
    from stam.fhir.topics import TOPICS
    from tests.integration.fhir_receiver import Receiver

    synthea, admitted, warm, feed = read_feed(args)
    entry_of = {derived_id("entry", e.entry_id): e.entry_id for e in feed}
    with tempfile.TemporaryDirectory(prefix="stam-bench-fhir-") as tmp:
        home = Path(tmp)
        receiver = Receiver(home)
        with stack_with_workers(home / "stack", 1) as (settings, _, _):
            proc, port, metrics_port, log = _start_notifier(settings, home / "stack", receiver.cert)
            base = f"http://127.0.0.1:{port}/fhir"
            sent: dict[str, float] = {}
            try:
                seconds = asyncio.run(measure(settings, receiver, base, warm, feed, args.rate, sent))
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            finally:
                proc.terminate()
                proc.wait(timeout=30)
                log.close()

    got = read_notifications(receiver.got, entry_of, sent)
    samples = {hook: pick(bundles, entry_of) for hook, bundles in got.candidates.items()}
    return {
        "benchmark": "fhir_notifications",
        "feed": {"entries": len(feed), "synthea_entries": len(synthea), "mimic_patient_entries": len(admitted),
                 "mimic_entries": len(feed) - len(synthea),
                 "warmup_entries": len(warm), "rate_per_s": args.rate, "seconds": round(seconds, 1)},
        "subscriptions": len(TOPICS) * len(VERSIONS), "notifications": len(receiver.got), "events": got.events,
        "validation_problems": got.problems[:20], "bundles_checked": len(receiver.got),
        "latency_entry_to_notification": _summary(got.lat["total"]),
        "latency_entry_to_transition": _summary(got.lat["to_applied"]),
        "latency_transition_to_notification": _summary(got.lat["applied_to_notified"]),
        "latency_by_topic": {t: _summary(v) for t, v in got.per_topic.items()},
        "metrics": [line for line in metrics.splitlines() if line.startswith("stam_fhir_notifications_total")],
        "samples": samples,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1000, help="MIMIC-IV feed entries measured (after the Synthea patient)")
    p.add_argument("--warmup", type=int, default=300, help="feed entries applied first, not measured")
    p.add_argument("--rate", type=float, default=10.0, help="entries/s published (0: flat out)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "fhir-notifications.json")
    p.add_argument("--demo", action="store_true", help="one patient, one subscription, print its first notification")
    args = p.parse_args()
    if args.demo:
        raise SystemExit(demo())
    from stam_lab.eval.provenance import stamp

    report = stamp(bench(args))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
