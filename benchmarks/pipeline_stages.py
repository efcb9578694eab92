"""Each stage of a finished pipeline run, re-run standalone on the same machine and the same inputs,
without Ray or HTTP: what the pipeline costs on top of its stages' own code.

    python benchmarks/pipeline_stages.py --run-dir RUN [--round 0] [--out stages.jsonl]

- generate: the round's prompts, recovered from its shards (each sample's tokens before its first
  trained one), in the data stage's batches, through `HFTarget.generate` (the call the target
  actor makes). Pipeline: the data stage's gen_tok_per_s (timed inside the actor) and its wall
  rate (the generated tokens over the whole stage: actor start, capture and shard writes in it).
- capture: the same sequences through `TargetWorker.capture_batch`, the data stage's own capture
  and shard writer, in this process. Pipeline: capture_tok_per_s.
- train: benchmarks/train_step.py at the round's shape (draft vocab, TTT length, tokens per
  batch, mean sample length). Pipeline: the Ray Train job's tok_per_s.
- serve: `SpecEngine` built as the Serve replica builds it, on the benchmark's own prompts, one
  at a time: plain decoding, and the shape the round served. Pipeline: the benchmark's tok/s,
  over HTTP through the Serve proxy.
Prints one JSON line per stage, then a table.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from actors.shards import iter_samples, read_shard  # noqa: E402
from benchmarks.harness import Results, clocked, parser  # noqa: E402
from pipeline.config import Config, load_config  # noqa: E402


def batches_of(manifest: Path, fresh_batches: int) -> list[list[tuple[list[int], list[int]]]]:
    """(input_ids, loss_mask) of every sample of the generated batches, by batch index (shards
    are named b<batch>-<part>; batches past `fresh_batches` were traffic, never generated)."""
    out: dict[int, list] = {}
    for s in json.loads(manifest.read_text())["shards"]:
        b = int(s["file"][1:6])
        if b < fresh_batches:
            for x in iter_samples(read_shard(manifest.parent / s["file"])):
                out.setdefault(b, []).append((x["input_ids"].tolist(), x["loss_mask"].tolist()))
    return [out[b] for b in sorted(out)]


def split(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    first = mask.index(1) if 1 in mask else len(mask)
    return ids[:first], ids[first:]


def data_stages(cfg: Config, rec: dict, batches: list) -> list[dict]:
    from actors.batch_records import Generated, write_generated
    from actors.target import TargetWorker

    worker = TargetWorker(cfg.target, cfg.data)
    d, device = cfg.data, worker.backend.device
    new_tokens, same, seconds = 0, 0, 0.0
    for i, batch in enumerate(batches):
        prompts, replies = zip(*(split(ids, m) for ids, m in batch), strict=True)
        new, took = clocked(
            lambda: worker.backend.generate(list(prompts), d.max_new_tokens, d.temperature, d.seed + i),  # noqa: B023
            device,
        )  # fmt: skip
        seconds += took
        new_tokens += sum(map(len, new))
        same += sum(list(r) == list(n)[: len(r)] for r, n in zip(replies, new, strict=True))
    n = sum(map(len, batches))
    wall = rec.get("wall_s") or rec["seconds"]
    gen_row = {
        "stage": "generate",
        "standalone_tok_per_s": new_tokens / seconds,
        "pipeline_tok_per_s": rec["gen_tok_per_s"],
        "pipeline_wall_tok_per_s": rec.get("gen_tokens", new_tokens) / wall,
        "tokens": new_tokens,
        "replies_equal_to_pipeline": same / n,
        "prompts": n,
        "actors_ready_s": rec.get("actors_ready_s"),
        "stage_wall_s": wall,
    }
    tokens, cap_s = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, batch in enumerate(batches):
            g = Generated([x for x, _ in batch], [m for _, m in batch], len(batch), 0, 0, 0.0)
            write_generated(tmp, i, f"k{i}", g)
            r = worker.capture_batch(tmp, i, f"k{i}")
            tokens, cap_s = tokens + r.capture_tokens, cap_s + r.capture_seconds
    cap_row = {
        "stage": "capture",
        "standalone_tok_per_s": tokens / cap_s,
        "pipeline_tok_per_s": rec["capture_tok_per_s"],
        "tokens": tokens,
    }
    worker.close()  # its model is freed on return, before the serve stage loads another
    return [gen_row, cap_row]


def train_stage(cfg: Config, rec: dict, mean_len: int, drafter_dir: Path) -> dict:
    from pipeline.train_worker import read_metrics

    tc = cfg.train
    vocab = json.loads((drafter_dir / "config.json").read_text()).get("draft_vocab_size")
    cmd = [sys.executable, str(Path(__file__).with_name("train_step.py")), "--shape", "smollm2",
           "--ttt", str(tc.ttt_length), "--tokens-per-batch", str(tc.tokens_per_batch),
           "--sample-len", str(mean_len), "--steps", "8"]  # fmt: skip
    if vocab:
        cmd += ["--draft-vocab", str(vocab)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    # the workers' steps after the first (which compiles), as the standalone times its steps
    steps = [m for m in read_metrics(Path(rec["metrics_file"])) if "step_s" in m]
    steady = statistics.median(m["tok_per_s"] for m in steps[1:]) if len(steps) > 1 else 0.0
    return {
        "stage": "train",
        "standalone_tok_per_s": got["tok_per_s"],
        "standalone_first_epoch_tok_per_s": got["tok_per_s_first_epoch"],
        "pipeline_tok_per_s": steady,
        "pipeline_first_step_s": steps[0]["step_s"] if steps else None,
        "pipeline_stage_tok_per_s": rec["tok_per_s"],
        "pipeline_wall_tok_per_s": rec["train_tokens"] * cfg.train.epochs / rec["wall_s"],
        "stage_wall_s": rec["wall_s"],
        "standalone": {
            k: got[k] for k in ("device", "draft_vocab", "ttt", "dtype", "path") if k in got
        },
    }


def serve_stage(cfg: Config, bench: dict, drafter_dir: str) -> dict:
    from actors.chat import prompt_ids
    from actors.cluster import reserved_device
    from actors.prompts import plan_prompts
    from pipeline.loop import _eval_set as eval_set  # the loop's own held-out set
    from serve.engine import GenParams, SpecEngine, eos_ids, load_eagle, load_target

    t = cfg.target
    device = reserved_device(cfg.serve.num_gpus, "serve.num_gpus")  # where the replica ran
    lm, tok = load_target(t.model, t.gguf_file, t.dtype, t.revision, t.trust_remote_code, device)
    s = cfg.serve
    engine = SpecEngine(lm, steps=s.steps, stop_ids=eos_ids(lm) | {tok.eos_token_id},
                        topk=s.topk, num_draft_tokens=s.num_draft_tokens)  # fmt: skip
    engine.set_drafter(load_eagle(drafter_dir, engine.target.model))
    messages, _ = eval_set(cfg, plan_prompts(cfg.data))
    prompts = [prompt_ids(tok, m) for m in messages]
    shape = bench.get("shape") or {}
    configured = GenParams(cfg.bench.max_tokens)  # the benchmark's own shape (the config's)
    served = GenParams(cfg.bench.max_tokens, steps=shape.get("steps"), topk=shape.get("topk"),
                       num_draft_tokens=shape.get("num_draft_tokens"))  # fmt: skip
    runs = {
        "plain": lambda p: engine.plain_generate([p], configured),
        "configured": lambda p: engine.generate([p], configured),
        "served": lambda p: engine.generate([p], served),
    }
    for p in prompts[: cfg.bench.warmup]:  # the benchmark's warm-up requests
        for run in runs.values():
            run(p)

    def rate(run, n: int) -> float:
        toks, secs = 0, 0.0
        for p in prompts[cfg.bench.warmup : cfg.bench.warmup + n]:
            gens, took = clocked(lambda: run(p), device)  # noqa: B023
            toks, secs = toks + len(gens[0].token_ids), secs + took
        return toks / secs

    plain_tps = rate(runs["plain"], cfg.bench.baseline_prompts or len(prompts))
    conf_tps = rate(runs["configured"], len(prompts))
    if shape.get("served") == "plain":  # the shape chooser found drafting slower
        served_tps = plain_tps
    else:
        served_tps = rate(runs["served"], len(prompts)) if shape else conf_tps
    return {
        "stage": "serve",
        "standalone_tok_per_s": served_tps,
        "pipeline_tok_per_s": shape.get("served_tok_per_s") or bench["tok_per_s"],
        "shape": shape.get("served"),
        "standalone_plain_tok_per_s": plain_tps,
        "pipeline_plain_tok_per_s": bench["baseline_tok_per_s"],
        "standalone_configured_shape_tok_per_s": conf_tps,
        "pipeline_configured_shape_tok_per_s": bench["tok_per_s"],
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of: data,train,serve")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = load_config(str(a.run_dir / "config.resolved.yaml"))
    done = json.loads((a.run_dir / "state.json").read_text())["rounds"][a.round]["done"]
    gen, train, bench = done["generate"], done["train"], done["bench"]
    fresh = -(-gen.get("fresh_prompts", 0) // cfg.data.batch_size)
    batches = batches_of(Path(gen["manifest"]), fresh)
    rows = []
    if "data" not in a.skip:
        rows += data_stages(cfg, gen, batches)
    if "train" not in a.skip:
        lens = [len(ids) for b in batches for ids, _ in b]
        rows.append(train_stage(cfg, train, sum(lens) // max(1, len(lens)), Path(train["drafter_dir"])))  # fmt: skip
    if "serve" not in a.skip:
        rows.append(serve_stage(cfg, bench, train["drafter_dir"]))
    res = Results("pipeline_stages", "cuda" if torch.cuda.is_available() else "cpu")
    lines = []
    for r in rows:
        r = res.emit({"round": a.round, **r, "ratio": r["pipeline_tok_per_s"] / r["standalone_tok_per_s"]})  # fmt: skip
        lines.append(json.dumps(r))
    if a.out:
        a.out.write_text("".join(x + "\n" for x in lines))
    print(f"\n{'stage':10} {'standalone':>12} {'pipeline':>12} {'ratio':>7}")
    for r in map(json.loads, lines):
        print(f"{r['stage']:10} {r['standalone_tok_per_s']:12.0f} {r['pipeline_tok_per_s']:12.0f} {r['ratio']:7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
