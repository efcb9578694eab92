"""Speculative-cycle overhead of the embedded engine on CPU (SmolLM2-135M, batch 1, greedy).

Measures, on held-out built-in prompts:
  - plain decoding tok/s vs speculative tok/s with an untrained drafter (accept_len ~1, the worst
    case: every cycle pays drafting + verify and emits one token);
  - draft ms and verify ms per cycle;
  - forward micro-benchmarks at the same context: one decode step (1 token) vs one verify pass
    (steps+1 tokens), one drafter extend and one draft step;
  - the break-even accept_len = cycle ms / decode-step ms a trained drafter must beat;
  - `--overhead`: the engine's drafting overhead per verify pass, for the chain and (with
    --topk) the tree: decode time outside the target's forward passes and the drafter's
    (`EagleDraft._prenorm`, `_tree_step`, its LM head), i.e. tree building, acceptance, KV cache
    bookkeeping and Python; also in decode-step units, and the plain loop's own overhead.
Prints one JSON line (benchmarks/harness.py).

  .venv/bin/python benchmarks/engine_cpu.py --max-tokens 64 --prompts 4 --steps 3
  .venv/bin/python benchmarks/engine_cpu.py --dtype auto --draft-vocab 4096 --threads 1 \
      --steps 5 --topk 4 --num-draft-tokens 12 --overhead     # the demo's shape (configs/smollm2-cpu.yaml)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser  # noqa: E402


def interleaved_ms(fns: dict, reps: int) -> dict[str, dict[str, float]]:
    """Run the callables round-robin `reps` times (so background load hits all alike); min and
    median ms of each. On a shared CPU the min is the cleaner number."""
    for fn in fns.values():
        fn()  # warm
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1000)
    return {k: {"min": min(v), "median": statistics.median(v)} for k, v in times.items()}


@torch.inference_mode()
def micro(engine, prompt: list[int], steps: int, reps: int) -> dict[str, dict[str, float]]:
    """ms of: a 1-token decode step, a (steps+1)-token verify pass, a drafter extend of one slot
    and a chain of 1 and 2 draft steps, all at the prompt's context length (cache cropped back)."""
    runner, drafter = engine.target, engine.drafter
    logits, aux, ids, valid = runner.prefill([prompt], aux=True)
    n = len(prompt)
    one = torch.ones(1, 1, dtype=torch.bool)

    def target_pass(q: int):
        ids_q = torch.randint(100, 1000, (1, q))
        pos = torch.arange(n, n + q)[None]
        runner.forward(ids_q, pos, torch.ones(1, q, dtype=torch.bool), aux=q > 1)
        runner.commit(torch.zeros(1, q, dtype=torch.bool))  # masked, then cropped away

    drafter.start(1, n + 64)
    x = torch.cat([ids[:, 1:], logits.argmax(-1)[:, None]], 1)
    pos = torch.arange(n)[None]
    drafter.extend(x, aux, pos, valid)
    fns = {
        "decode_1_token": lambda: target_pass(1),
        f"verify_{steps + 1}_tokens": lambda: target_pass(steps + 1),
        "drafter_extend_1_slot": lambda: drafter.extend(x[:, -1:], aux[:, -1:], pos[:, -1:], one),
        "draft_1_step": lambda: drafter.propose(1, 0.0, None),
        "draft_2_steps": lambda: drafter.propose(2, 0.0, None),
    }
    out = interleaved_ms(fns, reps)
    runner.release()
    v, d = out[f"verify_{steps + 1}_tokens"], out["decode_1_token"]
    out["verify_over_decode"] = {k: v[k] / d[k] for k in ("min", "median")}
    return out


class _Timed:
    """Wall time spent inside the wrapped callables, per call, in ms."""

    def __init__(self):
        self.calls: list[tuple[str, float]] = []

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.calls.append((name, (time.perf_counter() - t) * 1000))

        return timed


@torch.inference_mode()
def overhead(engine, prompts: list[list[int]], params, reps: int = 1) -> dict[str, float]:
    """Per verify pass (decode only, prefill excluded): wall ms, the target's forward ms, the
    drafter's forward ms, and the rest (overhead), over `prompts` run one at a time."""
    runner, drafter = engine._runner, engine.drafter
    timed = _Timed()
    model_call = runner.model.forward
    runner.model.forward = timed.wrap("target", model_call)
    patched = {"_prenorm": drafter._prenorm, "_tree_step": drafter._tree_step}
    for name, fn in patched.items():
        setattr(drafter, name, timed.wrap("drafter", fn))
    logits_fn = drafter.model.logits
    drafter.model.logits = timed.wrap("drafter", logits_fn)
    wall = target = draft = 0.0
    passes = 0
    try:
        for _ in range(reps):
            for p in prompts:
                timed.calls.clear()
                g = (engine.generate if drafter else engine.plain_generate)([p], params)[0]
                st = g.stats
                # the prefill: the target's first forward, the drafter's prompt extend (its
                # first _prenorm and LM head)
                first: dict[str, int] = {}
                for i, (name, _) in enumerate(timed.calls):
                    first.setdefault(name, i)
                skip = {first.get("target")}
                if "drafter" in first:
                    skip |= {first["drafter"], first["drafter"] + 1}
                kept = [c for i, c in enumerate(timed.calls) if i not in skip]
                wall += st.total_ms - st.prefill_ms
                target += sum(ms for n, ms in kept if n == "target")
                draft += sum(ms for n, ms in kept if n == "drafter")
                passes += st.spec_verify_ct or max(st.completion_tokens - 1, 0)
    finally:
        runner.model.forward = model_call
        for name in patched:
            delattr(drafter, name)
        del drafter.model.logits
    rest = wall - target - draft
    return {"passes": passes, "ms_per_pass": wall / passes, "target_forward_ms": target / passes,
            "drafter_forward_ms": draft / passes, "overhead_ms": rest / passes,
            "overhead_share": rest / wall}  # fmt: skip


