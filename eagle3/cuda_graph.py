"""CUDA graph capture, one rule for the data stage's batched decoder (actors/batch_decode.py)
and the serving engine's target runner and drafter (serve/engine/)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch


def capture_graph(
    fn: Callable[[], Any], pool: Any = None, warmups: int = 2, device: Any = None
) -> tuple[Any, Any]:
    """(graph, outputs): `fn` run `warmups` times on a side stream (compiled, kernels chosen,
    workspaces made), then captured, in the memory `pool` where one is given. The cyclic
    collector is off meanwhile: torch no longer collects before a capture (`force_cudagraph_gc`),
    and a collection set off inside one could destroy graphs held in dead cycles (a replaced
    drafter's), which invalidates the capture ("operation not permitted when stream is
    capturing", an H100's engine gpu tests, 2026-12-07)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, collecting = torch.cuda.CUDAGraph(), gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs
