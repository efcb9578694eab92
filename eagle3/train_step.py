"""Everything one training worker does with tensors, without Ray: read samples from shards, pack
them into token budgets, compute the target's soft labels, run one TTT step, evaluate, checkpoint
the training state, and turn counts into metrics.

`pipeline/train.py` (Ray Train workers) and `benchmarks/train_step.py` (no Ray) both call this.

Packing: samples are laid back to back in a budget of `tokens_per_batch` tokens with their
boundaries in `cu_seqlens`, which the model's TTT attention respects, so no FLOP goes to padding.
Bins are made once per run (seeded); rank r owns bins r, r+W, ... and visits them in a seeded
order per epoch, so each worker reads its own share of the shards and the plan is a pure function
of (samples, budget, seed, epoch, rank, world) — which is what makes mid-epoch resume exact.

Soft labels: `target_p[t]` is the target's softmax over the draft vocab at position t (it predicts
token t+1). Only rows whose next token is a loss token are computed, and whether the target's
full-vocab argmax lies in the draft vocab (`inside`) is kept per sample after the first visit, so
later epochs only multiply by the Vd draft rows of the target lm_head instead of all V rows.
`valid[t]` (what the model masks the prediction of token t with) is `loss_mask[t] & inside[t-1]`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import Tensor, nn

from eagle3.config import Eagle3Config
from eagle3.cpu import cpu_has_native_bf16
from eagle3.model import Eagle3Drafter, TTTOutput, init_from_target
from eagle3.vocab import draft_ids, target_soft_labels

STEP_DECAY = 0.8  # TTT loss weight of step i is STEP_DECAY**i (EAGLE-3 / SpecForge)

# ----------------------------------------------------------------------------------------------
# Samples and shards


@dataclass(frozen=True)
class SampleRef:
    """One sample of one shard: tokens [start, start+length) of the shard's packed arrays."""

    shard: int  # index into ShardSet.paths
    start: int
    length: int  # tokens stored (truncation to the budget happens when packing)
    key: str  # stable id: "<shard sha256 prefix>:<index in shard>"


