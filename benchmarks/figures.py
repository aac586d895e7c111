"""The documentation's generated figures, written from the results of the runs they come from (``make figures``).

A page marks a generated figure::

    <!-- figure: NAME -->
    (everything here is written by this module)
    <!-- /figure -->

and ``docs/results/NAME.json`` is the JSON report of the run it shows, as the benchmark or ``stam eval`` printed
it: with its ``provenance`` (command, commit, machine, time; ``lab/stam_lab/eval/provenance.py``). Each figure is rendered
from its file by the renderer of the report's kind (``RENDERERS``: a benchmark's ``"benchmark"`` name, or
``eval:<name>``) and followed by a line naming the file, the command, the commit and the machine.

``python -m benchmarks.figures`` rewrites every page whose figures differ; ``--check`` writes nothing and exits 1
naming each figure that differs from what its results file gives (a table edited by hand, or a results file replaced
without running ``make figures``). Both fail on a marker without its results file, a results file no page cites, a
report without complete provenance, or a kind with no renderer.

To add a figure: run the benchmark on a committed tree, save its stdout as ``docs/results/NAME.json``, put the
markers on a page, add a renderer for its kind when it has none, then ``make figures``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stam_lab.eval.provenance import missing

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = "results"
OPEN = re.compile(r"<!-- figure: (?P<name>[A-Za-z0-9_.-]+) -->")
CLOSE = "<!-- /figure -->"


class FigureError(Exception):
    """A figure that cannot be generated: its results file is missing, incomplete or of a kind with no renderer."""


def fmt(v: Any) -> str:
    """A value as the docs write numbers: thousands separated, as rounded as the report has it."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        return f"{v:,}"
    return str(v)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of a report that may hold one (its own keys) or several (``results``)."""
    results = report.get("results")
    return [r for r in results if isinstance(r, dict)] if isinstance(results, list) else [report]


def render_faust_floor(report: dict[str, Any]) -> str:
    """``python -m benchmarks.faust_floor``: one row per storage engine and linger; the settings every run shares
    are said once above the table."""
    runs = _runs(report)
    params = [("messages", "messages", "{} messages"), ("payload_bytes", "bytes", "{} bytes each"),
              ("fanout", "fan-out", "fan-out {}"), ("linger_ms", "linger ms", "producer linger {} ms")]
    shared = [(k, text) for k, _, text in params if len({r[k] for r in runs}) == 1]
    varying = [(k, head) for k, head, _ in params if k not in dict(shared)]
    rows = []
    for r in runs:
        cpu = r.get("cpu", {})
        rss = r.get("rss_mb", {})
        rows.append([r["storage"], *(r[k] for k, _ in varying), r["entries_per_s"], r["first_message_s"],
                     r["stack_up_s"], r["broker_disk_mb"], f"{fmt(rss.get('s3'))} / {fmt(rss.get('broker'))}",
                     cpu.get("cpu_ms_per_entry_total"), cpu.get("cores_busy")])
    head = ", ".join(text.format(fmt(runs[0][k])) for k, text in shared)
    return (f"{head}\n\n" if head else "") + table(
        ["broker storage", *(h for _, h in varying), "entries/s", "first message s", "stack up s", "broker disk MB",
         "RSS MB (SeaweedFS / Tansu)", "CPU ms per entry", "cores busy"], rows)


def render_redis_fsync(report: dict[str, Any]) -> str:
    """``python -m benchmarks.redis_fsync``: one row per ``appendfsync`` mode."""
    rows = [[r["appendfsync"], r["batches_per_s"], r["patient_commits_per_s"], r["memories_per_s"], r["batch_ms_p50"],
             r["batch_ms_p99"], r["aof_mb"]] for r in report["results"]]
    head = (f"{fmt(report['batches'])} batches of `commit_many`, {fmt(report['patients_per_batch'])} patients x "
            f"{fmt(report['memories_per_patient'])} memories each")
    return head + "\n\n" + table(["appendfsync", "batches/s", "patient commits/s", "memories/s", "batch p50 ms",
                                  "batch p99 ms", "AOF MB"], rows)


def render_lifecycle(report: dict[str, Any]) -> str:
    """``stam eval lifecycle``: ACTIVE orders and medications against the rows, at the latest time and at the sampled
    times, overall and by resource type."""
    rows = []
    for at in ("latest", "sampled"):
        r = report[at]
        rows.append([f"{at} ({fmt(r['times'])} times)", "all", r["precision"], r["recall"], r["active_units"],
                     r["gold_units"], r["active_from_ended_admission"]])
        rows += [["", kind, k["precision"], k["recall"], k["active_units"], k["gold_units"], ""]
                 for kind, k in r.get("by_resource", {}).items()]
    head = (f"{fmt(report['patients'])} patients ({report['source']}), {fmt(report['entries'])} entries, "
            f"{fmt(report['samples_per_patient'])} sampled times each (seed {report['seed']})")
    return head + "\n\n" + table(["at", "resource", "precision", "recall", "ACTIVE units", "gold units",
                                   "ACTIVE from a discharged admission"], rows)


def render_discharge_cost(report: dict[str, Any]) -> str:
    """``python -m benchmarks.discharge_cost``: one discharge against one order entry of the same visit."""
    rows = [[r["orders"], what, r[key]["ended"], r[key]["transitions"], r[key]["ms"], r[key]["redis_round_trips"],
             r[key]["vector_store_calls"]] for r in report["runs"]
            for key, what in (("last_order", "an order"), ("discharge", "the discharge"))]
    return table(["orders in the stay", "entry", "facts ended", "transitions", "ms", "Redis round trips",
                  "vector store calls"], rows)


def render_mllp_feed(report: dict[str, Any]) -> str:
    """``python -m benchmarks.mllp_feed``: the listener against the same run's raw produce and the mapping alone."""
    run, floor, mapping = report["listener"], report["raw_produce_floor"], report["mapping_only"]
    codes = ", ".join(f"{k} {fmt(v)}" for k, v in run["ack_codes"].items())
    rows = [[f"`stam listen mllp`, {fmt(run['connections'])} connections, one message in flight each",
             run["messages_per_s"], run["ack_latency_ms"]["p50"], run["ack_latency_ms"]["p99"], codes],
            ["floor: the same messages' entries produced raw (mapped beforehand; sealed, acks=all, pipelined)",
             floor["equivalent_messages_per_s"], "", "", f"{fmt(floor['entries_per_s'])} entries/s"],
            ["the HL7 v2 mapping alone (no broker)", mapping["messages_per_s"], "", "",
             f"{fmt(mapping['cpu_ms_per_message'])} CPU ms per message"]]
    head = (f"{fmt(run['messages'])} messages (the {fmt(report['samples'])} HL7 v2 samples repeated, one MSH-10 each), "
            f"broker storage {report['broker_storage']}")
    return head + "\n\n" + table(["what", "messages/s", "ACK p50 ms", "ACK p99 ms", "detail"], rows)


