"""Training throughput of the drafter on one GPU: reference path, fast path, SpecForge anchor, and
packed vs padded batches on a realistic length mix. Synthetic inputs, bf16 weights.

    python benchmarks/gpu_train.py --shape kimi-k2 --what parity,ref,fast,specforge,mix
    python benchmarks/gpu_train.py --shape llama-3.1-8b --what fast,specforge,mix,gemm

One step = target soft labels from the target's final hidden state (the frozen target lm_head) +
7-step TTT forward + backward; the optimizer update is timed apart (`optim`). Prints one JSON line
per measurement (benchmarks/harness.py; appended to $OUT/gpu_train.jsonl when OUT is set). MFU counts
6 × (matmul MACs per token per TTT step × steps + fc) per token over 790 TFLOP/s (bf16 peak
measured on the H200 we use); attention scores and the teacher's matmul are not counted.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import DrafterShape, Results, parser, pick_device, sync  # noqa: E402
from eagle3.fast import fast_soft_labels, fast_ttt_forward, split_lm_head  # noqa: E402
from eagle3.model import Eagle3Drafter, rope_parameters  # noqa: E402
from eagle3.train_step import train_flops_per_token  # noqa: E402
from eagle3.vocab import target_soft_labels  # noqa: E402

PEAK_TFLOPS = 790.0
SHAPES = {
    "kimi-k2": DrafterShape(7168, 18432, 64, 8, 128, 163840, 32000),
    "llama-3.1-8b": DrafterShape(4096, 14336, 32, 8, 128, 128256, 32000),
    "tiny": DrafterShape(64, 128, 4, 2, 16, 1000, 300, ttt=3),
}
START = time.time()
DEV = "cuda"  # --device cpu runs the tiny shape as a smoke test of this script


def elapsed_ms(fn) -> float:
    """Wall time of fn() on the device (CUDA events on GPU)."""
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if DEV == "cuda" else 0


def emit(rec: dict) -> None:
    Results("gpu_train", DEV).emit(rec)


def flops_per_token(s: DrafterShape) -> float:
    return float(train_flops_per_token(s.config(), s.ttt))


# ----------------------------------------------------------------------------------------------
# Synthetic inputs


def make_inputs(s: DrafterShape, T: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    H, V, Vd = s.hidden, s.vocab, s.draft_vocab
    bf = dict(device=DEV, dtype=torch.bfloat16)
    used = torch.randperm(V, generator=g, device=DEV)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool, device=DEV)
    t2d[used] = True
    return dict(
        ids=torch.randint(0, V, (T,), generator=g, device=DEV),
        aux=torch.randn(T, 3 * H, generator=g, **bf),
        final_hidden=torch.randn(T, H, generator=g, **bf),
        head=torch.randn(V, H, generator=g, **bf) * (3.0 / math.sqrt(H)),  # logits std ~3
        embed=torch.randn(V, H, generator=g, **bf) * 0.02,
        t2d=t2d,
        d2t=used - torch.arange(Vd, device=DEV),
        loss_mask=torch.ones(T, dtype=torch.bool, device=DEV),
        cu=[0, T],
        pos=torch.arange(T, device=DEV),
    )


def make_drafter(s: DrafterShape, inputs: dict, seed: int = 0) -> Eagle3Drafter:
    cfg = s.config(rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = Eagle3Drafter(cfg, embed_weight=inputs.pop("embed"))  # the drafter keeps its copy
    for p in model.parameters():  # bf16 weights; buffers (RoPE inv_freq) stay fp32
        p.data = p.data.to(torch.bfloat16)
    model.inv_freq = rope_parameters(cfg)[0].to(DEV)
    with torch.no_grad():
        model.d2t.copy_(inputs["d2t"])
        model.t2d.copy_(inputs["t2d"])
    return model


def free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------------------
# Steps


def our_step(model: Eagle3Drafter, inp: dict, fast: bool, ttt: int):
    head = split_lm_head(inp.pop("head"), inp["d2t"], inp["t2d"]) if fast else None  # one copy

    def step(row: dict | None = None):
        r = row or inp
        model.zero_grad(set_to_none=True)
        if fast:
            probs, inside = fast_soft_labels(inp["final_hidden"], head)
        else:
            probs, inside = target_soft_labels(
                inp["final_hidden"], inp["head"], inp["d2t"], inp["t2d"]
            )
        valid = r["loss_mask"] & inside
        args = (inp["ids"], inp["aux"], probs, valid, r["cu"], r["pos"])
        if fast:
            out = fast_ttt_forward(model, *args, ttt_length=ttt)
        else:  # the reference promotes RoPE'd q/k to fp32, so bf16 weights need autocast
            with torch.autocast(DEV, dtype=torch.bfloat16):
                out = model.ttt_forward(*args, ttt_length=ttt)
        out.loss.backward()
        return out

    return step


def timed(step, warmup: int, iters: int) -> dict:
    t0 = time.time()
    step()
    sync(DEV)
    first = time.time() - t0
    for _ in range(warmup - 1):
        step()
    step()  # after free(): the allocator's cache refills outside the timed runs
    sync(DEV)
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms, host = [], []

    def host_timed():
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)  # CPU time to enqueue the step

    ms = sorted(elapsed_ms(host_timed) for _ in range(iters))
    peak = peak_bytes()
    host.sort()
    return dict(
        ms_median=round(ms[len(ms) // 2], 2), ms_min=round(ms[0], 2), ms_max=round(ms[-1], 2),
        host_ms_median=round(host[len(host) // 2], 2), first_call_s=round(first, 1),
        peak_gb=round(peak / 1e9, 2), peak_gib=round(peak / 2**30, 2),
    )  # fmt: skip


def report(shape: str, s: DrafterShape, variant: str, T: int, t: dict, **extra) -> None:
    tok_s = T / (t["ms_median"] / 1e3)
    emit(dict(shape=shape, variant=variant, seq=T, batch=1, ttt=s.ttt, tok_s=round(tok_s),
              mfu=round(tok_s * flops_per_token(s) / (PEAK_TFLOPS * 1e12), 3), **t, **extra))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Sections


def run_parity(shape: str, s: DrafterShape, T: int) -> None:
    """Reference and fast path on the same batch and weights: loss and gradient agreement."""
    inp = make_inputs(s, T)
    model = make_drafter(s, inp)
    ref = our_step(model, inp, fast=False, ttt=s.ttt)()
    g_ref = {n: p.grad.float() for n, p in model.named_parameters()}
    out = our_step(model, inp, fast=True, ttt=s.ttt)()
    rel = {
        n: ((p.grad.float() - g_ref[n]).norm() / g_ref[n].norm().clamp(min=1e-30)).item()
        for n, p in model.named_parameters()
    }
    emit(dict(shape=shape, variant="parity", seq=T, loss_ref=ref.loss.item(), loss_fast=out.loss.item(),
              step_loss_ref=[round(x.item(), 4) for x in ref.step_losses],
              step_loss_fast=[round(x.item(), 4) for x in out.step_losses],
              acc_ref=(ref.correct / ref.counted).tolist(), acc_fast=(out.correct / out.counted).tolist(),
              grad_rel_err_max=max(rel.values()), grad_rel_err={k: round(v, 4) for k, v in rel.items()}))  # fmt: skip
    free()


def run_ours(shape: str, s: DrafterShape, T: int, fast: bool, iters: int) -> None:
    inp = make_inputs(s, T)
    model = make_drafter(s, inp)
    free()
    step = our_step(model, inp, fast=fast, ttt=s.ttt)
    t = timed(step, warmup=2 if fast else 1, iters=iters)
    import eagle3.fast

    opts = eagle3.fast.FLEX_KERNEL_OPTIONS
    name = (
        ("fast" + (json.dumps(opts, separators=(",", ":")) if opts else ""))
        if fast
        else "reference"
    )
    report(shape, s, name, T, t, loss=step().loss.item())
    free()


def run_specforge(shape: str, s: DrafterShape, T: int, iters: int, backend: str) -> None:
    from benchmarks.specforge_anchor import build_step, specforge_version

    inp = make_inputs(s, T)
    step = build_step(s, inp, attention_backend=backend)
    del inp["embed"]  # SpecForge holds its own copy
    free()
    t = timed(step, warmup=3, iters=iters)
    report(shape, s, f"specforge-{specforge_version()}-{backend}", T, t, loss=float(step()))
    free()


def lognormal_lengths(n: int, mean: float, cap: int, seed: int) -> list[int]:
    """Lengths ~ lognormal(sigma=1) scaled so the capped mean is close to `mean`."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    mu = math.log(mean) - 0.5
    for _ in range(30):  # fix mu so that mean(min(exp(mu + z), cap)) == mean
        got = torch.exp(mu + z).clamp(16, cap).mean().item()
        mu += math.log(mean / got)
    return torch.exp(mu + z).clamp(16, cap).round().long().tolist()


