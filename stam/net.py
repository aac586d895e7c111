"""Loopback ports: :func:`free_port`, the one way the project (the embedded stack, the demo, the serving check,
tests and benchmarks) picks a port for a server it is about to start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on the loopback now (the OS picks it). Free when asked: another process may still take it
    before the caller's server binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
