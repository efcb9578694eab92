"""Throughput of the generate stage on this machine's CPU with SmolLM2-135M-Instruct; prints JSON.

    .venv/bin/python benchmarks/data_cpu.py --prompts 32 --max-new-tokens 128 --actors 2 --batch-size 16
    .venv/bin/python benchmarks/data_cpu.py --dtype float32 --capture forward   # the previous stage
    .venv/bin/python benchmarks/data_cpu.py --hf-baseline 16,32   # plain HF generate, for reference

The stage run is the real one (Ray actors, capture, shards on disk). The load average is printed
with the figures (benchmarks/harness.py: one JSON line a result): on a shared machine other processes take CPU time, and wall-clock tok/s drop.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser  # noqa: E402


def stage(args: argparse.Namespace) -> dict:
    import ray

    from actors.cluster import start_ray
    from actors.generate import run_generate
    from actors.prompts import builtin_prompts
    from pipeline.config import DataConfig, TargetConfig

    start_ray(num_cpus=os.cpu_count())
    data = DataConfig(
        batch_size=args.batch_size,
        num_actors=args.actors,
        max_new_tokens=args.max_new_tokens,
        max_length=2048,
        capture=args.capture,
    )
    prompts = builtin_prompts(0)[: args.prompts]
    with tempfile.TemporaryDirectory() as out:
        load0 = os.getloadavg()[0]
        r = run_generate(TargetConfig(dtype=args.dtype), data, prompts, Path(out), "bench")
    ray.shutdown()
    return {
        "model": "smollm2",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "actors": args.actors,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "capture": args.capture,
        "cpus": os.cpu_count(),
        "gen_tok_per_s": round(r.gen_tok_per_s, 1),
        "capture_tok_per_s": round(r.capture_tok_per_s, 1),
        "stage_seconds": round(r.seconds, 1),
        "num_tokens": r.num_tokens,
        "num_loss_tokens": r.num_loss_tokens,
        "loadavg_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def hf_baseline(batch_sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """HF ``model.generate`` on left-padded batches (the naive path), for comparison."""
    import torch

    from actors.chat import prompt_ids
    from actors.hf_backend import HFTarget
    from actors.prompts import builtin_prompts
    from pipeline.config import TargetConfig

    t = HFTarget(TargetConfig(dtype=args.dtype), num_threads=os.cpu_count())
    t.tokenizer.padding_side = "left"
    rows = []
    for bs in batch_sizes:
        ps = [prompt_ids(t.tokenizer, c) for c in builtin_prompts(0)[:bs]]
        enc = t.tokenizer.pad({"input_ids": ps}, return_tensors="pt")
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = t.model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
        eos = set(t.info().eos_token_ids)
        n = sum(
            next((i + 1 for i, x in enumerate(r) if x in eos), len(r))
            for r in out[:, enc["input_ids"].shape[1] :].tolist()
        )
        rows.append({"batch_size": bs, "max_new_tokens": args.max_new_tokens,
                     "threads": torch.get_num_threads(), "tokens": n, "tok_per_s": round(n / dt, 1),
                     "loadavg": round(os.getloadavg()[0], 2)})  # fmt: skip
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--capture",
        default="auto",
        choices=["auto", "decode", "forward"],
        help="decode (auto): states from the generation's forwards; forward: a second pass",
    )
    ap.add_argument(
        "--hf-baseline", default="", help="comma-separated batch sizes: measure HF generate instead"
    )
    args = ap.parse_args()
    if args.hf_baseline:
        for row in hf_baseline([int(b) for b in args.hf_baseline.split(",")], args):
            Results("hf_generate_cpu").emit(row)
    else:
        Results("data_stage_cpu").emit(stage(args))


if __name__ == "__main__":
    main()
