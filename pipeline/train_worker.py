"""The train stage's worker loop: one Ray Train worker builds the drafter, resumes, trains,
evaluates, checkpoints and exports (rank 0). `pipeline/train.py` is the stage driver that checks
the inputs, fixes the starting point and runs the `TorchTrainer` over `train_worker`.

Workers read their share of the shards, pack, train (DDP; FSDP2 on GPUs when asked), log one line
per step, evaluate on held-out samples at each epoch end, checkpoint every `checkpoint_every` steps
through `ray.train.report`, and resume from `ray.train.get_checkpoint()` after a worker failure
(FailureConfig) or a driver restart (same RunConfig name + storage_path).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.files import atomic_write
from eagle3.cpu import allocator
from eagle3.train_step import (
    STATE_FILE,
    Anchor,
    ShardSet,
    SoftTargets,
    eval_metrics,
    eval_step,
    format_line,
    load_training_state,
    make_optimizer,
    make_scheduler,
    pack,
    parallelize,
    rank_order,
    save_training_state,
    scratch_drafter,
    set_threads,
    split_eval,
    step_metrics,
    steps_per_epoch,
    train_step,
)
from pipeline.best import Best, Gain, gate_line, gate_record, write_drafter_dir
from pipeline.best import allreduce as _allreduce
from pipeline.config import (
    TrainConfig,
)
from pipeline.continued import load_continued, write_last
from pipeline.time_box import (
    PROBE_STEPS,
    Phases,
    boxed_total,
    fix_total,
    stop_early,
    warm_s,
)

log = logging.getLogger("pipeline.train")


@dataclass(frozen=True)
class TrainJob:
    """What the driver hands every worker: paths, configs as dicts, numbers (JSON-safe)."""

    out_dir: str
    shards: tuple[tuple[str, str], ...]  # (path, sha256)
    drafter: dict[str, Any]  # Eagle3Config fields
    init: str  # "scratch" (init/vocab_map.safetensors) or "drafter" (init/drafter/)
    target: dict[str, Any]  # TargetConfig
    train: dict[str, Any]  # TrainConfig
    sim_steps: int  # draft steps the served chain uses (sim_accept_len)
    crash_at_step: int | None = None  # resume drill: the last worker exits once at this step
    online: bool = False  # ids-only shards: the worker computes the states (online_states.py)
    # the gate set's shards (path, sha256): the eval data when given, else a hold-out of `shards`
    eval_shards: tuple[tuple[str, str], ...] = ()
    continue_from: str | None = None  # init/continue/: trained from after step 0 (continued.py)


def _say(line: str) -> None:
    """One log line from a worker. Not print(): Ray Train V2 patches print in workers and, when
    stdout is redirected (it is in Ray workers), emits every line twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Worker


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: build, resume, train, evaluate, checkpoint, export (rank 0)."""
    import ray.train

    from eagle3.target_weights import load_target_tensors

    phases = Phases()
    job = TrainJob(**config["job"])
    tc = TrainConfig(**job.train)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    t = job.target
    # embed, lm_head and norm only: the target itself is never loaded here
    tensors = load_target_tensors(t["model"], t["revision"], t["gguf_file"])
    module, drafter, autocast, dt = _build(job, tc, tensors, device)
    # the load in pieces: on one H100 it took 29 s of a 5-minute round's training (2026-12-06)
    phases.mark("load_drafter")  # the target's embed/head/norm and the drafter on the device
    states = None
    if job.online:  # the target beside the drafter: each batch's states from its ids
        from pipeline.online_states import OnlineStates

        states = OnlineStates(job.target, job.drafter["aux_layer_ids"], device, tc.tokens_per_batch)
        phases.mark("load_target")
    plan = Plan.make(job, tc, rank, world, states)
    boxed = boxed_total(Path(job.out_dir), device)  # fixed by an earlier attempt of this run
    if boxed:
        plan.total = min(plan.total, boxed)
    opt = make_optimizer(module, tc.lr, tc.weight_decay)
    sched = make_scheduler(opt, plan.total, tc.warmup_ratio)
    # Before the resume: the anchor holds the weights the round was given, not a checkpoint's.
    anchor = Anchor(module, tc.anchor) if tc.anchor and job.init == "drafter" else None
    step = _resume(module, opt, sched)
    # After the resume: soft labels use the vocab map the checkpoint restored.
    soft = SoftTargets(
        tensors.pop("lm_head"), drafter.d2t, drafter.t2d, dt or torch.float32, device
    )
    del tensors
    mlog = MetricsLog(
        Path(job.out_dir), rank == 0, step, tc.ttt_length, job.sim_steps, plan.total, world
    )
    if rank == 0:
        _say(plan.describe(tc, world, step, device, dt))
    phases.mark("load")  # the data plan, the optimizer, a checkpoint to resume from

    best = Best(Path(job.out_dir), rank == 0, device, len(plan.eval_bins), tc.gate_z)
    stale = 0  # evaluations since the last new best (a resumed attempt starts counting afresh)
    eval_s = 0.0  # what one evaluation takes: the time box holds the evaluations too
    if job.init == "drafter" and step == 0 and plan.eval_refs:
        batch_s: list[float] = []
        # The drafter given is the first candidate: a round exports it unchanged unless a
        # trained state beats it on the same held-out batches by the gate's margin.
        sums = _evaluate(module, plan, soft, tc, autocast, device, batch_s)
        m = mlog.eval(0, 0, sums, None)
        best.offer(0, m["sim_accept_len"], mlog.batch_sims(sums), None, module, drafter)
        eval_s = warm_s(batch_s) * len(batch_s)
        if rank == 0:
            _say(f"[train] step 0 (the drafter given): sim_accept {m['sim_accept_len']:.3f} "
                 f"over {len(plan.eval_bins)} eval batches")  # fmt: skip
    if job.continue_from and step == 0:  # the start is judged; training goes on from here
        load_continued(module, Path(job.continue_from))
    phases.mark("step0_eval")
    # After the step-0 evaluation: the time box's probe times training steps only.
    start, first = time.perf_counter(), step
    step_s: list[float] = []  # wall time of each step since `first`: load, step, metrics
    ckpt_s: list[float] = []  # wall time of each checkpoint the probe made
    while step < plan.total:
        if tc.max_seconds and not boxed and step - first == PROBE_STEPS:
            spent = time.perf_counter() - start
            box = fix_total(plan.total, step, step_s, spent, eval_s, max(ckpt_s, default=0.0),
                            tc, device, Path(job.out_dir))  # fmt: skip
            boxed = plan.total = box["total"]
            if rank == 0:
                _say(f"[train] time box {tc.max_seconds:.0f}s at {box['s_per_step']:.2f}s/step, "
                     f"{box['s_per_evaluation']:.1f}s/evaluation and "
                     f"{box['s_per_checkpoint']:.2f}s/checkpoint: {boxed} steps "
                     f"({boxed / plan.steps_per_epoch:.2f} epochs)")  # fmt: skip
            sched = _rescheduled(opt, sched, plan.total, tc.warmup_ratio)
        t_step = time.perf_counter()
        epoch, i = divmod(step, plan.steps_per_epoch)
        batch = plan.batch(i, epoch).to(device)
        t0 = time.perf_counter()
        res = train_step(
            module, batch, soft, opt, sched, tc.ttt_length, tc.grad_clip, autocast, anchor
        )
        sums = torch.tensor([res.loss, res.tokens, *res.correct, *res.counted], dtype=torch.float64)
        step += 1
        mlog.train(
            step,
            epoch,
            _allreduce(sums, device),
            sched.get_last_lr()[0],
            time.perf_counter() - t0,
            res.grad_norm,
            {}
            if anchor is None
            else {"anchor_loss": res.anchor_loss, "drift_rms": anchor.drift_rms()},
        )
        step_s.append(time.perf_counter() - t_step)
        if plan.eval_refs and _eval_due(step, i, plan, tc):
            sums = _evaluate(module, plan, soft, tc, autocast, device)
            sims = mlog.batch_sims(sums)
            gain = best.gain(sims)
            m = mlog.eval(step, epoch, sums, gain)
            won = best.offer(step, m["sim_accept_len"], sims, gain, module, drafter)
            stale = 0 if won else stale + 1
            if tc.patience and stale >= tc.patience and step < plan.total:
                plan.total = stop_early(step, Path(job.out_dir))
                if rank == 0:
                    _say(f"[train] early stop at step {step}: {stale} evaluations without a "
                         f"new best (best {best.score:.3f} at step {best.step})")  # fmt: skip
        probing = bool(tc.max_seconds) and not boxed
        probe_end = probing and step - first == PROBE_STEPS  # the box prices a checkpoint too
        if step % tc.checkpoint_every == 0 or step == plan.total or probe_end:
            t_ckpt = time.perf_counter()
            _checkpoint(module, opt, sched, step, mlog.last)
            if probing:
                ckpt_s.append(time.perf_counter() - t_ckpt)
        if job.crash_at_step == step and rank == world - 1:
            _crash_once(Path(job.out_dir), step)
    phases.mark("steps")
    _export(module, drafter, Path(job.out_dir), rank, mlog, plan, best, job, tc.continue_kept)
    phases.mark("export")
    phases.save(Path(job.out_dir))


@dataclass
class Plan:
    """Which samples this rank trains and evaluates on, in which batches: a pure function of
    (shards, eval shards, tokens_per_batch, eval_fraction, seed, epoch, rank, world), so a
    resumed run replays it. The eval data is the gate set when the job has one (every training
    sample is trained on), else `eval_fraction` of the shards held out."""

    data: ShardSet
    eval_data: ShardSet
    train_refs: list
    eval_refs: list
    bins: list[list[int]]
    eval_bins: list[list[int]]  # all ranks': rank r evaluates bins r, r + world, ...
    rank: int
    world: int
    seed: int
    budget: int
    steps_per_epoch: int
    total: int
    states: Any = None  # OnlineStates when the shards hold ids only, else None

    @classmethod
    def make(
        cls, job: TrainJob, tc: TrainConfig, rank: int, world: int, states: Any = None
    ) -> Plan:
        data = ShardSet([p for p, _ in job.shards], [s for _, s in job.shards])
        if job.eval_shards:
            eval_data = ShardSet([p for p, _ in job.eval_shards], [s for _, s in job.eval_shards])
            train_refs, eval_refs = list(data.samples), list(eval_data.samples)
        else:
            eval_data = data
            train_refs, eval_refs = split_eval(data.samples, tc.eval_fraction)
        if not train_refs:
            raise ValueError(
                f"{job.out_dir}: no training samples after the eval hold-out; lower train.eval_fraction"
            )
        budget = tc.tokens_per_batch
        bins = pack([r.length for r in train_refs], budget, tc.seed)
        eval_bins = pack([r.length for r in eval_refs], budget, tc.seed)
        spe = steps_per_epoch(len(bins), world)
        return cls(
            data,
            eval_data,
            train_refs,
            eval_refs,
            bins,
            eval_bins,
            rank,
            world,
            tc.seed,
            budget,
            spe,
            spe * tc.epochs,
            states,
        )

    @property
    def train_tokens(self) -> int:
        return sum(min(r.length, self.budget) for r in self.train_refs)

    def batch(self, i: int, epoch: int):
        order = rank_order(len(self.bins), self.rank, self.world, self.seed, epoch)
        return self._load(self.data, [self.train_refs[j] for j in self.bins[order[i]]])

    def eval_batches(self):
        """(index among all ranks' eval batches, batch) of this rank's share."""
        for i in range(self.rank, len(self.eval_bins), self.world):
            yield i, self._load(self.eval_data, [self.eval_refs[j] for j in self.eval_bins[i]])

    def _load(self, data: ShardSet, refs: list):
        batch = data.load(refs, self.budget)
        return batch if self.states is None else self.states.fill(batch)

    def describe(self, tc: TrainConfig, world: int, step: int, device, dt) -> str:
        long = sum(r.length > self.budget for r in self.train_refs)
        cut = (
            f"; {long} samples longer than tokens_per_batch={self.budget} are truncated"
            if long
            else ""
        )
        return (
            f"[train] {len(self.train_refs)} train / {len(self.eval_refs)} eval samples "
            f"({'the gate set' if self.eval_data is not self.data else 'held out'}, "
            f"{len(self.eval_bins)} batches), {len(self.bins)} batches, "
            f"{world} workers, {self.steps_per_epoch} steps/epoch x {tc.epochs} = {self.total} steps, start at {step}, "
            f"{device} {dt or torch.float32}, {allocator()}{cut}"
        )


def _eval_due(step: int, i: int, plan: Plan, tc: TrainConfig) -> bool:
    """Evaluate at each epoch's end, at the last step, and every `train.eval_every` steps."""
    every = tc.eval_every and step % tc.eval_every == 0
    return bool(i + 1 == plan.steps_per_epoch or step == plan.total or every)


def _rescheduled(opt, sched, total: int, warmup_ratio: float):
    """The LR schedule decaying over `total` steps, continuing where `sched` is."""
    new = make_scheduler(opt, total, warmup_ratio)
    new.load_state_dict(sched.state_dict())  # the step count; the lambda stays the new one
    return new


def _build(job: TrainJob, tc: TrainConfig, tensors: dict, device: torch.device):
    """The drafter at its starting point, wrapped for data parallelism (DDP, or FSDP2 on GPUs),
    the autocast dtype and the compute dtype."""
    from eagle3.checkpoint import load_drafter
    from eagle3.config import Eagle3Config
    from eagle3.model import drafter_from_state

    if device.type == "cpu":
        set_threads(int(tc.cpus_per_worker))
    out = Path(job.out_dir)
    cfg = Eagle3Config(**job.drafter)
    if job.init == "scratch":
        from safetensors.torch import load_file

        vm = load_file(str(out / "init" / "vocab_map.safetensors"))
        drafter = scratch_drafter(
            cfg,
            tensors["embed"],
            tensors["lm_head"],
            tensors["norm"],
            vm["d2t"],
            vm["t2d"],
            tc.seed,
        )
    else:
        dcfg, state = load_drafter(out / "init" / "drafter")
        drafter = drafter_from_state(dcfg, state, tensors["embed"].float())
    drafter = drafter.to(device)
    if tc.fsdp and device.type != "cuda":
        _say("[train] train.fsdp needs GPUs (FSDP2 over NCCL); falling back to DDP on CPU")
    # one row length for the whole run (the budget): each new length recompiles the fast path
    module, autocast, dt = parallelize(drafter, device, tc.precision, tc.fsdp, tc.tokens_per_batch)
    return module, drafter, autocast, dt


def _evaluate(
    module, plan: Plan, soft, tc: TrainConfig, autocast, device, batch_s: list | None = None
) -> torch.Tensor:
    """Eval sums per eval batch, [n_batches, 3k]: each rank fills its batches' rows, then the
    all-reduce gives every rank all of them (every rank calls, even with none). Kept per batch:
    the gate's margin is the spread of batch-wise differences (`paired_gain`). `batch_s`
    collects this rank's time per batch (the time box prices an evaluation by them)."""
    k = tc.ttt_length
    sums = torch.zeros(len(plan.eval_bins), 3 * k, dtype=torch.float64)
    module.eval()
    for i, b in plan.eval_batches():
        t0 = time.perf_counter()
        sums[i] = eval_step(module, b.to(device), soft, k, autocast)
        if batch_s is not None:
            batch_s.append(time.perf_counter() - t0)
    module.train()
    return _allreduce(sums, device)


def _resume(module, opt, sched) -> int:
    """Step to start from: the latest checkpoint's (worker failure or driver restart), else 0.

    A driver killed while Ray persisted a checkpoint can leave Ray's latest one without (or with
    a truncated) state file, and a disk can corrupt one; then the newest readable checkpoint
    beside it is used."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        step = load_newest_readable([Path(d)], module, opt, sched)
    if step is not None:
        return step
    latest = Path(ckpt.path)  # local storage: older checkpoints sit beside it
    older = sorted((p for p in latest.parent.glob("step-*") if p.name < latest.name), reverse=True)
    step = load_newest_readable(older, module, opt, sched)
    if step is not None:
        return step
    _say(f"[train] no readable checkpoint in {latest.parent}; starting from step 0")
    return 0


def load_newest_readable(dirs: list[Path], module, opt, sched) -> int | None:
    """Load the first checkpoint of `dirs` (newest first) that loads; its step, or None when
    none did. Any error counts as unreadable, not only a missing or truncated file: torch.load
    raised UnpicklingError on random bytes and ValueError on a bit-flipped file, and a retry
    that raised those again would fail every attempt of the run. Each one skipped is named.
    A load fails before anything is applied when the file is what is wrong (torch.load comes
    first); the next one loaded overwrites all of model, optimizer, scheduler and RNG."""
    for d in dirs:
        try:
            step = load_training_state(d, module, opt, sched)
        except Exception as err:  # noqa: BLE001 - see above: whatever the bytes make torch raise
            why = (str(err).strip().splitlines() or [""])[0][:200]
            _say(f"[train] checkpoint {d / STATE_FILE} is unreadable ({type(err).__name__}: "
                 f"{why}); trying an older one")  # fmt: skip
            continue
        _say(f"[train] resumed from checkpoint {d.name} at step {step}")
        return step
    return None


def _checkpoint(module, opt, sched, step: int, metrics: dict[str, float]) -> None:
    """Model + optimizer + scheduler + step + RNG, persisted by Ray Train (every rank reports)."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        written = save_training_state(Path(d), module, opt, sched, step)
        ckpt = ray.train.Checkpoint.from_directory(d) if written is not None else None
        ray.train.report(
            {"step": step, **metrics}, checkpoint=ckpt, checkpoint_dir_name=f"step-{step:07d}"
        )


def _crash_once(out: Path, step: int) -> None:
    """Resume drill: exit this worker process once. It first waits out the controller's poll
    (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s): a checkpoint reported less than one poll before a
    crash is still queued in the worker and dies with it (the run would resume from the one before)."""
    marker = out / f".crashed-at-{step}"
    if not marker.exists():
        marker.touch()
        time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0)))
        _say(f"[train] crash drill: worker exits at step {step}")
        os._exit(1)


