"""The training time box (`train.max_seconds`) and the early stop (`train.patience`): how many
steps a round's training takes, fixed once and kept in <out>/boxed_total.json so a resumed
attempt of the same run stops at the same step. Used by the workers (pipeline/train_worker.py);
every rank decides alike (the probe's times are max-reduced, the stop's eval sums all-reduced)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from actors.files import atomic_write
from pipeline.best import allreduce
from pipeline.config import TrainConfig

PROBE_STEPS = 8  # steps timed before a time-boxed run fixes its step count
BOXED = "boxed_total.json"
PHASES = "phases.json"


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True


def boxed_total(out: Path, device) -> int:
    """The step count an earlier attempt of this run fixed (0: none yet). Rank 0 reads it and
    every rank takes its value, so workers on other nodes agree without the file."""
    n = json.loads((out / BOXED).read_text())["total"] if _rank0() and (out / BOXED).exists() else 0
    return int(allreduce(torch.tensor([n], dtype=torch.float64), device)[0])


def warm_s(times: list[float]) -> float:
    """The time a step (or an evaluation batch) takes once warm: the median of those timed. A
    first step that compiles the fast path (46.5 s on an H100, against 0.07 s for the next)
    would otherwise price every step of the box: the off-policy GPU climb was cut to 22 of
    1,740 steps (2026-12-05)."""
    return statistics.median(times) if times else 0.0


def box_total(
    total: int,
    step: int,
    per_step: float,
    spent: float,
    eval_s: float,
    tc: TrainConfig,
    ckpt_s: float = 0.0,
) -> int:
    """The step count a `train.max_seconds` box holds (at most `total`, at least one more step):
    what is left after the `spent` seconds, less the last evaluation and the one done (each
    `eval_s`) and the last checkpoint (`ckpt_s`), at `per_step` seconds a step plus its share of
    the evaluations every `train.eval_every` steps (a gate set makes them cost steps on a CPU)
    and of the checkpoints every `train.checkpoint_every`. A checkpoint costs at least one poll
    of Ray Train's controller once they come faster than it polls (its report queue holds one):
    unpriced, a test's 8 s box at 0.03 s a step and a checkpoint every 4 trained for 100 s."""
    per_eval = eval_s / tc.eval_every if tc.eval_every else 0.0
    per_ckpt = ckpt_s / tc.checkpoint_every
    left = tc.max_seconds - spent - 2 * eval_s - ckpt_s
    per = per_step + per_eval + per_ckpt
    return max(step + 1, min(total, step + int(max(0.0, left) / per)))


def fix_total(
    total: int,
    step: int,
    step_s: list[float],
    spent: float,
    eval_s: float,
    ckpt_s: float,
    tc: TrainConfig,
    device,
    out: Path,
) -> dict:
    """The step count the box holds, from the slowest rank's warm step time (`warm_s` of the
    probe's steps) and the seconds spent so far (the cold first step's included), kept for a
    resumed attempt: the record, with the figures it was priced by. `eval_s` is step 0's
    evaluation at its warm batch time (0 when there was none); `ckpt_s` the probe's slowest
    checkpoint (its last step makes one)."""
    t = torch.tensor([warm_s(step_s), spent, eval_s, ckpt_s], dtype=torch.float64)
    if torch.distributed.is_initialized():
        t = t.to(device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    per_step, spent, eval_s, ckpt_s = t.cpu().tolist()
    total = box_total(total, step, per_step, spent, eval_s, tc, ckpt_s)
    rec = {"total": total, "s_per_step": per_step, "spent_s": spent, "s_per_checkpoint": ckpt_s,
           "s_per_evaluation": eval_s}  # fmt: skip
    if _rank0():
        atomic_write(out / BOXED, json.dumps(rec))
    return rec


def stop_early(step: int, out: Path) -> int:
    """`train.patience` ran out: this step becomes the last one, kept in BOXED like a time box so a
    resumed attempt stops here too."""
    if _rank0():
        atomic_write(out / BOXED, json.dumps({"total": step, "early_stop": True}))
    return step


class Phases:
    """Where a worker's seconds go, phase by phase (`mark` ends one), kept by rank 0 in
    <out>/phases.json with the wall clock it entered at: the driver's `[train] done` line puts
    them beside Ray Train's start (pipeline/train.py `phases_line`). On one H100 a round's
    training spent about 80 s around 35 s of steps, and the steps were all a box could price."""

    def __init__(self) -> None:
        self.entered, self.t, self.s = time.time(), time.perf_counter(), {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name], self.t = round(now - self.t, 2), now

    def save(self, out: Path) -> None:
        if _rank0():
            atomic_write(out / PHASES, json.dumps({"entered": self.entered, **self.s}))