def rows_for(lengths: list[int], T: int, packed: bool) -> list[dict]:
    """Rows of T tokens: samples packed first-fit decreasing, or one sample per row (padded).
    The tail of a row is a dummy sample with no loss."""
    rows: list[list[int]] = []
    for n in sorted(lengths, reverse=True) if packed else lengths:
        fit = next((r for r in rows if packed and sum(r) + n <= T), None)
        if fit is None:
            rows.append([n])
        else:
            fit.append(n)
    out = []
    for r in rows:
        cu = [0]
        for n in r:
            cu.append(cu[-1] + n)
        real = cu[-1]
        if real < T:
            cu.append(T)
        pos = torch.cat([torch.arange(e - a) for a, e in zip(cu[:-1], cu[1:], strict=True)]).to(DEV)
        mask = torch.zeros(T, dtype=torch.bool, device=DEV)
        mask[:real] = True
        out.append(dict(cu=cu, pos=pos, loss_mask=mask, real=real))
    return out


def run_mix(shape: str, s: DrafterShape, T: int, n_samples: int) -> None:
    """P1c: the same samples fed packed vs padded to T; effective (non-pad) tokens per second."""
    lengths = lognormal_lengths(n_samples, 700.0, T, seed=0)
    inp = make_inputs(s, T)
    model = make_drafter(s, inp)
    step = our_step(model, inp, fast=True, ttt=s.ttt)
    res = {}
    for mode in ("packed", "padded"):
        rows = rows_for(lengths, T, packed=mode == "packed")
        step(rows[0])
        sync(DEV)
        sec = elapsed_ms(lambda rows=rows, step=step: [step(r) for r in rows]) / 1e3
        real = sum(r["real"] for r in rows)
        res[mode] = real / sec
        emit(dict(shape=shape, variant=f"fast-{mode}-mix", seq=T, samples=len(lengths), rows=len(rows),
                  mean_len=round(sum(lengths) / len(lengths), 1), real_tokens=real, fill=round(real / (len(rows) * T), 3),
                  seconds=round(sec, 3), effective_tok_s=round(real / sec)))  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # recompiles would show here
    ratio = round(res["packed"] / res["padded"], 2)
    emit(dict(shape=shape, variant="mix-ratio", packed_over_padded=ratio, dynamo_graphs=graphs))
    free()


