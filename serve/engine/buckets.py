"""Row and span buckets shared by the static runner and the static drafter: the shapes their
CUDA graphs are captured at, so a batch that grows or shrinks, or a context that lengthens,
replays a few graphs instead of one per size."""

from __future__ import annotations

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
