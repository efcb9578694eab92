"""Training-recipe sweeps without Ray: train a scratch drafter on captured shards in one process
and print the held-out TTT metrics after every epoch as JSON lines.

    .venv/bin/python benchmarks/recipe.py --data RUN/data/round-000 --epochs 2 --draft-vocab 4096
    .venv/bin/python benchmarks/recipe.py --data RUN/data/round-000 --train-samples 456 --lr 2e-3

The held-out set is `split_eval(eval_fraction)` over all given shards, so runs that train on a
subset (`--train-samples`) are scored on the same samples. `sim_accept_len` is the chain estimate
1 + a0 + a0·a1 + ... from the conditional accuracies; the benchmark of a served drafter matched
it within 0.02 on the demo (docs/training.md). The same functions as the Ray Train workers run
here (packing, soft labels, TTT step, AdamW, cosine schedule), on the CPU's bf16 path.

`train_on_shards`, `scratch_trainee` and `Trainee` are also what gpu_recipe.py and base_drafter.py
train with. Prints one JSON line per epoch (benchmarks/harness.py).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.shards import verify_manifest  # noqa: E402
from benchmarks.harness import Results, add_training_args, parser  # noqa: E402
from eagle3.checkpoint import save_drafter  # noqa: E402
from eagle3.config import Eagle3Config  # noqa: E402
from eagle3.target_weights import load_target_tensors, read_target_info  # noqa: E402
from eagle3.train_step import (  # noqa: E402
    Batch,
    ShardSet,
    SoftTargets,
    TTTModule,
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

WARMUP = 0.015  # the demo's warm-up share of the schedule


@dataclass
class Trainee:
    """A scratch drafter as the loop builds it (its config, vocabulary map and target tensors),
    wrapped for training on `device`, with its soft-label teacher."""

    drafter: Any
    module: Any
    autocast: torch.dtype | None
    soft: SoftTargets
    device: torch.device

    def evaluate(self, batches: Iterable[Batch], ttt: int) -> dict[str, float]:
        """Held-out TTT metrics (sim_accept_len, acc_i, ...) over `batches`."""
        self.module.eval()
        sums = torch.zeros(3 * ttt, dtype=torch.float64)
        for b in batches:
            sums += eval_step(self.module, b.to(self.device), self.soft, ttt, self.autocast).cpu()
        self.module.train()
        return eval_metrics(sums, ttt, 3)

    def export(self, where: Path) -> float:
        """Save the drafter as the loop exports it; returns its size in MiB."""
        sd = self.module.state_dict().items()
        state = {k.removeprefix("drafter."): v.detach().cpu() for k, v in sd}
        save_drafter(state, self.drafter.cfg, where)
        return round((where / "model.safetensors").stat().st_size / 2**20, 2)


def scratch_trainee(
    target: str, info, aux: list[int], vocab: int, counts: torch.Tensor, device, path="auto"
) -> Trainee:
    """The loop's scratch drafter (pipeline.train's config for this target, aux ids and draft
    vocab of `vocab` from token `counts`); path "reference" forces the reference TTT forward."""
    cfg = Eagle3Config(**_scratch_config(DrafterConfig(draft_vocab_size=vocab), info, aux))
    tens = load_target_tensors(target)
    d2t, t2d = build_vocab_map(counts, vocab)
    drafter = scratch_drafter(cfg, tens["embed"], tens["lm_head"], tens["norm"], d2t, t2d, 0)
    drafter = drafter.to(device)
    module, autocast, dt = parallelize(drafter, device, "auto")
    if path == "reference":  # the CPU path's numerics (bf16 autocast), on the GPU
        module, autocast = TTTModule(drafter, "reference"), dt
    soft = SoftTargets(tens["lm_head"], drafter.d2t, drafter.t2d, dt or torch.float32, device)
    return Trainee(drafter, module, autocast, soft, torch.device(device))


def drafter_trainee(target: str, init: str | Path, device) -> Trainee:
    """An existing drafter (SGLang folder) as the loop fine-tunes it: its own vocab map and
    weights, the target's embedding and lm_head for the soft labels."""
    from eagle3.checkpoint import load_drafter
    from eagle3.model import drafter_from_state

    tens = load_target_tensors(target)
    cfg, state = load_drafter(init)
    drafter = drafter_from_state(cfg, state, tens["embed"].float()).to(device)
    module, autocast, dt = parallelize(drafter, device, "auto")
    soft = SoftTargets(tens["lm_head"], drafter.d2t, drafter.t2d, dt or torch.float32, device)
    return Trainee(drafter, module, autocast, soft, torch.device(device))


