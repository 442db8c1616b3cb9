"""Loopback ports for the tests, safe when several test phases run at once on one machine.

The test command runs phases side by side and gives each its own block of ports
(``PD_BRIDGE_TEST_PORTS=LO:HI``), below the kernel's ephemeral range, so a port one phase picked
and has not bound yet (an engine takes up to a minute to start) is never taken by another phase or
by an outgoing connection. Without the variable (a test run by hand) the kernel picks.
"""

from __future__ import annotations

import os
import random
import socket

_held: list[socket.socket] = []  # dead ports: bound for the process's life, never listening


def _block() -> tuple[int, int] | None:
    spec = os.environ.get("PD_BRIDGE_TEST_PORTS", "")
    if not spec:
        return None
    lo, hi = (int(x) for x in spec.split(":"))
    if not 1024 <= lo < hi <= 65535:
        raise ValueError(f"PD_BRIDGE_TEST_PORTS={spec!r}: want LO:HI with 1024 <= LO < HI <= 65535")
    return lo, hi


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """A base port with ``n`` consecutive ports from it free now (for ``n`` = 1: one free port)."""
    block = _block()
    if block is None:
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
            if base + n <= 65536 and all(_bindable(p) for p in range(base + 1, base + n)):
                return base
        raise RuntimeError(f"no {n} consecutive free ports")
    lo, hi = block
    for _ in range(500):
        base = random.randrange(lo, hi - n + 1)
        if all(_bindable(p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in PD_BRIDGE_TEST_PORTS={lo}:{hi}")


def free_port() -> int:
    return free_ports(1)


def dead_port() -> int:
    """A port where nothing accepts: bound (so nothing else can take it) but never listening, so a
    connection is refused at once, for the rest of this process's life."""
    s = socket.socket()
    block = _block()
    if block is None:
        s.bind(("127.0.0.1", 0))
    else:
        s.bind(("127.0.0.1", free_port()))
    _held.append(s)
    return s.getsockname()[1]