class ShardSet:
    """Lazy reader over shard files: lengths come from `offsets`, token rows are read per batch
    (safetensors slices), so a worker touches only the samples of its own batches."""

    def __init__(self, paths: Sequence[str | Path], shard_ids: Sequence[str]):
        self.paths = [str(p) for p in paths]
        self.samples: list[SampleRef] = []
        self._files: dict[int, object] = {}
        for i, (p, sid) in enumerate(zip(self.paths, shard_ids, strict=True)):
            with safe_open(p, framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
            for j, (a, b) in enumerate(zip(off[:-1], off[1:], strict=True)):
                if b > a:
                    self.samples.append(SampleRef(i, a, b - a, f"{sid[:16]}:{j}"))

    def _open(self, i: int):
        if i not in self._files:
            self._files[i] = safe_open(self.paths[i], framework="pt")
        return self._files[i]

    def read(self, ref: SampleRef, n: int, names: Sequence[str]) -> dict[str, Tensor]:
        f = self._open(ref.shard)
        return {k: f.get_slice(k)[ref.start : ref.start + n] for k in names}  # type: ignore[attr-defined]

    def load(self, refs: Sequence[SampleRef], budget: int) -> Batch:
        names = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")
        parts = [self.read(r, min(r.length, budget), names) for r in refs]
        lengths = [p["input_ids"].shape[0] for p in parts]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return Batch(
            input_ids=torch.cat([p["input_ids"] for p in parts]).long(),
            loss_mask=torch.cat([p["loss_mask"] for p in parts]).bool(),
            aux_hidden=torch.cat([p["aux_hidden"] for p in parts]),
            final_hidden=torch.cat([p["final_hidden"] for p in parts]),
            cu_seqlens=cu,
            position_ids=torch.cat([torch.arange(n) for n in lengths]),
            keys=[r.key for r in refs],
        )


def token_counts(paths: Sequence[str | Path], vocab_size: int) -> Tensor:
    """How often each target token is a loss (assistant) token over all shards: the frequencies
    the draft vocab is chosen from. Reads only `input_ids` and `loss_mask`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"{p}: token id {int(ids.max())} >= target vocab {vocab_size}; shards come from another tokenizer"
            )
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def split_eval(
    samples: Sequence[SampleRef], eval_fraction: float
) -> tuple[list[SampleRef], list[SampleRef]]:
    """(train, eval) by a hash of each sample's key: stable when data accumulates over rounds (a
    sample never moves between the splits). At least one eval sample when eval_fraction > 0."""
    if eval_fraction <= 0 or len(samples) < 2:
        return list(samples), []

    def u(s: SampleRef) -> float:
        return int.from_bytes(hashlib.sha256(s.key.encode()).digest()[:8], "big") / 2**64

    ev = [s for s in samples if u(s) < eval_fraction] or [min(samples, key=u)]
    keys = {s.key for s in ev}
    return [s for s in samples if s.key not in keys], ev


# ----------------------------------------------------------------------------------------------
# Packing


@dataclass
class Batch:
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool: token t is an assistant token
    aux_hidden: Tensor  # [T, 3·Ht] target aux states (bf16 on disk)
    final_hidden: Tensor  # [T, Ht] target final-norm states
    cu_seqlens: list[int]
    position_ids: Tensor  # [T]
    keys: list[str] = field(default_factory=list)  # sample keys, one per segment

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]

    def to(self, device: torch.device | str) -> Batch:
        d = {
            k: getattr(self, k)
            for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "position_ids")
        }
        moved = {k: v.to(device, non_blocking=True) for k, v in d.items()}
        return Batch(**moved, cu_seqlens=self.cu_seqlens, keys=self.keys)


def pack(lengths: Sequence[int], budget: int, seed: int, window: int = 16) -> list[list[int]]:
    """Sample indices grouped into bins of at most `budget` tokens (longer samples count as
    `budget`: they are truncated on load). Seeded shuffle, then first fit over the last `window`
    open bins (bins come out >95% full for chat-length samples, in O(n·window))."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = min(lengths[i], budget)
        lo = max(0, len(bins) - window)
        for b in range(lo, len(bins)):
            if n <= room[b]:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def steps_per_epoch(num_bins: int, world: int) -> int:
    return max(1, math.ceil(num_bins / world))


