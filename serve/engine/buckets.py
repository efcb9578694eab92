"""Row and span buckets shared by the static runner and the static drafter: the shapes their
CUDA graphs are captured at, so a batch that grows or shrinks, or a context that lengthens,
replays a few graphs instead of one per size; and how both compile their graphed code for them
(`compile_static`, `dynamic_dims`, `span_arg`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def row_bucket(rows: int, most: int | None = None) -> int:
    """Rows a batch of `rows` runs as in the static runner and drafter: the next power of two
    (at most `most`), so a batch that shrinks replays a few graphs, not one per size."""
    b = 1 << (rows - 1).bit_length()
    return b if most is None else min(b, most)


def moved_rows(rows: Tensor) -> tuple[Tensor, Tensor] | None:
    """(to, from) of the kept `rows` (ascending) that move up to their new place in a select;
    None when none moves. In ascending order no row is overwritten before it is read."""
    keep = rows.tolist()
    moved = [(i, r) for i, r in enumerate(keep) if r != i]
    if not moved:
        return None
    dst, src = zip(*moved, strict=True)
    return torch.tensor(dst), torch.tensor(src)


def span_buckets(smallest: int, capacity: int) -> list[int]:
    """The attention spans of the static runners: powers of two from `smallest`, then capacity."""
    out, span = [], smallest
    while span < capacity:
        out.append(span)
        span *= 2
    return out + [capacity]


def compile_static(fn: Callable[..., Any], backend: str, mode: str | None = None) -> Callable[..., Any]:  # fmt: skip
    """`fn` compiled by torch.compile at static shapes (the best kernels) but for the dims
    `dynamic_dims` and `span_arg` mark, as one graph (fullgraph: a failure to trace is an
    error, not a silent fallback to eager). One row or several, one token or several, and each
    drafted shape is a specialisation of the same function, more than dynamo's default limit
    of 8, so the limit is raised."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(fn, backend=backend, mode=mode, dynamic=False, fullgraph=True)


def dynamic_dims(size: int, *marks: tuple) -> None:
    """Mark the dims of each (tensor, dim, ...) dynamic for `compile_static` when they are
    larger than 1 (`size`: a batch's rows, a verify's width): every row bucket (and span, where
    a mark names it) and every verify width then runs one compiled code instead of one per size,
    so start-up compiles a few codes, not dozens. Size 1 stays specialised (torch.compile
    specialises it anyway): one row, and plain decoding's one token, keep their static kernels.
    Marks are read when code is traced, so under CUDA graphs they matter at capture only."""
    if size > 1:
        for t, *dims in marks:
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(t, dim)


def span_arg(span: int, device: torch.device) -> Tensor:
    """`span` as the size of an empty [span, 0] tensor marked dynamic: a compiled function that
    reads its span from this argument's shape (`compile_static` specialises plain ints) runs one
    code for every span bucket instead of compiling one per span at start-up; its kernels take
    the span at run time (under CUDA graphs, at capture)."""
    carrier = torch.empty(span, 0, device=device)
    torch._dynamo.maybe_mark_dynamic(carrier, 0)
    return carrier
