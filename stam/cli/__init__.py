"""The ``stam`` command line.

  stam stack up|down|status     embedded broker (Tansu on SeaweedFS S3), Redis (AOF) and Milvus Lite on loopback;
                                up restarts only dead processes, status exits 1 when one is dead
  stam worker                   run the write-path workers (extract, link, impact, update)
  stam publish PATH...          publish FHIR R4 bundles/NDJSON, HL7 v2 messages or a MIMIC-IV folder
  stam transitions              print transitions from the transitions topic
  stam state --patient ID       a patient's ACTIVE and HISTORY memories (--json: stable export shape)
  stam deadletters list|show|replay|dismiss   dead letters and the record gaps they leave in patients' records
  stam rebuild --patient ID     rebuild a patient's Redis and Milvus projections from the transitions topic
  stam erase --patient ID       erase a patient everywhere, verify, publish a receipt (--dry-run, --verify)
  stam query-worker             the query consumer (queries -> answers topics, HTTP POST /v1/query)
  stam token new --name N --role R  a query token with a scope (clinician, or service:<name> --patient ID...)
  stam ask --patient ID "Q"     evidence packet for a question (--as-of T, --json, --gate ...)
  stam gate build-set|calibrate the store gate's calibration
  stam serve [--engine llamacpp|vllm]  the language model behind an OpenAI-compatible endpoint (Ray Serve)
  stam demo                     all of the above on one real Synthea patient
  stam eval state               write-time state diagnostics (MIMIC-IV or Synthea gold, ablation variants, plot)
  stam eval qa|questions        MIMIC-QA: STAM vs append-only, flat RAG, full context (evidence, reader F1/EM)
  stam demo-notes [--model M]   two real notes decomposed by the local language model (Ray Serve + llama.cpp)

Settings come from STAM_* environment variables; for any not set, the embedded stack's URLs
(<home>/stack.json) are used; when a process of it is not running, commands fail naming it (never a silent
fallback to a default address or a private store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from schemas.common import Category
from stam.config import Settings
from stam.eval.mimic_qa import PER_PATIENT as MIMIC_QA_PER_PATIENT
from stam.publish import FORMATS
from stam.sources.mimic import TABLES as MIMIC_TABLES

DEFAULT_DEMO_BUNDLE = "../shared/data/synthea-r4-bundles/7bf5504f-bb24-43e0-b58f-f9c7d8a7a9aa.json"


def load_settings() -> Settings:
    """Settings from the environment, completed by the running embedded stack where env is silent."""
    from stam import stack

    base = Settings()
    # The processes whose URL the environment does not give must run: a dead one is named, never replaced by
    # a default address or a private store (StackError, one line).
    needed = tuple(name for name, fld in (("s3", "broker_url"), ("broker", "broker_url"), ("redis", "redis_url"),
                                          ("milvus", "milvus_uri")) if not os.environ.get(f"STAM_{fld.upper()}"))
    info = stack.require(base.home, needed)
    if info is None:
        return base
    overrides: dict[str, Any] = {}
    for fld, value in (("broker_url", info.broker_url), ("redis_url", info.redis_url),
                       ("milvus_uri", info.milvus_uri)):
        if not os.environ.get(f"STAM_{fld.upper()}"):
            overrides[fld] = value
    return base.model_copy(update=overrides)


def _stack_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"STAM_BROKER_URL": settings.broker_url, "STAM_REDIS_URL": settings.redis_url,
                "STAM_MILVUS_URI": settings.resolved_milvus_uri(), "STAM_HOME": str(settings.home)})
    return env


# --- commands --------------------------------------------------------------------------------------

def cmd_stack(args: argparse.Namespace) -> int:
    from stam import stack

    home = Settings().home
    if args.action == "up":
        info = stack.up(home)
        settings = load_settings()
        from topology.admin import ensure_topics

        asyncio.run(ensure_topics(settings))
        print(json.dumps({"broker_url": info.broker_url, "redis_url": info.redis_url,
                          "milvus_uri": info.milvus_uri, "broker_storage": info.broker_storage,
                          "redis_fsync": info.redis_fsync, "started": info.restarted}, indent=2))
    elif args.action == "down":
        print("stopped (data kept in " + str(home) + ")" if stack.down(home) else "no stack running")
    else:
        procs = stack.status(home)
        if not procs:
            print(f"no stack in {home}")
            return 1
        print(json.dumps(procs, indent=2))
        dead = [n for n, p in procs.items() if not p["alive"]]
        if dead:
            print(f"not running: {', '.join(dead)}; `stam stack up` restarts them", file=sys.stderr)
        return 1 if dead else 0
    return 0


def cmd_query_worker(args: argparse.Namespace) -> int:
    from workers.ops import PortInUse
    from workers.query import run

    settings = load_settings()
    sys.argv = [sys.argv[0], "worker", "-l", args.loglevel]
    try:
        run(settings, loglevel=args.loglevel)
    except PortInUse as exc:
        print(f"stam query-worker: {exc}", file=sys.stderr)
        return 2
    return 0


def _query_service(settings: Settings) -> Any:
    from workers.query import build_service
    from workers.runtime import Runtime

    return build_service(settings, Runtime(settings=settings, topics=None))  # type: ignore[arg-type]


def cmd_ask(args: argparse.Namespace) -> int:
    from datetime import datetime

    from schemas.query import GateMode, QueryRequest

    settings = load_settings()
    as_of = None
    if args.as_of:
        try:
            as_of = datetime.fromisoformat(args.as_of.replace("Z", "+00:00"))
        except ValueError:
            print(f"stam ask: --as-of {args.as_of!r} is not an ISO 8601 date or time (e.g. 2019-06-01 or "
                  "2019-06-01T08:30:00Z)", file=sys.stderr)
            return 2
        if as_of.tzinfo is None:
            from datetime import UTC

            as_of = as_of.replace(tzinfo=UTC)
    visibility = None
    if args.exclude_entry or args.exclude_category or args.exclude_source_type:
        from schemas.query import Visibility

        visibility = Visibility(exclude_entry_ids=tuple(args.exclude_entry),
                                exclude_categories=tuple(args.exclude_category),
                                exclude_source_types=tuple(args.exclude_source_type))
    req = QueryRequest(request_id=f"cli-{time.time_ns()}", patient_id=args.patient, question=args.question,
                       k_active=args.k_active, k_history=args.k_history, gate=GateMode(args.gate),
                       ranking="joint" if args.joint else "separate", labels=not args.no_labels, spans=args.spans,
                       token_budget=args.token_budget, as_of=as_of, as_of_version=args.as_of_version,
                       visibility=visibility)
    from stam.read.service import failed_answer

    # pymilvus prints a traceback of its own for every failed call, and the service warns of an outage: the
    # answer says what failed, in one line (a bug is still logged with its traceback).
    for name in ("pymilvus", "pymilvus.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("stam.query").setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        service = _query_service(settings)
    except Exception as exc:  # a store down: Milvus is connected to when the service is built
        answer = failed_answer(req, exc, started)
    else:
        answer = asyncio.run(service.answer(req))
    if args.json:
        print(answer.model_dump_json(indent=2))
    elif not answer.ok:
        print(f"error ({answer.error_kind}): {answer.error}", file=sys.stderr)
    else:
        assert answer.packet is not None
        p = answer.packet
        print(p.rendered)
        print(f"\n[gate: {'ACTIVE+HISTORY' if p.gate.serve_history else 'ACTIVE only'} - {p.gate.reason}; "
              f"{len(p.items)} items, {p.tokens} tokens ({p.tokenizer}); {answer.latency_ms:.0f} ms]")
        print(f"\nanswer ({answer.reader}): {answer.answer}" if answer.answer else f"\n{answer.note or ''}")
    return 0 if answer.ok else 1


def cmd_gate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stam.read.calibrate import labelled_set, load_set, replay
    from stam.read.gate import calibrate, write_gate_file

    settings = load_settings()
    service = _query_service(settings)
    if args.action == "build-set":
        patients = args.patients.split(",") if args.patients else service.states.patients()
        items = labelled_set(service.states, patients, per_patient=args.per_patient)
        Path(args.set).write_text("".join(json.dumps(i) + "\n" for i in items))
        print(json.dumps({"questions": len(items), "patients": len(patients), "set": args.set}))
        return 0
    items = load_set(Path(args.set))
    samples = asyncio.run(replay(service, items, k_active=args.k_active, k_history=args.k_history))
    out = Path(args.out) if args.out else settings.resolved_gate_file()
    report = {}
    for lam in args.lambdas:
        report[str(lam)] = calibrate(samples, lam).as_dict()
    chosen = calibrate(samples, args.lambdas[0])
    write_gate_file(out, chosen, source=args.set)
    print(json.dumps({"written": str(out), "chosen_lambda": args.lambdas[0], "by_lambda": report,
                      "cue_rate": round(sum(s.cue for s in samples) / len(samples), 4)}, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from stam.serving.app import run
    from stam.serving.config import LlamaCppEngine, ServingConfig, VllmEngine

    engine: LlamaCppEngine | VllmEngine
    if args.engine == "vllm":
        engine = VllmEngine(model_id=args.model or "qwen2.5-7b-instruct", accelerator_type=args.accelerator)
    else:
        engine = LlamaCppEngine(model_id=args.model or "qwen2.5-coder-1.5b-instruct-q4_k_m", gguf=args.gguf,
                                n_threads=args.threads)
    config = ServingConfig(engine=engine, host=args.host, port=args.port)
    print(f"serving {engine.model_id} ({engine.kind}) at http://{args.host}:{args.port}/v1  (Ctrl-C stops)",
          file=sys.stderr)
    run(config, blocking=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import UnknownStage, parse_stages, run
    from workers.ops import PortInUse

    try:
        stages = parse_stages(args.stages)
    except UnknownStage as exc:
        print(f"stam worker: {exc}", file=sys.stderr)
        return 2
    settings = load_settings()
    sys.argv = [sys.argv[0], "worker", "-l", args.loglevel]
    try:
        run(settings, loglevel=args.loglevel, stages=stages)
    except PortInUse as exc:
        print(f"stam worker: {exc}", file=sys.stderr)
        return 2
    return 0


async def _until_interrupted(work: Any) -> bool:
    """Run ``work``; True when Ctrl-C (SIGINT) stopped it. The signal is recorded, not only turned into a
    cancellation: a library that swallows the cancellation must not make an interrupted run look complete."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        await task
    except asyncio.CancelledError:
        if not interrupted:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return interrupted


