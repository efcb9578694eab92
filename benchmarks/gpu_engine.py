"""Embedded engine cost at batch 1 on a GPU (issue 7, P3): a decode step and a k-token verify.

Builds a random-weight target of a real shape on the GPU (no download) and, in one process:
- parity: every width's new ids are drawn once and fed to every path below, after the same
  prompt, so all logits are of identical inputs; each is compared with an fp32 copy of the model
  (HF forward of prompt + ids, no cache) and with the bf16 HF forward of the same tokens
  (`parity` lines: ||a - ref|| / ||ref||, share of rows whose argmax equals the fp32 one);
- the anchor: plain HF eager forwards over a DynamicCache of `--ctx` tokens;
- `StaticTargetRunner` (serve/engine/static.py) in four variants: CUDA graphs over the torch.compile'd
  step functions with the split (flash-decoding) attention kernel (the default on CUDA), the same
  with cuBLAS batched products for attention, graphs over the functions uncompiled, and no
  graphs (eager); for graphs also the replay alone timed with CUDA events, and for the default
  where a step's host-clock time goes;
- a kernel profile of one step (kernel count and GPU time by kernel);
- the engine end to end: `plain_generate` and speculative `generate` with an untrained drafter
  (accept length about 1, so it measures the cycle's overhead, not a speed-up).

    python benchmarks/gpu_engine.py --shape llama-3.1-8b --ctx 512
    python benchmarks/gpu_engine.py --device cpu --shape tiny --ctx 64 --iters 3   # smoke test

Prints one JSON line per measurement (benchmarks/harness.py; also to $OUT/engine.jsonl when $OUT
is set).
"""

from __future__ import annotations

import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_capture import SHAPES, build_target  # noqa: E402
from benchmarks.harness import Results, median_ms, parser, pick_device, sync  # noqa: E402
from serve.engine import (  # noqa: E402
    GenParams,
    SpecEngine,
    StaticTargetRunner,
    random_drafter,
)