def _export(
    module,
    drafter,
    out: Path,
    rank: int,
    mlog: MetricsLog,
    plan: Plan,
    best: Best,
    job: TrainJob,
    keep_last: bool,
) -> None:
    """Rank 0 writes the drafter (SGLang format) and result.json: the best one by held-out
    simulated acceptance when evaluated, else the last; the last state is gathered on every rank
    first (a collective under FSDP). When the best is the drafter the round was given (step 0),
    its files are copied as they came (`kept_start`), and with `keep_last` the last state goes
    to <out>/last/ for the next round to train on from (pipeline/continued.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    state = {k.removeprefix("drafter."): v for k, v in sd.items()}
    dest = out / "drafter"  # a re-run after completion rewrites the same weights
    evals = [m for m in mlog.read() if "eval_loss" in m]
    from_drafter = job.init == "drafter"
    kept = from_drafter and best.dir.is_dir() and best.step == 0
    gate = gate_record(evals, best, kept) if best.start is not None else {}
    if gate:
        _say(gate_line(gate))
    if kept:
        write_drafter_dir(dest, out / "init" / "given", state, drafter.cfg)
        after = max((m for m in evals if m["step"] > 0), key=lambda m: m["eval_sim_accept_len"], default=None)  # fmt: skip
        _say(
            f"[train] no trained state beat the start (sim_accept {best.score:.3f} at step 0"
            + (
                f"; best after training {after['eval_sim_accept_len']:.3f} at step {after['step']}"
                if after
                else ""
            )  # fmt: skip
            + "): exporting the starting drafter unchanged"
        )
    else:
        write_drafter_dir(dest, best.dir if best.dir.is_dir() else None, state, drafter.cfg)
    train_lines = [m for m in mlog.read() if "loss" in m]
    secs = sum(m["step_s"] for m in train_lines)
    toks = sum(m["tokens"] for m in train_lines)
    chosen = [m for m in evals if m["step"] == best.step] or evals
    start = [m for m in evals if m["step"] == 0 and from_drafter]
    rec = {
        "drafter_dir": str(dest),
        "kept_start": kept,
        "start_eval_metrics": {
            k.removeprefix("eval_"): v
            for k, v in (start[-1] if start else {}).items()
            if k.startswith("eval_")
        },
        "train_tokens": int(plan.train_tokens),
        "steps": plan.total,
        "tok_per_s": toks / secs if secs else 0.0,
        "final_metrics": {
            k: v
            for k, v in (train_lines[-1] if train_lines else {}).items()
            if k not in ("step", "epoch")
        },
        "eval_metrics": {
            k.removeprefix("eval_"): v
            for k, v in (chosen[-1] if chosen else {}).items()
            if k.startswith("eval_")
        },
        "best_step": best.step if best.dir.is_dir() else plan.total,
        "last_eval_metrics": {
            k.removeprefix("eval_"): v
            for k, v in (evals[-1] if evals else {}).items()
            if k.startswith("eval_")
        },
        "metrics_file": str(mlog.path),
        "resumed_from": [e["start_step"] for e in mlog.events() if e["start_step"] > 0],
        "gate": gate,
        "last_dir": write_last(out, state, drafter.cfg) if kept and keep_last else None,
        "continued_from": job.continue_from,
    }
    atomic_write(out / "result.json", json.dumps(rec, indent=1) + "\n")


RESUME = "resume_from"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of <out>/metrics.jsonl as the last attempt left them: at each resume marker
    the lines after its step are dropped (that attempt redid them); torn lines are skipped."""
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if not isinstance(m, dict):
            continue
        if RESUME in m:
            out = [x for x in out if x["step"] <= m[RESUME]]
        elif "step" in m:
            out.append(m)
    return out


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class MetricsLog:
    """The one metrics seam of the workers: rank 0 prints a dense line per step and appends the
    same numbers to <out>/metrics.jsonl (the driver logs them to MLflow under train/)."""

    def __init__(
        self,
        out: Path,
        enabled: bool,
        start_step: int,
        k: int,
        sim_steps: int,
        total: int,
        world: int,
    ):
        self.path, self.enabled, self.last = out / "metrics.jsonl", enabled, {}
        self.k, self.sim_steps, self.total, self.world = k, sim_steps, total, world
        if not enabled:
            return
        # Appended, never rewritten: a resume marker tells readers to forget the lines after
        # start_step (the steps this attempt redoes), so a crash here cannot lose earlier ones.
        if self.path.exists() or start_step:
            with self.path.open("a") as f:  # only an earlier attempt's crash can tear a line
                if f.tell() and not _ends_with_newline(self.path):
                    f.write("\n")  # keep the torn line apart: readers skip it
            self._write({RESUME: start_step})
        with (out / "events.jsonl").open("a") as f:
            rec = {"start_step": start_step, "time": time.time(), "allocator": allocator()}
            f.write(json.dumps(rec) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def events(self) -> list[dict[str, Any]]:
        p = self.path.parent / "events.jsonl"
        return (
            [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
        )

    def _write(self, rec: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def train(
        self,
        step: int,
        epoch: int,
        sums: torch.Tensor,
        lr: float,
        secs: float,
        grad_norm: float,
        anchor: dict[str, float] | None = None,
    ) -> None:
        """sums = all-reduced [loss, tokens, correct_0..k-1, counted_0..k-1]; `anchor`: rank 0's
        anchor term and drift from the start (DDP keeps the ranks' weights equal)."""
        k = self.k
        loss, tokens = float(sums[0]) / self.world, int(sums[1])
        m = step_metrics(
            loss, sums[2 : 2 + k].tolist(), sums[2 + k :].tolist(), lr, tokens, secs, self.sim_steps
        )
        m.update(grad_norm=grad_norm, tokens=tokens, step_s=secs, **(anchor or {}))
        self.last = m
        if self.enabled:
            pull = (
                f" anchor {anchor['anchor_loss']:.2e} drift {anchor['drift_rms']:.2e}"
                if anchor
                else ""
            )
            _say(format_line(step, self.total, m, f" gnorm {grad_norm:.2f}{pull}"))
            self._write({"step": step, "epoch": epoch, **m})

    def batch_sims(self, sums: torch.Tensor) -> list[float]:
        """Each eval batch's simulated acceptance, from `_evaluate`'s [n_batches, 3k] sums."""
        return [eval_metrics(row, self.k, self.sim_steps)["sim_accept_len"] for row in sums]

    def eval(
        self, step: int, epoch: int, sums: torch.Tensor, gain: Gain | None
    ) -> dict[str, float]:
        """One evaluation from its per-batch sums; `gain`: its paired gain over the start,
        logged as `gain` and `gain_se` (eval_ in metrics.jsonl)."""
        m = eval_metrics(sums.sum(0), self.k, self.sim_steps)
        if gain is not None:  # an infinite SE (one batch) is left out: JSON and MLflow lack it
            m.update(gain=gain.mean, **({"gain_se": gain.se} if math.isfinite(gain.se) else {}))
        if self.enabled:
            accs = " ".join(f"{m[f'acc_{i}']:.3f}" for i in range(self.k))
            vs = f" gain {gain.mean:+.4f} se {gain.se:.4f}" if gain is not None else ""
            _say(
                f"[eval] epoch {epoch} step {step} loss {m['loss']:.4f} acc [{accs}] sim_accept {m['sim_accept_len']:.3f}{vs}"
            )
            self._write({"step": step, "epoch": epoch, **{f"eval_{n}": v for n, v in m.items()}})
        return m