@torch.inference_mode()
def overhead_plain(engine, prompts: list[list[int]], params) -> dict[str, float]:
    """`overhead` of plain decoding: per decode step, outside the target's forward."""
    runner = engine._runner
    timed = _Timed()
    model_call = runner.model.forward
    runner.model.forward = timed.wrap("target", model_call)
    wall = target = 0.0
    passes = 0
    try:
        for p in prompts:
            timed.calls.clear()
            st = engine.plain_generate([p], params)[0].stats
            wall += st.total_ms - st.prefill_ms
            target += sum(ms for _, ms in timed.calls[1:])  # [0]: the prefill
            passes += st.completion_tokens - 1
    finally:
        runner.model.forward = model_call
    return {"passes": passes, "ms_per_pass": wall / passes, "target_forward_ms": target / passes,
            "drafter_forward_ms": 0.0, "overhead_ms": (wall - target) / passes,
            "overhead_share": (wall - target) / wall}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000, help="drafter.draft_vocab_size")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--topk", type=int, default=1, help="> 1: also measure tree drafting")
    ap.add_argument("--hf-linear", action="store_true", help="keep F.linear (no small-rows path)")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="tree: tokens per verify")
    ap.add_argument("--dtype", default="float32", help="target dtype (auto: bf16 where fast)")
    ap.add_argument("--overhead", action="store_true", help="also the drafting overhead per pass")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from actors.chat import prompt_ids
    from actors.prompts import builtin_prompts, split_prompts
    from serve.engine import GenParams, SpecEngine, load_target, random_drafter

    t = time.perf_counter()
    model, tok = load_target("smollm2", dtype=args.dtype)
    load_s = time.perf_counter() - t
    engine = SpecEngine(
        model,
        random_drafter(model, args.draft_vocab),
        steps=args.steps,
        fast_linear=not args.hf_linear,
    )
    heldout = split_prompts(builtin_prompts(0), 64, 0)[1][: args.prompts]
    prompts = [prompt_ids(tok, conv) for conv in heldout]
    params = GenParams(max_tokens=args.max_tokens, ignore_eos=True)

    engine.generate(prompts[:1], GenParams(max_tokens=8))  # warm both paths
    engine.plain_generate(prompts[:1], GenParams(max_tokens=8))
    tree_params = GenParams(
        max_tokens=args.max_tokens,
        ignore_eos=True,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
    )
    plain, spec, tree = [], [], []
    for p in prompts:  # interleaved so background load hits all alike
        plain.append(engine.plain_generate([p], params)[0])
        spec.append(engine.generate([p], params)[0])
        if args.topk > 1:
            tree.append(engine.generate([p], tree_params)[0])
    # verify passes round differently from 1-token steps: a near-tie may flip, so count, not assert
    mismatches = sum(
        s.token_ids != p.token_ids for s, p in zip(spec + tree, plain + plain, strict=False)
    )

    def tps(gens) -> float:
        return sum(g.stats.completion_tokens for g in gens) / sum(
            (g.stats.total_ms - g.stats.prefill_ms) / 1000 for g in gens
        )

    cycles = sum(g.stats.spec_verify_ct for g in spec)
    draft_ms = sum(g.stats.draft_ms for g in spec) / cycles
    verify_ms = sum(g.stats.verify_ms for g in spec) / cycles
    decode_ms = sum(g.stats.verify_ms for g in plain) / sum(
        g.stats.completion_tokens - 1 for g in plain
    )
    out = {
        "target": f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, {model.dtype})",
        "threads": torch.get_num_threads(),
        "fast_linear": not args.hf_linear,
        "greedy_mismatches_vs_plain": mismatches,
        "load_avg_1m": os.getloadavg()[0],
        "load_s": round(load_s, 1),
        "steps": args.steps,
        "draft_vocab": args.draft_vocab,
        "prompts": len(prompts),
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "max_tokens": args.max_tokens,
        "plain_tok_per_s": tps(plain),
        "spec_tok_per_s_random_drafter": tps(spec),
        "accept_len_random_drafter": sum(g.stats.completion_tokens for g in spec) / cycles,
        "decode_ms_per_token": decode_ms,
        "draft_ms_per_cycle": draft_ms,
        "verify_ms_per_cycle": verify_ms,
        "cycle_ms": draft_ms + verify_ms,
        "break_even_accept_len": (draft_ms + verify_ms) / decode_ms,
        "verify_over_decode": verify_ms / decode_ms,
        "micro": micro(engine, prompts[0], args.steps, args.reps),
    }
    if tree:
        t_cycles = sum(g.stats.spec_verify_ct for g in tree)
        out["tree"] = {
            "topk": args.topk,
            "num_draft_tokens": args.num_draft_tokens or args.steps + 1,
            "tok_per_s_random_drafter": tps(tree),
            "draft_ms_per_cycle": sum(g.stats.draft_ms for g in tree) / t_cycles,
            "verify_ms_per_cycle": sum(g.stats.verify_ms for g in tree) / t_cycles,
        }
    if args.overhead:
        out["overhead"] = {"chain": overhead(engine, prompts, params)}
        if args.topk > 1:
            out["overhead"]["tree"] = overhead(engine, prompts, tree_params)
        keep, engine.drafter = engine.drafter, None
        out["overhead"]["plain"] = overhead_plain(engine, prompts, params)
        engine.drafter = keep
        for v in out["overhead"].values():
            v["overhead_in_decode_steps"] = v["overhead_ms"] / decode_ms
    Results("engine_cpu", "cpu").emit(out)


if __name__ == "__main__":
    main()