def replay_ms(graph, iters: int = 50) -> float:
    """GPU time of one replay of a captured graph (CUDA events around `iters` replays)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def reference_logits(
    model, prompt: list[int], new: dict[int, torch.Tensor], device: torch.device
) -> dict[str, dict[int, torch.Tensor]]:
    """Logits [q, V] of each width's new ids after the prompt, from one uncached HF forward of
    prompt + ids: in bf16 (the model as is) and in fp32 (an upcast copy, freed afterwards)."""
    out: dict[str, dict[int, torch.Tensor]] = {"hf_bf16": {}, "fp32": {}}
    for name, m in [("hf_bf16", model), ("fp32", None)]:
        if m is None:
            m = copy.deepcopy(model).float()
        for q, ids in new.items():
            x = torch.tensor([prompt + ids[0].tolist()], device=device)
            out[name][q] = m(input_ids=x, use_cache=False, logits_to_keep=q).logits[0].float()
        if m is not model:
            del m
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def host_breakdown(runner: StaticTargetRunner, ids, pos, ones, res: Results, iters: int) -> None:
    """Where a graphed decode step's host-clock time goes (medians, ms): packing the inputs; the
    whole `forward` call on the host (no sync); one replay waited for (launch + GPU); the full
    synchronized `forward`."""

    def host(fn, wait: bool) -> float:
        out = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if wait:
                torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1000)
        return statistics.median(out)

    graph = runner._graphs[1, runner._span(1), True].graph
    res.emit(
        {
            "what": "host_breakdown",
            "q": 1,
            "pack_ms": round(host(lambda: runner._pack(ids, pos, None), False), 4),
            "forward_host_ms": round(
                host(lambda: runner.forward(ids, pos, ones, aux=True), False), 4
            ),
            "replay_waited_ms": round(host(graph.replay, True), 4),
            "forward_waited_ms": round(
                host(lambda: runner.forward(ids, pos, ones, aux=True), True), 4
            ),
        }
    )


def profile_step(runner: StaticTargetRunner, ids, pos, ones, res: Results, label: str) -> None:
    """Kernel count and GPU time of one forward, by kernel name (top 30)."""
    from torch.profiler import ProfilerActivity, profile

    runner.forward(ids, pos, ones, aux=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(ids, pos, ones, aux=True)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name].append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:30]
    res.emit(
        {
            "what": "profile",
            "variant": label,
            "q": int(ids.shape[1]),
            "kernels": sum(len(v) for v in by_name.values()),
            "kernel_ms": round(total / 1000, 3),
            "top": [[n[:60], len(v), round(sum(v) / 1000, 3)] for n, v in top],
        }
    )


@torch.inference_mode()
def main() -> None:
    ap = parser(__doc__, device="cuda", shapes=SHAPES, shape="llama-3.1-8b", iters=30)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--widths", default="1,2,4,5,8")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=2048)
    args = ap.parse_args()
    device = pick_device(args.device)
    dtype = torch.bfloat16
    res = Results("engine", device, {"shape": args.shape, "ctx": args.ctx})
    model = build_target(args.shape, device, dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, V, (args.ctx,), generator=g).tolist()
    widths = [int(w) for w in args.widths.split(",")]
    # One draw of new ids per width, fed to every path: parity compares identical inputs.
    new = {q: torch.randint(3, V, (1, q), generator=g) for q in widths}
    ref = reference_logits(model, prompt, new, device)

    def parity(name: str, q: int, logits: torch.Tensor) -> None:
        fp32 = ref["fp32"][q]
        res.emit(
            {
                "what": "parity",
                "variant": name,
                "q": q,
                "rel_err_vs_fp32": round(rel_err(logits, fp32), 5),
                "rel_err_vs_hf_bf16": round(rel_err(logits, ref["hf_bf16"][q]), 5),
                "argmax_eq_fp32": round(
                    float((logits.argmax(-1) == fp32.argmax(-1)).float().mean()), 3
                ),
            }
        )

    for q in widths:
        parity("hf_bf16", q, ref["hf_bf16"][q])

    # Anchor: HF eager, DynamicCache holding ctx tokens, cropped back after each call.
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache)
    for q in widths:
        x = new[q].to(device)

        def hf_step(x=x, q=q):
            model(input_ids=x, past_key_values=cache, logits_to_keep=q)
            cache.crop(-q)

        ms = median_ms(hf_step, device, args.iters)
        res.emit({"what": "hf_eager", "q": q, "ms": round(ms, 3)})

    aux_ids = [1, model.config.num_hidden_layers // 2 - 1, model.config.num_hidden_layers - 4]
    cuda = device.type == "cuda"
    variants = {  # name: (graphs, compiled, split attention); the first is the CUDA default
        "static_graph_compiled": (True, True, True),
        "static_graph_compiled_bmm": (True, True, False),
        "static_graph": (True, False, False),
        "static_eager": (False, False, False),
    }
    if not cuda:
        variants = {"static_eager": (False, False, False)}
    logits_of: dict[tuple[str, int], torch.Tensor] = {}
    for name, (graphs, compiled, split) in variants.items():
        r = StaticTargetRunner(
            model, capacity=args.capacity, graphs=graphs, compiled=compiled, split_attention=split
        )
        r.set_aux_layers(aux_ids)
        r.prefill([prompt], aux=False)
        decode = None
        for q in widths:
            ids = new[q]
            pos = torch.arange(args.ctx, args.ctx + q)[None]
            ones = torch.ones(1, q, dtype=torch.bool)
            t = time.perf_counter()
            logits = r.forward(ids, pos, ones, aux=True)[0][0]  # graphed: compile + capture
            sync(device)
            first = (time.perf_counter() - t) * 1000
            logits_of[name, q] = logits
            parity(name, q, logits)
            ms = median_ms(
                lambda r=r, ids=ids, pos=pos, ones=ones: r.forward(ids, pos, ones, aux=True),
                device,
                args.iters,
            )
            decode = ms if q == 1 else decode
            rec = {"what": name, "q": q, "ms": round(ms, 3), "first_call_ms": round(first, 1)}
            if q > 1 and decode:
                rec["x_decode"] = round(ms / decode, 3)
            if graphs:
                graph = r._graphs[q, r._span(q), True].graph
                rec["replay_ms"] = round(replay_ms(graph), 3)
            res.emit(rec)
            if not graphs and cuda:  # the same code at the graphs' bucketed span
                span = StaticTargetRunner.MIN_BUCKET
                while span < args.ctx + q:
                    span *= 2
                packed = r._pack(ids, pos, None).to(device)
                logits_of["static_eager_bucket", q] = r._core(packed, q, span, True)[0][0]
        if cuda and name == "static_graph_compiled":
            ones = torch.ones(1, 1, dtype=torch.bool)
            pos = torch.tensor([[args.ctx]])
            host_breakdown(r, new[1], pos, ones, res, args.iters)
            profile_step(r, new[1], pos, ones, res, "graph replay")
            r.use_graphs = False  # the same compiled functions launched one by one
            profile_step(r, new[1], pos, ones, res, "compiled, no graph")
        del r
    # Same inputs, two paths: what the graphs and the compiled functions change.
    pairs = [
        ("static_graph_compiled", "static_graph_compiled_bmm"),
        ("static_graph", "static_eager_bucket"),
        ("static_graph", "static_eager"),
        ("static_graph_compiled", "static_graph"),
    ]
    for a, b in pairs:
        for q in widths:
            if (a, q) in logits_of and (b, q) in logits_of:
                x, y = logits_of[a, q], logits_of[b, q]
                res.emit(
                    {
                        "what": "pair",
                        "a": a,
                        "b": b,
                        "q": q,
                        "rel_err": round(rel_err(x, y), 6),
                        "bitwise_equal": bool(torch.equal(x, y)),
                        "argmax_equal": bool(torch.equal(x.argmax(-1), y.argmax(-1))),
                    }
                )

    # The engine end to end at batch 1 (auto runner: static + graphs on CUDA).
    engine = SpecEngine(model, steps=3, stop_ids=set(), static_capacity=args.capacity)
    n = args.gen_tokens
    params = GenParams(max_tokens=n, ignore_eos=True)
    engine.plain_generate([prompt], params)  # warm: graphs of this context bucket
    t = time.perf_counter()
    plain = engine.plain_generate([prompt], params)[0]
    s = time.perf_counter() - t
    res.emit(
        {
            "what": "engine_plain",
            "tokens": n,
            "ms_per_token": round(s * 1000 / n, 3),
            "verify_ms_per_token": round(plain.stats.verify_ms / (n - 1), 3),
        }
    )
    engine.set_drafter(random_drafter(model, draft_vocab_size=32000, aux_layer_ids=aux_ids))
    engine.generate([prompt], params)
    t = time.perf_counter()
    spec = engine.generate([prompt], params)[0]
    s = time.perf_counter() - t
    st = spec.stats
    res.emit(
        {
            "what": "engine_spec_random_drafter",
            "tokens": n,
            "ms_per_token": round(s * 1000 / n, 3),
            "accept_len": round(st.accept_len or 0, 3),
            "verify_ms_per_cycle": round(st.verify_ms / st.spec_verify_ct, 3),
            "draft_ms_per_cycle": round(st.draft_ms / st.spec_verify_ct, 3),
            "same_tokens_as_plain": spec.token_ids == plain.token_ids,
            "late_captures": engine.late_captures(),  # graphs captured after set_drafter: 0
        }
    )


if __name__ == "__main__":
    main()