def rank_order(num_bins: int, rank: int, world: int, seed: int, epoch: int) -> list[int]:
    """Bins rank `rank` visits in `epoch`, one per step: its own bins (r, r+W, ...) in a seeded
    order, wrapped around so every rank makes the same number of steps (DDP runs in lockstep)."""
    mine = list(range(rank, num_bins, world)) or [rank % max(num_bins, 1)]
    random.Random(f"{seed}:{epoch}:{rank}").shuffle(mine)
    n = steps_per_epoch(num_bins, world)
    return [mine[i % len(mine)] for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Target soft labels


class SoftTargets:
    """Target softmax over the draft vocab (`target_p`) and the loss mask joined with "the target's
    argmax is a draft token" (`valid`), from the target's final hidden states and its lm_head.

    `target_p` always comes from the Vd draft rows of the lm_head, so it is the same number whether
    or not a sample's `inside` bits are cached (a resumed run computes what an uninterrupted one
    does); the full-vocab argmax (`target_soft_labels`) runs once per sample and worker."""

    def __init__(
        self,
        lm_head: Tensor,
        d2t: Tensor,
        t2d: Tensor,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.head = lm_head.to(device=device, dtype=dtype)
        self.d2t, self.t2d = d2t.to(device), t2d.to(device)
        self.draft_rows = self.head[draft_ids(self.d2t)].contiguous()  # [Vd, Ht]
        self.inside: dict[str, Tensor] = {}  # sample key -> bool [L] (rows needing it only)

    @torch.no_grad()
    def __call__(self, b: Batch) -> tuple[Tensor, Tensor]:
        T, dev = b.tokens, b.input_ids.device
        cu = torch.tensor(b.cu_seqlens, device=dev)
        seg = torch.searchsorted(cu[1:], torch.arange(T, device=dev), right=True)
        nxt = torch.arange(1, T + 1, device=dev)
        # Row t is needed when token t+1 is a loss token of the same sample.
        need = (nxt < cu[1:][seg]) & b.loss_mask[nxt.clamp(max=T - 1)]
        cached = torch.zeros(T, dtype=torch.bool, device=dev)
        inside = torch.zeros(T, dtype=torch.bool, device=dev)
        for k, s, e in zip(b.keys, b.cu_seqlens[:-1], b.cu_seqlens[1:], strict=True):
            got = self.inside.get(k)
            if got is not None and got.numel() == e - s:
                inside[s:e] = got
                cached[s:e] = True
        rows = need.nonzero().squeeze(-1)
        target_p = torch.zeros(T, self.draft_rows.shape[0], device=dev, dtype=torch.float32)
        logits = b.final_hidden[rows].to(self.draft_rows.dtype) @ self.draft_rows.T
        target_p[rows] = torch.softmax(logits.float(), dim=-1)
        full = (need & ~cached).nonzero().squeeze(-1)
        if full.numel():  # first visit: the argmax over the whole target vocab
            inside[full] = target_soft_labels(b.final_hidden[full], self.head, self.d2t, self.t2d)[
                1
            ]
        for k, s, e in zip(b.keys, b.cu_seqlens[:-1], b.cu_seqlens[1:], strict=True):
            if k and not bool(cached[s]):
                self.inside[k] = inside[s:e].clone()
        valid = torch.zeros(T, dtype=torch.bool, device=dev)
        valid[1:] = b.loss_mask[1:] & inside[:-1]
        return target_p, valid


# ----------------------------------------------------------------------------------------------
# Model, wrapper, optimizer


def scratch_drafter(
    cfg: Eagle3Config,
    embed: Tensor,
    lm_head: Tensor,
    norm: Tensor | None,
    d2t: Tensor,
    t2d: Tensor,
    seed: int,
) -> Eagle3Drafter:
    """Random init (seeded, identical on every rank), the given vocab map, and the target's
    lm_head rows for the draft vocab plus its final norm (init_from_target)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, embed.float())
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    init_from_target(model, lm_head.float(), None if norm is None else norm.float())
    return model


class TTTModule(nn.Module):
    """`forward` = one TTT pass of the drafter, so DDP / FSDP2 hooks wrap it (they hook `forward`,
    not `ttt_forward`). `path="fast"` runs eagle3.fast (fused; flex attention on CUDA), which
    computes in the weights' dtype and does not work under autocast: `cast` then hands it bf16
    copies of the fp32 master weights (gradients flow back through the cast)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        path: Literal["reference", "fast"] = "reference",
        cast: torch.dtype | None = None,
        pad_to: int | None = None,
    ):
        super().__init__()
        self.drafter = drafter
        self.path = path
        self.cast = cast
        object.__setattr__(
            self, "_fast", _FastRunner(drafter, pad_to)
        )  # not a submodule: no duplicate names

    def forward(
        self, input_ids, aux_hidden, target_p, valid, cu_seqlens, position_ids, ttt_length: int
    ) -> TTTOutput:
        args = (input_ids, aux_hidden, target_p, valid, cu_seqlens, position_ids, ttt_length)
        if self.path == "reference":
            return self.drafter.ttt_forward(*args, step_decay=STEP_DECAY)
        if self.cast is None:
            return self._fast(*args)
        params = {f"drafter.{n}": p.to(self.cast) for n, p in self.drafter.named_parameters()}
        return torch.func.functional_call(self._fast, params, args, strict=False)


class _FastRunner(nn.Module):
    def __init__(self, drafter: Eagle3Drafter, pad_to: int | None = None):
        super().__init__()
        self.drafter = drafter
        self.pad_to = pad_to

    def forward(self, *args) -> TTTOutput:
        from eagle3.fast import fast_ttt_forward

        return fast_ttt_forward(self.drafter, *args, step_decay=STEP_DECAY, pad_to=self.pad_to)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


class Anchor:
    """L2-SP: `weight` x the squared distance of every trainable parameter from where training
    started, summed over parameters, added to the loss. Its units are per weight: each weight's
    gradient gains 2·weight·(θ−θ₀), whatever the model's size (the published continued-training
    recipes' 1e-4 is in these units). Fine-tuning a trained drafter on a few thousand samples pulls it
    toward them and away from what it knew (over-specialising); the anchor keeps it near its
    start unless the data pays for the move. Built after wrapping (DDP), before any resume, so
    it holds the weights the round was given. FSDP2's sharded weights are not supported
    (pipeline.train.prepare refuses the pair)."""

    def __init__(self, module: nn.Module, weight: float):
        self.weight = weight
        self.start = [(p, p.detach().clone()) for p in module.parameters() if p.requires_grad]

    def __call__(self) -> Tensor:
        return self.weight * self.distance2()

    def distance2(self) -> Tensor:
        """Σ(θ−θ₀)² over the trainable parameters."""
        return sum(((p - p0) ** 2).sum() for p, p0 in self.start)

    @torch.no_grad()
    def drift_rms(self) -> float:
        """Root-mean-square distance of a weight from its start: how far training moved it."""
        n = sum(p0.numel() for _, p0 in self.start)
        return math.sqrt(float(self.distance2()) / max(1, n))


def lr_factor(step: int, total: int, warmup_ratio: float, final: float = 0.1) -> float:
    """Linear warmup over ceil(warmup_ratio·total) steps, then cosine from 1 down to `final`."""
    warm = math.ceil(warmup_ratio * total)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(
    opt: torch.optim.Optimizer, total: int, warmup_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup_ratio))


