"""The fine-tuning recipe's sweep: fine-tune trained drafters on the same regenerated samples
with each setting and score every epoch (and the start) on held-out samples, without Ray.

    python benchmarks/base_drafter.py gen --replies target --pool train.jsonl.gz --limit 4096 --out D
    python benchmarks/base_drafter.py gen --replies target --pool users.jsonl.gz --out H
    python benchmarks/finetune_sweep.py --target T.gguf --train D --heldout H \
        --init base=drafters/smollm2-135m-base --init offpolicy=drafters/smollm2-135m-offpolicy \
        --grid "n=512 lr=3e-4,1e-4,3e-5 anchor=0,1e-2 ttt=3 warmup=0.015,0.1 bs=1024 epochs=3"

`--train`/`--heldout`: folders of `samples.pt` as `base_drafter.py gen` writes them; the
held-out set is the demo's simulated users' prompts (benchmarks/demo_prompts.py), which neither
training nor the benchmark uses. A grid is `key=v1,v2 ...`; every combination runs once per
init, on the first `n` training samples, with the project's training step (eagle3.train_step,
the Anchor included), cosine schedule and AdamW, each batch's aux states captured by the target
right before its step. Scored as the workers score: held-out TTT accuracy and the chain-3
simulated accept length (`sim3`). Prints one JSON line per (init, setting) with the start's
score, every epoch's and the best; `--export DIR` keeps each init's best state as DIR/<init>/; `--export-rows DIR`
keeps every row's best state as DIR/<init>-<row>/ (with <init>-<row>.json), for
benchmarks/accept_eval.py to score as the loop's benchmark does (scripts/gpu_sweep.sh). Grid key
`head=1` holds the drafter's lm_head still. Each row trains a seeded sample of `n`.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.base_drafter import _batch, drafter_trainee, epoch_order, load_target  # noqa: E402
from benchmarks.harness import Results, parser  # noqa: E402
from eagle3.train_step import Anchor, make_optimizer, make_scheduler, pack, train_step  # noqa: E402

KEYS = {"n": int, "lr": float, "anchor": float, "ttt": int, "warmup": float, "bs": int, "epochs": int}  # fmt: skip
OPTIONAL = {"head": (int, 0)}  # head=1: the drafter's lm_head held still (only the layer moves)


def grid(spec: str) -> list[dict]:
    axes = {}
    for part in spec.split():
        k, _, vals = part.partition("=")
        kind = KEYS.get(k) or OPTIONAL.get(k, (None,))[0]
        if kind is None:
            raise SystemExit(f"--grid: unknown key {k!r}; use {', '.join([*KEYS, *OPTIONAL])}")
        axes[k] = [kind(v) for v in vals.split(",")]
    missing = set(KEYS) - set(axes)
    if missing:
        raise SystemExit(f"--grid: give every key ({', '.join(sorted(missing))} missing)")
    for k, (_, default) in OPTIONAL.items():
        axes.setdefault(k, [default])
    return [dict(zip(axes, c, strict=True)) for c in itertools.product(*axes.values())]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--target", required=True)
    ap.add_argument("--train", required=True, type=Path)
    ap.add_argument("--heldout", required=True, type=Path)
    ap.add_argument("--init", action="append", required=True, help="name=drafter folder")
    ap.add_argument("--grid", action="append", required=True)
    ap.add_argument("--export", type=Path)
    ap.add_argument("--export-rows", type=Path, help="each row's best state as DIR/<init>-<row>/")
    a = ap.parse_args()
    t = load_target(a.target)
    dev = t.device
    blob = torch.load(a.train / "samples.pt")
    aux, eos = blob["aux"], blob["eos"]
    train = [s for s in blob["samples"] if s["reply"]]
    held = [s for s in torch.load(a.heldout / "samples.pt")["samples"] if s["reply"]]
    from actors.batch_decode import BatchDecoder

    longest = max(len(s["prompt"]) + len(s["reply"]) for s in train + held)
    dec = BatchDecoder(t.model, 1, longest + 1, eos)
    lens = [len(s["prompt"]) + len(s["reply"]) for s in held]
    held_batches = [_batch(dec, aux, [held[j] for j in b]) for b in pack(lens, 16384, 1)]
    inits = dict(x.split("=", 1) for x in a.init)
    res = Results("finetune_sweep", "cuda" if dev.type == "cuda" else "cpu")
    best_of: dict[str, float] = {}
    for name, path in inits.items():
        for row, g in enumerate([g for spec in a.grid for g in grid(spec)]):
            torch.manual_seed(0)
            tr = drafter_trainee(a.target, path, dev)
            if g["head"]:
                tr.drafter.lm_head.weight.requires_grad_(False)
            tag = f"{name}-{row:02d}"
            m0 = tr.evaluate(held_batches, 3)  # TTT 3 for every setting: one scale
            rows = [{"epoch": 0, "sim3": round(m0["sim_accept_len"], 4)}]
            # a seeded sample, the same in every row: samples.pt is sorted by prompt length
            data = random.Random(0).sample(train, min(g["n"], len(train)))
            bins = pack([len(s["prompt"]) + len(s["reply"]) for s in data], g["bs"], 0)
            opt = make_optimizer(tr.module, g["lr"], 0.0)
            sched = make_scheduler(opt, len(bins) * g["epochs"], g["warmup"])
            anchor = Anchor(tr.module, g["anchor"]) if g["anchor"] else None
            t0, best = time.perf_counter(), (0, m0["sim_accept_len"])
            for epoch in range(g["epochs"]):
                for b in epoch_order(len(bins), epoch):
                    batch = _batch(dec, aux, [data[j] for j in bins[b]])
                    train_step(tr.module, batch, tr.soft, opt, sched, g["ttt"], 0.5, tr.autocast, anchor)  # fmt: skip
                m = tr.evaluate(held_batches, 3)
                rows.append({"epoch": epoch + 1, "sim3": round(m["sim_accept_len"], 4),
                             "acc": [round(m[f"acc_{i}"], 3) for i in range(3)]})  # fmt: skip
                if m["sim_accept_len"] > best[1]:
                    best = (epoch + 1, m["sim_accept_len"])
                    if a.export_rows:  # the state the loop's best-state choice would export
                        tr.export(a.export_rows / tag)
                    if a.export and best[1] > best_of.get(name, 0.0):
                        best_of[name] = best[1]
                        tr.export(a.export / name)
            if a.export_rows:
                (a.export_rows / f"{tag}.json").write_text(
                    json.dumps({"init": name, **g, "best_epoch": best[0]})
                )
            res.emit({"row": tag, "init": name, **g, "steps_per_epoch": len(bins), "train_tokens":
                      sum(len(s["prompt"]) + len(s["reply"]) for s in data), "heldout": len(held),
                      "start_sim3": rows[0]["sim3"], "best_epoch": best[0], "best_sim3": round(best[1], 4),
                      "gain": round(best[1] - rows[0]["sim3"], 4), "epochs_eval": rows,
                      "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip


if __name__ == "__main__":
    main()
