"""MLLP feed benchmark: the 139 shared HL7 v2 samples, repeated to ``--messages`` messages, sent over
``--connections`` concurrent MLLP connections to ``stam listen mllp`` (its own process) on the embedded stack.

Each message gets its own MSH-10 (``r<repetition>-<sample>``), so every message is new (not a duplicate answered from the
stored ACK), and MSH-15/16 emptied (original mode: 11 samples ask for enhanced mode, some with no accept ACK, which
a sender does not wait for): the listener maps each, sends its entries with acks=all (or dead-letters it) and only
then acknowledges it.
Each connection keeps one message in flight, as MLLP senders do.

Prints JSON (stdout): messages/s over the run, ACK latency p50/p99/max (from the message's last byte written to its
ACK read, at the sender), ACK codes; and the floor: the same run's entries produced raw (already mapped, one
``Publisher.send_entries`` call: sealed, acks=all, pipelined) on the same broker, entries/s and the messages/s
that equals; and the HL7 v2 mapping alone (messages/s and CPU ms per message, no broker). The gap between the
listener and the floor is what mapping, one message in flight per connection, the ACK store and the round trips
cost.

Usage: python -m benchmarks.mllp_feed [--messages 10000] [--connections 8] [--storage s3] (make bench-mllp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.write_path import DATA, REPO
from stam.net import free_port
from stam_lab.eval.provenance import stamp

SAMPLES = DATA / "hl7v2-samples"


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def messages(n: int, tag: str = "r") -> list[bytes]:
    """The samples in name order, repeated to ``n`` messages, each with its own MSH-10 (``<tag><repetition>-<i>``):
    the samples themselves share control ids (42 distinct (MSH-3, MSH-4, MSH-10) among 139), which a listener
    rightly answers as duplicates."""
    base = []
    for p in sorted(SAMPLES.glob("*.hl7")):
        raw = p.read_bytes().removeprefix(b"\xef\xbb\xbf").replace(b"\r\n", b"\r").replace(b"\n", b"\r").strip()
        base.append(raw + b"\r")
    out = []
    r = 0
    while len(out) < n:
        for i, raw in enumerate(base):
            msh, sep, rest = raw.partition(b"\r")
            f = msh.split(msh[3:4])
            f += [b""] * (16 - len(f))
            f[9] = f"{tag}{r}-{i}".encode()  # MSH-10: the samples share control ids (MSG00001...)
            f[14] = f[15] = b""  # MSH-15/16: original mode, every message acknowledged (NE asks for none)
            out.append(msh[3:4].join(f) + sep + rest)
            if len(out) == n:
                break
        r += 1
    return out


async def _sender(port: int, queue: asyncio.Queue[bytes], latencies: list[float], codes: Counter[str]) -> None:
    from hl7.mllp import open_hl7_connection

    reader, writer = await open_hl7_connection("127.0.0.1", port)
    try:
        while True:
            try:
                msg = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            writer.writeblock(msg)
            await writer.drain()
            started = time.perf_counter()
            ack = await asyncio.wait_for(reader.readblock(), 120)
            latencies.append(time.perf_counter() - started)
            codes[ack.split(b"\rMSA|", 1)[1][:2].decode()] += 1
    finally:
        writer.close()


async def feed(port: int, msgs: list[bytes], connections: int) -> dict[str, Any]:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for m in msgs:
        queue.put_nowait(m)
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    started = time.perf_counter()
    await asyncio.gather(*(_sender(port, queue, latencies, codes) for _ in range(connections)))
    seconds = time.perf_counter() - started
    return {"messages": len(msgs), "connections": connections, "seconds": round(seconds, 2),
            "messages_per_s": round(len(msgs) / seconds, 1),
            "ack_latency_ms": {"p50": round(1000 * _pct(latencies, 0.50), 2),
                               "p99": round(1000 * _pct(latencies, 0.99), 2),
                               "max": round(1000 * max(latencies), 2)},
            "ack_codes": dict(sorted(codes.items()))}


def mapping_only(msgs: list[bytes]) -> dict[str, Any]:
    """The HL7 v2 mapping alone (``parse_message`` per message, no broker), in this process: the CPU each message
    costs the listener before anything is sent."""
    from stam.errors import SourceError
    from stam.sources.hl7v2 import parse_message

    wall, cpu = time.perf_counter(), time.process_time()
    for m in msgs:
        with contextlib.suppress(SourceError):
            parse_message(m, "bench")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"messages": len(msgs), "messages_per_s": round(len(msgs) / wall, 1),
            "cpu_ms_per_message": round(1000 * cpu / len(msgs), 2)}


async def raw_produce(settings: Any, msgs: list[bytes]) -> dict[str, Any]:
    """The floor: the same messages (with other MSH-10s: other entry ids) mapped beforehand, their entries produced
    in one pipelined ``send_entries``, sealed, acks=all."""
    from stam.errors import SourceError
    from stam.publish import Publisher, PublishSummary
    from stam.sources.hl7v2 import parse_message

    entries = []
    mapped = 0
    for m in msgs:
        try:
            entries.extend(parse_message(m, "bench"))
            mapped += 1
        except SourceError:
            pass
    async with Publisher(settings) as pub:
        for pid in dict.fromkeys(e.patient_id for e in entries):  # keys made beforehand, as the listener's are
            pub.sealer.keys.key_for_sealing(pid)
        pub.sealer.durable()
        started = time.perf_counter()
        await pub.send_entries(entries, PublishSummary())
        seconds = time.perf_counter() - started
    return {"entries": len(entries), "mapped_messages": mapped, "seconds": round(seconds, 2),
            "entries_per_s": round(len(entries) / seconds, 1),
            "equivalent_messages_per_s": round(mapped / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--storage", default="s3", choices=["s3", "memory"], help="the embedded broker's storage")
    args = ap.parse_args(argv)
    if not SAMPLES.is_dir():
        print(f"mllp_feed: {SAMPLES} not found (set STAM_SHARED_DATA)", file=sys.stderr)
        return 2

    from stam import stack
    from topology.admin import ensure_topics

    msgs = messages(args.messages)
    with tempfile.TemporaryDirectory(prefix="stam-mllp-bench-") as tmp:
        home = Path(tmp)
        info = stack.up(home, storage=args.storage)
        proc = None
        try:
            settings = stack.settings(info, home, web_port=0)
            asyncio.run(ensure_topics(settings))
            port, metrics = free_port(), free_port()
            env = dict(os.environ, STAM_HOME=str(home), STAM_BROKER_URL=info.broker_url, STAM_REDIS_URL=info.redis_url,
                       STAM_MILVUS_URI=info.milvus_uri, STAM_MLLP_PORT=str(port), STAM_METRICS_PORT=str(metrics))
            log = open(home / "listener.log", "wb")  # noqa: SIM115 - kept open for the process's life
            proc = subprocess.Popen([sys.executable, "-m", "stam.cli", "listen", "mllp", "--loglevel", "warning"],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            _wait_port(port, proc, home / "listener.log")
            warm = asyncio.run(feed(port, messages(139, "warm"), args.connections))
            run = asyncio.run(feed(port, msgs, args.connections))
            run["listener_outcomes"] = _outcomes(metrics)  # warm-up included
            floor = asyncio.run(raw_produce(settings, messages(args.messages, "floor")))
            mapping = mapping_only(messages(min(args.messages, 2000), "map"))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
            stack.down(home)
    report = {"benchmark": "mllp_feed", "broker_storage": args.storage, "samples": len(list(SAMPLES.glob("*.hl7"))),
              "warm_up_messages": warm["messages"], "listener": run, "raw_produce_floor": floor, "mapping_only": mapping,
              "listener_share_of_floor": round(run["messages_per_s"] / floor["equivalent_messages_per_s"], 3)}
    print(json.dumps(stamp(report), indent=2))
    return 0


def _outcomes(port: int) -> dict[str, float]:
    """The listener's ``stam_mllp_messages_total`` by outcome."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()  # noqa: S310
    out = {}
    for line in text.splitlines():
        if line.startswith("stam_mllp_messages_total{"):
            out[line.split('outcome="', 1)[1].split('"', 1)[0]] = float(line.split()[-1])
    return out


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the listener exited ({proc.returncode}): {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the listener did not open port {port} within {timeout:g} s")


if __name__ == "__main__":
    raise SystemExit(main())
