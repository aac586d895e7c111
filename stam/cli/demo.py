"""``stam demo`` (one real Synthea patient through the embedded stack) and ``stam demo-notes`` (two of their
notes decomposed by the local language model)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from schemas.query import QueryRequest
from stam.cli.context import load_settings, query_service, stack_env
from stam.cli.transitions import consume_transitions
from stam.config import Settings
from stam.net import free_port
from stam.sources.fhir_ndjson import load_ndjson, patient_lines
from stam.sources.fhir_r4 import load_bundle
from stam.sources.mimic import is_mimic_root, load_mimic

DEFAULT_DEMO_BUNDLE = "../shared/data/synthea-r4-bundles/7bf5504f-bb24-43e0-b58f-f9c7d8a7a9aa.json"
DEMO_NOTES_PATIENT = "6a4160eb-a793-2f86-2302-378626f46cce"
DEMO_NOTES = ("00d2ed9f-74f9-2ca0-1b88-e711d800c300", "3e587458-87ac-4859-9517-a2a4e8a1145c")
DEFAULT_MIMIC = "../shared/data/mimic-iv-demo-2.2"
DEMO_ADMISSION = "10019917"
"""A MIMIC-IV demo patient with one admission (2182-01-07 to 2182-01-10): a diet order changed five times, a
medication order discontinued, 16 doses given; its discharge ends what is left of the stay."""
DEMO_TABLES = ("admissions", "poe", "pharmacy", "emar")


def _demo_stack(steps: int) -> tuple[Path, bool, Settings]:
    """Start (or join) the embedded stack of the demo home with its topics; whether this call started it."""
    # deferred: stam.stack, topology.admin pull in redis, aiokafka (kept off `stam --help`)
    from stam import stack
    from topology.admin import ensure_topics

    home = Settings().home
    print(f"1/{steps} starting the embedded stack (Tansu broker, Redis, Milvus Lite) ...")
    started_stack = stack.running_stack(home) is None
    stack.up(home)
    settings = load_settings()
    asyncio.run(ensure_topics(settings))
    return home, started_stack, settings


def _stop(proc: subprocess.Popen[bytes], *, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def cmd_demo(args: argparse.Namespace) -> int:
    # deferred: stam.stack (kept off `stam --help`)
    from stam import stack

    bundle = Path(args.bundle)
    if not bundle.exists():
        print(f"bundle {bundle} not found (the shared data folder is expected at ../shared/data)",
              file=sys.stderr)
        return 1
    home, started_stack, settings = _demo_stack(7)
    print(f"    broker {settings.broker_url}  redis {settings.redis_url}  milvus {settings.milvus_uri}")
    print("2/7 starting the write-path worker (extract -> link -> impact -> update) ...")
    log = open(home / "logs" / "worker.log", "ab")  # noqa: SIM115 - lives as long as the worker
    worker = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"],
                              env=stack_env(settings), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        result = load_bundle(bundle)
        patient = result.patient_id or "?"
        print(f"3/7 publishing {len(result.entries)} entries of one Synthea patient "
              f"({sum(result.skipped.values())} non-clinical resources skipped) ...")
        # deferred: stam.publish pulls in igraph, redis, numpy (kept off `stam --help`)
        from stam.publish import Publisher, PublishSummary

        async def publish() -> PublishSummary:
            summary = PublishSummary()
            async with Publisher(settings) as pub:
                await pub.send_entries(result.entries, summary)
            return summary

        summary = asyncio.run(publish())
        print(f"    sent {summary.sent} entries")
        print("4/7 state transitions as they happen (new -> ACTIVE additions not shown):")
        started = time.monotonic()
        counts = asyncio.run(consume_transitions(
            settings, until_entries={e.entry_id for e in result.entries}, timeout=args.timeout, show=True))
        elapsed = time.monotonic() - started
        print(f"    {counts['entries_done']}/{len(result.entries)} entries applied, "
              f"{counts['transitions']} transitions, {counts['dead_letters']} dead letters, {elapsed:.1f}s")
        if worker.poll() is not None:
            print(f"worker exited early ({worker.returncode}); see {home / 'logs' / 'worker.log'}")
            return 1
        print("5/7 the patient's memory now:\n")
        # deferred: stam.backends.redis_state, stam.export and others pull in igraph, redis, numpy (kept off `stam --help`)
        from stam.backends.redis_state import RedisStateStore
        from stam.export import render_text
        from stam.transport import redis_client

        state = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix).load(patient)
        print(render_text(state, limit=args.limit))
        print(f"\nFull export: STAM_HOME={home} .venv/bin/stam state --patient {patient} --json")

        service = query_service(settings)
        for question in ("What is the patient's body height?", "How has the body height changed over time?"):
            print(f"\n6/7 ask: {question!r}")
            answer = asyncio.run(service.answer(QueryRequest(request_id="demo", patient_id=patient,
                                                             question=question, k_active=3, k_history=3)))
            if answer.packet is None:
                print(f"    error: {answer.error}")
                return 1
            g = answer.packet.gate
            print(f"    gate: {'ACTIVE+HISTORY' if g.serve_history else 'ACTIVE only'} ({g.reason}); "
                  f"{answer.packet.tokens} tokens; {answer.latency_ms:.0f} ms")
            print("    " + answer.packet.rendered.replace("\n", "\n    "))
        if not _demo_admission(settings, Path(args.mimic), args.timeout):
            return 1
        again = "" if not started_stack or args.keep else f"STAM_HOME={home} .venv/bin/stam stack up && "
        print(f"\nAsk more (the record is kept in {home}): {again}STAM_HOME={home} .venv/bin/stam ask "
              f"--patient {patient} \"How has the body height changed over time?\" --as-of 1938-06-01")
        return 0 if counts["entries_done"] == len(result.entries) else 1
    finally:
        _stop(worker, timeout=20)
        log.close()
        if started_stack and not args.keep:
            stack.down(home)


def _demo_admission(settings: Settings, root: Path, timeout: float) -> bool:
    """Step 7: one MIMIC-IV admission through the same worker; its discharge ends the stay's orders (the lifecycle)."""
    # deferred: stam.publish pulls in igraph, redis, numpy (kept off `stam --help`)
    from stam.publish import Publisher, PublishSummary

    if not is_mimic_root(root):
        print(f"\n7/7 skipped: no MIMIC-IV demo at {root}")
        return True
    result = load_mimic(root, subjects=[DEMO_ADMISSION], tables=DEMO_TABLES)
    discharges = {e.entry_id for e in result.entries if e.entry_id.endswith(":discharge")}
    print(f"\n7/7 one MIMIC-IV admission of patient {DEMO_ADMISSION}: {len(result.entries)} entries (the admission, "
          "its orders, their pharmacy versions, the doses given). Nothing in them says the orders still open at the "
          "end stopped; the discharge does:")

    async def publish() -> None:
        async with Publisher(settings) as pub:
            await pub.send_entries(result.entries, PublishSummary())

    asyncio.run(publish())
    counts = asyncio.run(consume_transitions(settings, until_entries={e.entry_id for e in result.entries},
                                              timeout=timeout, show=False, show_entries=discharges))
    # deferred: stam.backends.redis_state, stam.transport pull in igraph, redis, numpy (kept off `stam --help`)
    from stam.backends.redis_state import RedisStateStore
    from stam.transport import redis_client

    state = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix).load(DEMO_ADMISSION)
    reasons = Counter(m.reason.value for m in state.memories.values() if m.reason is not None)
    current = sum(1 for m in state.memories.values() if m.store.value == "active" and m.memory.category.value in
                  ("medication", "order"))
    print(f"    {counts['entries_done']}/{len(result.entries)} entries applied. Of the patient's orders and doses: "
          f"{reasons['event']} doses given went straight to HISTORY (events, never current), "
          f"{reasons['encounter-ended']} facts ended with the stay, {reasons['stopped']} were stopped and "
          f"{reasons['superseded']} replaced before it; {current} orders or medications are current now")
    return counts["entries_done"] == len(result.entries)


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    # deferred: urllib.request is slow to import (kept off `stam --help`)
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return True
        except OSError:
            time.sleep(2)
    return False


