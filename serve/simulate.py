"""Simulated users: replay prompts against a live server, as users would send them.

The demo's stand-in for real traffic (`serve.simulate_users`): after a round's benchmark the
loop sends prompts from the simulated users' pool (`data.user_prompts`, disjoint from training
and from the benchmark) to the server it deployed, which answers them with the serving drafter
and, with `serve.record_traffic`, writes them to the traffic log the next round learns from.

Bounded: a fixed number of requests, a wall-time limit, loopback addresses only (this is a load
generator; it must never hit someone else's server by a typo).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from serve.http_client import post

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class SimulationResult:
    requests: int
    failed: int
    completion_tokens: int
    seconds: float
    first_error: str | None = None


def simulate_users(
    url: str,
    prompts: list[list[dict[str, str]]],
    *,
    max_tokens: int,
    concurrency: int = 4,
    max_seconds: float = 900.0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> SimulationResult:
    """Send every prompt once (chat completions, `concurrency` in flight); stops sending when
    `max_seconds` have passed. A 503 with Retry-After is sent again after the wait it names
    (serve/http_client.py), as a patient user would. Failures are counted, not raised: a user's
    bad request is the server's business, and the caller decides what a failure rate means."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"simulated users only talk to loopback servers, not {url!r}")
    deadline = time.monotonic() + max_seconds
    errors: list[str] = []

    def one(client: httpx.Client, messages: list[dict[str, str]]) -> int:
        if time.monotonic() > deadline:
            return -1
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **({"top_p": top_p} if temperature > 0 else {}),
            **({"top_k": top_k} if temperature > 0 and top_k > 0 else {}),
        }
        try:
            r = post(client, "/v1/chat/completions", body)  # 503 + Retry-After: again
        except httpx.HTTPError as e:
            errors.append(f"{type(e).__name__}: {e}")
            return -2
        if r.status_code != 200:
            errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
            return -2
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 1)
    with httpx.Client(base_url=url, timeout=max_seconds, limits=limits) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda m: one(client, m), prompts))
    sent = [g for g in got if g != -1]
    return SimulationResult(
        requests=len(sent),
        failed=sum(1 for g in sent if g == -2),
        completion_tokens=sum(g for g in sent if g >= 0),
        seconds=time.perf_counter() - t0,
        first_error=errors[0] if errors else None,
    )
