"""The train stage: fine-tune the EAGLE-3 drafter with time-test training on captured shards,
as a Ray Train (V2) `TorchTrainer`, and export it in SGLang's format.

    python -m pipeline.train --config configs/smollm2-cpu.yaml --data RUN/data/round-000 --out RUN/train/round-000

Driver (`run_train`): checks every input before a worker starts (manifests and shards, target
identity, aux layer ids, vocab sizes, at least one sample), fixes the drafter's starting point
under `<out>/init/` (a vocab map built from loss-token frequencies for `scratch`, or a local copy
of the existing drafter whose d2t/t2d are kept bit for bit), runs the trainer, and returns a
`TrainResult` of paths and numbers. MLflow is not touched here: the loop logs `metrics.jsonl`.

Workers (`train_worker`): read their share of the shards, pack, train (DDP; FSDP2 on GPUs when
asked), log one line per step, evaluate on held-out samples at each epoch end, checkpoint every
`checkpoint_every` steps through `ray.train.report`, and resume from `ray.train.get_checkpoint()`
after a worker failure (FailureConfig) or a driver restart (same RunConfig name + storage_path).

Output folder:
    <out>/init/           vocab_map.safetensors (scratch) or drafter/ (existing drafter, as loaded)
    <out>/metrics.jsonl   one JSON line per step ({"step", loss, acc_i, lr, tok_per_s, ...}) and per
                          eval ({"step", eval_loss, eval_acc_i, ...}); rewritten past the resumed step
    <out>/events.jsonl    one line per worker-group start: {"start_step": ..} (resumes show here)
    <out>/ray/<name>/     Ray Train storage: checkpoints (model, optimizer, scheduler, step, RNG)
    <out>/drafter/        the exported drafter (config.json + model.safetensors, SGLang format)
    <out>/result.json     what TrainResult holds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.train_step import (
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
    token_counts,
    train_step,
)
from pipeline.config import (
    Config,
    DrafterConfig,
    TargetConfig,
    TrainConfig,
    dump_config,
    load_config,
)

log = logging.getLogger("pipeline.train")


@dataclass(frozen=True)
class TrainResult:
    drafter_dir: str  # <out>/drafter, SGLang format
    train_tokens: int  # tokens in the training split (one epoch)
    steps: int  # optimizer steps
    tok_per_s: float  # training tokens per second over all steps (all workers)
    final_metrics: dict[
        str, float
    ]  # last step's metrics (loss, acc_i, lr, tok_per_s, sim_accept_len)
    eval_metrics: dict[
        str, float
    ]  # last evaluation (loss, acc_i, sim_accept_len) or {} without eval data
    metrics_file: str  # <out>/metrics.jsonl
    resumed_from: tuple[
        int, ...
    ] = ()  # steps the run restarted from (worker failures, driver restarts)


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


def _say(line: str) -> None:
    """One log line from a worker. Not print(): Ray Train V2 patches print in workers and, when
    stdout is redirected (it is in Ray workers), emits every line twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class TrainInputError(ValueError):
    """Inputs the train stage cannot use; the message lists every problem and its fix."""


# ----------------------------------------------------------------------------------------------
# Driver


