"""The static runner's prefill: the prompts through the runner's own step (`_core`), padded to a
length bucket and a row bucket and replayed as one CUDA graph per (rows, length) when the
prompts fit `PREFILL_CHUNK`; longer prompts in chunks, without a graph.

Why graphs: outside a graph every layer's kernels are dispatched from the host, one call at a
time. On an H100 (2026-12-08, SmolLM2-135M, bf16) that made an everyday prompt's prefill 40 ms,
the price of 40 decoded tokens, where its kernels need a few milliseconds: a graph replays them
with one launch. A padded entry writes cache slots past its row's length, which no query reads
before a forward overwrites them; a padding row repeats the first row (its ids, its cache row),
so it writes the same values to the same slots and its outputs are dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from eagle3.cuda_graph import capture_graph
from serve.engine.buckets import row_bucket, span_buckets

# `runner` below is a serve.engine.static.StaticTargetRunner, typed Any: that module imports this
# one (no import circles, tests/test_architecture.py).
StaticTargetRunner = Any

SMALLEST = 16  # the shortest length bucket: a prompt of 3 tokens runs as 16


@dataclass
class PrefillGraph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: Tensor  # [b, 2Q + 1 + Q*Q]: ids (the first Q columns change), positions, base 0, causal
    last: Tensor  # [b] each row's last prompt entry
    rows: Tensor  # [b] each row's cache row
    logits: Tensor  # [b, 1, V]
    aux: Tensor | None  # [b, Q, 3·Ht]


def length_buckets(runner: StaticTargetRunner) -> list[int]:
    """The lengths a padded prefill runs at: powers of two from SMALLEST up to the runner's
    `PREFILL_CHUNK` (or its capacity)."""
    return span_buckets(SMALLEST, min(runner.PREFILL_CHUNK, runner.capacity))


def fits(runner: StaticTargetRunner, length: int) -> bool:
    """Whether prompts of at most `length` tokens take the padded path (`padded`)."""
    return runner.padded_prefill and length <= length_buckets(runner)[-1]


def padded(
    runner: StaticTargetRunner, ids: Tensor, lens: Tensor, aux: bool, first: int
) -> tuple[Tensor, Tensor | None]:
    """The right-padded prompts [B, L] (on the device) in cache rows first..first+B-1, as one
    forward of b rows (`row_bucket`) x Q entries (the length bucket of L), in its graph where the
    runner has graphs. Returns (each row's last logits [B, V], aux states [B, L, 3·Ht] or None)."""
    (B, L), dev = ids.shape, runner.device
    Q = next(q for q in length_buckets(runner) if q >= L)
    b = row_bucket(B, runner.max_batch) if runner.bucket_rows else B
    pad = torch.zeros(b, Q, dtype=torch.long, device=dev)
    pad[:B, :L] = ids
    pad[B:] = pad[:1]  # padding rows repeat the first row, in its cache row
    last = torch.cat([lens - 1, (lens[:1] - 1).expand(b - B)]).to(dev)
    rows = torch.tensor([first + r for r in range(B)] + [first] * (b - B), device=dev)
    has_aux = bool(runner.aux_ids)  # one graph serves both: the states are dropped if unasked
    if runner.use_graphs:
        g = graph(runner, b, Q)
        g.inputs[:, :Q].copy_(pad)
        g.last.copy_(last)
        g.rows.copy_(rows)
        g.graph.replay()
        logits, states = g.logits, g.aux
    else:
        logits, states = runner._core(_packed(pad, 0), Q, Q, has_aux, rows, last)
    keep = states[:B, :L].clone() if aux and states is not None else None
    return logits[:B, 0].clone(), keep


def graph(runner: StaticTargetRunner, b: int, Q: int) -> PrefillGraph:
    """The prefill graph of b rows x Q entries, captured on first use (or by `capture`)."""
    key = ("prefill", b, Q)
    if key in runner._graphs:
        return runner._graphs[key]
    dev = runner.device
    inputs = _packed(torch.zeros(b, Q, dtype=torch.long, device=dev), 0)
    last = torch.full((b,), Q - 1, dtype=torch.long, device=dev)
    rows = torch.zeros(b, dtype=torch.long, device=dev)
    if runner._pool is None:
        runner._pool = torch.cuda.graph_pool_handle()
    has_aux = bool(runner.aux_ids)
    g, (logits, states) = capture_graph(
        lambda: runner._core(inputs, Q, Q, has_aux, rows, last), runner._pool
    )
    runner.captures += 1
    runner._graphs[key] = PrefillGraph(g, inputs, last, rows, logits, states)
    return runner._graphs[key]


def capture(runner: StaticTargetRunner, row_buckets: list[int]) -> int:
    """Capture the prefill graph of every row bucket and length bucket now (start-up); returns
    how many were new. Writes slots of row 0 that no request holds then."""
    n = 0
    for b in row_buckets:
        for Q in length_buckets(runner):
            n += ("prefill", b, Q) not in runner._graphs
            graph(runner, b, Q)
    return n


def chunked(
    runner: StaticTargetRunner, ids: Tensor, lens: Tensor, aux: bool, first: int
) -> tuple[Tensor, Tensor | None]:
    """The right-padded prompts [B, L] without a graph, in chunks of `PREFILL_CHUNK` entries,
    each causal over its entries and attending to the chunks before it, from slot 0 of cache
    rows first..first+B-1 (a padding column's entries go to slots past the row's length). Compiled
    (a GPU), every prompt length runs the code every verify width runs. Returns like `padded`."""
    (B, L), dev, C = ids.shape, runner.device, runner.PREFILL_CHUNK
    ends = [min(e, L) for e in range(C, L + C, C)]
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:  # no one-token chunk: its own code
        ends.pop(-2)
    rows = torch.arange(first, first + B, device=dev)
    logits, states, s = torch.empty(0), [], 0
    for e in ends:
        q = e - s
        packed = _packed(ids[:, s:e], s)
        last = (lens - 1).clamp(s, e - 1) - s  # each row's last prompt entry, if here
        # span >= 2: a one-token prompt attends like any other (a span of 1 would specialise)
        out, st = runner._core(packed, q, max(e, 2), aux, rows, last)
        mine = (lens - 1 >= s)[:, None]
        logits = out[:, 0] if s == 0 else torch.where(mine, out[:, 0], logits)
        states.append(st)
        s = e
    return logits, (torch.cat(states, 1) if aux and runner.aux_ids else None)


def _packed(ids: Tensor, start: int) -> Tensor:
    """`_core`'s inputs for prompt entries [b, q] at slots start..start+q-1 of their rows: ids,
    positions, base slot `start`, causal among themselves."""
    (b, q), dev = ids.shape, ids.device
    causal = torch.ones(q, q, dtype=torch.long, device=dev).tril().reshape(1, -1)
    pos = torch.arange(start, start + q, device=dev).expand(b, q)
    base = torch.full((b, 1), start, dtype=torch.long, device=dev)
    return torch.cat([ids, pos, base, causal.expand(b, q * q)], 1)
