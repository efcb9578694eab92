"""Requests that join a running batch between cycles (continuous batching) on the static runner:
their prompts are prefilled into the rows after the batch's own, whose caches stay, and they run
the next cycle with it. Greedy batches on the device paths (`device_cycles`,
`device_plain` in serve/engine/device.py) and sampled ones on the host cycles with the static drafter (a seeded request
draws from its own generator, as alone); on the eager runner a request waits for the batch to
end (`SpecEngine.takes_joins`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from serve.engine.requests import Rows
from serve.engine.static import StaticTargetRunner
from serve.engine.static_draft import StaticEagleDraft

# Called between cycles with the number of free rows; returns (prompt ids, max_tokens) of the
# requests that join now, at most that many, each with the batch's sampling settings. Their
# request indices follow the batch's in the order returned (on_tokens and the results use them).
Joins = Callable[[int], list[tuple[list[int], int]]]


def admit(
    joins: Joins,
    rows: Rows,
    runner: StaticTargetRunner,
    drafter: StaticEagleDraft | None,
    x: Tensor,
    pos: Tensor,
    steps: int = 0,
) -> tuple[Tensor, Tensor, list[bool], list[int]]:
    """Ask `joins` for requests and start them in the running batch: the target's prefill of
    their prompts (one pass), their first token (`Rows.first_token`: greedy, or drawn from each
    request's own generator), the drafter's prompt extension. Returns
    the batch's (next token, its position) with the new rows after the old, which rows are
    finished already (a limit of one token, a stop token), and the new rows' positions."""
    free = runner.max_batch - len(rows.active)
    new = joins(free) if free > 0 else []
    if not new:
        return x, pos, [False] * len(rows.active), []
    if len(new) > free:
        raise ValueError(f"joins returned {len(new)} requests for {free} free rows")
    t = time.perf_counter()
    first = len(rows.active)
    for prompt, limit in new:
        rows.add(prompt, limit, steps)
    prompts = [p for p, _ in new]
    logits, aux, ids, valid = runner.prefill(prompts, aux=drafter is not None, join=True)
    reqs = rows.active[first:]
    x_new = rows.first_token(logits, reqs)
    if drafter is not None:
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        drafter.join(torch.cat([ids[:, 1:], x_new[:, None]], 1), aux, positions, valid)
    pos_new = valid.sum(1)
    ms = (time.perf_counter() - t) * 1000
    for req in reqs:
        rows.stats[req].prefill_ms += ms
    done = [False] * first + [rows.append(first + i, [int(v)]) for i, v in enumerate(x_new)]
    x = torch.cat([x, x_new.to(x.device)])
    return x, torch.cat([pos, pos_new.to(pos.device)]), done, pos_new.tolist()
