"""A faster linear for the few-row matmuls of verify passes on CPU (fp32, MKL): the engine swaps
it into the target's and the drafter's linears."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

# ----------------------------------------------------------------------------------------------
# A faster linear for the few-row matmuls of verify passes

SMALL_ROWS = 8
_PAD_ROWS = {1: 2, 3: 4}  # the 2- and 4-column kernels beat the 1- and 3-column ones


def small_rows_linear(mod: torch.nn.Linear, x: Tensor) -> Tensor:
    """`mod(x)` computed as (W @ x^T)^T when x has at most SMALL_ROWS rows.

    On this CPU (MKL), F.linear of a single row is a GEMV that runs on one thread, and for 2-8
    rows it picks a GEMM kernel that costs ~2x a single-row step. W @ x^T with x^T column-major
    streams W once and uses every thread. With 1 and 3 rows padded to 2 and 4: decoding one token
    is 1.2x (1 thread) to 2x (2 threads) faster, and a 4-token verify costs about one decode
    step (benchmarks/reports/2026-12-01-cpu-drafting-overhead.md). Plain decoding uses the same path, so the baseline is not
    handicapped. Results differ from F.linear only in float rounding; `SpecEngine(fast_linear=False)`
    keeps HF's kernels exactly."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if not 1 <= rows <= SMALL_ROWS:
        return F.linear(x, mod.weight, mod.bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows in _PAD_ROWS:
        x2 = torch.cat([x2, x2.new_zeros(_PAD_ROWS[rows] - rows, x2.shape[1])])
    y = (mod.weight @ x2.contiguous().t()).t()[:rows].contiguous()
    if mod.bias is not None:
        y = y + mod.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def use_small_rows_linear(model: torch.nn.Module) -> int:
    """Route every plain nn.Linear of `model` through `small_rows_linear`; returns how many."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and not hasattr(mod, "_small_rows"):
            mod.forward = functools.partial(small_rows_linear, mod)
            mod._small_rows = True
            n += 1
    return n
