"""Loopback ports: one the OS has free now, and whether a server could listen on a given one.
Needs no Ray: the engine launchers (actors/engine_server.py) check their port before they start
a server, and `serve` checks the proxy's before Ray starts (serve/startup.py)."""

from __future__ import annotations

import errno
import socket


def free_port(host: str = "127.0.0.1", below: int = 65536) -> int:
    """A port free right now (the OS's pick, so parallel runs on one machine differ), under
    `below` (sglang takes port + 10000 as well)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < below:
            return port
    raise RuntimeError(f"no free port under {below} on {host}")


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