def cmd_publish(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError
    from tqdm import tqdm

    from stam.errors import InputRefused
    from stam.integrity import SourceConfigError, source_keys
    from stam.publish import PublishSummary, publish_paths, report

    settings = load_settings()
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an unreachable broker is said in one line below
    logging.getLogger("stam.publish").setLevel(logging.INFO)  # the run's counts, one line at the end (report)
    bar = tqdm(desc="publishing", unit=" entries", file=sys.stderr, disable=args.quiet, mininterval=0.5)

    def progress(n: int) -> None:
        bar.update(n - bar.n)

    subjects = args.subjects.split(",") if args.subjects else None
    tables = args.tables.split(",") if args.tables else None
    summary = PublishSummary()
    try:
        if args.source_system is None and source_keys(settings).require_signed:
            raise SourceConfigError("signed entries are required (STAM_SOURCES / STAM_REQUIRE_SIGNED_ENTRIES): pass "
                                    "--source-system NAME, or the workers dead-letter every entry")
        interrupted = asyncio.run(_until_interrupted(publish_paths(
            settings, args.paths, fmt=args.format, rate=args.rate, progress=progress, subjects=subjects,
            tables=tables, summary=summary, source_system=args.source_system)))
        if interrupted:
            raise KeyboardInterrupt
    except SourceConfigError as exc:
        bar.close()
        print(f"stam publish: {exc}", file=sys.stderr)
        return 2
    except InputRefused as exc:
        bar.close()
        print(f"stam publish: {exc}; nothing was sent", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        bar.close()
        print(f"stam publish: interrupted after {summary.sent} entries sent ({summary.dead_lettered} "
              "dead-lettered); re-running the same command is safe: entry ids are deterministic and the workers "
              "skip entries already applied", file=sys.stderr)
        report(settings, summary, "interrupted", log_line=False)  # the line above has the counts
        return 130
    except (KafkaError, OSError) as exc:
        bar.close()
        print(f"stam publish: cannot reach the broker at {settings.broker_url} ({type(exc).__name__}); "
              f"{summary.sent} entries sent. Is the stack up (stam stack status)?", file=sys.stderr)
        report(settings, summary, "broker_unreachable", log_line=False)
        return 1
    finally:
        bar.close()
    print(json.dumps(summary.as_dict()))
    report(settings, summary, "ok" if summary.dead_lettered == 0 else "dead_lettered")
    return 0 if summary.dead_lettered == 0 else 2


def cmd_token(args: argparse.Namespace) -> int:
    from stam.read.scopes import TokenConfigError, new_token

    settings = load_settings()
    path = Path(args.file) if args.file else settings.query_tokens_file or settings.home / "query-tokens.json"
    try:
        token = new_token(path, args.name, args.role, args.patient)
    except (TokenConfigError, OSError, ValueError) as exc:
        print(f"stam token: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(f"token {args.name!r} ({args.role}) added to {path}; only its SHA-256 is kept, so copy it now. The query "
          f"worker reads the file named by STAM_QUERY_TOKENS_FILE.", file=sys.stderr)
    return 0


def cmd_state(args: argparse.Namespace) -> int:
    from stam.deadletters import gap_line
    from stam.export import export_state, render_text
    from stam.stores.redis_state import RedisStateStore
    from workers.runtime import redis_client

    settings = load_settings()
    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    state = states.load(args.patient)
    gaps = states.gaps(args.patient)
    if state.version == 0:
        gap = gap_line(gaps)
        print(f"no state for patient {args.patient}" + (f" ({gap}; see `stam deadletters list --patient`)"
                                                         if gap else ""), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**export_state(state), "gaps": [g.model_dump(mode="json") for g in gaps]}, indent=2))
    else:
        gap = gap_line(gaps)
        if gap:
            print(f"{gap}  (`stam deadletters list --patient {args.patient}`)")
            for g in gaps:
                print(f"  - entry {g.entry_id or '(unknown id)'}: {g.stage}, {g.error_type}; dead letter "
                      f"{g.dead_letter}" + (", replayed, not applied yet" if g.replayed_at else ""))
        print(render_text(state, limit=args.limit))
    return 0