def epoch_order(bins: int, epoch: int) -> list[int]:
    """The bins of one epoch, shuffled with the epoch as seed: the order these scripts have
    always used (drafters/smollm2-135m-base was trained in it, so its build reproduces)."""
    order = list(range(bins))
    random.Random(epoch).shuffle(order)
    return order


def train_on_shards(
    dirs: list[Path],
    target: str,
    epochs: int,
    device,
    on_epoch: Callable[[int, dict[str, Any]], None],
    lr: float = 1e-3,
    tokens_per_batch: int = 512,
    ttt: int = 3,
    vocab: int = 4096,
    eval_fraction: float = 0.05,
    train_samples: int = 0,
    path: str = "auto",
    warmup: float = WARMUP,
) -> Trainee:
    """Train a scratch drafter on the round data in `dirs` with the Ray workers' functions;
    after every epoch `on_epoch(epoch, facts)` gets the held-out metrics (`eval`) and counts."""
    paths, ids, aux = [], [], None
    for d in dirs:
        m = verify_manifest(Path(d))
        paths += [str(p) for p in m.shard_paths()]
        ids += [s.sha256 for s in m.shards]
        aux = list(m.aux_layer_ids)
    info = read_target_info(target)
    t = scratch_trainee(target, info, aux, vocab, token_counts(paths, info.vocab_size), device, path)  # fmt: skip
    data = ShardSet(paths, ids)
    train, held = split_eval(data.samples, eval_fraction)
    train = train[:train_samples] if train_samples else train
    bins = pack([r.length for r in train], tokens_per_batch, 0)
    eval_bins = pack([r.length for r in held], 2048, 0)
    opt = make_optimizer(t.module, lr, 0.0)
    sched = make_scheduler(opt, len(bins) * epochs, warmup)
    tokens = sum(r.length for r in train)
    t0, seen = time.perf_counter(), 0
    for epoch in range(epochs):
        for b in epoch_order(len(bins), epoch):
            batch = data.load([train[j] for j in bins[b]], tokens_per_batch).to(device)
            train_step(t.module, batch, t.soft, opt, sched, ttt, 0.5, t.autocast)
            seen += batch.tokens
        m = t.evaluate((data.load([held[j] for j in b], 2048) for b in eval_bins), ttt)
        on_epoch(epoch, {"eval": m, "train_samples": len(train), "train_tokens": tokens,
                         "eval_samples": len(held), "seconds": time.perf_counter() - t0, "seen": seen})  # fmt: skip
    return t


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--data", nargs="+", required=True, help="round data folders (manifest.json)")
    ap.add_argument("--target", default="smollm2", help="the target the shards came from")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    add_training_args(ap, tokens_per_batch=512, ttt=3, threads=2)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    res = Results("recipe_cpu", "cpu")

    def report(epoch: int, f: dict[str, Any]) -> None:
        res.emit({
            "epoch": epoch + 1, "train_samples": f["train_samples"], "train_tokens": f["train_tokens"],
            "eval_samples": f["eval_samples"], "lr": a.lr, "tokens_per_batch": a.tokens_per_batch,
            "draft_vocab": a.draft_vocab, "ttt": a.ttt, "seconds": round(f["seconds"], 1),
            "train_tok_per_s": round(f["seen"] / f["seconds"], 1),
            **{f"eval_{k}": round(v, 4) for k, v in f["eval"].items()},
        })  # fmt: skip

    train_on_shards(
        a.data, a.target, a.epochs, torch.device("cpu"), report, lr=a.lr,
        tokens_per_batch=a.tokens_per_batch, ttt=a.ttt, vocab=a.draft_vocab,
        eval_fraction=a.eval_fraction, train_samples=a.train_samples,
    )  # fmt: skip


if __name__ == "__main__":
    main()