# ----------------------------------------------------------------------------------------------
# One step, evaluation


@dataclass
class StepOut:
    loss: float
    step_losses: Tensor  # [k] per-step mean soft CE
    correct: Tensor  # [k]
    counted: Tensor  # [k]
    tokens: int
    grad_norm: float
    anchor_loss: float = 0.0  # the anchor's term, added to `loss` in the backward pass


def _forward(
    module: nn.Module,
    b: Batch,
    target_p: Tensor,
    valid: Tensor,
    ttt_length: int,
    autocast: torch.dtype | None,
) -> TTTOutput:
    """The TTT forward under bf16 autocast, or in fp32 (aux states are bf16 on disk)."""
    aux = b.aux_hidden if autocast is not None else b.aux_hidden.float()
    with torch.autocast(
        b.input_ids.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
    ):
        return module(b.input_ids, aux, target_p, valid, b.cu_seqlens, b.position_ids, ttt_length)


def train_step(
    module: nn.Module,
    batch: Batch,
    soft: SoftTargets,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    ttt_length: int,
    grad_clip: float,
    autocast: torch.dtype | None,
    anchor: Anchor | None = None,
) -> StepOut:
    """Soft labels once for the batch (every TTT step reads shifts of them), forward + backward
    of the TTT loss (plus the anchor's pull, when fine-tuning), clip, AdamW, scheduler. `module`
    is a TTTModule, possibly DDP/FSDP-wrapped. The reported loss is the TTT loss alone."""
    target_p, valid = soft(batch)
    out = _forward(module, batch, target_p, valid, ttt_length, autocast)
    pull = anchor() if anchor is not None else None
    (out.loss if pull is None else out.loss + pull).backward()
    norm = torch.nn.utils.clip_grad_norm_(
        [p for p in module.parameters() if p.grad is not None], grad_clip
    )
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return StepOut(
        float(out.loss.detach()),
        torch.stack(out.step_losses).float().cpu(),
        out.correct.float().cpu(),
        out.counted.float().cpu(),
        batch.tokens,
        float(norm),
        0.0 if pull is None else float(pull.detach()),
    )