def run_profile(shape: str, s: DrafterShape, T: int) -> None:
    inp = make_inputs(s, T)
    model = make_drafter(s, inp)
    step = our_step(model, inp, fast=True, ttt=s.ttt)
    step()
    step()
    sync(DEV)
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]
    ) as prof:
        step()
        sync(DEV)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_{shape}.txt"), "w") as f:
            for t, c, k in rows:
                f.write(f"{t / 1e3:9.2f} ms {c:5d}  {k}\n")
    emit(dict(shape=shape, variant="profile-fast", gpu_ms_total=round(total / 1e3, 1),
              top=[[round(t / 1e3, 2), c, k[:90]] for t, c, k in rows[:22]]))  # fmt: skip
    free()


def run_gemm_floor(shape: str, s: DrafterShape, T: int) -> None:
    """Time of the step's matrix products alone (fwd, dgrad, wgrad per use): the floor."""
    H, inter, hd, Vd = s.hidden, s.inter, s.head_dim, s.draft_vocab
    q, kv = s.heads * hd, s.kv_heads * hd
    lin = {
        "qkv": (2 * H, q + 2 * kv),
        "o": (q, H),
        "gate_up": (H, 2 * inter),
        "down": (inter, H),
        "lm_head": (H, Vd),
    }
    res, total, flop = {}, 0.0, 0.0
    for name, (K, N) in lin.items():
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
        gw = torch.empty(N, K, device=DEV, dtype=torch.bfloat16)

        def three(x=x, w=w, dy=dy, gw=gw):
            x @ w.T
            dy @ w
            gw.addmm_(dy.T, x)

        for _ in range(3):
            three()
        sync(DEV)
        ms = elapsed_ms(lambda three=three: [three() for _ in range(10)]) / 10
        res[name] = dict(ms_fwd_bwd=round(ms, 3), tflops=round(6 * T * K * N / ms / 1e9, 1))
        total += s.ttt * ms
        flop += s.ttt * 6 * T * K * N
    emit(dict(shape=shape, variant="gemm-floor", seq=T, per_linear=res, ttt_gemm_ms=round(total, 2),
              ttt_gemm_tflops=round(flop / total / 1e9, 1), tok_s_if_only_gemms=round(T / (total / 1e3))))  # fmt: skip
    free()


