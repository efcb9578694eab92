"""Per-cycle cost of the embedded engine (issue 42): draft, verify and overhead per verify pass,
the static drafter on and off, plain decoding beside it, at batch 1, 4 and 16, in one run.

For each batch size b, the first b held-out prompts (built-in prompts, chat template) decode
together in one `generate` call, greedy, `--max-tokens` each (ignore_eos), in three modes:
  - plain: the target alone (`plain_generate`);
  - eager_draft: speculative with the drafter as `EagleDraft` (the reference; eager);
  - static_draft_host_glue: speculative with `StaticEagleDraft` (static shapes; CUDA graphs on
    a GPU) and the cycle's glue on the host (`device_glue=False`: what main ran before issue 50);
  - static_draft: the same with the glue on the device (greedy on the static runner: one host
    read a cycle; elsewhere the same as static_draft_host_glue);
  - static_draft_compiled (with `--drafter-compile BACKEND`): static_draft with the drafter's
    graphed functions compiled by BACKEND (inductor): before and after in one run.
Per mode: tok/s (all completion tokens / the call's wall time), speedup over plain at the same
batch, accept_len, and per verify pass (of the request that ran the most passes, active the
whole call): draft ms (proposals + the cache extension), verify ms (the target's pass; with the
host glue also acceptance), accept ms (device glue: acceptance, the cache move and the queued
host copy, timed by CUDA events on a GPU), overhead ms (the rest of decoding: bookkeeping,
Python, host transfers) and their shares, and `late_captures`: CUDA graphs captured after the
engine's start-up (each one a capture inside a request's time; 0 when start-up captured every
shape; batches of several rows capture their buckets in an untimed warm-up call first). With the static runner (a GPU, or `--runner static`) a batch runs in groups of
`--static-batch` rows (1: one request after the other, `batched: false` in the record).
`--target-compile-mode MODE` compiles the static runner's step with torch.compile's MODE
(max-autotune-no-cudagraphs: triton matmul templates, autotuned at start-up); `--fused-matmuls`
runs its steps' matmuls in serve/engine/kernels.py's few-rows kernel. `--profile` (CUDA)
adds the kernels of one target step at batch 1, plain (1 entry) and verify (steps + 1 entries,
with the aux states): kernels a step, their summed µs against the graph's replay µs (the rest is
gaps between kernels), and the kernels that cost most.

    .venv/bin/python benchmarks/engine_breakdown.py --target smollm2 \\
        --drafter drafters/smollm2-135m-base --threads 2          # CPU: eager batched runner
    python benchmarks/engine_breakdown.py --target smollm2 --drafter drafters/smollm2-135m-base \\
        --dtype bfloat16 --max-tokens 128                           # an H200: graphs on

Prints one JSON line per (batch, mode) and a summary line (benchmarks/harness.py; also to
$OUT/engine_breakdown.jsonl when $OUT is set).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser, pick_device, sync  # noqa: E402

MODES = ("plain", "eager_draft", "static_draft_host_glue", "static_draft")
COMPILED = "static_draft_compiled"


def breakdown(engine, prompts: list[list[int]], params, mode: str, device) -> dict:
    """One `generate` of `prompts` as a batch in `mode`; the record described in the module doc."""
    engine.device_glue = mode != "static_draft_host_glue"
    sync(device)
    t = time.perf_counter()
    if mode == "plain":
        out = engine.plain_generate(prompts, params)
    else:
        out = engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - t
    tokens = sum(len(g.token_ids) for g in out)
    st = max((g.stats for g in out), key=lambda s: (s.spec_verify_ct, s.completion_tokens))
    passes = st.spec_verify_ct or max(st.completion_tokens - 1, 1)
    decode = st.total_ms - st.prefill_ms
    rest = decode - st.draft_ms - st.verify_ms - st.accept_ms
    return {
        "mode": mode,
        "batch": len(prompts),
        "tok_per_s": tokens / wall,
        "accept_len": (sum(g.stats.completion_tokens for g in out)
                       / sum(g.stats.spec_verify_ct for g in out)) if mode != "plain" else 1.0,
        "passes": passes,
        "cycle_ms": decode / passes,
        "draft_ms": st.draft_ms / passes,
        "verify_ms": st.verify_ms / passes,
        "accept_ms": st.accept_ms / passes,  # device glue only (the host path counts it in verify)
        "overhead_ms": rest / passes,
        "draft_share": st.draft_ms / decode,
        "overhead_share": rest / decode,
        "late_captures": engine.late_captures(),  # graphs captured after start-up: must be 0
    }  # fmt: skip


def step_profile(runner, q: int, aux: bool, reps: int = 50) -> dict:
    """The kernels of one step of the static runner `runner` (CUDA graphs) at batch 1 with q new
    entries over a 256-token context: the graph's replay µs (CUDA events, `reps` replays), and
    the kernels the step's code launches outside a graph (the same kernels the graph holds):
    their count, summed µs, and the 12 that cost most (name, calls, µs)."""
    from torch.profiler import ProfilerActivity, profile

    aux = aux and bool(runner.aux_ids)
    runner.release()
    runner.prefill([[1] * 256], aux=aux)
    packed = runner._pack(
        torch.zeros(1, q, dtype=torch.long), torch.arange(256, 256 + q)[None], None
    )
    span = runner._span(q)
    g = runner._graph(q, span, aux, packed)
    g.inputs.copy_(packed)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.graph.replay()
    start.record()
    for _ in range(reps):
        g.graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) * 1000 / reps
    inputs = packed.to(runner.device)
    runner._core(inputs, q, span, aux)  # warm (compiled already)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner._core(inputs, q, span, aux)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.time_range.elapsed_us() / 3)
    runner.release()
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "q": q, "aux": aux, "span": span, "replay_us": round(replay_us, 1),
        "kernels_per_step": round(sum(len(v) for v in kernels.values()) / 3, 1),
        "kernel_us": round(sum(sum(v) for v in kernels.values()), 1),
        "top": [(name[:90], len(v) // 3, round(sum(v), 1)) for name, v in top],
    }  # fmt: skip


def main() -> None:
    ap = parser(__doc__, device="auto")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="drafters/smollm2-135m-base")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runner", default="auto", choices=["auto", "eager", "static"])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1, help="> 1: a tree")
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=4096, help="static KV slots")
    ap.add_argument("--static-batch", type=int, default=1, help="rows the static runner holds")
    ap.add_argument("--drafter-compile", default=None,
                    help="adds mode static_draft_compiled: the static drafter compiled by this backend")  # fmt: skip
    ap.add_argument("--target-compile-mode", default=None,
                    help="torch.compile mode of the static runner's step (max-autotune-no-cudagraphs)")  # fmt: skip
    ap.add_argument("--fused-matmuls", action="store_true",
                    help="the static runner's matmuls in the few-rows kernel (norms, SwiGLU inside)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="the kernels of one target step (CUDA)")
    ap.add_argument("--profile-only", action="store_true",
                    help="only --profile, on a runner that compiles just the profiled shapes")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if (args.profile or args.profile_only) and device.type != "cuda":
        raise SystemExit("--profile: the kernels of a step are CUDA's; use --device cuda")

    from actors.chat import prompt_ids
    from actors.prompts import builtin_prompts, split_prompts
    from serve.engine import GenParams, SpecEngine, StaticEagleDraft, load_eagle, load_target

    model, tok = load_target(args.target, dtype=args.dtype, device=str(device))
    batches = [int(b) for b in args.batches.split(",")]
    heldout = split_prompts(builtin_prompts(0), 64, 0)[1][: max(batches)]
    prompts = [prompt_ids(tok, conv) for conv in heldout]
    shape = dict(steps=args.steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    if args.profile_only:  # a bare runner: no engine start-up compiling every shape
        from serve.engine import StaticTargetRunner

        runner = StaticTargetRunner(model, args.capacity, compile_mode=args.target_compile_mode,
                                    fused_matmuls=args.fused_matmuls)  # fmt: skip
        runner.set_aux_layers(load_eagle(args.drafter, model).aux_layer_ids)
        res = Results("engine_breakdown", device, {"target": args.target, "dtype": args.dtype,
                      "target_compile_mode": args.target_compile_mode,
                      "fused_matmuls": args.fused_matmuls})  # fmt: skip
        return profile_report(res, runner, args.steps)
    engines, start_up = {}, {}
    built = [("eager_draft", False, None), ("static_draft", True, None)]
    if args.drafter_compile:
        built.append((COMPILED, True, args.drafter_compile))
    modes = MODES + ((COMPILED,) if args.drafter_compile else ())
    for mode, static_draft, backend in built:
        drafter = load_eagle(args.drafter, model)
        drafter.model.to(device)
        t = time.perf_counter()  # start-up: compiles and graph captures (shared codes reused)
        engines[mode] = SpecEngine(model, drafter, runner=args.runner, static_draft=static_draft,
                                   static_capacity=args.capacity, static_batch=args.static_batch,
                                   drafter_compile=backend, target_compile_mode=args.target_compile_mode,
                                   target_fused_matmuls=args.fused_matmuls, **shape)  # fmt: skip
        start_up[mode] = round(time.perf_counter() - t, 1)
        print(f"{mode} engine start-up {start_up[mode]} s", flush=True)  # a cut-off run says it
        assert isinstance(engines[mode].drafter, StaticEagleDraft) == static_draft
    engines["plain"] = engines["eager_draft"]
    engines["static_draft_host_glue"] = engines["static_draft"]
    e = engines["static_draft"]
    batched = e.static is None or e.static.max_batch > 1
    res = Results("engine_breakdown", device, {
        "target": args.target, "drafter": args.drafter, "dtype": args.dtype,
        "runner": "static" if e.static is not None else "eager", "batched": batched,
        "graphs": bool(e.static is not None and e.static.use_graphs), "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(), "drafter_compile": args.drafter_compile,
        "target_compile_mode": args.target_compile_mode, "fused_matmuls": args.fused_matmuls,
        **shape,
    })  # fmt: skip
    params = GenParams(max_tokens=args.max_tokens, ignore_eos=True)
    with torch.inference_mode():
        # Warm each (batch, mode) first: allocation, and the graphs and compiled code of the
        # batch's row bucket, which start-up captures only for one row. Without this a batch's
        # first timed call pays them (a 4-row plain step measured 22.9 ms instead of about 1).
        for b in batches:
            for mode in modes:
                breakdown(engines[mode], prompts[:b], GenParams(max_tokens=8, ignore_eos=True),
                          mode, device)  # fmt: skip
    print("warm-up done", flush=True)
    summary = {}
    for b in batches:
        rows = {}
        for mode in modes:  # interleaved per batch: drifting load hits all modes alike
            with torch.inference_mode():
                rows[mode] = breakdown(engines[mode], prompts[:b], params, mode, device)
        for row in rows.values():
            row["speedup"] = row["tok_per_s"] / rows["plain"]["tok_per_s"]
            res.emit(row)
            print(f"batch {b} {row['mode']}: {row['tok_per_s']:.1f} tok/s, {row['speedup']:.3f}x, "
                  f"cycle {row['cycle_ms']:.3f} ms", flush=True)  # fmt: skip
        summary[str(b)] = {m: {k: round(rows[m][k], 3) for k in ("tok_per_s", "speedup",
                           "cycle_ms", "draft_ms", "verify_ms", "accept_ms", "overhead_ms")} for m in modes}  # fmt: skip
    late = {m: engines[m].late_captures() for m in modes}
    res.emit(
        {"mode": "summary", "by_batch": summary, "late_captures": late, "start_up_s": start_up}
    )
    cols = ("tok_per_s", "speedup", "cycle_ms", "draft_ms", "verify_ms", "accept_ms", "overhead_ms")
    print("| batch | mode | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for b, by_mode in summary.items():
        for m, row in by_mode.items():
            print(f"| {b} | {m} | " + " | ".join(str(row[c]) for c in cols) + " |")
    if args.profile and e.static is not None and e.static.use_graphs:
        profile_report(res, e.static, args.steps)


def profile_report(res: Results, runner, steps: int) -> None:
    """`step_profile` of a plain step and a chain's verify, printed and emitted."""
    with torch.inference_mode():
        for q, aux in ((1, False), (steps + 1, True)):
            t = time.perf_counter()
            p = step_profile(runner, q, aux)
            res.emit({"mode": "profile", "first_call_s": round(time.perf_counter() - t, 1), **p})
            print(f"\ntarget step q={q} aux={aux}: replay {p['replay_us']} us, "
                  f"{p['kernels_per_step']} kernels summing {p['kernel_us']} us")  # fmt: skip
            for name, calls, us in p["top"]:
                print(f"  {us:8.1f} us  {calls:4d}x  {name}")


if __name__ == "__main__":
    main()
