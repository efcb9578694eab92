"""What the project's own HTTP clients share (the benchmark: serve/bench_stats.py, which `eagle-loop
bench` and the loop's benchmark run; the simulated users: serve/simulate.py): a request answered
503 with `Retry-After` (the server's queue is full, or the replicas that took it died:
serve/router.py) is sent again after the seconds the header names, a bounded number of times.
A 503 without the header, and every other status, is the caller's to judge.

These clients never stream, so a stream's retryable error event (`server_unavailable` before any
token) never reaches them; a streaming client sends the request again on it the same way.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from typing import Any

import httpx

RETRIES = 3  # sends after the first
MAX_WAIT_S = 30.0  # the longest one Retry-After is waited for


def retry_after(r: httpx.Response) -> float | None:
    """Seconds a 503 asks the client to wait (`Retry-After`: seconds or an HTTP date), capped at
    MAX_WAIT_S; None when the answer asks for no retry."""
    value = r.headers.get("retry-after") if r.status_code == 503 else None
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), MAX_WAIT_S)


def post(
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    retries: int = RETRIES,
    sleep: Callable[[float], None] = time.sleep,
) -> httpx.Response:
    """POST `body` as JSON; a 503 with Retry-After is sent again after the wait it names, at
    most `retries` times. The last answer is returned whatever its status."""
    for _ in range(retries):
        r = client.post(path, json=body)
        wait = retry_after(r)
        if wait is None:
            return r
        sleep(wait)
    return client.post(path, json=body)