def run_flexbench(shape: str, s: DrafterShape, T: int) -> None:
    """The step-0 attention alone (flex, document-causal, lse returned and differentiated), fwd+bwd,
    under a few kernel_options, to pick FLEX_KERNEL_OPTIONS."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from eagle3.fast import doc_causal_block_mask, doc_ids

    n_q, n_kv, d = s.heads, s.kv_heads, s.head_dim
    g = torch.Generator(device=DEV).manual_seed(0)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    q = torch.randn(T, n_q, d, generator=g, **bf).requires_grad_()
    k = torch.randn(T, n_kv, d, generator=g, **bf).requires_grad_()
    v = torch.randn(T, n_kv, d, generator=g, **bf).requires_grad_()
    go = torch.randn(1, n_q, T, d, generator=g, **bf)
    gl = torch.randn(1, n_q, T, generator=g, device=DEV)
    bm = doc_causal_block_mask(doc_ids([0, T], T, DEV))
    flops = 3.5 * 4 * (T * T / 2) * n_q * d
    variants = {
        "default": None,
        "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
        "tma": {"USE_TMA": True},
        "tma_rows_safe": {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True},
    }
    out = {}
    for name, opts in variants.items():
        fn = torch.compile(flex_attention, dynamic=False)

        def fwd_bwd(fn=fn, opts=opts):
            o, aux = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        block_mask=bm, scale=d**-0.5, enable_gqa=True, return_aux=AuxRequest(lse=True),
                        kernel_options=opts)  # fmt: skip
            torch.autograd.backward([o, aux.lse], [go, gl])

        try:
            t = timed(fwd_bwd, warmup=3, iters=20)
            out[name] = dict(
                ms=t["ms_median"],
                tflops=round(flops / t["ms_median"] / 1e9, 1),
                compile_s=t["first_call_s"],
            )
        except Exception as e:
            out[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    emit(dict(shape=shape, variant="flexbench", seq=T, results=out))
    timed_ok = {k: r["ms"] for k, r in out.items() if "ms" in r}
    if timed_ok and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "best_flex.json"), "w") as f:
            json.dump(variants[min(timed_ok, key=timed_ok.get)], f)


def run_fast_best(shape: str, s: DrafterShape, T: int, iters: int, path: str) -> None:
    """The full fast step with the flex kernel_options that flexbench found best (if not default)."""
    import eagle3.fast

    if not os.path.exists(path):
        emit(dict(shape=shape, variant="fast-best", skipped=f"no {path}"))
        return
    with open(path) as f:
        best = json.load(f)
    if not best:
        emit(dict(shape=shape, variant="fast-best", skipped="default options are best"))
        return
    eagle3.fast.FLEX_KERNEL_OPTIONS = best
    try:
        run_ours(shape, s, T, fast=True, iters=iters)
    finally:
        eagle3.fast.FLEX_KERNEL_OPTIONS = None


def run_optim(shape: str, s: DrafterShape, T: int) -> None:
    """AdamW over fp32 master weights of the bf16 drafter (SpecForge's BF16Optimizer scheme)."""
    inp = make_inputs(s, T)
    model = make_drafter(s, inp)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    master = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-4, fused=True)

    def step():
        for m, p in zip(master, params, strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master, 0.5, foreach=True)
        opt.step()
        torch._foreach_copy_([p.data for p in params], master)

    t = timed(step, warmup=2, iters=5)
    emit(
        dict(
            shape=shape,
            variant="optimizer-adamw-fp32-master",
            n_params=sum(p.numel() for p in params),
            **t,
        )
    )
    free()


