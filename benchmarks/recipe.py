"""Training-recipe sweeps without Ray: train a scratch drafter on captured shards in one process
and print the held-out TTT metrics after every epoch as JSON lines.

    .venv/bin/python benchmarks/recipe.py --data RUN/data/round-000 --epochs 2 --draft-vocab 4096
    .venv/bin/python benchmarks/recipe.py --data RUN/data/round-000 --train-samples 456 --lr 2e-3

The held-out set is `split_eval(eval_fraction)` over all given shards, so runs that train on a
subset (`--train-samples`) are scored on the same samples. `sim_accept_len` is the chain estimate
1 + a0 + a0·a1 + ... from the conditional accuracies; the benchmark of a served drafter matched
it within 0.02 on the demo (docs/training.md). The same functions as the Ray Train workers run
here (packing, soft labels, TTT step, AdamW, cosine schedule), on the CPU's bf16 path.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.shards import verify_manifest  # noqa: E402
from eagle3.config import Eagle3Config  # noqa: E402
from eagle3.target_weights import load_target_tensors, read_target_info  # noqa: E402
from eagle3.train_step import (  # noqa: E402
    ShardSet,
    SoftTargets,
    eval_metrics,
    eval_step,
    make_optimizer,
    make_scheduler,
    pack,
    parallelize,
    scratch_drafter,
    split_eval,
    token_counts,
    train_step,
)
from eagle3.vocab import build_vocab_map  # noqa: E402
from pipeline.config import DrafterConfig  # noqa: E402
from pipeline.train import _scratch_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", nargs="+", required=True, help="round data folders (manifest.json)")
    ap.add_argument("--target", default="smollm2", help="the target the shards came from")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    ap.add_argument("--train-samples", type=int, default=0, help="0 = all training samples")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    paths, ids, aux = [], [], None
    for d in a.data:
        m = verify_manifest(Path(d))
        paths += [str(p) for p in m.shard_paths()]
        ids += [s.sha256 for s in m.shards]
        aux = list(m.aux_layer_ids)
    info = read_target_info(a.target)
    # the loop's own scratch config (target shapes, aux ids of the shards, this draft vocab)
    cfg = Eagle3Config(**_scratch_config(DrafterConfig(draft_vocab_size=a.draft_vocab), info, aux))
    tens = load_target_tensors(a.target)
    d2t, t2d = build_vocab_map(token_counts(paths, info.vocab_size), a.draft_vocab)
    drafter = scratch_drafter(cfg, tens["embed"], tens["lm_head"], tens["norm"], d2t, t2d, 0)
    module, autocast, dt = parallelize(drafter, torch.device("cpu"), "auto")
    data = ShardSet(paths, ids)
    train, held = split_eval(data.samples, a.eval_fraction)
    train = train[: a.train_samples] if a.train_samples else train
    bins = pack([r.length for r in train], a.tokens_per_batch, 0)
    eval_bins = pack([r.length for r in held], 2048, 0)
    total = len(bins) * a.epochs
    opt = make_optimizer(module, a.lr, 0.0)
    sched = make_scheduler(opt, total, 0.015)
    soft = SoftTargets(tens["lm_head"], drafter.d2t, drafter.t2d, dt or torch.float32, "cpu")
    tokens = sum(r.length for r in train)
    t0, seen = time.perf_counter(), 0
    for epoch in range(a.epochs):
        order = list(range(len(bins)))
        random.Random(epoch).shuffle(order)
        for b in order:
            batch = data.load([train[j] for j in bins[b]], a.tokens_per_batch)
            train_step(module, batch, soft, opt, sched, a.ttt, 0.5, autocast)
            seen += batch.tokens
        module.eval()
        sums = torch.zeros(3 * a.ttt, dtype=torch.float64)
        for b in eval_bins:
            sums += eval_step(module, data.load([held[j] for j in b], 2048), soft, a.ttt, autocast)
        module.train()
        m = eval_metrics(sums, a.ttt, 3)
        took = time.perf_counter() - t0
        print(json.dumps({
            "bench": "recipe_cpu", "epoch": epoch + 1, "train_samples": len(train),
            "train_tokens": tokens, "eval_samples": len(held), "lr": a.lr,
            "tokens_per_batch": a.tokens_per_batch, "draft_vocab": a.draft_vocab, "ttt": a.ttt,
            "seconds": round(took, 1), "train_tok_per_s": round(seen / took, 1),
            **{f"eval_{k}": round(v, 4) for k, v in m.items()},
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