def render_fhir_notifications(report: dict[str, Any]) -> str:
    """``python -m benchmarks.fhir_notifications``: entry in to notification out on the hospital feed."""
    feed = report["feed"]
    rows = [["entry published to notification received", *_lat(report["latency_entry_to_notification"])],
            ["entry published to transition applied", *_lat(report["latency_entry_to_transition"])],
            ["transition applied to notification received", *_lat(report["latency_transition_to_notification"])]]
    rows += [[f"topic `{t}` (entry to notification)", *_lat(v)] for t, v in report["latency_by_topic"].items()]
    admission = feed.get("mimic_patient_entries", 0)
    parts = f"{fmt(feed['synthea_entries'])} of one Synthea patient, " + (
        f"{fmt(admission)} of one MIMIC-IV admission, " if admission else "")
    head = (f"{fmt(feed['entries'])} entries ({parts}then {fmt(feed['mimic_entries'] - admission)} of the MIMIC-IV "
            f"hospital feed) at {fmt(feed['rate_per_s'])} entries/s, "
            f"{fmt(report['subscriptions'])} full-resource Subscriptions over HTTPS (each topic, R4B and R5); "
            f"{fmt(report['events'])} events in {fmt(report['notifications'])} notifications, every Bundle checked: "
            f"{fmt(len(report['validation_problems']))} problems")
    return head + "\n\n" + table(["latency", "events", "p50 s", "p99 s", "max s"], rows)


