"""Loopback ports: one the OS has free now, and whether a server could listen on a given one.
Needs no Ray: the engine launchers (actors/engine_server.py) check their port before they start
a server, and `serve` checks the proxy's before Ray starts (serve/startup.py)."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

# Ports nobody takes by chance: above Ray's worker ports (10002-19999 by default) and below the
# kernel's ephemeral range, which every `bind(port 0)` draws from. A port picked from the
# ephemeral range is free when picked, yet any process on the machine (a Ray starting beside,
# its gRPC servers, a connection's local end) may take it before our server binds it: CI lost a
# Serve start that way (serve.port 32909 taken, 2026-12-06).
QUIET_LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out on its own (Linux's default when unreadable)."""
    try:
        lo, hi = _EPHEMERAL.read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", below: int = 65536) -> int:
    """A port free right now, under `below` (sglang takes port + 10000 as well): a random one
    between Ray's worker ports and the ephemeral range (parallel runs pick differently)."""
    high = min(ephemeral_range()[0], below)
    low = QUIET_LOW if high > QUIET_LOW + 1000 else 1024  # a kernel with a wide ephemeral range
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(low, high)
        if _bindable(host, port):
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1} on {host}")


def port_problem(host: str, port: int) -> str | None:
    """Why a new server could not listen on host:port on this machine, or None."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return None  # not an address of this machine: the server's node decides
            return f"serve.port {port} on {host} is taken ({e}); pick a free port"
    return None