def cmd_demo_notes(args: argparse.Namespace) -> int:
    """Two real Synthea notes decomposed by the local model, after the patient's coded history."""
    # deferred: stam.stack, stam.publish pull in igraph, redis, numpy (kept off `stam --help`)
    from stam import stack
    from stam.publish import publish_paths

    bulk = Path(args.bulk)
    if not (bulk / "DocumentReference.000.ndjson").is_file():
        print(f"Synthea bulk folder {bulk} not found (the shared data folder is expected at ../shared/data)",
              file=sys.stderr)
        return 1
    home, started_stack, settings = _demo_stack(6)
    port = free_port()
    print(f"2/6 serving {args.model} with Ray Serve (llama.cpp on CPU) on port {port} ...")
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    serve_log = open(logs / "serve.log", "ab")  # noqa: SIM115 - lives as long as the server
    server = subprocess.Popen([sys.executable, "-m", "stam.cli", "serve", "--model", args.model, "--port", str(port)],
                              stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    worker_log = open(logs / "worker.log", "ab")  # noqa: SIM115
    worker: subprocess.Popen[bytes] | None = None
    llm_url = f"http://127.0.0.1:{port}/v1"
    metrics_port = 0
    try:
        if not _wait_http(f"{llm_url}/models", 600, server):
            print(f"the model server did not start; see {logs / 'serve.log'}")
            return 1
        metrics_port = free_port()
        print("3/6 starting the write-path worker with the language-model reasoner ...")
        worker = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"],
                                  env=dict(stack_env(settings), STAM_LLM_URL=llm_url, STAM_LLM_MODEL=args.model,
                                           STAM_LLM_CONCURRENCY="1", STAM_METRICS_PORT=str(metrics_port)),
                                  stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
        folder, notes_raw = _notes_folder(bulk)

        entries = load_ndjson([folder]).entries
        note_entries = {e.entry_id for e in entries if e.resource_type == "DocumentReference"}
        print(f"4/6 publishing {len(entries) - len(note_entries)} coded entries of one Synthea patient (no model "
              f"call) and {len(note_entries)} of their notes:")
        _print_notes(notes_raw)
        summary = asyncio.run(publish_paths(settings, [folder]))
        print(f"    sent {summary.sent} entries")
        print("5/6 what the model made of the notes (each fact: its store, the relations the link+update call "
              "made, the facts it ended):")
        started = time.monotonic()
        counts = asyncio.run(consume_transitions(settings, until_entries={e.entry_id for e in entries},
                                                  timeout=args.timeout, show=True, show_entries=note_entries))
        _print_applied(counts, len(entries), time.monotonic() - started, metrics_port)
        print("6/6 ask: 'Which medications is the patient taking?'")
        _ask_medications(settings)
        print(f"\nFull export: STAM_HOME={home} .venv/bin/stam state --patient {DEMO_NOTES_PATIENT} --json")
        return 0 if counts["entries_done"] == len(entries) and counts["dead_letters"] == 0 else 1
    finally:
        for proc in (worker, server):
            if proc is not None:
                _stop(proc, timeout=30)
        serve_log.close()
        worker_log.close()
        if started_stack and not args.keep:
            stack.down(home)


def _notes_folder(bulk: Path) -> tuple[Path, list[dict[str, Any]]]:
    """A temporary bulk folder of the demo's two notes and the patient's coded history up to the later one (its
    conditions, medication requests and encounters), and the notes as read."""
    folder = Path(tempfile.mkdtemp(prefix="stam-demo-notes-"))
    notes_raw = [json.loads(line) for line in (bulk / "DocumentReference.000.ndjson").read_text().splitlines()
                 if any(n in line for n in DEMO_NOTES)]
    until = max(n["context"]["period"]["start"] for n in notes_raw)[:19]
    history = patient_lines(bulk, DEMO_NOTES_PATIENT, ("Condition", "MedicationRequest", "Encounter"), until)
    for rtype, keep in history.items():
        (folder / f"{rtype}.000.ndjson").write_text("\n".join(keep) + "\n")
    (folder / "DocumentReference.000.ndjson").write_text("\n".join(json.dumps(n) for n in notes_raw) + "\n")
    return folder, notes_raw


def _print_notes(notes_raw: list[dict[str, Any]]) -> None:
    """Each note's medications section, oldest note first."""
    for n in sorted(notes_raw, key=lambda n: n["context"]["period"]["start"]):
        text = base64.b64decode(n["content"][0]["attachment"]["data"]).decode().strip()
        print("    --- note of " + n["context"]["period"]["start"][:10] + " ---\n    "
              + text[text.find("# Medications"):].replace("\n", "\n    ")[:400])


def _print_applied(counts: dict[str, int], n_entries: int, elapsed: float, metrics_port: int) -> None:
    """How many entries the worker applied, and the model calls and tokens it spent (from its metrics)."""
    # deferred: urllib.request is slow to import (kept off `stam --help`)
    import urllib.request

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    calls = _metric_sum(metrics, 'stam_llm_calls_total{outcome="ok"}')
    prompt = _metric_sum(metrics, 'stam_llm_tokens_total{kind="prompt"}')
    completion = _metric_sum(metrics, 'stam_llm_tokens_total{kind="completion"}')
    print(f"    {counts['entries_done']}/{n_entries} entries applied in {elapsed:.0f}s, "
          f"{counts['dead_letters']} dead letters; model calls {calls:.0f} (prompt tokens {prompt:.0f}, "
          f"completion tokens {completion:.0f})")


def _ask_medications(settings: Settings) -> None:
    """The demo's question to the patient's memory, and the evidence packet it is answered from."""
    service = query_service(settings)
    answer = asyncio.run(service.answer(QueryRequest(request_id="demo-notes", patient_id=DEMO_NOTES_PATIENT,
                                                     question="Which medications is the patient taking?",
                                                     k_active=6, k_history=3)))
    if answer.packet is not None:
        print("    " + answer.packet.rendered.replace("\n", "\n    "))


def _metric_sum(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="stream one real Synthea patient through the embedded stack")
    p.add_argument("--bundle", default=DEFAULT_DEMO_BUNDLE, help="the patient's Synthea R4 bundle (default: one "
                   "in ../shared/data/synthea-r4-bundles)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the worker to apply every entry (default 300)")
    p.add_argument("--limit", type=int, default=25, help="memories shown per store (default 25)")
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running afterwards")
    p.add_argument("--mimic", default=DEFAULT_MIMIC, help="the MIMIC-IV demo folder whose admission step 7 streams "
                   f"(default {DEFAULT_MIMIC}; skipped when absent)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("demo-notes", help="two real Synthea notes decomposed by the local language model",
                       description="Starts the embedded stack, the Ray Serve app with a local GGUF model "
                       "(llama.cpp on CPU) and a worker pointed at it; publishes one patient's coded history "
                       "and two of their notes; shows the facts the model extracted, their relations and "
                       "transitions, the model calls and tokens, and one question.")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m",
                   help="packaged model (make models-1.5b) or qwen2.5-coder-0.5b-instruct-q4_k_m (faster, weaker)")
    p.add_argument("--bulk", default="../shared/data/synthea-bulk-10p",
                   help="Synthea bulk-export folder with the notes (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds to wait for the worker to apply every entry (default 1200)")
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running afterwards")
    p.set_defaults(fn=cmd_demo_notes)