def main() -> None:
    ap = parser(__doc__, device="cuda", shapes=SHAPES, shape="kimi-k2", iters=10)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--what", default="parity,ref,fast,specforge,mix")
    ap.add_argument("--mix-samples", type=int, default=48)
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="skip sections once this much time has passed"
    )
    ap.add_argument(
        "--flex-options", default="", help='JSON kernel_options, e.g. {"USE_TMA": true}'
    )
    ap.add_argument(
        "--best-flex", default=os.path.join(os.environ.get("OUT", "."), "best_flex.json")
    )
    args = ap.parse_args()
    global DEV
    DEV = pick_device(args.device).type
    s, T = SHAPES[args.shape], args.seq
    sections = {
        "parity": lambda: run_parity(args.shape, s, T),
        "ref": lambda: run_ours(args.shape, s, T, fast=False, iters=3),
        "fast": lambda: run_ours(args.shape, s, T, fast=True, iters=args.iters),
        "specforge": lambda: run_specforge(args.shape, s, T, args.iters, "flex_attention"),
        "specforge-sdpa": lambda: run_specforge(args.shape, s, T, args.iters, "sdpa"),
        "mix": lambda: run_mix(args.shape, s, T, args.mix_samples),
        "profile": lambda: run_profile(args.shape, s, T),
        "gemm": lambda: run_gemm_floor(args.shape, s, T),
        "optim": lambda: run_optim(args.shape, s, T),
        "flexbench": lambda: run_flexbench(args.shape, s, T),
        "fast-best": lambda: run_fast_best(args.shape, s, T, args.iters, args.best_flex),
    }
    if args.flex_options:
        import eagle3.fast

        eagle3.fast.FLEX_KERNEL_OPTIONS = json.loads(args.flex_options)
    for name in args.what.split(","):
        if time.time() - START > args.budget_s:
            emit(dict(shape=args.shape, variant=name, skipped="time budget"))
            continue
        t0 = time.time()
        try:
            sections[name]()
        except Exception as e:  # keep going: one broken section must not hide the others
            traceback.print_exc()
            emit(dict(shape=args.shape, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
        free()
        print(
            f"# {name} took {time.time() - t0:.1f}s (total {time.time() - START:.0f}s)", flush=True
        )


if __name__ == "__main__":
    main()