def render_hospital_feed(report: dict[str, Any]) -> str:
    """``python -m benchmarks.hospital_feed``: each run's write path, load, throughput, end-to-end latency, stale-redo
    ratio and CPU per entry; the Faust floor and each write path's ratio to it."""
    rows = []
    runs = {k: v for k, v in report.items() if isinstance(v, dict) and "write_path" in v}
    # Recorded since issue 38's read sets and run-ahead bound: what the updater did with the link and impact work,
    # and the latency of a burst's first tenth.
    reads = any("link_impact_reads" in run for run in runs.values())
    # Recorded since the Milvus seal was taken off the stage thread: the p50 of the slowest half second of publishing
    # (where a stall of the write path shows).
    halves = any("slowest_half_second_p50_s" in run for run in runs.values())
    for name, run in runs.items():
        load = ("flat out" if run.get("rate_asked") is None else
                f"{fmt(run['rate_asked'])}/s" + (f" ({round(run['load'] * 100)}%)" if run.get("load") else ""))
        lat = run.get("latency_s") or {}
        hop = run.get("hop_wait") or {}
        rows.append([f"`{name}`", "fused (one hop)" if run["write_path"] == "fused" else "four stages over topics",
                     run["workers"], run.get("fetch_wait_ms"), load, run.get("entries_per_s"),
                     round(lat["p50"] * 1000) if lat else None, round(lat["p99"] * 1000) if lat else None,
                     round(sum(h.get("p50_ms", 0) for h in hop.values())) if hop else None,
                     run.get("stale_redo_ratio"), (run.get("cpu") or {}).get("cpu_ms_per_entry_total")])
        if reads:
            shares = run.get("link_impact_reads") or {}
            first = run.get("first_tenth_latency_s") or {}
            rows[-1][-1:-1] = [" / ".join(fmt((shares.get(k) or {}).get("share", 0.0)) for k in ("reused", "patched"))
                               if shares else None]
            rows[-1].append(round(first["p50"] * 1000) if first else None)
        if halves:  # at a fixed rate only: a flat-out run publishes its whole feed in the first seconds
            slowest = run.get("slowest_half_second_p50_s") if run.get("rate_asked") is not None else None
            rows[-1].append(round(slowest * 1000) if slowest is not None else None)
    feed = report["feed"]
    head = (f"{fmt(feed['entries'])} entries of the MIMIC-IV hospital feed ({fmt(feed.get('patients'))} patients), "
            "each run on a fresh embedded stack")
    if "broker_storage" in report:  # recorded since the benchmark could choose them
        head += (f" (the broker's log on {report['broker_storage']}, Redis appendfsync "
                 f"{report.get('redis_fsync', 'everysec')}"
                 + (f", {report['partitions']} partitions a topic" if "partitions" in report else "") + ")")
    columns = ["run", "write path", "workers", "fetch wait ms", "load", "entries/s", "p50 ms", "p99 ms",
               "hop waits p50 ms (sum)", "stale-redo", "CPU ms/entry"]
    if reads:
        columns[-1:-1] = ["link/impact reused / patched"]
        columns.append("first tenth p50 ms")
    if halves:
        columns.append("slowest half second p50 ms")
    out = head + "\n\n" + table(columns, rows)
    floor = report.get("faust_floor")
    if isinstance(floor, dict):
        ratios = [f"{'fused' if k.endswith('_fused') else 'four stages'} {fmt(v)}" for k, v in report.items()
                  if k.startswith("write_path_floor_ratio")]
        out += (f"\n\nFaust floor in the same run (four hops doing nothing): {fmt(floor.get('entries_per_s'))} "
                f"entries/s; flat-out rate over the floor's: {', '.join(ratios)}.")
    return out


def _lat(v: dict[str, Any]) -> list[Any]:
    return [v["n"], v["p50_s"], v["p99_s"], v["max_s"]]


