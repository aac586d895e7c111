"""The STAM Grafana dashboard, kept as code (grafana-foundation-sdk).

    python -m stam.ops.dashboard --write   # regenerate helm/stam/dashboards/stam.json and docker/grafana/dashboards/
    python -m stam.ops.dashboard --check   # exit 1 when a committed copy is out of date
    python -m stam.ops.dashboard --queries # panel title and PromQL of every query, as JSON

Every expression uses metrics of stam/metrics.py, stam/llm/client.py and prometheus-client's process collector.
Labels never carry a patient id. ``$__rate_interval`` is Grafana's; :func:`queries` substitutes it (``1m`` by
default) so the expressions can be evaluated by a plain Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (ROOT / "helm" / "stam" / "dashboards" / "stam.json", ROOT / "docker" / "grafana" / "dashboards" / "stam.json")
UID = "stam-overview"
RATE = "$__rate_interval"

# (row, [(title, unit, description, [(legend, expr)])])
Target = tuple[str, str]
PanelSpec = tuple[str, str, str, list[Target]]


def _quantiles(metric: str, by: str) -> list[Target]:
    by_le = f"le, {by}" if by else "le"
    label = f"{{{{{by}}}}} " if by else ""
    return [(f"{label}p{int(q * 100)}",
             f"histogram_quantile({q}, sum by ({by_le}) (rate({metric}_bucket[{RATE}])))") for q in (0.5, 0.99)]


ROWS: list[tuple[str, list[PanelSpec]]] = [
    ("Write path", [
        ("Entries/s per stage", "ops", "Messages handled by each write stage, by outcome (ok, dead_letter, erased, "
         "duplicate)",
         [("{{stage}} {{outcome}}", f"sum by (stage, outcome) (rate(stam_messages_total[{RATE}]))")]),
        ("Stage latency p50/p99", "s", "Time in the stage function per message",
         _quantiles("stam_stage_seconds", "stage")),
        ("Hop wait p50/p99", "s", "From a message's produce to its stage starting on it: the broker, the "
         "consumer's fetch wait and the batch window (stage latency plus hop wait, summed over the stages, is the "
         "write path's latency budget)",
         _quantiles("stam_hop_wait_seconds", "stage")),
        ("Commit and delivery p50/p99", "s", "Within the update stage, each batch's writes of what it applied: its "
         "vectors to Milvus and its state with the transition outboxes to Redis (one MULTI/EXEC, fsync included); "
         "then, after the stage, from the transitions handed to the producer to the broker's acknowledgement",
         [*(_quantiles("stam_commit_seconds", "store")),
          *((f"delivery {legend}", expr) for legend, expr in _quantiles("stam_delivery_seconds", ""))]),
        ("Transitions by kind and reason", "ops", "State transitions applied by the update stage",
         [("{{kind}} {{reason}}", f"sum by (kind, reason) (rate(stam_transitions_total[{RATE}]))")]),
        ("Dead letters by stage and error type", "short", "Messages sent to the dead-letter topic in 5 minutes "
         "(each is a gap in a patient's record until replayed: stam deadletters list)",
         [("{{stage}} {{error_type}}", "sum by (stage, error_type) (increase(stam_dead_letters_total[5m]))")]),
        ("Consumer lag per topic and partition", "short", "End offset minus committed offset of each partition, "
         "per consumer group (0 when caught up)",
         [("{{group}} {{topic}}/{{partition}}", "sum by (group, topic, partition) (stam_consumer_lag)")]),
        ("Link and impact work at the updater", "percentunit", "Four stages: share of applied entries by what "
         "the updater did with their link/impact work: current, reused (nothing they read changed), patched (looked "
         "up again in memory, search kept), redone (searched again: the stale-redo ratio)",
         [("{{reads}}", f"sum by (reads) (rate(stam_update_reads_total[{RATE}])) / scalar(clamp_min(sum("
                        f"rate(stam_update_reads_total[{RATE}])), 1e-9))")]),
        ("Stalled partitions and stage bugs", "short", "Partitions held by an unexpected exception now, and such "
         "exceptions per second (a bug: alert on any)",
         [("stalled {{stage}}", "sum by (stage) (stam_partition_stalled)"),
          ("bugs/s {{stage}} {{error_type}}", f"sum by (stage, error_type) (rate(stam_stage_bug_total[{RATE}]))")]),
    ]),
    ("Read path", [
        ("Queries/s", "reqps", "Queries answered, by channel and outcome",
         [("{{channel}} {{outcome}}", f"sum by (channel, outcome) (rate(stam_queries_total[{RATE}]))")]),
        ("Query latency p50/p99", "s", "Retrieval, gate and packet (reader included when configured)",
         _quantiles("stam_query_seconds", "channel")),
        ("HISTORY served", "percentunit", "Share of answered queries whose packet included HISTORY (the store "
         "gate let it through), and the rate of such queries",
         [("share", f"sum(rate(stam_queries_total{{outcome=\"ok\", served=\"both\"}}[{RATE}])) / "
                    f"clamp_min(sum(rate(stam_queries_total{{outcome=\"ok\"}}[{RATE}])), 1e-9)")]),
        ("HISTORY-served queries/s", "reqps", "Queries whose packet included HISTORY, per channel",
         [("{{channel}}", f"sum by (channel) (rate(stam_queries_total{{served=\"both\"}}[{RATE}]))")]),
        ("Served tokens", "short", "Tokens of the evidence packets served: per second, and the mean per query by "
         "what was served (active, both)",
         [("tokens/s", f"sum(rate(stam_query_served_tokens_sum[{RATE}]))"),
          ("mean per query {{served}}", f"sum by (served) (rate(stam_query_served_tokens_sum[{RATE}])) / "
                                        f"clamp_min(sum by (served) (rate(stam_query_served_tokens_count[{RATE}])), "
                                        "1e-9)")]),
    ]),
    ("Language model", [
        ("Language-model calls/s", "reqps", "Calls to the OpenAI-compatible endpoint by outcome (ok, retry, "
         "rejected, failed)",
         [("{{outcome}}", f"sum by (outcome) (rate(stam_llm_calls_total[{RATE}]))")]),
        ("Language-model tokens/s", "short", "Prompt and completion tokens reported by the server",
         [("{{kind}}", f"sum by (kind) (rate(stam_llm_tokens_total[{RATE}]))")]),
        ("Language-model latency p50/p99", "s", "Duration of successful calls (retries included)",
         _quantiles("stam_llm_seconds", "")),
    ]),
    ("Processes", [
        ("Process memory (RSS)", "bytes", "Resident memory of every process that exports STAM metrics",
         [("{{job}} {{instance}}", "max by (job, instance) (process_resident_memory_bytes) and on (job, instance) "
                                   "count by (job, instance) ({__name__=~\"stam_.+\"})")]),
        ("Dependencies ready", "short", "Last readiness check of each dependency (1 ready, 0 not), worst process",
         [("{{dependency}}", "min by (dependency) (stam_ready)")]),
    ]),
]


def build() -> dict[str, Any]:
    """The dashboard as Grafana JSON (a dict)."""
    # deferred: optional grafana_foundation_sdk (stam[deploy]), not installed everywhere
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (db.Dashboard("STAM")
             .uid(UID)
             .description("STAM write path, read path and language model (generated by stam/ops/dashboard.py; "
                          "edit the code, not the JSON)")
             .tags(["stam"])
             .refresh("30s")
             .time("now-1h", "now")
             .timezone("browser")
             .readonly()
             .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    for row, panels in ROWS:
        board = board.with_row(db.Row(row))
        for title, unit, description, targets in panels:
            panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(ds)
                     .height(8).span(12).min(0)
                     .legend(cb.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                             .placement(common.LegendPlacement.BOTTOM).show_legend(True))
                     .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                              .sort(common.SortOrder.DESCENDING)))
            for i, (legend, expr) in enumerate(targets):
                panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend)
                                          .ref_id(chr(ord("A") + i)).datasource(ds))
            board = board.with_panel(panel)
    out: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(rate_interval: str | None = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard; ``$__rate_interval`` replaced by ``rate_interval``
    (None: as in the dashboard)."""
    out = []
    for _, panels in ROWS:
        for title, _, _, targets in panels:
            for _, expr in targets:
                out.append((title, expr if rate_interval is None else expr.replace(RATE, rate_interval)))
    return out


def stale(paths: tuple[Path, ...] = OUTPUTS) -> list[Path]:
    """The committed copies that differ from what build() makes now."""
    text = render()
    return [p for p in paths if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the STAM Grafana dashboard as code")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="regenerate the committed JSON copies")
    group.add_argument("--check", action="store_true", help="exit 1 when a committed copy is out of date")
    group.add_argument("--queries", action="store_true", help="print panel titles and PromQL as JSON")
    args = parser.parse_args(argv)
    if args.write:
        text = render()
        for path in OUTPUTS:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if args.check:
        bad = stale()
        for path in bad:
            print(f"dashboard: {path.relative_to(ROOT)} is out of date; run `python -m stam.ops.dashboard --write`",
                  file=sys.stderr)
        return 1 if bad else 0
    if args.queries:
        print(json.dumps([{"panel": t, "expr": e} for t, e in queries()], indent=1))
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