def run_train(
    cfg: Config,
    data_dirs: Sequence[str | Path],
    out_dir: str | Path,
    init: str | None = None,
    run_name: str | None = None,
    storage_path: str | Path | None = None,
    crash_at_step: int | None = None,
) -> TrainResult:
    """Train a drafter on the shards of `data_dirs` into `out_dir`; Ray must be initialised.

    init: `scratch`, or a local folder / HF repo id of an existing drafter (default
    cfg.drafter.init). Calling again with the same out_dir (and run_name) resumes the run."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    done = out / "result.json"
    if done.exists() and Path(json.loads(done.read_text())["drafter_dir"]).is_dir():
        rec = json.loads(done.read_text())  # finished earlier: its checkpoints are pruned
        print(f"[train] already finished: {rec['drafter_dir']}", flush=True)
        return TrainResult(**{**rec, "resumed_from": tuple(rec["resumed_from"])})
    job = prepare(
        cfg, [Path(d).resolve() for d in data_dirs], out, init or cfg.drafter.init, crash_at_step
    )
    (out / "train_config.yaml").write_text(dump_config(cfg))
    tc = cfg.train
    resources = {"CPU": tc.cpus_per_worker}  # use_gpu adds one GPU per worker
    from pipeline.rendezvous import LoopbackTorchConfig

    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"job": asdict(job)},
        torch_config=LoopbackTorchConfig(),  # rendezvous on 127.0.0.1 when Ray is on loopback
        scaling_config=ScalingConfig(
            num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=run_name or f"train-{out.name}",
            storage_path=str(Path(storage_path or out / "ray").resolve()),
            failure_config=FailureConfig(max_failures=tc.max_failures),
            # Keep every checkpoint while the run lives: with num_to_keep, a driver killed between
            # Ray deleting an old checkpoint and persisting that fact leaves a snapshot naming a
            # missing folder, and the resumed run then fails. Pruned below once fit() returns.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )
    t0 = time.perf_counter()
    result = trainer.fit()  # raises TrainingFailedError once max_failures is spent
    _prune_checkpoints(result)
    rec = json.loads((out / "result.json").read_text())
    print(
        f"[train] done in {time.perf_counter() - t0:.0f}s: {rec['steps']} steps, {rec['tok_per_s']:.0f} tok/s, drafter {rec['drafter_dir']}",
        flush=True,
    )
    return TrainResult(**{**rec, "resumed_from": tuple(rec["resumed_from"])})


def _prune_checkpoints(result) -> None:
    """Delete all but the latest checkpoint of a finished run (the exported drafter is what
    the next stage reads; the latest checkpoint is what a re-run would resume from)."""
    latest = result.checkpoint.path if result.checkpoint else None
    for ckpt, _ in result.best_checkpoints or []:
        if ckpt.path != latest:
            shutil.rmtree(ckpt.path, ignore_errors=True)


def prepare(
    cfg: Config, data_dirs: list[Path], out: Path, init: str, crash_at_step: int | None = None
) -> TrainJob:
    """Every check that needs no training, then the drafter's starting point under <out>/init.
    Raises TrainInputError listing all problems (or ShardError for damaged shards)."""
    from actors.shards import verify_manifest
    from eagle3.target_weights import read_target_info

    if not data_dirs:
        raise TrainInputError("no data dirs; pass --data DIR (a folder holding manifest.json)")
    manifests = [verify_manifest(d) for d in data_dirs]  # ShardError names bad shards
    tcfg = cfg.target
    info = read_target_info(tcfg.model, tcfg.revision, tcfg.gguf_file)
    problems = [p for m in manifests for p in _target_problems(m, tcfg, info)]
    ids = {tuple(m.aux_layer_ids) for m in manifests}
    if len(ids) > 1:
        problems.append(
            f"data dirs were captured at different aux layer ids {sorted(ids)}; train on data of one capture setting"
        )
    if sum(m.num_samples for m in manifests) == 0 or sum(m.num_loss_tokens for m in manifests) == 0:
        problems.append(
            f"{[str(d) for d in data_dirs]}: no samples with loss tokens; rerun the generate stage"
        )
    if problems:
        raise TrainInputError("cannot train:\n  " + "\n  ".join(problems))
    aux_ids = list(next(iter(ids)))
    shards = tuple(
        (str(p), s.sha256)
        for m in manifests
        for p, s in zip(m.shard_paths(), m.shards, strict=True)
    )
    init_dir = out / "init"
    if init == "scratch":
        drafter = _scratch_config(cfg.drafter, info, aux_ids)
        _write_vocab_map([p for p, _ in shards], drafter, init_dir)
        kind = "scratch"
    else:
        drafter = _copy_existing(init, info, aux_ids, init_dir / "drafter")
        kind = "drafter"
    sim = min(cfg.serve.steps, cfg.train.ttt_length)
    return TrainJob(
        str(out),
        shards,
        drafter,
        kind,
        tcfg.model_dump(),
        cfg.train.model_dump(),
        sim,
        crash_at_step,
    )


def _target_problems(m, tcfg: TargetConfig, info) -> list[str]:
    t, src = m.target, f"{m.root}/manifest.json"
    want = {
        "model": tcfg.model,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "num_layers": info.num_layers,
    }
    out = [
        f"{src}: target.{k} is {t.get(k)!r} but the configured target has {v!r}; these shards come from another "
        "target: regenerate them with this target or point target.model at the one that made them"
        for k, v in want.items()
        if t.get(k) != v
    ]
    if tcfg.revision and t.get("revision") and t["revision"] != tcfg.revision:
        out.append(
            f"{src}: target.revision {t['revision']!r} != target.revision {tcfg.revision!r}; regenerate the data"
        )
    return out


def _scratch_config(d: DrafterConfig, info, aux_ids: list[int]) -> dict[str, Any]:
    from eagle3.config import Eagle3Config

    hidden = d.hidden_size or info.hidden_size
    if hidden != info.hidden_size:
        raise TrainInputError(
            f"drafter.hidden_size={hidden} but the target's hidden size is {info.hidden_size}; an EAGLE-3 drafter "
            "reads the target's own embedding (SGLang shares it), so leave drafter.hidden_size unset"
        )
    heads = d.num_attention_heads or info.num_attention_heads
    head_dim = d.head_dim or (
        info.head_dim
        if hidden == info.hidden_size and heads == info.num_attention_heads
        else hidden // heads
    )
    vd = d.draft_vocab_size
    if vd > info.vocab_size:
        log.warning(
            "drafter.draft_vocab_size %d > target vocab %d: capped to %d",
            vd,
            info.vocab_size,
            info.vocab_size,
        )
        vd = info.vocab_size
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=d.intermediate_size or info.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=d.num_key_value_heads or info.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=info.vocab_size,
        draft_vocab_size=vd,
        target_hidden_size=info.hidden_size,
        aux_layer_ids=aux_ids,
        rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta,
        rope_scaling=info.rope_scaling,
        max_position_embeddings=info.max_position_embeddings or 2048,
    ).as_dict()


def _write_vocab_map(paths: list[str], drafter: dict[str, Any], init_dir: Path) -> None:
    """Top-N loss-token frequencies over all shards -> d2t/t2d (eagle3.vocab.build_vocab_map)."""
    from safetensors.torch import load_file, save_file

    from eagle3.vocab import build_vocab_map, coverage

    f = init_dir / "vocab_map.safetensors"
    counts = token_counts(paths, drafter["vocab_size"])
    if f.exists():  # a restarted run keeps the map its checkpoints were trained with
        t2d = load_file(str(f))["t2d"]
        if int(t2d.sum()) != drafter["draft_vocab_size"]:
            raise TrainInputError(
                f"{f}: holds a {int(t2d.sum())}-token vocab map but drafter.draft_vocab_size gives "
                f"{drafter['draft_vocab_size']}; use a new --out folder for a different drafter"
            )
        print(f"[train] vocab map: kept {f} (restarted run)", flush=True)
    else:
        d2t, t2d = build_vocab_map(counts, drafter["draft_vocab_size"])
        init_dir.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": d2t, "t2d": t2d}, str(f))
    print(
        f"[train] vocab map: {drafter['draft_vocab_size']} draft tokens cover {coverage(counts, t2d):.1%} of "
        f"{int(counts.sum())} loss tokens",
        flush=True,
    )


def _copy_existing(init: str, info, aux_ids: list[int], dest: Path) -> dict[str, Any]:
    """Load an existing drafter (folder or repo id), check it against the target and the data,
    and keep a local copy (fp32, d2t/t2d untouched) that every worker loads."""
    import shutil

    from eagle3.checkpoint import load_drafter, save_drafter

    if init == "previous":
        raise TrainInputError(
            "drafter.init=previous: no previous round to start from here; pass the previous round's "
            "drafter folder (…/train/round-NNN/drafter) or use scratch"
        )
    dcfg, state = load_drafter(init)
    problems = []
    if dcfg.vocab_size != info.vocab_size:
        problems.append(
            f"{init}: vocab_size {dcfg.vocab_size} != target vocab {info.vocab_size}; it was trained for another target"
        )
    if dcfg.draft_vocab_size > info.vocab_size:
        problems.append(
            f"{init}: draft_vocab_size {dcfg.draft_vocab_size} > target vocab {info.vocab_size}; not a drafter of this target"
        )
    if dcfg.hidden_size != info.hidden_size:
        problems.append(
            f"{init}: hidden_size {dcfg.hidden_size} != target hidden {info.hidden_size}; it cannot read this target's embedding"
        )
    if dcfg.target_hidden_size != info.hidden_size:
        problems.append(
            f"{init}: target_hidden_size {dcfg.target_hidden_size} != target hidden {info.hidden_size}; its fc reads another target"
        )
    if list(dcfg.aux_layer_ids) != aux_ids:
        problems.append(
            f"{init}: aux layer ids {list(dcfg.aux_layer_ids)} but the shards were captured at {aux_ids}; regenerate the "
            f"data with target.aux_layer_ids={list(dcfg.aux_layer_ids)} or start from scratch"
        )
    if problems:
        raise TrainInputError("cannot fine-tune:\n  " + "\n  ".join(problems))
    if dest.exists():
        shutil.rmtree(dest)
    save_drafter(state, dcfg, dest, dtype=torch.float32)
    return dcfg.as_dict()


# ----------------------------------------------------------------------------------------------
# Worker


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: build, resume, train, evaluate, checkpoint, export (rank 0)."""
    import ray.train

    from eagle3.target_weights import load_target_tensors

    job = TrainJob(**config["job"])
    tc = TrainConfig(**job.train)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    t = job.target
    # embed, lm_head and norm only: the target itself is never loaded here
    tensors = load_target_tensors(t["model"], t["revision"], t["gguf_file"])
    module, drafter, autocast, dt = _build(job, tc, tensors, device)
    plan = Plan.make(job, tc, rank, world)
    opt = make_optimizer(module, tc.lr, tc.weight_decay)
    sched = make_scheduler(opt, plan.total, tc.warmup_ratio)
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

    while step < plan.total:
        epoch, i = divmod(step, plan.steps_per_epoch)
        batch = plan.batch(i, epoch).to(device)
        t0 = time.perf_counter()
        res = train_step(module, batch, soft, opt, sched, tc.ttt_length, tc.grad_clip, autocast)
        sums = torch.tensor([res.loss, res.tokens, *res.correct, *res.counted], dtype=torch.float64)
        step += 1
        mlog.train(
            step,
            epoch,
            _allreduce(sums, device),
            sched.get_last_lr()[0],
            time.perf_counter() - t0,
            res.grad_norm,
        )
        if i + 1 == plan.steps_per_epoch and plan.eval_refs:
            mlog.eval(step, epoch, _evaluate(module, plan, soft, tc, autocast, device))
        if step % tc.checkpoint_every == 0 or step == plan.total:
            _checkpoint(module, opt, sched, step, mlog.last)
        if job.crash_at_step == step and rank == world - 1:
            _crash_once(Path(job.out_dir), step)
    _export(module, drafter, Path(job.out_dir), rank, mlog, plan.train_tokens, plan.total)


