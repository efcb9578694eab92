"""Timing of the device cycle: marks on the stream (CUDA events, read once the cycles ran, so timing
adds no sync) or the host clock on CPU."""

from __future__ import annotations

import time
from typing import Any

import torch


def _mark(cuda: bool) -> Any:
    """A point in time of the device cycle: a CUDA event on the stream (read at the end, so
    timing adds no sync), else the host clock."""
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _marks_ms(marks: list[tuple[Any, ...]], cuda: bool) -> tuple[float, float, float]:
    """(draft, verify, accept) ms summed over cycles of (start, drafted, verified, accepted,
    extended) marks: drafting is the proposal plus the extension, verifying the target's pass
    (with its inputs' packing), accepting the acceptance, the tree's cache move and the queued
    host copy."""
    if not marks:
        return 0.0, 0.0, 0.0
    if cuda:
        marks[-1][-1].synchronize()
        span = lambda a, b: a.elapsed_time(b)  # noqa: E731
    else:
        span = lambda a, b: (b - a) * 1000  # noqa: E731
    draft = sum(span(m[0], m[1]) + span(m[3], m[4]) for m in marks)
    return draft, sum(span(m[1], m[2]) for m in marks), sum(span(m[2], m[3]) for m in marks)


def ms_since(t: float) -> float:
    """Milliseconds of the host clock since `t` (a `time.perf_counter()`)."""
    return (time.perf_counter() - t) * 1000
