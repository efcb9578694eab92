"""The embedded default's recipe, sized and scored on one GPU host without Ray: how far do N real
prompts and E epochs take the SmolLM2 drafter on held-out real prompts (tree and chain)?

    python benchmarks/gpu_recipe.py --target /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --pool pool.jsonl --eval chat.jsonl --eval everyday.jsonl --out $OUT \
        --run real1280:1280:4 --run real2560:2560:3 --run builtin1280:b1280:4

`--pool`: training prompts, one `{"messages": [...]}` per line (.jsonl or .jsonl.gz, as
benchmarks/base_pool.py writes them), in draw order (the loop's own split: write it with
`actors.prompts.plan_prompts`). A run `name:N:E` generates the first N (the data is shared: a
longer run reuses the shorter runs' shards), trains a scratch drafter E epochs with the demo's
training settings (benchmarks/recipe.py), exports it, and scores it in-process with `SpecEngine`
on each eval file (any format `data.source: jsonl` reads; tree 5/4/12 and chain 3, greedy, 96
tokens, end at EOS). `bN` draws from `--builtin`.
Generation and training run on the GPU; scoring runs on the host's CPU in fp32 (the engine's
bf16 CPU path needs AVX512-BF16). Prints one JSON line per run.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.config import DataConfig, TargetConfig  # noqa: E402
from actors.pool import read_pool  # noqa: E402
from actors.prompts import load_jsonl_prompts  # noqa: E402
from actors.shards import ShardInfo, write_manifest  # noqa: E402
from actors.target import TargetWorker  # noqa: E402
from benchmarks.harness import Results, parser, pick_device  # noqa: E402
from benchmarks.recipe import train_on_shards  # noqa: E402

BATCH = 128


def generate(worker: TargetWorker, prompts: list, out: Path, first: int) -> list:
    """Shards of `prompts` (batches numbered from `first`), kept across runs."""
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for b in range(0, len(prompts), BATCH):
        idx = first + b // BATCH
        if (out / f"b{idx:05d}.json").exists():  # made by an earlier call
            continue
        key = hashlib.sha256(json.dumps(prompts[b : b + BATCH]).encode()).hexdigest()[:16]
        res = worker.process(prompts[b : b + BATCH], str(out), idx, key)
        shards += list(res.shards)
    return shards


RECIPE = {"lr": 1e-3, "ttt": 3, "bs": 512, "vocab": 4096, "path": "auto", "warmup": 0.015}


def train(
    dirs: list[Path], target: str, epochs: int, out: Path, device: torch.device, **over
) -> dict:
    """The demo's recipe (RECIPE: ttt 3, 512-token batches, lr 1e-3, draft vocab 4096) on
    `dirs`, with `over` replacing any of its settings (path "reference" forces the reference
    TTT forward on the GPU, to check the fast path's figures)."""
    r = {**RECIPE, **over}
    ttt, evals, facts = int(r["ttt"]), [], {}

    def epoch_done(epoch: int, f: dict) -> None:
        m = f["eval"]
        evals.append([round(m["sim_accept_len"], 3), [round(m[f"acc_{i}"], 3) for i in range(ttt)]])
        facts.update(f)

    t = train_on_shards(
        dirs, target, epochs, device, epoch_done, lr=float(r["lr"]), tokens_per_batch=int(r["bs"]),
        ttt=ttt, vocab=int(r["vocab"]), path=str(r["path"]), warmup=float(r["warmup"]),
    )  # fmt: skip
    t.export(out)
    return {"train_s": round(facts["seconds"], 1), "samples": facts["train_samples"],
            "tokens": facts["train_tokens"], "sim_accept_by_epoch": evals}  # fmt: skip


def score(drafter: Path, target: str, evals: list[str], limit: int, threads: int) -> dict:
    """accept_len (mean over requests) of `drafter` on each eval file, tree and chain, on CPU."""
    torch.set_num_threads(threads)
    from actors.chat import prompt_ids
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    model, tok = load_target(target, dtype="float32")
    engine = SpecEngine(model, load_eagle(drafter, model))
    settings = {"tree": GenParams(max_tokens=96, steps=5, topk=4, num_draft_tokens=12),
                "chain3": GenParams(max_tokens=96, steps=3, topk=1)}  # fmt: skip
    out = {}
    for f in evals:
        ids = [prompt_ids(tok, p.messages) for p in load_jsonl_prompts(Path(f))[:limit]]
        for name, p in settings.items():
            lens = [g.stats.accept_len for g in (engine.generate([x], p)[0] for x in ids)]
            out[f"{Path(f).stem}/{name}"] = round(sum(lens) / len(lens), 3)
    return out


def main() -> None:
    ap = parser(__doc__, device="cuda")
    ap.add_argument("--target", required=True)
    ap.add_argument("--pool", required=True)
    ap.add_argument("--builtin", default=None)
    ap.add_argument("--eval", action="append", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--run", action="append", required=True,
        help="name:N:epochs[:key=value,...] (bN = builtin; keys of RECIPE)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--limit", type=int, default=24, help="first N prompts of each eval file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = pick_device(a.device)
    res = Results("gpu_recipe", device)
    worker = None
    pools = {k: [r["messages"] for r in read_pool(p)] if p else [] for k, p in [("", a.pool), ("b", a.builtin)]}  # fmt: skip
    runs = []
    for spec in a.run:
        name, n, epochs, *rest = spec.split(":")
        over = dict(kv.split("=") for kv in rest[0].split(",")) if rest else {}
        assert set(over) <= set(RECIPE), f"{spec}: keys are {sorted(RECIPE)}"
        kind, n = ("b", int(n[1:])) if n.startswith("b") else ("", int(n))
        runs.append((name, kind, n, int(epochs), over))
    gen_s = {}
    for kind in ("", "b"):  # generate each pool's longest prefix once; runs share the shards
        n = max([x[2] for x in runs if x[1] == kind], default=0)
        if n:
            t0 = time.perf_counter()
            out = a.out / f"data{kind or 'real'}"
            if not all((out / f"b{i:05d}.json").exists() for i in range(n // BATCH)):
                worker = worker or TargetWorker(
                    TargetConfig(model=a.target, dtype="bfloat16", num_gpus_per_actor=int(a.device == "cuda")),
                    DataConfig(source="builtin", max_new_tokens=128, batch_size=BATCH),
                )  # fmt: skip
                generate(worker, pools[kind][:n], out, 0)
            gen_s[kind] = round(time.perf_counter() - t0, 1)
    side = json.loads(next((a.out / "datareal").glob("b*.json")).read_text())
    info = {"target": side["target"], "aux_layer_ids": side["aux_layer_ids"]}
    del worker
    torch.cuda.empty_cache()
    results = {}
    for name, kind, n, epochs, over in runs:
        data = a.out / f"data{kind or 'real'}"
        shards = [s for p in sorted(data.glob("b*.json")) if int(p.stem[1:]) < n // BATCH
                  for s in json.loads(p.read_text())["shards"]]  # fmt: skip
        sub = a.out / f"{name}-data"
        sub.mkdir(parents=True, exist_ok=True)
        for s in shards:
            (sub / s["file"]).unlink(missing_ok=True)
            (sub / s["file"]).symlink_to((data / s["file"]).resolve())
        write_manifest(sub, info["target"], info["aux_layer_ids"], name, [ShardInfo(**s) for s in shards])  # fmt: skip
        results[name] = {"run": name, "prompts": n, "epochs": epochs, "gen_s_pool": gen_s[kind],
                         "over": over, **train([sub], a.target, epochs, a.out / name, device, **over)}  # fmt: skip
        res.emit(results[name])
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    per = max(1, a.threads // len(runs))
    with ProcessPoolExecutor(len(runs), mp_context=mp.get_context("spawn")) as pool:
        futs = {
            name: pool.submit(score, a.out / name, a.target, a.eval, a.limit, per)
            for name in results
        }
        for name, fut in futs.items():
            res.emit({**results[name], **fut.result()})


if __name__ == "__main__":
    main()