@dataclass
class Plan:
    """Which samples this rank trains and evaluates on, in which batches: a pure function of
    (shards, tokens_per_batch, eval_fraction, seed, epoch, rank, world), so a resumed run replays it."""

    data: ShardSet
    train_refs: list
    eval_refs: list
    bins: list[list[int]]
    eval_bins: list[list[int]]  # this rank's
    rank: int
    world: int
    seed: int
    budget: int
    steps_per_epoch: int
    total: int

    @classmethod
    def make(cls, job: TrainJob, tc: TrainConfig, rank: int, world: int) -> Plan:
        data = ShardSet([p for p, _ in job.shards], [s for _, s in job.shards])
        train_refs, eval_refs = split_eval(data.samples, tc.eval_fraction)
        if not train_refs:
            raise ValueError(
                f"{job.out_dir}: no training samples after the eval hold-out; lower train.eval_fraction"
            )
        budget = tc.tokens_per_batch
        bins = pack([r.length for r in train_refs], budget, tc.seed)
        eval_bins = pack([r.length for r in eval_refs], budget, tc.seed)[rank::world]
        spe = steps_per_epoch(len(bins), world)
        return cls(
            data,
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
        )

    @property
    def train_tokens(self) -> int:
        return sum(min(r.length, self.budget) for r in self.train_refs)

    def batch(self, i: int, epoch: int):
        order = rank_order(len(self.bins), self.rank, self.world, self.seed, epoch)
        return self.data.load([self.train_refs[j] for j in self.bins[order[i]]], self.budget)

    def eval_batches(self):
        for b in self.eval_bins:
            yield self.data.load([self.eval_refs[j] for j in b], self.budget)

    def describe(self, tc: TrainConfig, world: int, step: int, device, dt) -> str:
        long = sum(r.length > self.budget for r in self.train_refs)
        cut = (
            f"; {long} samples longer than tokens_per_batch={self.budget} are truncated"
            if long
            else ""
        )
        return (
            f"[train] {len(self.train_refs)} train / {len(self.eval_refs)} eval samples, {len(self.bins)} batches, "
            f"{world} workers, {self.steps_per_epoch} steps/epoch x {tc.epochs} = {self.total} steps, start at {step}, "
            f"{device} {dt or torch.float32}{cut}"
        )


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
    module, autocast, dt = parallelize(drafter, device, tc.precision, tc.fsdp)
    return module, drafter, autocast, dt