def render_qa(report: dict[str, Any]) -> str:
    """``stam eval qa`` with a reader: per question type, each system's evidence recall, the reader's exact match and
    the median tokens served; then each comparator paired with STAM on the same questions (McNemar on exact match, a
    bootstrap 95% interval of the difference in token F1 and in evidence recall, comparator minus STAM)."""
    systems = list(report["systems"])
    header = ["type", "n"] + [f"{s} {m}" for s in systems for m in ("recall", "EM", "tokens")]
    first = report["systems"][systems[0]]
    rows = []
    for qtype in first["by_type"]:
        row: list[Any] = [qtype, first["by_type"][qtype]["n"]]
        for s in systems:
            t = report["systems"][s]["by_type"][qtype]
            row += [t["evidence_recall"], t.get("em"), t["tokens_median"]]
        rows.append(row)
    row = ["all", first["n"]]
    for s in systems:
        t = report["systems"][s]
        row += [t["evidence_recall"], t.get("em"), t["tokens_median"]]
    rows.append(row)
    head = (f"{fmt(first['n'])} questions of the {report['split']} split, {fmt(report['patients'])} patients, "
            f"each asked at its clinical time; reader: {report['reader'] or 'none'}")
    out = head + "\n\n" + table(header, rows)
    paired = report.get("paired_vs_stam") or {}
    if paired:
        prow = []
        for s, p in paired.items():
            m, f1, rec = p.get("mcnemar_em"), p.get("bootstrap_f1"), p["bootstrap_recall"]
            prow.append([s, f"{m['b_accuracy']:.3f} vs {m['a_accuracy']:.3f} (p {m['p_value']:.2g})" if m else None,
                         f"{f1['mean_difference']:+.3f} [{f1['ci_low']:+.3f}, {f1['ci_high']:+.3f}]" if f1 else None,
                         f"{rec['mean_difference']:+.3f} [{rec['ci_low']:+.3f}, {rec['ci_high']:+.3f}]"])
        out += "\n\n" + table(["against STAM", "EM (it vs STAM, McNemar p)", "token F1 difference [95% CI]",
                                 "evidence recall difference [95% CI]"], prow)
    return out


