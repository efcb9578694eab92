"""Throughput of the drafter's training step (eagle3/train_step.py) on synthetic inputs, no Ray.

    .venv/bin/python benchmarks/train_step.py --shape smollm2 --draft-vocab 8192 --workers 2 --threads 1
    .venv/bin/python benchmarks/train_step.py --shape smollm2 --draft-vocab 32000 --workers 1 --threads 2
    python benchmarks/train_step.py --shape llama31-8b --device cuda --tokens-per-batch 16384

One step is what a Ray Train worker does per batch: target soft labels from the target's final
hidden states (frozen target lm_head), the TTT forward + backward, grad clip, AdamW, scheduler;
with --workers > 1 the processes run gloo/NCCL DDP like the Ray workers (gradient all-reduce
included). Each synthetic batch is visited twice: `first` is the first epoch (soft labels over the
full target vocab), `steady` the later epochs (the "argmax in draft vocab" bit is cached per sample,
so soft labels only need the draft rows).

Prints one JSON line (benchmarks/harness.py: device, date, versions, cpu count, load): shape, tokens/s (total over workers), MFU and peak memory.
MFU = 6 × (matmul MACs per token per TTT step × k + fc) × tokens/s over the peak of one dense
matmul in the compute dtype measured on the same device and thread count (attention scores and
the target's soft-label matmul are not counted).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.ports import free_port  # noqa: E402
from benchmarks.harness import DrafterShape, Results, parser, sync, timed_ms  # noqa: E402
from eagle3.config import Eagle3Config  # noqa: E402
from eagle3.train_step import (  # noqa: E402
    Batch,
    SoftTargets,
    TTTModule,
    compute_dtype,
    load_training_state,
    make_optimizer,
    make_scheduler,
    matmul_macs_per_token,
    parallelize,
    save_training_state,
    scratch_drafter,
    train_step,
    wrap_ddp,
)
from eagle3.vocab import build_vocab_map, draft_ids  # noqa: E402

# Drafter shapes: SpecForge's Kimi-K2 and Llama-3.1-8B drafters, and the one this project trains
# for the embedded SmolLM2-135M target.
SHAPES = {
    "kimi-k2": DrafterShape(7168, 18432, 64, 64, 128, 163840, 32000),
    "llama31-8b": DrafterShape(4096, 14336, 32, 8, 128, 128256, 32000),
    "smollm2": DrafterShape(576, 1536, 9, 3, 64, 49152, 8192),
}


def synthetic_batches(
    cfg: Eagle3Config, n: int, budget: int, mean_len: int, prompt_frac: float, seed: int
) -> list[Batch]:
    """`n` packed batches of chat-like samples: lengths uniform in [mean/2, 3·mean/2], the first
    `prompt_frac` of each sample is prompt (loss_mask 0), the rest response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        lengths = []
        while True:
            L = int(torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (1,), generator=g))
            if sum(lengths) + L > budget:
                break
            lengths.append(L)
        if budget - sum(lengths) >= 8:  # fill the budget: a packed batch is (nearly) full
            lengths.append(budget - sum(lengths))
        T = sum(lengths)
        cu = [0]
        for L in lengths:
            cu.append(cu[-1] + L)
        mask = torch.cat([torch.arange(L) >= int(prompt_frac * L) for L in lengths])
        out.append(
            Batch(
                input_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
                loss_mask=mask,
                aux_hidden=torch.randn(T, 3 * cfg.target_hidden_size, generator=g).to(
                    torch.bfloat16
                ),
                final_hidden=torch.randn(T, cfg.target_hidden_size, generator=g).to(torch.bfloat16),
                cu_seqlens=cu,
                position_ids=torch.cat([torch.arange(L) for L in lengths]),
                keys=[f"b{b}s{i}" for i in range(len(lengths))],
            )
        )
    return out


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved TFLOP/s of one large dense matmul: the ceiling this device reaches in `dtype`."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.type == "cuda" else 5
    ms = sum(timed_ms(lambda: [a @ b for _ in range(reps)], device, 1, warm=1))
    return 2 * n**3 * reps / ms / 1e9


def worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.workers > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=rank, world_size=args.workers)
    cfg = SHAPES[args.shape].config(args.draft_vocab)
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02
    d2t, t2d = build_vocab_map(
        torch.randint(0, 1000, (cfg.vocab_size,), generator=g), cfg.draft_vocab_size
    )
    # A real target's argmax is a draft token ~95% of the time; a random head's only Vd/V of it,
    # and the TTT step skips rows that no step scores, so the draft rows are made to win.
    lm_head[draft_ids(d2t)] *= 4
    drafter = scratch_drafter(cfg, embed, lm_head, None, d2t, t2d, seed=0).to(device)
    if args.path == "auto":  # what the Ray workers do
        module, autocast, dt = parallelize(drafter, device, args.precision, args.fsdp)
        path = "fast" if device.type == "cuda" else "reference"
    else:
        dt, path = compute_dtype(args.precision, device), args.path
        module = TTTModule(drafter, path, cast=dt if path == "fast" else None)
        module = wrap_ddp(module, device) if args.workers > 1 else module
        autocast = dt if path == "reference" else None
    opt = make_optimizer(module, 1e-4, 0.0)
    sched = make_scheduler(opt, 10_000, 0.0)
    soft = SoftTargets(lm_head, d2t, t2d, dt or torch.float32, device)
    batches = synthetic_batches(
        cfg, args.steps + 1, args.tokens_per_batch, args.sample_len, 0.3, seed=rank
    )
    batches = [b.to(device) for b in batches]

    def run(bs: list[Batch]) -> tuple[float, int]:
        sync(device)
        if args.workers > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        for b in bs:
            train_step(module, b, soft, opt, sched, args.ttt, 0.5, autocast)
        sync(device)
        if args.workers > 1:
            torch.distributed.barrier()
        return time.perf_counter() - t, sum(b.tokens for b in bs)

    run(batches[:1])  # warm-up (allocator, kernels, compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cpu0 = time.process_time()
    first = run(batches[1:])
    steady = run(batches[1:])
    cpu_s = time.process_time() - cpu0
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    ckpt_s = checkpoint_round_trip(module, opt, sched) if args.workers > 1 else None
    results.put(
        {
            "rank": rank,
            "first": first,
            "steady": steady,
            "cpu_s": cpu_s,
            "peak_gib": peak,
            "path": path,
            "checkpoint_s": ckpt_s,
            "dtype": str(dt or torch.float32),
        }
    )
    if args.workers > 1:
        torch.distributed.destroy_process_group()


def checkpoint_round_trip(module, opt, sched) -> float:
    """Save and restore the full training state as Ray workers do at a checkpoint and a resume
    (gathering is a collective under FSDP2; rank 0 writes, every rank reads); returns seconds."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.gettempdir()) / f"train-step-bench-{os.getppid()}"  # shared by the ranks
    t = time.perf_counter()
    save_training_state(d, module, opt, sched, step=1)
    torch.distributed.barrier()
    assert load_training_state(d, module, opt, sched) == 1
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)
    return round(time.perf_counter() - t, 2)


def main() -> None:
    ap = parser(__doc__, device="auto", shapes=SHAPES, shape="smollm2")
    ap.add_argument(
        "--draft-vocab", type=int, default=None, help="override the shape's draft vocab"
    )
    ap.add_argument("--ttt", type=int, default=3, help="TTT length k")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--sample-len", type=int, default=384, help="mean sample length")
    ap.add_argument(
        "--steps", type=int, default=4, help="timed steps per epoch (two epochs are timed)"
    )
    ap.add_argument(
        "--workers", type=int, default=1, help="DDP processes (gloo on CPU, NCCL on CUDA)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default cores/workers)"
    )
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--path", choices=["auto", "reference", "fast"], default="auto")
    ap.add_argument(
        "--fsdp", action="store_true", help="FSDP2 instead of DDP (CUDA, --workers > 1)"
    )
    args = ap.parse_args()
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    if args.workers == 1:
        worker(0, args, port, results)
    else:
        mp.start_processes(
            worker, args=(args, port, results), nprocs=args.workers, start_method="spawn"
        )
    rs = sorted((results.get() for _ in range(args.workers)), key=lambda r: r["rank"])

    cfg = SHAPES[args.shape].config(args.draft_vocab)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    dt = compute_dtype(args.precision, device) or torch.float32
    torch.set_num_threads(args.threads)
    peak = matmul_peak_tflops(device, dt) * args.workers
    flops_tok = 6 * matmul_macs_per_token(cfg, args.ttt)

    def rate(key: str) -> float:
        return sum(r[key][1] for r in rs) / max(r[key][0] for r in rs)

    first, steady = rate("first"), rate("steady")
    out = {
        "shape": args.shape,
        "hidden": cfg.hidden_size,
        "draft_vocab": cfg.draft_vocab_size,
        "ttt": args.ttt,
        "tokens_per_batch": args.tokens_per_batch,
        "workers": args.workers,
        "threads_per_worker": args.threads,
        "dtype": rs[0]["dtype"],
        "path": rs[0]["path"],
        "fsdp": args.fsdp,
        "checkpoint_round_trip_s": rs[0]["checkpoint_s"],
        "tok_per_s": round(steady, 1),
        "tok_per_s_first_epoch": round(first, 1),
        "tok_per_cpu_s": round(
            sum(r["steady"][1] + r["first"][1] for r in rs) / sum(r["cpu_s"] for r in rs), 1
        ),
        "train_gflops_per_token": round(flops_tok / 1e9, 4),
        "achieved_tflops": round(steady * flops_tok / 1e12, 4),
        "matmul_peak_tflops": round(peak, 3),
        "mfu": round(steady * flops_tok / 1e12 / peak, 4),
        "peak_mem_gib": round(max(r["peak_gib"] for r in rs), 3),
    }
    Results("train_step", device).emit(out)


if __name__ == "__main__":
    main()