@torch.no_grad()
def eval_step(
    module: nn.Module,
    batch: Batch,
    soft: SoftTargets,
    ttt_length: int,
    autocast: torch.dtype | None,
) -> Tensor:
    """Sums for one eval batch: [loss_sum_0..k-1, correct_0..k-1, counted_0..k-1] (float64), so
    batches and ranks add up before dividing."""
    target_p, valid = soft(batch)
    out = _forward(module, batch, target_p, valid, ttt_length, autocast)
    losses = torch.stack(out.step_losses).double().cpu() * out.counted.double().cpu()
    return torch.cat([losses, out.correct.double().cpu(), out.counted.double().cpu()])


# ----------------------------------------------------------------------------------------------
# Metrics


def sim_accept_len(acc: Sequence[float], steps: int) -> float:
    """Expected accept length of a chain of `steps` drafts when position i is accepted with the
    conditional accuracy acc[i] (TTT feeds true tokens, so acc_i is conditional on 0..i-1 right):
    1 + a0 + a0·a1 + ... (the 1 is the target's bonus token)."""
    total, run = 1.0, 1.0
    for a in list(acc)[:steps]:
        run *= a
        total += run
    return total


def step_metrics(
    loss: float,
    correct: Sequence[float],
    counted: Sequence[float],
    lr: float,
    tokens: int,
    seconds: float,
    sim_steps: int,
) -> dict[str, float]:
    """The per-step metric dict (un-namespaced; the driver logs it under `train/`)."""
    acc = [c / n if n else 0.0 for c, n in zip(correct, counted, strict=True)]
    m = {"loss": loss, **{f"acc_{i}": a for i, a in enumerate(acc)}}
    m.update(
        lr=lr, tok_per_s=tokens / max(seconds, 1e-9), sim_accept_len=sim_accept_len(acc, sim_steps)
    )
    return m


def eval_metrics(sums: Tensor, ttt_length: int, sim_steps: int) -> dict[str, float]:
    k = ttt_length
    loss_sum, correct, counted = sums[:k], sums[k : 2 * k], sums[2 * k :]
    mean = [float(s / n) if n else 0.0 for s, n in zip(loss_sum, counted, strict=True)]
    acc = [float(c / n) if n else 0.0 for c, n in zip(correct, counted, strict=True)]
    m = {
        "loss": sum(STEP_DECAY**i * x for i, x in enumerate(mean)),
        **{f"acc_{i}": a for i, a in enumerate(acc)},
    }
    m["sim_accept_len"] = sim_accept_len(acc, sim_steps)
    m["tokens"] = float(counted[0]) if k else 0.0
    return m


def format_line(step: int, total: int, m: dict[str, float], extra: str = "") -> str:
    accs = " ".join(f"{m[k]:.3f}" for k in sorted(m) if k.startswith("acc_"))
    return (
        f"[train] step {step}/{total} loss {m['loss']:.4f} acc [{accs}] sim_accept {m['sim_accept_len']:.2f} "
        f"lr {m['lr']:.2e} tok/s {m['tok_per_s']:.0f}{extra}"
    )


