"""The floor under the write path: the same four Faust hops on the embedded broker, doing nothing.

Four agents forward each message (entries -> a -> b -> c -> out) with the worker's batching settings, and
the last hop also produces ``--fanout`` messages per entry (the write path produces ~1.8 transitions per
entry). Prints JSON: messages/s end to end. What the real worker reaches cannot exceed this.

Usage: python -m benchmarks.faust_floor [--messages 5000] [--fanout 2] [--storage s3 memory] [--linger-ms 5 50]
[--batching stam faust]
(``--storage``: the broker storage engines to compare, one stack each, in turn; also reports the stack's start
time, the first message's time (the worker's group join), the broker's disk and the RSS of its processes, and the
CPU seconds each process spent on the measured messages.)
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
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from benchmarks.write_path import CpuMeter
from stam.transport import PRODUCER_BATCH_BYTES
from stam_lab.eval.provenance import stamp

PREFIX = "floor"
HOPS = ["entries", "a", "b", "c", "out"]


def worker_main(broker: str, fanout: int, linger_ms: int = 5, batching: str = "stam", partitions: int = 8) -> None:
    import faust

    from stam.config import Settings
    from stam.logs import faust_worker
    from topology.batching import Stream

    app = faust.App("floor-worker", broker=broker, store="memory://", topic_partitions=partitions,
                    consumer_auto_offset_reset="earliest", web_enabled=False, producer_linger_ms=linger_ms,
                    producer_max_batch_size=PRODUCER_BATCH_BYTES,
                    broker_session_timeout=10, broker_rebalance_timeout=10, broker_heartbeat_interval=3,
                    Stream=Stream)
    topics = [app.topic(f"{PREFIX}.{h}", key_type=bytes, value_type=bytes, key_serializer="raw",
                        value_serializer="raw", partitions=partitions) for h in HOPS]

    def hop(src: Any, dst: Any, copies: int) -> None:
        @app.agent(src, name=f"floor.{src.get_topic_name()}")
        async def forward(stream: Any) -> None:
            # the worker's batches (topology.batching), or Faust's own take_events to compare
            take = stream.take_batches if batching == "stam" else stream.take_events
            async for events in take(256, within=0.02):
                for ev in events:
                    for _ in range(copies):
                        await dst.send(key=ev.message.key, value=ev.value)

    for i in range(3):
        hop(topics[i], topics[i + 1], 1)
    hop(topics[3], topics[4], fanout)
    sys.argv = [sys.argv[0], "worker", "-l", "warning"]
    faust_worker(app, Settings(), "warning").execute_from_commandline()  # as the STAM worker: no spinner


async def drive(bootstrap: str, n: int, fanout: int, payload: bytes, cpu: CpuMeter | None = None,
                linger_ms: int = 5) -> dict[str, Any]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=linger_ms, max_batch_size=PRODUCER_BATCH_BYTES)
    consumer = AIOKafkaConsumer(f"{PREFIX}.out", bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=None)
    await producer.start()
    await consumer.start()
    try:
        async def run(count: int, tag: str) -> float:
            started = time.monotonic()
            futs = [await producer.send(f"{PREFIX}.entries", key=f"p{i % 50}".encode(), value=payload)
                    for i in range(count)]
            await asyncio.gather(*futs)
            want, got = count * fanout, 0
            while got < want and time.monotonic() - started < 600:
                batch = await consumer.getmany(timeout_ms=500)
                got += sum(len(v) for v in batch.values())
            return time.monotonic() - started

        first = await run(1, "warm")  # the worker's group join, then one message through the four hops
        if cpu is not None:
            cpu.reset()
        elapsed = await run(n, "measure")
        out: dict[str, Any] = {"messages": n, "seconds": round(elapsed, 3),
                               "entries_per_s": round(n / elapsed, 1), "first_message_s": round(first, 1)}
        if cpu is not None:
            out["cpu"] = cpu.report(n)
        return out
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--fanout", type=int, default=2)
    parser.add_argument("--payload-bytes", type=int, default=3000,
                        help="size of each message (an ImpactedEntry of a coded entry is ~1-6 kB)")
    parser.add_argument("--storage", nargs="+", choices=["s3", "memory"], default=["s3"],
                        help="broker storage engine(s); several: one run each, in turn")
    parser.add_argument("--linger-ms", type=int, nargs="+", default=[5],
                        help="producer linger of the hops and the driver (the worker's is 5); several: one run each")
    parser.add_argument("--batching", nargs="+", choices=["stam", "faust"], default=["stam"],
                        help="the hops' batches: stam (the worker's, topology.batching) or faust (Faust's "
                        "take_events, which polls every 20 ms while idle); several: one run each")
    parser.add_argument("--worker", nargs=5, metavar=("BROKER", "FANOUT", "LINGER", "BATCHING", "PARTITIONS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.worker[3], int(args.worker[4]))
        return
    results = [floor_run(args, storage, linger, batching) for storage in args.storage for linger in args.linger_ms
               for batching in args.batching]
    print(json.dumps(stamp(results[0] if len(results) == 1 else results), indent=2))


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def floor_run(args: argparse.Namespace, storage: str, linger_ms: int = 5, batching: str = "stam") -> dict[str, Any]:
    """One floor measurement: a fresh embedded stack on ``storage``, the plain Faust pipeline over ``args.messages``
    messages (JSON figures)."""
    from stam import stack

    with tempfile.TemporaryDirectory(prefix="stam-floor-") as tmp:
        home = Path(tmp)
        t0 = time.monotonic()
        info = stack.up(home, storage=storage)
        partitions = info.partitions or stack.EMBEDDED_PARTITIONS
        up_s = time.monotonic() - t0
        log = open(home / "worker.log", "wb")  # noqa: SIM115
        worker = subprocess.Popen([sys.executable, "-m", "benchmarks.faust_floor", "--worker", info.broker_url,
                                   str(args.fanout), str(linger_ms), batching, str(partitions)],
                                  cwd=Path(__file__).resolve().parents[1], env=dict(os.environ), stdout=log,
                                  stderr=subprocess.STDOUT)
        try:
            bootstrap = info.broker_url.split("://", 1)[1]
            cpu = CpuMeter({**{n: p.pid for n, p in info.processes.items()}, "worker": worker.pid,
                            "driver": os.getpid()})
            result = asyncio.run(drive(bootstrap, args.messages, args.fanout, b"x" * args.payload_bytes, cpu,
                                       linger_ms))
            broker_dir = home / "broker"
            result.update(
                storage=storage, partitions=partitions, stack_up_s=round(up_s, 1),
                broker_disk_mb=round(sum(f.stat().st_size for f in broker_dir.rglob("*") if f.is_file()) / 2**20, 1)
                if broker_dir.exists() else 0.0,
                rss_mb={n: _rss_mb(p.pid) for n, p in info.processes.items() if n in ("s3", "broker")})
        finally:
            worker.terminate()
            worker.wait(timeout=30)
            log.close()
            stack.down(home)
    return {"benchmark": "faust_floor", "hops": 4, "fanout": args.fanout, "payload_bytes": args.payload_bytes,
            "linger_ms": linger_ms, "batching": batching, **result}


if __name__ == "__main__":
    main()
