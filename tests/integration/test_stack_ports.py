"""The embedded stack starts although another process takes one of its ports between the moment it was found
free and the moment the server binds it (seen when two stacks start at once on one machine: the demo beside a
test run, or tests in parallel)."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path
from typing import Any

import pytest

from stam import stack

# The order _specs asks for ports: S3's main port and its other ports, then the broker, Redis, Milvus.
PICK = {"s3": 0, "broker": 1 + len(stack._WEED_PORTS), "redis": 2 + len(stack._WEED_PORTS),
        "milvus": 3 + len(stack._WEED_PORTS)}


@pytest.mark.parametrize("victim", list(PICK))
def test_a_port_taken_while_the_stack_starts_is_replaced_by_a_fresh_one(victim: str, tmp_path: Path,
                                                                         monkeypatch: Any) -> None:
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))  # bound, not listening: whoever binds this port next fails as in the race
    taken = thief.getsockname()[1]
    real = stack.free_port
    counter = itertools.count()
    monkeypatch.setattr(stack, "free_port", lambda: taken if next(counter) == PICK[victim] else real())
    home = tmp_path / "stack"
    try:
        info = stack.up(home)
        assert taken not in {p.port for p in info.processes.values()}
        assert not info.dead()
        said = (home / "logs" / f"{victim}.log").read_text(errors="replace").lower()
        assert stack._PORT_TAKEN.search(said), said[-2000:]
    finally:
        stack.down(home)
        thief.close()