def _allreduce(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if torch.distributed.is_initialized():
        t = t.to(device)
        torch.distributed.all_reduce(t)
    return t.cpu()


def _evaluate(module, plan: Plan, soft, tc: TrainConfig, autocast, device) -> torch.Tensor:
    """Eval sums over this rank's eval batches, all-reduced (every rank calls, even with none)."""
    k = tc.ttt_length
    sums = torch.zeros(3 * k, dtype=torch.float64)
    module.eval()
    for b in plan.eval_batches():
        sums += eval_step(module, b.to(device), soft, k, autocast)
    module.train()
    return _allreduce(sums, device)


def _resume(module, opt, sched) -> int:
    """Step to start from: the latest checkpoint's (worker failure or driver restart), else 0.

    A driver killed while Ray persisted a checkpoint can leave Ray's latest one without (or with
    a truncated) state file; then the newest complete checkpoint beside it is used."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    bad = (FileNotFoundError, RuntimeError, EOFError)
    try:
        with ckpt.as_directory() as d:
            step = load_training_state(Path(d), module, opt, sched)
        _say(f"[train] resumed from checkpoint at step {step}")
        return step
    except bad as err:
        _say(f"[train] latest checkpoint is incomplete ({type(err).__name__}); trying older ones")
    latest = Path(ckpt.path)  # local storage: older checkpoints sit beside it
    for cand in sorted(latest.parent.glob("step-*"), reverse=True):
        if cand.name >= latest.name:
            continue
        try:
            step = load_training_state(cand, module, opt, sched)
        except bad:
            continue
        _say(f"[train] resumed from checkpoint {cand.name} at step {step}")
        return step
    _say("[train] no complete checkpoint found; starting from step 0")
    return 0


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
    module, drafter, out: Path, rank: int, mlog: MetricsLog, train_tokens: int, total: int
) -> None:
    """Rank 0 writes the drafter (SGLang format) and result.json; the state is gathered on every
    rank first (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from eagle3.checkpoint import save_drafter

    sd = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    state = {k.removeprefix("drafter."): v for k, v in sd.items()}
    dest = out / "drafter"
    if dest.exists():
        import shutil

        shutil.rmtree(dest)  # a re-run after completion rewrites the same weights
    save_drafter(state, drafter.cfg, dest)
    train_lines = [m for m in mlog.read() if "loss" in m]
    secs = sum(m["step_s"] for m in train_lines)
    toks = sum(m["tokens"] for m in train_lines)
    evals = [m for m in mlog.read() if "eval_loss" in m]
    rec = {
        "drafter_dir": str(dest),
        "train_tokens": int(train_tokens),
        "steps": total,
        "tok_per_s": toks / secs if secs else 0.0,
        "final_metrics": {
            k: v
            for k, v in (train_lines[-1] if train_lines else {}).items()
            if k not in ("step", "epoch")
        },
        "eval_metrics": {
            k.removeprefix("eval_"): v
            for k, v in (evals[-1] if evals else {}).items()
            if k.startswith("eval_")
        },
        "metrics_file": str(mlog.path),
        "resumed_from": [e["start_step"] for e in mlog.events() if e["start_step"] > 0],
    }
    (out / "result.json").write_text(json.dumps(rec, indent=1) + "\n")


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
        kept = [m for m in self.read() if m["step"] <= start_step]  # drop lines a failure will redo
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        with (out / "events.jsonl").open("a") as f:
            f.write(json.dumps({"start_step": start_step, "time": time.time()}) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def events(self) -> list[dict[str, Any]]:
        p = self.path.parent / "events.jsonl"
        return (
            [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
        )

    def _write(self, rec: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def train(
        self, step: int, epoch: int, sums: torch.Tensor, lr: float, secs: float, grad_norm: float
    ) -> None:
        """sums = all-reduced [loss, tokens, correct_0..k-1, counted_0..k-1]."""
        k = self.k
        loss, tokens = float(sums[0]) / self.world, int(sums[1])
        m = step_metrics(
            loss, sums[2 : 2 + k].tolist(), sums[2 + k :].tolist(), lr, tokens, secs, self.sim_steps
        )
        m.update(grad_norm=grad_norm, tokens=tokens, step_s=secs)
        self.last = m
        if self.enabled:
            _say(format_line(step, self.total, m, f" gnorm {grad_norm:.2f}"))
            self._write({"step": step, "epoch": epoch, **m})

    def eval(self, step: int, epoch: int, sums: torch.Tensor) -> None:
        m = eval_metrics(sums, self.k, self.sim_steps)
        if self.enabled:
            accs = " ".join(f"{m[f'acc_{i}']:.3f}" for i in range(self.k))
            _say(
                f"[eval] epoch {epoch} step {step} loss {m['loss']:.4f} acc [{accs}] sim_accept {m['sim_accept_len']:.2f}"
            )
            self._write({"step": step, "epoch": epoch, **{f"eval_{n}": v for n, v in m.items()}})


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> TrainResult:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.train",
        description="Train an EAGLE-3 drafter on captured shards (Ray Train).",
    )
    ap.add_argument(
        "--config", required=True, help="YAML config (target:, drafter:, train: are used)"
    )
    ap.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="data dirs holding manifest.json (rounds accumulate)",
    )
    ap.add_argument(
        "--out", required=True, help="output folder (re-run with the same folder to resume)"
    )
    ap.add_argument(
        "--init",
        default=None,
        help="scratch, or an existing drafter folder / HF repo id (default drafter.init)",
    )
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=value", help="config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if os.environ.get("RAY_ADDRESS"):
            ray.init(runtime_env=cfg.runtime_env or None)
        else:  # a local Ray bound to loopback
            ray.init(
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                runtime_env=cfg.runtime_env or None,
            )
    res = run_train(cfg, args.data, args.out, init=args.init)
    _say(json.dumps(dataclasses.asdict(res)))
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main()
