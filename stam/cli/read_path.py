"""The read path: ``stam query-worker``, ``stam token new``, ``stam ask`` and ``stam gate build-set|calibrate``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from schemas.query import GateMode, QueryRequest, Visibility
from schemas.wire import Category
from stam.cli.context import load_settings, query_service
from stam.errors import PortInUse, TokenConfigError


def cmd_query_worker(args: argparse.Namespace) -> int:
    settings = load_settings(needs=("broker", "redis", "milvus"))  # first: no stack, no imports of the stores

    # deferred: workers.query_consumer pulls in pymilvus, igraph, aiohttp (kept off `stam --help`)
    from workers.query_consumer import run

    sys.argv = [sys.argv[0], "worker", "-l", args.loglevel]
    try:
        run(settings, loglevel=args.loglevel)
    except PortInUse as exc:
        print(f"stam query-worker: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    # deferred: stam.read.scopes (kept off `stam --help`)
    from stam.read.scopes import new_token

    settings = load_settings(needs=())
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


def cmd_ask(args: argparse.Namespace) -> int:
    as_of = None
    if args.as_of:
        try:
            as_of = datetime.fromisoformat(args.as_of.replace("Z", "+00:00"))
        except ValueError:
            print(f"stam ask: --as-of {args.as_of!r} is not an ISO 8601 date or time (e.g. 2019-06-01 or "
                  "2019-06-01T08:30:00Z)", file=sys.stderr)
            return 2
        if as_of.tzinfo is None:
            as_of = as_of.replace(tzinfo=UTC)
    # The user's own arguments first (above), then the stores; the transition log (the broker) only for
    # --as-of-version.
    settings = load_settings(needs=("redis", "milvus") + (("broker",) if args.as_of_version is not None else ()))
    visibility = None
    if args.exclude_entry or args.exclude_category or args.exclude_source_type:
        visibility = Visibility(exclude_entry_ids=tuple(args.exclude_entry),
                                exclude_categories=tuple(args.exclude_category),
                                exclude_source_types=tuple(args.exclude_source_type))
    req = QueryRequest(request_id=f"cli-{time.time_ns()}", patient_id=args.patient, question=args.question,
                       k_active=args.k_active, k_history=args.k_history, gate=GateMode(args.gate),
                       ranking="joint" if args.joint else "separate", labels=not args.no_labels, spans=args.spans,
                       token_budget=args.token_budget, as_of=as_of, as_of_version=args.as_of_version,
                       visibility=visibility)
    # deferred: stam.read.service pulls in pymilvus, igraph, redis (kept off `stam --help`)
    from stam.read.service import failed_answer

    # pymilvus prints a traceback of its own for every failed call, and the service warns of an outage: the
    # answer says what failed, in one line (a bug is still logged with its traceback).
    for name in ("pymilvus", "pymilvus.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("stam.query").setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        service = query_service(settings)
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
    settings = load_settings(needs=("redis", "milvus"))  # first: no stack, no imports of the stores

    # deferred: stam.read.calibrate, stam.read.store_gate pull in pymilvus, igraph, redis (kept off `stam --help`)
    from stam.read.calibrate import labelled_set, load_set, replay
    from stam.read.store_gate import calibrate, write_gate_file

    service = query_service(settings)
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("query-worker", help="run the query consumer (queries topic -> answers topic, HTTP "
                       "POST /v1/query with a bearer token)")
    p.add_argument("--loglevel", default="info", help="debug, info, warning, error or critical (default: info)")
    p.set_defaults(fn=cmd_query_worker)

    p = sub.add_parser("token", help="create a query token with a scope (clinician: every patient; "
                       "service:<name>: the listed patients)",
                       description="Generates a random token, prints it once on stdout and appends its name, role, "
                       "patients and SHA-256 (never the token) to the tokens file the query worker reads "
                       "(STAM_QUERY_TOKENS_FILE). See README, Security.")
    p.add_argument("action", choices=["new"], help="new: generate a token and add it to the tokens file")
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
    p.add_argument("--patient", required=True, help="the patient's id")
    p.add_argument("question", help="the question, in quotes")
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
    p.add_argument("--token-budget", type=int, default=None,
                   help="fill the packet by rank up to this many tokens (default: no budget)")
    p.add_argument("--json", action="store_true", help="the QueryAnswer JSON (schemas/json/query-answer.v1.json)")
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("gate", help="build a calibration set or calibrate the store gate",
                       description="build-set: derive a labelled question set from stored patients. "
                       "calibrate: replay the set with and without HISTORY, choose the threshold for the "
                       "first --lambda, write it to the gate file (default <home>/gate.json), report all.")
    p.add_argument("action", choices=["build-set", "calibrate"],
                   help="build-set: write a labelled question set; calibrate: choose and write the threshold")
    p.add_argument("--set", required=True, help="JSON Lines calibration set (written by build-set)")
    p.add_argument("--patients", default=None, help="build-set: comma-separated patient ids (default: all)")
    p.add_argument("--per-patient", type=int, default=12, help="build-set: questions per patient (default 12)")
    p.add_argument("--lambda", dest="lambdas", type=float, nargs="+", default=[0.2],
                   help="quality/serving trade-off; the first is written (default 0.2)")
    p.add_argument("--k-active", type=int, default=8, help="calibrate: concept threads served (default 8)")
    p.add_argument("--k-history", type=int, default=8,
                   help="calibrate: earlier values served per thread with HISTORY (default 8)")
    p.add_argument("--out", default=None, help="calibrate: the gate file to write (default: STAM_GATE_FILE, "
                   "else <home>/gate.json)")
    p.set_defaults(fn=cmd_gate)