def matmul_macs_per_token(cfg: Eagle3Config, ttt_length: int) -> int:
    """Matmul multiply-accumulates per token of one TTT forward: k × (q,k,v,o + MLP + lm_head)
    + fc once. Attention scores are not counted (they depend on sample lengths)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = 2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    o = cfg.num_attention_heads * d * h
    per_step = qkv + o + 3 * h * i + h * cfg.draft_vocab_size
    return ttt_length * per_step + 3 * cfg.target_hidden_size * h


def train_flops_per_token(cfg: Eagle3Config, ttt_length: int) -> int:
    """6 × MACs: forward (2) + backward (4)."""
    return 6 * matmul_macs_per_token(cfg, ttt_length)


def target_dtype(name: str, device_type: str) -> torch.dtype:
    """`target.dtype` as a torch dtype; `auto` = bf16 on GPUs and on CPUs with native bf16
    matmuls (SmolLM2 decodes 2.3x faster than fp32 on this AVX512-BF16 CPU), fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" or cpu_has_native_bf16() else torch.float32
    return getattr(torch, name)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 (autocast) or None (fp32) for `precision` in auto|bf16|fp32."""
    if precision == "fp32":
        return None
    if precision == "bf16" or device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return None


# ----------------------------------------------------------------------------------------------
# Training state (checkpoint of a run, not the exported drafter)

STATE_FILE = "train_state.pt"


def save_training_state(
    directory: Path,
    module: nn.Module,
    opt: torch.optim.Optimizer,
    sched,
    step: int,
    extra: dict | None = None,
) -> dict[str, Tensor] | None:
    """Gather full model + optimizer state (collective under FSDP: every rank calls) and write it
    on rank 0 with the scheduler, step and RNG states. Returns the drafter state dict on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(module, opt, options=opts)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    payload = {
        "model": model_sd,
        "optim": optim_sd,
        "sched": sched.state_dict(),
        "step": step,
        "rng": rng,
    }
    torch.save(payload, directory / STATE_FILE)
    (directory / "meta.json").write_text(json.dumps({"step": step, **(extra or {})}) + "\n")
    return {k.removeprefix("drafter."): v for k, v in model_sd.items()}


def load_training_state(
    directory: Path, module: nn.Module, opt: torch.optim.Optimizer, sched
) -> int:
    """Restore what save_training_state wrote; returns the step to continue from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    payload = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True)
    set_state_dict(
        module,
        opt,
        model_state_dict=payload["model"],
        optim_state_dict=payload["optim"],
        options=opts,
    )
    sched.load_state_dict(payload["sched"])
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    if "cuda" in payload["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    return int(payload["step"])


def wrap_ddp(module: nn.Module, device: torch.device) -> nn.Module:
    """DDP without per-step buffer broadcasts: the buffers (target embedding, vocab map, RoPE) are
    identical on every rank, and the embedding alone is V×H floats."""
    import inspect

    ddp = torch.nn.parallel.DistributedDataParallel
    kw: dict = {"gradient_as_bucket_view": True}
    if "forward_sync_buffers" in inspect.signature(ddp).parameters:  # torch >= 2.13
        kw["forward_sync_buffers"] = False
    else:
        kw["broadcast_buffers"] = False
    ids = [device.index] if device.type == "cuda" else None
    return ddp(module, device_ids=ids, **kw)


def parallelize(
    drafter: Eagle3Drafter,
    device: torch.device,
    precision: str = "auto",
    fsdp: bool = False,
    pad_to: int | None = None,
) -> tuple[nn.Module, torch.dtype | None, torch.dtype | None]:
    """(module to train, autocast dtype, compute dtype) for a drafter already on `device`.

    CUDA runs the fast path (eagle3.fast) in bf16 weights: FSDP2's MixedPrecisionPolicy gives it
    them under `fsdp`, else `TTTModule.cast`. CPU runs the reference path under bf16 autocast (or
    fp32). FSDP2 shards the whole TTTModule as one group: both paths reach the midlayer's weights
    directly (MidLayer has no forward of its own), so a separate group there would never unshard.
    FSDP needs CUDA; on CPU `fsdp` falls back to DDP. One process: no wrapper at all.
    `pad_to` (the fast path): every packed row padded to this many tokens, one compiled shape."""
    dt = compute_dtype(precision, device)
    path: Literal["reference", "fast"] = "fast" if device.type == "cuda" else "reference"
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if fsdp and device.type == "cuda" and distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        module = TTTModule(drafter, path, pad_to=pad_to)
        fully_shard(
            module, mp_policy=MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
        )
    else:
        module = TTTModule(drafter, path, cast=dt if path == "fast" else None, pad_to=pad_to)
        if distributed:
            module = wrap_ddp(module, device)
    return module, (dt if path == "reference" else None), dt


def set_threads(n: int) -> None:
    """Intra-op threads of this process (Ray sets OMP_NUM_THREADS to the CPUs it reserved)."""
    n = max(1, int(n))
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
