"""Per-shape speedup of the embedded engine over plain decoding (issue 50): batch 1, greedy, real
chat prompts, the shipped base drafter, through `SpecEngine` as the server builds it.

Each of `--prompts-file`'s first `--prompts` prompts (chat template) is generated alone,
`--max-tokens` tokens (ignore_eos), by plain decoding and by each draft shape; a shape is timed
with its cycle's glue on the device (`glue: device`, the default) and, with `--host-glue`, also
with the host-side cycle (`glue: host`, what main ran before). One engine serves all shapes: it is
built with the first tree configured, the chains in `capture_chains` and the other trees in
`capture_trees`, so start-up captures every graph at batch 1 (`late_captures` is printed and
must stay 0). The shapes run interleaved per prompt, so drifting load hits them alike. `--batch N`
decodes the prompts N at a time as one batch in the static runner's rows: start-up captures plain
and the configured shape in every row bucket, and an untimed first batch of each shape, whole
requests, captures the rest (`warm_up_captures`; `late_captures` - `warm_up_captures` were
captured while timed, and must be 0).
Each row also splits the time: prefill ms per call (the target's and the drafter's over the
prompt), decode ms per token (the rest, per position of each call's longest request), and the
garbage collector's pauses inside the calls.

    python benchmarks/engine_shapes.py --dtype bfloat16                      # an H200
    .venv/bin/python benchmarks/engine_shapes.py --device cpu --prompts 2 --max-tokens 8 \\
        --shapes plain,chain-1,tree-3x2x4,tree-2x2x3 --runner static --host-glue  # CPU smoke test

Prints one JSON line per (shape, glue) and a summary line with the markdown table
(benchmarks/harness.py; also to $OUT/engine_shapes.jsonl when $OUT is set).
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser, pick_device, sync  # noqa: E402

DEFAULT_SHAPES = "plain,chain-1,chain-2,chain-3,chain-4,tree-5x4x12"


def parse_shape(name: str) -> tuple[int, int, int] | None:
    """'plain' -> None; 'chain-k' -> (k, 1, k + 1); 'tree-SxKxN' -> (S, K, N)."""
    if name == "plain":
        return None
    if m := re.fullmatch(r"chain-(\d+)", name):
        k = int(m.group(1))
        return k, 1, k + 1
    if m := re.fullmatch(r"tree-(\d+)x(\d+)x(\d+)", name):
        s, k, n = (int(g) for g in m.groups())
        return s, k, n
    raise SystemExit(f"--shapes: {name!r} is not plain, chain-K or tree-SxKxN")


def main() -> None:
    ap = parser(__doc__, device="auto")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="drafters/smollm2-135m-base")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts-file", default="benchmarks/prompts/everyday.jsonl")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--runner", default="auto", choices=["auto", "eager", "static"])
    ap.add_argument("--capacity", type=int, default=1024, help="static KV slots")
    ap.add_argument("--host-glue", action="store_true", help="also time the host-side cycle")
    ap.add_argument("--drafter-dtype", default="serving", choices=["serving", "float32"],
                    help="serving: the drafter in the target's dtype on a GPU (the default)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fused-matmuls", action="store_true",
                    help="the static runner's matmuls in serve/engine/kernels.py's few-rows kernel")  # fmt: skip
    ap.add_argument("--drafter-compile", default=None,
                    help="torch.compile backend of the static drafter's graphs (inductor)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=1,
                    help="requests decoded together (rows of the static runner)")  # fmt: skip
    args = ap.parse_args()
    if args.batch < 1:
        raise SystemExit(f"--batch {args.batch}: requests decoded together; give 1 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)

    from actors.chat import prompt_ids
    from actors.prompts import load_jsonl_prompts
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    shapes = {name: parse_shape(name) for name in args.shapes.split(",")}
    trees = [s for s in shapes.values() if s is not None and s[1] > 1]
    chains = tuple(s[0] for s in shapes.values() if s is not None and s[1] == 1)
    steps, topk, n_tok = trees[0] if trees else (max(chains or (1,)), 1, None)
    model, tok = load_target(args.target, dtype=args.dtype, device=str(device))
    convs = load_jsonl_prompts(Path(args.prompts_file))[: args.prompts]
    prompts = [prompt_ids(tok, p.messages) for p in convs]
    t = time.perf_counter()
    engine = SpecEngine(model, load_eagle(args.drafter, model), steps=steps, topk=topk,
                        num_draft_tokens=n_tok, capture_chains=chains or (1,),
                        capture_trees=tuple(trees[1:]),
                        static_capacity=args.capacity, runner=args.runner,
                        drafter_dtype=args.drafter_dtype, static_batch=args.batch,
                        drafter_compile=args.drafter_compile,
                        target_fused_matmuls=args.fused_matmuls)  # fmt: skip
    start_s = time.perf_counter() - t
    # progress as it goes: a run cut off by its time limit still says where the time went
    print(f"engine start-up {start_s:.1f} s", flush=True)
    res = Results("engine_shapes", device, {
        "target": args.target, "drafter": args.drafter, "dtype": args.dtype,
        "prompts_file": args.prompts_file, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "runner": "static" if engine.static is not None else "eager",
        "graphs": bool(engine.static is not None and engine.static.use_graphs),
        "drafter_dtype": str(next(engine.drafter.model.parameters()).dtype),
        "drafter_compile": args.drafter_compile, "batch": args.batch,
        "fused_matmuls": args.fused_matmuls,
    })  # fmt: skip
    glues = ["device", "host"] if args.host_glue else ["device"]
    runs = [(name, glue) for name, s in shapes.items() for glue in (glues if s else ["-"])]
    tokens = {r: 0 for r in runs}
    secs = {r: 0.0 for r in runs}
    passes = {r: 0 for r in runs}
    prefill = {r: 0.0 for r in runs}  # ms: where a request's time goes besides decoding
    steps = {r: 0 for r in runs}  # decoded positions: each call's longest request's tokens
    gc_ms = {r: 0.0 for r in runs}  # the garbage collector's pauses inside the timed calls
    outs: dict[tuple[str, str], list[list[int]]] = {r: [] for r in runs}
    groups = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    with torch.inference_mode():
        # First calls: allocation, the drafter's cast, caches, and the graphs of the shapes that
        # start-up captured for one row only (a batch captures plain and the configured shape):
        # whole requests, so a batch that shrinks as its rows end captures each row bucket here.
        warm = GenParams(max_tokens=8 if args.batch == 1 else args.max_tokens, ignore_eos=True)
        for name, glue in runs:
            measure(engine, groups[0], warm, shapes[name], glue, device)
        warm_captures = engine.late_captures()
        print(f"warm-up done at {time.perf_counter() - t:.1f} s", flush=True)
        for group in groups:
            for name, glue in runs:
                params = GenParams(max_tokens=args.max_tokens, ignore_eos=True)
                with gc_clock() as paused:
                    gens, s = measure(engine, group, params, shapes[name], glue, device)
                gc_ms[name, glue] += paused[0]
                prefill[name, glue] += max(g.stats.prefill_ms for g in gens)
                steps[name, glue] += max(len(g.token_ids) for g in gens)
                tokens[name, glue] += sum(len(g.token_ids) for g in gens)
                secs[name, glue] += s
                passes[name, glue] += sum(g.stats.spec_verify_ct for g in gens)
                outs[name, glue] += [g.token_ids for g in gens]
    plain = tokens["plain", "-"] / secs["plain", "-"] if ("plain", "-") in runs else None
    rows = []
    for name, glue in runs:
        tps = tokens[name, glue] / secs[name, glue]
        row = {
            "shape": name,
            "glue": glue,
            "tok_per_s": round(tps, 1),
            "ms_per_token": round(1000 / tps, 3),
            "speedup": round(tps / plain, 3) if plain else None,
            "accept_len": round(tokens[name, glue] / passes[name, glue], 3)
            if passes[name, glue]
            else None,
            "same_tokens_as_plain": outs[name, glue] == outs["plain", "-"]
            if ("plain", "-") in runs
            else None,
            "prefill_ms_per_call": round(prefill[name, glue] / len(groups), 2),
            "decode_ms_per_token": round((secs[name, glue] * 1000 - prefill[name, glue]) / steps[name, glue], 3),
            "gc_ms_total": round(gc_ms[name, glue], 1),
        }  # fmt: skip
        res.emit(row)
        rows.append(row)
    table = [
        "| shape | glue | tok/s | ms/token | speedup | accept_len | prefill ms | decode ms/token | gc ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    table += [f"| {r['shape']} | {r['glue']} | {r['tok_per_s']} | {r['ms_per_token']} | "
              f"{r['speedup']} | {r['accept_len']} | {r['prefill_ms_per_call']} | "
              f"{r['decode_ms_per_token']} | {r['gc_ms_total']} |" for r in rows]  # fmt: skip
    res.emit({"shape": "summary", "start_up_s": round(start_s, 1),
              "late_captures": engine.late_captures(), "warm_up_captures": warm_captures,
              "table": "\n".join(table)})  # fmt: skip
    print("\n".join(table))


@contextlib.contextmanager
def gc_clock():
    """Milliseconds the cyclic garbage collector ran inside the block (a one-item list, filled
    at its end): a full collection over a process that compiled code scans its objects."""
    paused, began = [0.0], [0.0]

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            paused[0] += (time.perf_counter() - began[0]) * 1000

    gc.callbacks.append(clock)
    try:
        yield paused
    finally:
        gc.callbacks.remove(clock)


def measure(engine, prompts: list[list[int]], params, shape, glue: str, device):
    """The requests of `prompts` as one batch of `shape` (None: plain decoding) with the glue on
    the device or the host; (their generations, the batch's seconds)."""
    from dataclasses import replace

    engine.device_glue = glue != "host"
    sync(device)
    t = time.perf_counter()
    if shape is None:
        gens = engine.plain_generate(prompts, params)
    else:
        steps, topk, n_tok = shape
        gens = engine.generate(prompts, replace(params, steps=steps, topk=topk, num_draft_tokens=n_tok))  # fmt: skip
    sync(device)
    return gens, time.perf_counter() - t


if __name__ == "__main__":
    main()
