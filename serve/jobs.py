"""Requests of the embedded engine's deployment as batch jobs: what one request brings to a
batch (prompt, settings, its stream), and running a batch so that a request that breaks the
engine fails only itself. serve/deployment.py batches them (`serve.batch`)."""

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from serve.engine import Generation, GenParams
from serve.stops import StopWatch

log = logging.getLogger("ray.serve")


@dataclass
class _Job:
    prompt: list[int]
    params: GenParams
    speculative: bool
    queue: asyncio.Queue | None = None  # streaming: token lists, then None
    loop: asyncio.AbstractEventLoop | None = None
    record: dict[str, Any] | None = None  # what the traffic log keeps of the request, if any
    # Set on the event loop, read by the engine's thread at every step (a plain bool: one
    # attribute store is atomic under the GIL). The client hung up, or its time is up.
    cancelled: bool = False
    deadline: float = math.inf  # time.monotonic() past which the engine drops the request
    stops: StopWatch | None = None  # its stop strings: the engine drops it once one appears
    # the response's and the traffic record's id: the router's, the same in every attempt
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # (future, its event loop): the Generation, set as the request leaves the engine's batch
    answer: tuple[asyncio.Future, asyncio.AbstractEventLoop] | None = field(
        default=None, compare=False
    )

    @property
    def stopped(self) -> bool:
        """Nobody waits for this request any more: the engine skips or drops it."""
        return self.cancelled or time.monotonic() > self.deadline

    @property
    def key(self) -> tuple:
        """Requests with equal keys share one engine call: every GenParams field but max_tokens
        (each request keeps its own), so a setting added there can never be batched away."""
        p = self.params
        return (
            self.speculative,
            *(getattr(p, f.name) for f in fields(p) if f.name != "max_tokens"),
        )

    seen: int = 0  # tokens the current attempt produced
    sent: int = 0  # tokens already streamed to the client (a retry does not repeat them)

    def push(self, item: list[int] | None) -> bool:
        """Hand new tokens (None: the end) to the stream; True when the engine should stop
        this request (the engine's TokenCallback): nobody waits for it, or it reached a stop
        string."""
        hit = item is not None and self.stops is not None and self.stops.feed(item)
        return self._push(item) or hit

    def _push(self, item: list[int] | None) -> bool:
        if item is not None:
            self.seen += len(item)
            fresh = self.seen - self.sent
            if fresh <= 0:
                return self.stopped
            item, self.sent = item[len(item) - fresh :], self.seen
        if self.queue is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        return self.stopped

    def restart(self) -> None:
        """Before a retry: the tokens it produces again up to `sent` are not streamed twice."""
        self.seen = 0
        if self.stops is not None:
            self.stops.reset()


def run_isolated(
    run: Callable[[list[_Job]], list[Generation]], jobs: list[_Job]
) -> list[Generation | Exception]:
    """`run(jobs)`, one engine call; when it fails, each job again alone, so a request that breaks
    the engine fails only itself and the others it was batched with still get their answer.
    (A streamed job retried after some tokens went out continues after them; greedy decoding
    reproduces them, sampling may not.)"""
    try:
        return list(run(jobs))
    except Exception as e:  # noqa: BLE001 - isolate, then report per request
        if len(jobs) == 1:
            log.error("request failed: %r", e)
            return [e]
        log.warning("a batch of %d failed (%r); retrying each request alone", len(jobs), e)
    out: list[Generation | Exception] = []
    for j in jobs:
        j.restart()
        out += run_isolated(run, [j])
    return out


def await_answer(job: _Job) -> asyncio.Future:
    """A future of `job`'s Generation on this event loop: the engine answers it the moment the
    request leaves its batch (`answer`), not when the whole batch ends."""
    loop = asyncio.get_running_loop()
    job.answer = (loop.create_future(), loop)
    return job.answer[0]


def answered(job: _Job) -> bool:
    """Whether `job` has its answer (a batch retried after a failure skips it)."""
    return job.answer is not None and job.answer[0].done()


def answer(job: _Job, result: Any) -> None:
    """Resolve `job`'s future (from the engine's thread); the first answer stands."""
    if job.answer is None:
        return
    fut, loop = job.answer

    def done() -> None:
        if not fut.done():
            fut.set_result(result)

    loop.call_soon_threadsafe(done)


class JoinQueue:
    """Requests waiting to join the batch the engine runs now (continuous batching on the static
    runner): while a batch runs, a request of its key is offered here instead of waiting for the
    batch to end; the engine's thread takes waiting requests between cycles (`take`, behind the
    engine's `joins`); those the batch ended without taking run in the next engine call (`close`
    hands them back). The event loop offers, the engine's thread takes: one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.key: tuple | None = None  # the running batch's key; None: no batch takes joins
        self._waiting: list[_Job] = []

    def open(self, key: tuple) -> None:
        with self._lock:
            self.key = key

    def offer(self, job: _Job) -> asyncio.Future | None:
        """A future of `job`'s Generation when a batch of its key runs now, else None."""
        with self._lock:
            if self.key is None or job.key != self.key:
                return None
            self._waiting.append(job)
            return await_answer(job)

    def take(self, free: int, fits: Callable[[_Job], bool]) -> list[_Job]:
        """Up to `free` waiting requests that `fits` (in arrival order); one whose client is
        gone is left for `close` (the next call skips it)."""
        with self._lock:
            taken = [j for j in self._waiting if not j.stopped and fits(j)][:free]
            gone = {id(j) for j in taken}  # by identity: equal requests are equal dataclasses
            self._waiting = [j for j in self._waiting if id(j) not in gone]
            return taken

    def close(self) -> list[_Job]:
        """The batch ended: nothing joins it any more; the requests still waiting."""
        with self._lock:
            self.key, left, self._waiting = None, self._waiting, []
            return left