def render_timeline_page(report: dict[str, Any]) -> str:
    """``python -m benchmarks.timeline_page``: per patient, the first view's window and its load time in Chromium,
    the first run (the patient read from Redis) apart from the later ones (the timeline the page kept)."""
    def span(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        return fmt(round(lo)) if round(lo) == round(hi) else f"{fmt(round(lo))}-{fmt(round(hi))}"

    rows = []
    for p in report["patients"]:
        runs = p["runs"]
        first, later = runs[0], runs[1:]
        rows_drawn = f" in {fmt(first['rows'])} rows" if "rows" in first else ""  # folded by category
        window = (f"{fmt(first['shown'])} memories, {fmt(first['threads'])} threads{rows_drawn}, "
                  f"{fmt(first['transitions'])} transitions")
        rows.append([p["patient"], p["memories"], window, "first (read from Redis)", round(first["fetch_ms"]),
                     round(first["render_ms"]), round(first["wall_ms_from_click"])])
        if later:
            rows.append(["", "", "", f"the next {fmt(len(later))}", span([r["fetch_ms"] for r in later]),
                         span([r["render_ms"] for r in later]), span([r["wall_ms_from_click"] for r in later])])
    head = (f"Chromium {report['chromium']} headless; {fmt(len(report['patients']))} patients of a replayed store of "
            f"{fmt(report['store_patients'])}")
    return head + "\n\n" + table(["patient", "memories", "first window", "run", "data call ms", "render ms",
                                   "click to drawn ms"], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "timeline_page": render_timeline_page,
    "faust_floor": render_faust_floor,
    "redis_fsync": render_redis_fsync,
    "eval:lifecycle": render_lifecycle,
    "eval:qa": render_qa,
    "discharge_cost": render_discharge_cost,
    "mllp_feed": render_mllp_feed,
    "fhir_notifications": render_fhir_notifications,
    "hospital_feed": render_hospital_feed,
}


def kind(report: dict[str, Any]) -> str | None:
    """The renderer a report needs: its benchmark's name, ``eval:<name>`` for ``stam eval``."""
    for run in [report, *_runs(report)]:
        if isinstance(run.get("benchmark"), str):
            return str(run["benchmark"])
        if isinstance(run.get("eval"), str):
            return f"eval:{run['eval']}"
    return None


def source_line(report: dict[str, Any], link: str) -> str:
    """What a generated figure says of its run: the file, the command, the commit, the machine and the time."""
    p = report["provenance"]
    m = p["machine"]
    load = m.get("loadavg_1_5_15")
    dirty = " with uncommitted changes" if p.get("dirty") else ""
    machine = f"{fmt(m['cores'])} cores ({m['cpu']}), {fmt(m['memory_gib'])} GiB, Python {m['python']}"
    if load:
        machine += f", load average {' / '.join(fmt(x) for x in load)} when it ended"
    return (f"*Generated by `make figures` from [`{link.rsplit('/', 1)[-1]}`]({link}): `{p['command']}` at commit "
            f"`{str(p['commit'])[:10]}`{dirty}; {machine}; {p['when']}.*")


def load_report(results: Path, name: str) -> dict[str, Any]:
    path = results / f"{name}.json"
    if not path.is_file():
        raise FigureError(f"figure {name!r}: no results file {path}")
    try:
        report = json.loads(path.read_text())
    except ValueError as exc:
        raise FigureError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(report, dict) or missing(report):
        gaps = missing(report)
        raise FigureError(f"{path}: provenance incomplete ({', '.join(gaps)}); rerun it with a stamped benchmark")
    return report


def render(page: Path, name: str, docs: Path) -> str:
    """The text between the markers of figure ``name`` on ``page``."""
    report = load_report(docs / RESULTS, name)
    k = kind(report)
    if k not in RENDERERS:
        raise FigureError(f"{docs / RESULTS / name}.json: no renderer for its kind {k!r} (known: {', '.join(RENDERERS)})")
    link = os.path.relpath(docs / RESULTS / f"{name}.json", page.parent).replace(os.sep, "/")
    return "\n" + RENDERERS[k](report) + "\n\n" + source_line(report, link) + "\n\n"


def split(text: str, page: Path | str = "") -> list[str | tuple[str, str]]:
    """``text`` as plain runs of lines and ``(name, body)`` figures. A marker is a line of its own outside fenced code
    (a marker shown as an example, in a code block or a code span, is not one)."""
    parts: list[str | tuple[str, str]] = []
    plain: list[str] = []
    figure: tuple[str, list[str]] | None = None
    fence = False
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if figure is None and bare.lstrip().startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else OPEN.fullmatch(bare)
        if figure is not None:
            if m:
                raise FigureError(f"{page}: figure {m['name']!r} opens inside figure {figure[0]!r}")
            if bare == CLOSE:
                parts.append((figure[0], "".join(figure[1])))
                figure = None
            else:
                figure[1].append(line)
        elif m:
            parts.append("".join(plain))
            plain = []
            figure = (m["name"], [])
        elif bare == CLOSE and not fence:
            raise FigureError(f"{page}: {CLOSE} without its opening marker")
        else:
            plain.append(line)
    if figure is not None:
        raise FigureError(f"{page}: figure {figure[0]!r} is never closed with {CLOSE}")
    parts.append("".join(plain))
    return parts


def find(text: str, page: Path | str = "") -> list[tuple[str, str]]:
    """The ``(name, body)`` of every figure on a page."""
    return [p for p in split(text, page) if isinstance(p, tuple)]


def rewrite(text: str, page: Path, docs: Path) -> tuple[str, list[str]]:
    """``text`` with every figure rendered, and the names of those that changed."""
    out: list[str] = []
    changed: list[str] = []
    for part in split(text, page):
        if isinstance(part, str):
            out.append(part)
            continue
        name, body = part
        new = render(page, name, docs)
        if new != body:
            changed.append(name)
        out.append(f"<!-- figure: {name} -->\n{new}{CLOSE}\n")
    return "".join(out), changed


def pages(docs: Path) -> list[Path]:
    return sorted(p for p in docs.rglob("*.md") if p.is_file())


def run(docs: Path = DOCS, *, write: bool) -> tuple[list[str], list[str]]:
    """(figures that differ from their results, problems); with ``write`` the pages are rewritten."""
    stale: list[str] = []
    problems: list[str] = []
    cited: set[str] = set()
    for page in pages(docs):
        text = page.read_text()
        try:
            cited.update(name for name, _ in find(text, page))
            new, changed = rewrite(text, page, docs)
        except FigureError as exc:
            problems.append(str(exc))
            continue
        stale += [f"{page.relative_to(docs)}: {name}" for name in changed]
        if write and new != text:
            page.write_text(new)
    results = docs / RESULTS
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        if path.stem not in cited:
            problems.append(f"{path}: no page cites it (<!-- figure: {path.stem} -->)")
    return stale, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a figure differs from its results")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the documentation folder (default: docs/)")
    args = ap.parse_args(argv)
    stale, problems = run(args.docs, write=not args.check)
    for p in problems:
        print(f"figures: {p}", file=sys.stderr)
    if args.check:
        for s in stale:
            print(f"figures: {s} differs from its results file: run `make figures` (never edit a figure by hand)",
                  file=sys.stderr)
        ok = not stale and not problems
        print(f"figures: {'up to date' if ok else 'stale or broken'}", file=sys.stderr)
        return 0 if ok else 1
    for s in stale:
        print(f"figures: rewrote {s}", file=sys.stderr)
    if not stale and not problems:
        print("figures: up to date", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
