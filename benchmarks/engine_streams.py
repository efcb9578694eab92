"""Concurrent streams on the static runner (issue 56): requests that arrive over time, served as
whole batches (a request that arrives while a batch runs waits for it to end) and with joins
(continuous batching: it joins the running batch between cycles), plain and speculative, greedy,
in one run.

Request i arrives `i * --gap-ms` after the first. One scheduler thread, as the server's engine:
when idle it starts a batch of every request that has arrived (up to `--static-batch` rows); with
joins the running batch also takes arrived requests into its free rows between cycles
(`SpecEngine.generate(joins=...)`). Each request asks `--max-tokens` tokens (ignore_eos). Per
mode: aggregate tok/s (all tokens / the wall from the first arrival to the last finish), mean and
p90 latency (finish - arrival), and the engine calls. The prompts are the built-in held-out
prompts (chat template), as engine_breakdown.py's.

    python benchmarks/engine_streams.py --dtype bfloat16 --drafter-compile inductor   # a GPU
    .venv/bin/python benchmarks/engine_streams.py --device cpu --runner static --streams 4 \\
        --static-batch 4 --max-tokens 8 --gap-ms 50                                  # CPU smoke

Prints one JSON line per mode and a markdown table (benchmarks/harness.py; also to
$OUT/engine_streams.jsonl when $OUT is set).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser, pick_device  # noqa: E402


def serve(engine, prompts: list[list[int]], n_tokens: int, gap_s: float, joins_on: bool,
          speculative: bool) -> dict:  # fmt: skip
    """Run the arrivals through `engine`; the mode's record."""
    from serve.engine import GenParams

    params, n = GenParams(max_tokens=n_tokens, ignore_eos=True), len(prompts)
    t0 = time.perf_counter()
    arrive = [t0 + i * gap_s for i in range(n)]
    finish: list[float] = [0.0] * n
    got = [0] * n
    nxt, calls = 0, 0

    def arrived(most: int) -> list[int]:
        nonlocal nxt
        taken = []
        while nxt < n and len(taken) < most and arrive[nxt] <= time.perf_counter():
            taken.append(nxt)
            nxt += 1
        return taken

    while nxt < n:
        time.sleep(max(0.0, arrive[nxt] - time.perf_counter()))
        ids = arrived(engine.static.max_batch)  # engine request index -> arrival index

        def on_tokens(r: int, toks: list[int], ids: list[int] = ids) -> None:
            got[ids[r]] += len(toks)
            if got[ids[r]] >= n_tokens:
                finish[ids[r]] = time.perf_counter()

        def joins(free: int, ids: list[int] = ids) -> list[tuple[list[int], int]]:
            taken = arrived(free)
            ids.extend(taken)
            return [(prompts[i], n_tokens) for i in taken]

        run = engine.generate if speculative else engine.plain_generate
        kw = {"speculative": True} if speculative else {}
        run([prompts[i] for i in ids], params, on_tokens=on_tokens,
            joins=joins if joins_on else None, **kw)  # fmt: skip
        calls += 1
    lat = sorted(f - a for f, a in zip(finish, arrive, strict=True))
    return {
        "tok_per_s": sum(got) / (max(finish) - t0),
        "mean_latency_s": statistics.mean(lat),
        "p90_latency_s": lat[int(0.9 * (n - 1))],
        "engine_calls": calls,
        "tokens": sum(got),
    }


def main() -> None:
    ap = parser(__doc__, device="auto")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="drafters/smollm2-135m-base")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runner", default="auto", choices=["auto", "static"])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=1024, help="static KV slots")
    ap.add_argument("--drafter-compile", default=None, help="torch.compile backend (inductor)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)

    from actors.chat import prompt_ids
    from actors.prompts import builtin_prompts, split_prompts
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    model, tok = load_target(args.target, dtype=args.dtype, device=str(device))
    heldout = split_prompts(builtin_prompts(0), 64, 0)[1][: args.streams]
    prompts = [prompt_ids(tok, conv) for conv in heldout]
    engine = SpecEngine(model, load_eagle(args.drafter, model), steps=args.steps,
                        runner=args.runner, static_capacity=args.capacity,
                        static_batch=args.static_batch, drafter_compile=args.drafter_compile)  # fmt: skip
    if engine.static is None:
        raise SystemExit("joins need the static runner: --runner static (CPU) or a CUDA device")
    res = Results("engine_streams", device, {
        "target": args.target, "drafter": args.drafter, "dtype": args.dtype, "streams": args.streams,
        "static_batch": args.static_batch, "gap_ms": args.gap_ms, "max_tokens": args.max_tokens,
        "steps": args.steps, "drafter_compile": args.drafter_compile,
    })  # fmt: skip
    modes = [(spec, joins) for spec in (False, True) for joins in (False, True)]
    rows = []
    with torch.inference_mode():
        for spec in (False, True):  # warm: each row bucket's first call (allocation, caches)
            run = engine.generate if spec else engine.plain_generate
            for b in sorted({1 << i for i in range(args.static_batch.bit_length())} | {args.static_batch}):  # fmt: skip
                if b <= args.static_batch:
                    run(prompts[:1] * b, GenParams(max_tokens=8, ignore_eos=True))
        for spec, joins in modes:
            rec = serve(engine, prompts, args.max_tokens, args.gap_ms / 1000, joins, spec)
            rec = {
                "mode": ("speculative" if spec else "plain") + (" + joins" if joins else ""),
                **rec,
            }
            rec["late_captures"] = engine.late_captures()
            rows.append(res.emit(rec))
    print("| mode | tok/s | mean latency s | p90 latency s | engine calls |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_per_s']:.1f} | {r['mean_latency_s']:.3f} | "
              f"{r['p90_latency_s']:.3f} | {r['engine_calls']} |")  # fmt: skip


if __name__ == "__main__":
    main()