def _one_line(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def cmd_deadletters(args: argparse.Namespace) -> int:
    """list|show|replay|dismiss: read the dead-letter topic from offset 0; act on one dead letter by its id."""
    import redis
    from aiokafka.errors import KafkaError

    from stam import deadletters as dl
    from stam.stores.redis_state import RedisStateStore
    from workers.runtime import redis_client

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # an unreachable broker is said in one line below
    settings = load_settings()
    states = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix)
    try:
        if args.action == "list":
            if args.id:
                raise dl.DeadLetterError("`list` takes no id (filters: --patient, --stage, --status)")
        elif not args.id:
            raise dl.DeadLetterError(f"`{args.action}` needs a dead letter id (PARTITION:OFFSET, from `list`)")
        else:
            dl.parse_id(args.id)
        value = None
        if args.action == "replay" and args.value_file:
            try:
                value = Path(args.value_file).read_bytes()
            except OSError as exc:
                raise dl.DeadLetterError(f"cannot read --value-file {args.value_file}: {exc.strerror}") from None
        if args.action == "dismiss" and not (args.reason and args.reason.strip()):
            raise dl.DeadLetterError("dismiss needs --reason (why the entry may stay out of the record)")
        letters = dl.with_status(asyncio.run(dl.read_letters(settings)), states)
        if args.action == "list":
            rows = [x for x in letters
                    if (args.patient is None or x.patient_id == args.patient)
                    and (args.stage is None or (x.letter is not None and x.letter.stage == args.stage))
                    and (args.status is None or x.status.startswith(args.status))]
            if args.json:
                print(json.dumps([x.summary() for x in rows], indent=2))
            elif not rows:
                print("no dead letters" + (" matching the filters" if len(letters) else ""))
            else:
                print(_table([{**x.summary(), "patient_id": x.patient_id or "(unknown: no gap)",
                               "entry_id": x.entry_id or "-", "error": _one_line(x.summary()["error"], 60),
                               "failed_at": x.letter.failed_at.strftime("%Y-%m-%d %H:%M:%S") if x.letter else ""}
                              for x in rows],
                             [("id", "id"), ("status", "status"), ("stage", "stage"), ("error_type", "error"),
                              ("patient_id", "patient"), ("entry_id", "entry"), ("failed_at", "failed at"),
                              ("error", "reason")]))
            return 0
        item = dl.find(letters, args.id)
        if args.action == "show":
            print(json.dumps(dl.show(item), indent=2, default=str))
            return 0
        if args.action == "replay":
            plan = dl.plan_replay(item, settings, value)
            sent = asyncio.run(dl.publish_replay(settings, plan, dl.signed(settings, plan, args.source_system)))
            log = dl.record_replay(states, item, plan, sent, by=args.by)
            print(json.dumps({"id": item.id, **log, "patient_id": item.patient_id, "entry_id": plan.entry_id,
                              "note": "the gap closes when the worker applies the entry"
                              if item.patient_id else "no gap: patient unknown"}))
            return 0
        print(json.dumps({"id": item.id, "patient_id": item.patient_id, "entry_id": item.entry_id,
                          **dl.dismiss(states, item, args.reason, by=args.by)}))
        return 0
    except dl.DeadLetterError as exc:
        print(f"stam deadletters {args.action}: {exc}", file=sys.stderr)
        return 2
    except (KafkaError, redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        where = "Redis" if isinstance(exc, redis.RedisError) else "broker"
        print(f"stam deadletters {args.action}: {where} unreachable ({type(exc).__name__}: {_one_line(str(exc), 120)})"
              f"; is the stack up (`stam stack status`)?", file=sys.stderr)
        return 1


async def _patient_transitions(settings: Settings, patient_id: str) -> list[Any]:
    from stam.read.asof import read_patient_transitions

    return await read_patient_transitions(settings, patient_id)


def cmd_rebuild(args: argparse.Namespace) -> int:
    from stam.rebuild import rebuild
    from workers.runtime import build_deps

    settings = load_settings()
    if _refuse_erased(settings, args.patient):
        return 1
    deps = build_deps(settings)
    if deps.states.load(args.patient).version != 0:
        print(f"patient {args.patient} already has state; erase it first (rebuild writes into empty stores)",
              file=sys.stderr)
        return 1
    events = asyncio.run(_patient_transitions(settings, args.patient))
    if not events:
        print(f"no transitions for patient {args.patient}", file=sys.stderr)
        return 1
    state = rebuild(args.patient, events, deps)
    print(json.dumps({"patient_id": args.patient, "transitions": len(events), "state_version": state.version,
                      **state.counts()}))
    return 0


def _refuse_erased(settings: Settings, patient_id: str) -> bool:
    """An erased patient is never rebuilt from the transition log (the erasure register, or a shredded key)."""
    from stam.erase import is_erased
    from workers.runtime import redis_client

    if is_erased(settings, redis_client(settings), patient_id):
        print("this patient was erased (see its receipt on the audit topic); rebuild refuses", file=sys.stderr)
        return True
    return False


def cmd_erase(args: argparse.Namespace) -> int:
    from stam import erase

    settings = load_settings()
    for name in ("pymilvus", "pymilvus.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if not args.patient.strip():
        print("stam erase: --patient must name a patient", file=sys.stderr)
        return 2
    try:
        if args.verify:
            out: dict[str, Any] = erase.scan(settings, args.patient, args.sample_text)
            print(json.dumps(out, indent=2))
            return 0 if out["verified"] else 1
        if args.dry_run:
            plan = erase.plan(settings, args.patient)
            print(json.dumps(plan, indent=2) if args.json else
                  "would erase: " + ", ".join(f"{k} {v}" for k, v in plan["counts"].items())
                  + f"; topics: {plan['topics']}")
            return 0
        result = erase.erase(settings, args.patient, request_id=args.request_id, samples=args.sample_text)
    except Exception as exc:  # noqa: BLE001 - one line for the operator; the erasure can be run again
        print(f"stam erase: failed: {type(exc).__name__}: {str(exc).replace(args.patient, '<patient>')[:300]} "
              "(running it again is safe)", file=sys.stderr)
        return 1
    receipt = result["receipt"]
    if args.json:
        print(json.dumps({"receipt": receipt, "published": result["published"], "scan": result["scan"]}, indent=2))
    else:
        print(json.dumps(receipt, indent=2))
        where = {k: v for k, v in result["scan"]["where"].items() if v and result["scan"]["residuals"].get(k)}
        if where:
            print("residuals: " + json.dumps(where), file=sys.stderr)
    if not result["published"]:
        print("stam erase: the receipt could not be published to the audit topic (printed above)", file=sys.stderr)
        return 3
    return 0 if receipt["verification"]["verified"] else 1


def _describe(t: dict[str, Any], texts: dict[str, str]) -> str:
    what = texts.get(t["memory_id"], t["memory_id"])
    if t["kind"] == "archived":
        succ = texts.get(t.get("successor_id") or "", "")
        return f"ACTIVE -> HISTORY [{t['reason']}] {what}" + (f"  (successor: {succ})" if succ else "")
    if t["kind"] == "added" and t["to_store"] == "history":
        return f"new -> HISTORY [{t['reason']}] {what}"
    if t["kind"] == "delete_proposed":
        return f"DELETE proposed (not executed) {what}"
    return f"new -> ACTIVE {what}"


async def _consume_transitions(settings: Settings, *, until_entries: set[str] | None, timeout: float,
                               show: bool, show_added: bool = False,
                               show_entries: set[str] | None = None) -> dict[str, int]:
    """Follow the transitions and dead-letter topics; print them (``show_entries``: only those entries').
    Sealed values are opened; those of erased patients are skipped."""
    from aiokafka import AIOKafkaConsumer

    from stam.crypto import Erased, SealBroken, sealer_for
    from topology import topics as t
    from topology.admin import kafka_client_kwargs

    sealer = sealer_for(settings)
    consumer = AIOKafkaConsumer(
        t.TRANSITIONS.name(settings.topic_prefix), t.DEAD_LETTERS.name(settings.topic_prefix),
        **kafka_client_kwargs(settings), auto_offset_reset="earliest", enable_auto_commit=False,
        group_id=None)
    await consumer.start()
    counts: dict[str, int] = {"transitions": 0, "dead_letters": 0, "entries_done": 0}
    texts: dict[str, str] = {}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for rec in records:
                    try:
                        data = json.loads(sealer.open(rec.value))
                    except Erased:
                        continue
                    except SealBroken:
                        data = {"stage": "?", "error_type": "SealBroken", "error": "a sealed value that does not open"}
                    if tp.topic.endswith("deadletter.v1"):
                        counts["dead_letters"] += 1
                        if show:
                            print(f"  DEAD LETTER stage={data['stage']} {data['error_type']}: {data['error'][:120]}")
                        continue
                    counts["transitions"] += 1
                    if data.get("memory"):
                        texts[data["memory_id"]] = data["memory"]["text"]
                    seen.add(data["entry_id"])
                    key = f"{data['kind']}:{data.get('reason') or ''}"
                    counts[key] = counts.get(key, 0) + 1
                    if show_entries is not None:
                        if data["entry_id"] in show_entries:
                            rels = "".join(f"\n        {r['type']} -> {texts.get(r['target_id'], r['target_id'])}"
                                           for r in data.get("relations") or ())
                            print("  " + _describe(data, texts) + rels)
                    elif show and (show_added or data["kind"] != "added" or data["to_store"] == "history"):
                        print("  " + _describe(data, texts))
            if until_entries is not None:
                counts["entries_done"] = len(until_entries & seen)
                if until_entries <= seen:
                    break
    finally:
        await consumer.stop()
    return counts


def cmd_transitions(args: argparse.Namespace) -> int:
    settings = load_settings()
    counts = asyncio.run(_consume_transitions(settings, until_entries=None, timeout=args.seconds,
                                              show=True, show_added=True))
    print(json.dumps(counts))
    return 0


def _demo_stack() -> tuple[Path, bool, Settings]:
    """Start (or join) the embedded stack of the demo home with its topics; whether this call started it."""
    from stam import stack
    from topology.admin import ensure_topics

    home = Settings().home
    print("1/6 starting the embedded stack (Tansu broker, Redis, Milvus Lite) ...")
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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cmd_demo(args: argparse.Namespace) -> int:
    from stam import stack
    from stam.sources.fhir_r4 import load_bundle

    bundle = Path(args.bundle)
    if not bundle.exists():
        print(f"bundle {bundle} not found (the shared data folder is expected at ../shared/data)",
              file=sys.stderr)
        return 1
    home, started_stack, settings = _demo_stack()
    print(f"    broker {settings.broker_url}  redis {settings.redis_url}  milvus {settings.milvus_uri}")
    print("2/6 starting the write-path worker (extract -> link -> impact -> update) ...")
    log = open(home / "logs" / "worker.log", "ab")  # noqa: SIM115 - lives as long as the worker
    worker = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"],
                              env=_stack_env(settings), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        result = load_bundle(bundle)
        patient = result.patient_id or "?"
        print(f"3/6 publishing {len(result.entries)} entries of one Synthea patient "
              f"({sum(result.skipped.values())} non-clinical resources skipped) ...")
        from stam.publish import Publisher, PublishSummary

        async def publish() -> PublishSummary:
            summary = PublishSummary()
            async with Publisher(settings) as pub:
                await pub.send_entries(result.entries, summary)
            return summary

        summary = asyncio.run(publish())
        print(f"    sent {summary.sent} entries")
        print("4/6 state transitions as they happen (new -> ACTIVE additions not shown):")
        started = time.monotonic()
        counts = asyncio.run(_consume_transitions(
            settings, until_entries={e.entry_id for e in result.entries}, timeout=args.timeout, show=True))
        elapsed = time.monotonic() - started
        print(f"    {counts['entries_done']}/{len(result.entries)} entries applied, "
              f"{counts['transitions']} transitions, {counts['dead_letters']} dead letters, {elapsed:.1f}s")
        if worker.poll() is not None:
            print(f"worker exited early ({worker.returncode}); see {home / 'logs' / 'worker.log'}")
            return 1
        print("5/6 the patient's memory now:\n")
        from stam.export import render_text
        from stam.stores.redis_state import RedisStateStore
        from workers.runtime import redis_client

        state = RedisStateStore(redis_client(settings), prefix=settings.collection_prefix).load(patient)
        print(render_text(state, limit=args.limit))
        print(f"\nFull export: STAM_HOME={home} .venv/bin/stam state --patient {patient} --json")
        from schemas.query import QueryRequest

        service = _query_service(settings)
        for question in ("What is the patient's body height?", "How has the body height changed over time?"):
            print(f"\n6/6 ask: {question!r}")
            answer = asyncio.run(service.answer(QueryRequest(request_id="demo", patient_id=patient,
                                                             question=question, k_active=3, k_history=3)))
            if answer.packet is None:
                print(f"    error: {answer.error}")
                return 1
            g = answer.packet.gate
            print(f"    gate: {'ACTIVE+HISTORY' if g.serve_history else 'ACTIVE only'} ({g.reason}); "
                  f"{answer.packet.tokens} tokens; {answer.latency_ms:.0f} ms")
            print("    " + answer.packet.rendered.replace("\n", "\n    "))
        again = "" if not started_stack or args.keep else f"STAM_HOME={home} .venv/bin/stam stack up && "
        print(f"\nAsk more (the record is kept in {home}): {again}STAM_HOME={home} .venv/bin/stam ask "
              f"--patient {patient} \"How has the body height changed over time?\" --as-of 1938-06-01")
        return 0 if counts["entries_done"] == len(result.entries) else 1
    finally:
        _stop(worker, timeout=20)
        log.close()
        if started_stack and not args.keep:
            stack.down(home)


DEMO_NOTES_PATIENT = "6a4160eb-a793-2f86-2302-378626f46cce"
DEMO_NOTES = ("00d2ed9f-74f9-2ca0-1b88-e711d800c300", "3e587458-87ac-4859-9517-a2a4e8a1145c")


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
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
    import base64
    import tempfile
    import urllib.request

    from stam import stack
    from stam.publish import publish_paths

    bulk = Path(args.bulk)
    if not (bulk / "DocumentReference.000.ndjson").is_file():
        print(f"Synthea bulk folder {bulk} not found (the shared data folder is expected at ../shared/data)",
              file=sys.stderr)
        return 1
    home, started_stack, settings = _demo_stack()
    port = _free_port()
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
        metrics_port = _free_port()
        print("3/6 starting the write-path worker with the language-model reasoner ...")
        worker = subprocess.Popen([sys.executable, "-m", "stam.cli", "worker", "--loglevel", "warning"],
                                  env=dict(_stack_env(settings), STAM_LLM_URL=llm_url, STAM_LLM_MODEL=args.model,
                                           STAM_LLM_CONCURRENCY="1", STAM_METRICS_PORT=str(metrics_port)),
                                  stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
        folder = Path(tempfile.mkdtemp(prefix="stam-demo-notes-"))
        notes_raw = [json.loads(line) for line in (bulk / "DocumentReference.000.ndjson").read_text().splitlines()
                     if any(n in line for n in DEMO_NOTES)]
        until = max(n["context"]["period"]["start"] for n in notes_raw)[:19]
        from stam.sources.fhir_ndjson import load_ndjson, patient_lines

        history = patient_lines(bulk, DEMO_NOTES_PATIENT, ("Condition", "MedicationRequest", "Encounter"), until)
        for rtype, keep in history.items():
            (folder / f"{rtype}.000.ndjson").write_text("\n".join(keep) + "\n")
        (folder / "DocumentReference.000.ndjson").write_text("\n".join(json.dumps(n) for n in notes_raw) + "\n")

        entries = load_ndjson([folder]).entries
        note_entries = {e.entry_id for e in entries if e.resource_type == "DocumentReference"}
        print(f"4/6 publishing {len(entries) - len(note_entries)} coded entries of one Synthea patient (no model "
              f"call) and {len(note_entries)} of their notes:")
        for n in sorted(notes_raw, key=lambda n: n["context"]["period"]["start"]):
            text = base64.b64decode(n["content"][0]["attachment"]["data"]).decode().strip()
            print("    --- note of " + n["context"]["period"]["start"][:10] + " ---\n    "
                  + text[text.find("# Medications"):].replace("\n", "\n    ")[:400])
        summary = asyncio.run(publish_paths(settings, [folder]))
        print(f"    sent {summary.sent} entries")
        print("5/6 what the model made of the notes (each fact: its store, the relations the link+update call "
              "made, the facts it ended):")
        started = time.monotonic()
        counts = asyncio.run(_consume_transitions(settings, until_entries={e.entry_id for e in entries},
                                                  timeout=args.timeout, show=True, show_entries=note_entries))
        elapsed = time.monotonic() - started
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        calls = _metric_sum(metrics, 'stam_llm_calls_total{outcome="ok"}')
        prompt = _metric_sum(metrics, 'stam_llm_tokens_total{kind="prompt"}')
        completion = _metric_sum(metrics, 'stam_llm_tokens_total{kind="completion"}')
        print(f"    {counts['entries_done']}/{len(entries)} entries applied in {elapsed:.0f}s, "
              f"{counts['dead_letters']} dead letters; model calls {calls:.0f} (prompt tokens {prompt:.0f}, "
              f"completion tokens {completion:.0f})")
        print("6/6 ask: 'Which medications is the patient taking?'")
        from schemas.query import QueryRequest

        service = _query_service(settings)
        answer = asyncio.run(service.answer(QueryRequest(request_id="demo-notes", patient_id=DEMO_NOTES_PATIENT,
                                                         question="Which medications is the patient taking?",
                                                         k_active=6, k_history=3)))
        if answer.packet is not None:
            print("    " + answer.packet.rendered.replace("\n", "\n    "))
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


def _metric_sum(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = [title for _, title in columns]
    body = [["" if r.get(key) is None else f"{r[key]:.3f}" if isinstance(r.get(key), float) else str(r[key])
             for key, _ in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *body])


def _emit_report(report: dict[str, Any], path: str | None) -> int:
    """An eval report: to ``path`` when given, and to stdout."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval_state(args: argparse.Namespace) -> int:
    import tempfile

    from tqdm import tqdm

    from stam.embedding import Embedder
    from stam.eval.state import VARIANTS, evaluate_mimic
    from stam.eval.synthea import evaluate_synthea

    variants = list(VARIANTS) if args.variant == "all" else args.variant.split(",")
    subjects = args.subjects.split(",") if args.subjects else None
    tables = args.tables.split(",")
    head: dict[str, Any] = ({"eval": "state", "source": "mimic-iv", "mimic": args.mimic, "subjects": subjects,
                             "tables": tables} if args.source == "mimic" else
                            {"eval": "state", "source": "synthea-r4", "synthea": args.synthea, "patients": subjects})
    embedder = Embedder()
    reports: list[dict[str, Any]] = []
    for variant in variants:
        bar = tqdm(desc=f"replaying ({variant})", unit=" entries", file=sys.stderr, disable=args.quiet,
                   mininterval=0.5)

        def progress(n: int, bar: Any = bar) -> None:
            bar.update(n - bar.n)

        with tempfile.TemporaryDirectory(prefix="stam-eval-") as work:
            common: dict[str, Any] = {"variant": variant, "workdir": Path(work), "embedder": embedder,
                                      "progress": progress, "samples_per_patient": args.samples,
                                      "timeline_patient": args.timeline_patient}
            if args.source == "mimic":
                reports.append(evaluate_mimic(Path(args.mimic), subjects=subjects, tables=tables, **common))
            else:
                reports.append(evaluate_synthea(Path(args.synthea), patients=subjects, **common))
        bar.close()
        if args.out:  # after each variant, so a long run keeps what it has measured
            Path(args.out).write_text(json.dumps({**head, "reports": reports}, indent=2) + "\n")
    rows = [{"variant": r["variant"], "recall": r["pairs"]["recall"], "archived": r["pairs"]["archived"],
             "ceiling": r["pairs"]["impact_ceiling"], "false": r["false_archival"]["rate"],
             "ended": r.get("ended", {}).get("in_history"), "fraction": r["archived_fraction"],
             "pit": r.get("point_in_time", {}).get("agreement"),
             "pit_int": r.get("point_in_time", {}).get("interval_agreement"),
             "pairs": r["pairs"]["total"], "entries": r["entries"], "seconds": r["seconds"]} for r in reports]
    print(_table(rows, [("variant", "variant"), ("recall", "pair recall"), ("archived", "old archived"),
                        ("ceiling", "impact ceiling"), ("false", "false archival"), ("ended", "ended in HISTORY"),
                        ("fraction", "archived frac"), ("pit", "point-in-time"), ("pit_int", "pit intervals"),
                        ("pairs", "gold pairs"), ("entries", "entries"), ("seconds", "s")]), file=sys.stderr)
    out = {**head, "reports": reports}
    if args.plot:
        from stam.eval.plots import plot_timeline

        series = [(r["variant"], r["timeline"]["points"]) for r in reports if r.get("timeline")]
        if series:
            title = f"ACTIVE and HISTORY over clinical time: one {head['source']} patient"
            out["plot"] = str(plot_timeline(series, Path(args.plot), title=title))
            print(f"plot: {out['plot']}", file=sys.stderr)
    return _emit_report(out, args.out)


def cmd_eval_qa(args: argparse.Namespace) -> int:
    import tempfile

    from tqdm import tqdm

    from stam.eval.mimic_qa import balanced_sample, build_questions, read_jsonl
    from stam.eval.qa_run import READER_SYSTEM, evaluate_qa
    from stam.read.reader import LocalReader, OpenAIReader

    root = Path(args.mimic)
    source = read_jsonl(args.questions) if args.questions else build_questions(root, per_patient=args.per_patient,
                                                                               seed=args.seed)
    questions = [q for q in source if q.split == args.split and (not args.types or q.qtype in args.types)]
    patients = sorted({q.patient_id for q in questions})[: args.patients or None]
    questions = [q for q in questions if q.patient_id in set(patients)]
    if args.limit:
        questions = balanced_sample(questions, args.limit, seed=args.seed)
    tables = tuple(args.tables.split(",")) if args.tables else None
    reader: Any = None
    if args.reader_url:
        reader = OpenAIReader(args.reader_url, args.reader_model, api_key=os.environ.get("STAM_READER_API_KEY", ""),
                              timeout_s=600.0, max_tokens=64, system=READER_SYSTEM)
    elif args.reader_local:
        reader = LocalReader(args.reader_local, system=READER_SYSTEM)
    bar = tqdm(desc="replaying", unit=" entries", file=sys.stderr, disable=args.quiet, mininterval=0.5)

    def progress(n: int) -> None:
        bar.update(n - bar.n)

    answers = tqdm(desc="answering", unit=" answers", file=sys.stderr, disable=args.quiet or reader is None,
                   mininterval=1.0)

    def answered(n: int) -> None:
        answers.update(n - answers.n)

    with tempfile.TemporaryDirectory(prefix="stam-eval-qa-") as work:
        report = evaluate_qa(root, questions, workdir=Path(args.replay_dir or work), budget=args.budget,
                             rag_k=args.rag_k, tables=tables, progress=progress, reader=reader, match=args.match,
                             keep_rows=args.rows, answer_progress=answered, keep_replay=bool(args.replay_dir),
                             systems=args.systems)
    bar.close()
    answers.close()
    rows = [{"system": name, **{k: v for k, v in s.items() if not isinstance(v, dict)}}
            for name, s in report["systems"].items()]
    columns = [("system", "system"), ("evidence_recall", "evidence recall"), ("type_macro_recall", "type-macro"),
               ("all_evidence", "all evidence"), ("tokens_mean", "tokens mean"), ("tokens_median", "tokens median")]
    if reader is not None:
        columns += [("f1", "F1"), ("em", "EM"), ("type_macro_f1", "type-macro F1")]
    print(_table(rows, columns), file=sys.stderr)
    if "matching" in report:
        print(f"context matching: {report['matching']}", file=sys.stderr)
    out = {"eval": "qa", "mimic": str(root), "split": args.split, **report}
    if args.plot:
        from stam.eval.plots import plot_score_vs_tokens

        score = "f1" if reader is not None else "evidence_recall"
        out["plot"] = str(plot_score_vs_tokens(report["systems"], Path(args.plot), score=score,
                                               title=f"MIMIC-QA ({args.split}, {len(questions)} questions): "
                                               f"{score.replace('_', ' ')} vs served tokens"))
        print(f"plot: {out['plot']}", file=sys.stderr)
    return _emit_report(out, args.out)


def cmd_eval_gate(args: argparse.Namespace) -> int:
    import random
    import tempfile

    from stam.embedding import Embedder
    from stam.eval.gate_eval import labelled_samples, mimic_samples, report, synthea_items
    from stam.eval.mimic_qa import build_questions
    from stam.eval.qa_run import READER_SYSTEM
    from stam.eval.state import replay_mimic
    from stam.read.gate import StoreGate, calibrate, write_gate_file
    from stam.read.reader import LocalReader, OpenAIReader
    from stam.read.service import QueryService
    from stam.read.tokens import load_tokenizer

    reader: Any = (OpenAIReader(args.reader_url, args.reader_model, timeout_s=600.0, max_tokens=64,
                                system=READER_SYSTEM) if args.reader_url
                   else LocalReader(args.reader_local, system=READER_SYSTEM))

    def answer(question: str, evidence: str) -> str:
        if hasattr(reader, "answer_sync"):
            return str(reader.answer_sync(question, evidence))
        return str(asyncio.run(reader.answer(question, evidence)))

    embedder = Embedder()
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    gate = StoreGate()
    out: dict[str, Any] = {"eval": "gate", "reader": reader.name, "lambdas": args.lambdas}
    samples: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="stam-eval-gate-") as work:
        if args.mimic:
            root = Path(args.mimic)
            questions = [q for q in build_questions(root, per_patient=args.per_patient) if q.split == args.split]
            random.Random(args.seed).shuffle(questions)
            subjects = sorted({q.patient_id for q in questions})
            run = replay_mimic(root, subjects=subjects, tables=MIMIC_TABLES, variant="stam",
                               workdir=Path(args.replay_dir or work) / "stam", embedder=embedder,
                               keep=bool(args.replay_dir))
            try:
                svc = QueryService(states=run.deps.states, vectors=run.deps.vectors, embedder=embedder,
                                   tokenizer=tokenizer, gate=gate)
                got, rows = mimic_samples(svc, questions, answer, limit=args.limit)
            finally:
                run.close()
            samples += got
            out["mimic"] = report(got, args.lambdas) | {"split": args.split, "rows": rows if args.rows else None}
        if args.synthea:
            run, items = synthea_items(Path(args.synthea), Path(work) / "synthea", embedder, patients=None,
                                       per_patient=args.per_patient)
            try:
                random.Random(args.seed).shuffle(items)
                svc = QueryService(states=run.deps.states, vectors=run.deps.vectors, embedder=embedder,
                                   tokenizer=tokenizer, gate=gate)
                got, rows = labelled_samples(svc, items, answer, limit=args.limit)
            finally:
                run.close()
            samples += got
            out["synthea"] = report(got, args.lambdas) | {"rows": rows if args.rows else None}
    if not samples:
        print("stam eval gate: give --mimic and/or --synthea", file=sys.stderr)
        return 2
    out["both"] = report(samples, args.lambdas)
    chosen = calibrate(samples, args.lambdas[0])
    out["chosen"] = chosen.as_dict()
    if args.write:
        write_gate_file(Path(args.write), chosen, source=f"stam eval gate ({reader.name})")
        out["written"] = args.write
    return _emit_report(out, args.out)


def cmd_eval_questions(args: argparse.Namespace) -> int:
    from collections import Counter

    from stam.eval.mimic_qa import build_questions, write_jsonl

    subjects = args.subjects.split(",") if args.subjects else None
    questions = build_questions(Path(args.mimic), per_patient=args.per_patient, seed=args.seed, subjects=subjects)
    write_jsonl(questions, Path(args.out))
    print(json.dumps({"questions": len(questions), "out": args.out,
                      "by_type": dict(sorted(Counter(q.qtype for q in questions).items())),
                      "by_split": dict(sorted(Counter(q.split for q in questions).items())),
                      "patients": len({q.patient_id for q in questions})}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stam", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stack", help="start, stop or show the embedded stack")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(fn=cmd_stack)

    p = sub.add_parser("worker", help="run the write-path workers (Faust)",
                       description="Runs the write-path stages in one process (all four by default). Probes on "
                       "STAM_WEB_HOST:STAM_WEB_PORT (GET /healthz, /readyz), metrics on "
                       "STAM_METRICS_HOST:STAM_METRICS_PORT. A port already taken stops it with one line (exit 2).")
    p.add_argument("--loglevel", default="info")
    p.add_argument("--stages", default=None, help="comma-separated subset of extract,link,impact,update (default: "
                   "all); give each stage group its own consumer group with STAM_APP_ID")
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("publish", help="publish FHIR R4 bundles or NDJSON, HL7 v2 messages or a MIMIC-IV folder "
                       "to the entries topic",
                       description="Sends record entries keyed by patient id; input that cannot be parsed or "
                       "validated goes to the dead-letter topic with its bytes and the reason. Prints a JSON "
                       "summary (sent, skipped, dead-lettered, per source). Exit status 2 when anything was "
                       "dead-lettered, or when a path does not exist or is an empty or non-clinical file (refused "
                       "in one line, nothing sent); 1 when the broker cannot be reached; 130 on Ctrl-C (says how "
                       "many entries were sent; re-running is safe). Limits: an entry is at most 256 KiB "
                       "serialized, its text 100,000 characters, ids printable ASCII (patient id up to 128 "
                       "characters); input over them is dead-lettered.")
    p.add_argument("paths", nargs="+", help="bundle files, folders of *.json bundles, *.ndjson files or "
                   "bulk-export folders, .hl7 files or folders of them, a MIMIC-IV folder (with hosp/, icu/)")
    p.add_argument("--format", choices=list(FORMATS), default="auto",
                   help="input format (default: detected per path)")
    p.add_argument("--rate", type=float, default=None, help="entries per second (default: unlimited)")
    p.add_argument("--subjects", default=None, help="MIMIC-IV: comma-separated subject_ids (default: all)")
    p.add_argument("--tables", default=None, help="MIMIC-IV: comma-separated tables (default: all of "
                   + ", ".join(MIMIC_TABLES) + ")")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--source-system", default=None, help="sign every entry as this source system, with its secret "
                   "from STAM_SOURCES / STAM_SOURCES_FILE (required where the workers require signed entries)")
    p.set_defaults(fn=cmd_publish)

    p = sub.add_parser("query-worker", help="run the query consumer (queries topic -> answers topic, HTTP "
                       "POST /v1/query with a bearer token)")
    p.add_argument("--loglevel", default="info")
    p.set_defaults(fn=cmd_query_worker)

    p = sub.add_parser("token", help="create a query token with a scope (clinician: every patient; "
                       "service:<name>: the listed patients)",
                       description="Generates a random token, prints it once on stdout and appends its name, role, "
                       "patients and SHA-256 (never the token) to the tokens file the query worker reads "
                       "(STAM_QUERY_TOKENS_FILE). See README, Security.")
    p.add_argument("action", choices=["new"])
    p.add_argument("--name", required=True, help="unique name of the token (who holds it)")
    p.add_argument("--role", required=True, help="clinician, or service:<name> with --patient")
    p.add_argument("--patient", action="append", default=None, help="a patient id a service token may read "
                   "(repeat)")
    p.add_argument("--file", default=None, help="tokens file (default: STAM_QUERY_TOKENS_FILE, else "
                   "<home>/query-tokens.json)")
    p.set_defaults(fn=cmd_token)

    p = sub.add_parser("ask", help="ask about one patient: the evidence packet (and answer when a reader is set)",
                       description="Reads the stores directly with the query worker's code: the patient's concept "
                       "threads, filled by what the question asks of time (current, previous, first, highest, "
                       "lowest, count, change, orders started or stopped most recently, is X active, what X was "
                       "changed into), with computed facts where the question names a concept. A time in the "
                       "question (\"as of 2148-01-28 20:06\", \"in the last 24 hours\") is read against the "
                       "patient's clinical clock. --as-of views the state at a clinical time; --as-of-version "
                       "replays the patient's transitions topic to a position in its stream.")
    p.add_argument("--patient", required=True)
    p.add_argument("question")
    p.add_argument("--as-of", default=None, help="clinical time (ISO 8601; no zone: UTC)")
    p.add_argument("--as-of-version", type=int, default=None, help="patient state version (stream position)")
    p.add_argument("--gate", choices=["auto", "active", "both"], default="auto",
                   help="serve HISTORY as the store gate decides (auto), never, or always")
    p.add_argument("--k-active", type=int, default=8, help="concept threads served")
    p.add_argument("--k-history", type=int, default=8,
                   help="earlier values served per thread beyond what the question needs (when HISTORY is served)")
    p.add_argument("--joint", action="store_true",
                   help="one ranking over all threads (default: threads with a current memory first)")
    p.add_argument("--exclude-entry", action="append", default=[], metavar="ENTRY_ID",
                   help="evidence this query may not see (repeatable): its memories are left out, and what they ended "
                   "is current again")
    p.add_argument("--exclude-category", action="append", default=[],
                   choices=[c.value for c in Category], help="memory categories this query may not see (repeatable)")
    p.add_argument("--exclude-source-type", action="append", default=[], metavar="TYPE",
                   help="source resource types this query may not see, e.g. DocumentReference (repeatable)")
    p.add_argument("--no-labels", action="store_true", help="neutral rendering: no [current] marks, no reasons")
    p.add_argument("--spans", action="store_true", help="render the source text around each memory")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--json", action="store_true", help="the QueryAnswer JSON (schemas/json/query-answer.v1.json)")
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("gate", help="build a calibration set or calibrate the store gate",
                       description="build-set: derive a labelled question set from stored patients. "
                       "calibrate: replay the set with and without HISTORY, choose the threshold for the "
                       "first --lambda, write it to the gate file (default <home>/gate.json), report all.")
    p.add_argument("action", choices=["build-set", "calibrate"])
    p.add_argument("--set", required=True, help="JSON Lines calibration set (written by build-set)")
    p.add_argument("--patients", default=None, help="build-set: comma-separated patient ids (default: all)")
    p.add_argument("--per-patient", type=int, default=12)
    p.add_argument("--lambda", dest="lambdas", type=float, nargs="+", default=[0.2],
                   help="quality/serving trade-off; the first is written (default 0.2)")
    p.add_argument("--k-active", type=int, default=8)
    p.add_argument("--k-history", type=int, default=8)
    p.add_argument("--out", default=None)
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("serve", help="the language model behind an OpenAI-compatible endpoint (Ray Serve)",
                       description="llamacpp: a CPU replica on the packaged GGUF weights (joined and checked on "
                       "first use). vllm: Ray Serve LLM replicas on GPUs (needs vLLM installed; not runnable here).")
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--model", default=None, help="model id (llamacpp: qwen2.5-coder-1.5b-instruct-q4_k_m, the "
                   "default, or qwen2.5-coder-0.5b-instruct-q4_k_m)")
    p.add_argument("--gguf", default="", help="llamacpp: a GGUF path instead of the packaged weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--accelerator", default="A100", help="vllm: Ray accelerator type")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("transitions", help="print transitions from the transitions topic")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to listen")
    p.set_defaults(fn=cmd_transitions)

    p = sub.add_parser("state", help="a patient's ACTIVE and HISTORY memories")
    p.add_argument("--patient", required=True)
    p.add_argument("--json", action="store_true", help="the stable export shape (see README)")
    p.add_argument("--limit", type=int, default=None, help="text mode: at most N memories per store")
    p.set_defaults(fn=cmd_state)

    p = sub.add_parser("deadletters", help="list, show, replay or dismiss dead letters (and the record gaps they "
                       "leave)",
                       description="list: every dead letter on the dead-letter topic from offset 0, with its id "
                       "(PARTITION:OFFSET), stage, error, patient and entry, and status (open: the patient's record "
                       "has a gap; replayed; applied; dismissed; superseded; no gap: patient unknown). show ID: the "
                       "decoded value, error and coordinates. replay ID: publish the original bytes again to the "
                       "topic they came from, when they pass its schema (a fault outside the message, since "
                       "fixed), or --value-file with a corrected payload; a publisher's bad file is refused (fix "
                       "it and publish it again). The gap closes when the worker applies the entry. dismiss ID "
                       "--reason R: close the gap without applying the entry; who, when and why are kept.")
    p.add_argument("action", choices=["list", "show", "replay", "dismiss"])
    p.add_argument("id", nargs="?", default=None, help="dead letter id, PARTITION:OFFSET (show, replay, dismiss)")
    p.add_argument("--patient", default=None, help="list: only this patient's dead letters")
    p.add_argument("--stage", default=None, help="list: only this stage's (extract, link, impact, update, "
                   "publish:fhir-r4...)")
    p.add_argument("--status", default=None, help="list: only this status (open, replayed, applied, dismissed...)")
    p.add_argument("--json", action="store_true", help="list: JSON")
    p.add_argument("--value-file", default=None, help="replay: a corrected payload (JSON) instead of the original")
    p.add_argument("--source-system", default=None, help="replay to the entries topic: sign the entry as this "
                   "configured source system (where entries must be signed; a dead letter keeps no headers)")
    p.add_argument("--reason", default=None, help="dismiss: why the entry may stay out of the record (required)")
    p.add_argument("--by", default=None, help="replay, dismiss: who (default: the OS user)")
    p.set_defaults(fn=cmd_deadletters)

    p = sub.add_parser("rebuild", help="rebuild a patient's stores from the transitions topic")
    p.add_argument("--patient", required=True)
    p.set_defaults(fn=cmd_rebuild)

    p = sub.add_parser("erase", help="erase a patient everywhere, verify with an independent scan, publish a receipt",
                       description="Removes the patient from Redis (every key by exact name, the patients set; then "
                       "the append-only file and the RDB snapshot are rewritten), Milvus (delete, flush; Milvus Lite "
                       "rewrites the collection, a server compacts), JSON Lines files under STAM_HOME and the gate's "
                       "calibration set (lines naming the patient), log files (the id redacted), and shreds the "
                       "patient's data key when crypto-shredding is installed. Then scans Redis, Milvus, every topic "
                       "from offset 0 and every file under STAM_HOME for the id and sample texts, and publishes a "
                       "receipt without patient data on the audit topic. Exit status: 0 verified, 1 residuals or "
                       "failure, 3 receipt not published.")
    p.add_argument("--patient", required=True)
    p.add_argument("--request-id", default=None, help="the caller's reference of the request, kept on the receipt")
    p.add_argument("--dry-run", action="store_true", help="count what would be removed, per store; change nothing")
    p.add_argument("--verify", action="store_true", help="only scan for the id and --sample-text texts; change "
                   "nothing (exit 0 when no residual)")
    p.add_argument("--sample-text", nargs="*", default=[], metavar="TEXT",
                   help="texts of the patient to search for besides the id (erase also picks distinctive ones)")
    p.add_argument("--json", action="store_true", help="print the receipt, the scan and whether it was published")
    p.set_defaults(fn=cmd_erase)

    p = sub.add_parser("demo", help="stream one real Synthea patient through the embedded stack")
    p.add_argument("--bundle", default=DEFAULT_DEMO_BUNDLE)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--limit", type=int, default=25)
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running afterwards")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("demo-notes", help="two real Synthea notes decomposed by the local language model",
                       description="Starts the embedded stack, the Ray Serve app with a local GGUF model "
                       "(llama.cpp on CPU) and a worker pointed at it; publishes one patient's coded history "
                       "and two of their notes; shows the facts the model extracted, their relations and "
                       "transitions, the model calls and tokens, and one question.")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m",
                   help="packaged model (make models-1.5b) or qwen2.5-coder-0.5b-instruct-q4_k_m (faster, weaker)")
    p.add_argument("--bulk", default="../shared/data/synthea-bulk-10p")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running afterwards")
    p.set_defaults(fn=cmd_demo_notes)

    p = sub.add_parser("eval", help="evaluation: write-time state diagnostics (MIMIC-IV, Synthea), MIMIC-QA with "
                       "baselines and a reader, plots",
                       description="Instruments of the paper's evaluation (sections 4-6, appendices A-F).")
    ev = p.add_subparsers(dest="eval_command", required=True)
    q = ev.add_parser("state", help="replay MIMIC-IV patients or Synthea bundles and diagnose the state against "
                      "gold read from the data",
                      description="Gold from the data, never from STAM: MIMIC-IV POE Change and D/C links, pharmacy "
                      "stops, repeated labs; Synthea medication renewals and stops, condition abatements, repeated "
                      "observations. Supersession-pair recall, impact-candidate ceiling, false archival, ended facts "
                      "in HISTORY, archived fraction, point-in-time agreement. Prints a table on stderr and the JSON "
                      "report on stdout (and --out); --plot draws one patient's ACTIVE/HISTORY over time.")
    q.add_argument("--source", default="mimic", choices=["mimic", "synthea"])
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2", help="MIMIC-IV folder (hosp/, icu/)")
    q.add_argument("--synthea", default="../shared/data/synthea-r4-bundles", help="folder of Synthea R4 bundles")
    q.add_argument("--subjects", help="comma-separated subject_ids / Synthea patient ids (default: all)")
    q.add_argument("--tables", default="poe,pharmacy,labevents", help="comma-separated MIMIC-IV tables")
    q.add_argument("--plot", help="write a PNG of one patient's ACTIVE/HISTORY sizes over time, per variant")
    q.add_argument("--timeline-patient", default="auto",
                   help="the patient of the timeline (default: the one with the most transitions)")
    q.add_argument("--variant", default="stam", help="stam, semantic-only, no-relations, rule-measurement-dose, "
                   "rule-non-episodic, append-only; comma-separated, or 'all'")
    q.add_argument("--samples", type=int, default=10, help="point-in-time samples per patient")
    q.add_argument("--out", help="also write the JSON report here")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(fn=cmd_eval_state)
    q = ev.add_parser("qa", help="MIMIC-QA: STAM versus append-only, flat RAG, full context (evidence, tokens, "
                      "and a reader's F1/EM)",
                      description="Replays the split's patients (every MIMIC-IV table unless --tables) under "
                      "STAM, then for each question, asked at its clinical time (as_of), measures what each system "
                      "serves a reader: STAM, STAM with HISTORY always served, append-only (the same memories, none "
                      "ever ended, cosine top-k), STAM's read path over that append-only state, flat RAG over the "
                      "entries, full context. Reported: gold-evidence recall, tokens, paired tests against STAM, "
                      "and items STAM served as current that the rows say were replaced. With --reader-url (an "
                      "OpenAI-compatible endpoint such as `stam serve`) or --reader-local (a packaged GGUF model in "
                      "process), the same reader answers from every system's context: token F1, exact match, "
                      "McNemar/bootstrap/sign-flip against STAM. --match runs STAM again at a comparator's median "
                      "context size (appendix C.5).")
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2")
    q.add_argument("--split", default="test", choices=["train", "dev", "test"])
    q.add_argument("--questions", help="a question set (JSONL from `stam eval questions`) instead of building one")
    q.add_argument("--types", nargs="+", help="only these question types")
    q.add_argument("--limit", type=int, default=0, help="N questions after the other filters, a seeded sample with "
                   "the question types in equal shares (0: all)")
    q.add_argument("--tables", help="MIMIC-IV tables to replay, comma-separated (default: every table the loader "
                   "reads, the distractors a real record has)")
    q.add_argument("--replay-dir", help="keep the replay in this folder and reuse it next time (a replay of the "
                   "whole demo with every table takes most of an hour here)")
    q.add_argument("--systems", nargs="+", help="systems to run (default: stam, stam-both, append-only, "
                   "append-only+threads, flat-rag, full-context; also the rendering controls stam-no-facts and "
                   "stam-neutral); stam always runs")
    q.add_argument("--patients", type=int, default=0, help="first N patients of the split (0: all)")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--budget", type=int, default=4000, help="full-context token budget")
    q.add_argument("--rag-k", type=int, default=16)
    q.add_argument("--reader-url", help="OpenAI-compatible base URL of the reader (e.g. http://127.0.0.1:8000/v1)")
    q.add_argument("--reader-model", default="qwen2.5-coder-1.5b-instruct-q4_k_m", help="model name at --reader-url")
    q.add_argument("--reader-local", help="packaged GGUF model run in process by llama.cpp "
                   "(qwen2.5-coder-1.5b-instruct-q4_k_m or qwen2.5-coder-0.5b-instruct-q4_k_m)")
    q.add_argument("--match", choices=["append-only", "flat-rag", "full-context"],
                   help="also run STAM at this system's median context size")
    q.add_argument("--rows", action="store_true", help="keep every question's row (answers, tokens) in the report")
    q.add_argument("--plot", help="write a PNG of each system's score versus served tokens")
    q.add_argument("--out")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(fn=cmd_eval_qa)
    q = ev.add_parser("gate", help="calibrate the store gate with a reader on MIMIC-QA and Synthea",
                      description="For the questions whose wording does not ask for the past (the only ones the "
                      "threshold decides), the reader answers from the ACTIVE-only packet and from the packet with "
                      "both stores; they agree when ACTIVE alone does as well (MIMIC-QA: token F1 against the rows' "
                      "answer at least as high; Synthea, questions derived from the stored state: the same answer). "
                      "Reports, per lambda, the threshold minimising disagreement - lambda * skip rate, with its "
                      "skip rate, disagreement and served tokens, per source and for both; --write saves the first "
                      "lambda's threshold as a gate file (STAM_GATE_FILE).")
    q.add_argument("--mimic", help="MIMIC-IV folder (questions of --split, every table replayed)")
    q.add_argument("--split", default="train", choices=["train", "dev", "test"])
    q.add_argument("--replay-dir", help="keep/reuse the MIMIC-IV replay here")
    q.add_argument("--synthea", help="folder of Synthea FHIR bundles (questions derived from their state)")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT)
    q.add_argument("--limit", type=int, default=120, help="questions answered by the reader per source")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--lambda", dest="lambdas", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.5, 1.0])
    q.add_argument("--reader-url", help="OpenAI-compatible base URL of the reader")
    q.add_argument("--reader-model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    q.add_argument("--reader-local", default="qwen2.5-coder-0.5b-instruct-q4_k_m",
                   help="packaged GGUF model run in process (when no --reader-url)")
    q.add_argument("--write", help="write the first lambda's calibrated threshold to this gate file")
    q.add_argument("--rows", action="store_true", help="keep every question's answers in the report")
    q.add_argument("--out")
    q.set_defaults(fn=cmd_eval_gate)
    q = ev.add_parser("questions", help="build the deterministic MIMIC-QA question set (JSONL)")
    q.add_argument("--mimic", default="../shared/data/mimic-iv-demo-2.2")
    q.add_argument("--subjects")
    q.add_argument("--per-patient", type=int, default=MIMIC_QA_PER_PATIENT)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--out", default="mimic-qa.jsonl")
    q.set_defaults(fn=cmd_eval_questions)

    args = parser.parse_args(argv)
    from pydantic import ValidationError

    from stam.logs import configure

    try:
        configure(Settings(), logging.WARNING)
    except ValidationError as exc:  # contradictory settings (e.g. SASL without a password): one line per error
        for err in exc.errors():
            print(f"stam: settings: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    from stam.errors import StackError

    try:
        return int(args.fn(args))
    except StackError as exc:  # a stack process down, or one that cannot start: one line, no traceback
        print(f"stam: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
