"""Embedded engine cost at batch 1 on a GPU (issue 7, P3): a decode step and a k-token verify.

Builds a random-weight target of a real shape on the GPU (no download) and times, in one process:
- the anchor: plain HF eager forwards over a DynamicCache of `--ctx` tokens (1, 4, 8 new tokens);
- `StaticTargetRunner` (serve/engine.py): the same widths replayed as CUDA graphs over the static
  cache, and the same code without graphs (what the graphs buy);
- the engine end to end: `plain_generate` and speculative `generate` with an untrained drafter
  (accept length about 1, so it measures the cycle's overhead, not a speed-up).
It also checks that the graphed logits equal the eager static runner's.

    python benchmarks/gpu_engine.py --shape llama-3.1-8b --ctx 512
    python benchmarks/gpu_engine.py --device cpu --shape tiny --ctx 64 --iters 3   # smoke test

Prints one JSON line per measurement (also to $OUT/engine.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_capture import build_target, sync  # noqa: E402
from serve.engine import (  # noqa: E402
    GenParams,
    SpecEngine,
    StaticTargetRunner,
    random_drafter,
)


def emit(rec: dict, base: dict) -> None:
    line = json.dumps({**base, **rec})
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "engine.jsonl", "a") as f:
            f.write(line + "\n")


def median_ms(fn, device: torch.device, iters: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    sync(device)
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--widths", default="1,2,4,5,8")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=2048)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    base = {
        "bench": "engine",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "shape": args.shape,
        "ctx": args.ctx,
        "torch": torch.__version__,
    }
    model = build_target(args.shape, device, dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, V, (args.ctx,), generator=g).tolist()
    widths = [int(w) for w in args.widths.split(",")]

    # Anchor: HF eager, DynamicCache holding ctx tokens, cropped back after each call.
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache)
    for q in widths:
        x = torch.randint(3, V, (1, q), generator=g).to(device)

        def hf_step(x=x, q=q):
            model(input_ids=x, past_key_values=cache, logits_to_keep=q)
            cache.crop(-q)

        ms = median_ms(hf_step, device, args.iters)
        emit({"what": "hf_eager", "q": q, "ms": round(ms, 3)}, base)

    aux_ids = [1, model.config.num_hidden_layers // 2 - 1, model.config.num_hidden_layers - 4]
    runners = {"static_graph": None, "static_eager": False} if device.type == "cuda" else {}
    runners = runners or {"static_eager": False}
    logits_of: dict[str, torch.Tensor] = {}
    decode_ms: dict[str, float] = {}
    for name, graphs in runners.items():
        r = StaticTargetRunner(model, capacity=args.capacity, graphs=graphs)
        r.set_aux_layers(aux_ids)
        r.prefill([prompt], aux=False)
        for q in widths:
            ids = torch.randint(3, V, (1, q), generator=g)
            pos = torch.arange(args.ctx, args.ctx + q)[None]
            ones = torch.ones(1, q, dtype=torch.bool)
            t = time.perf_counter()
            r.forward(ids, pos, ones, aux=True)  # first call: graph capture when graphed
            sync(device)
            first = (time.perf_counter() - t) * 1000
            ms = median_ms(
                lambda r=r, ids=ids, pos=pos, ones=ones: r.forward(ids, pos, ones, aux=True),
                device,
                args.iters,
            )
            if q == 1:
                decode_ms[name] = ms
            rec = {"what": name, "q": q, "ms": round(ms, 3), "first_call_ms": round(first, 1)}
            if q > 1 and name in decode_ms:
                rec["x_decode"] = round(ms / decode_ms[name], 3)
            emit(rec, base)
            if q == widths[-1]:
                logits_of[name] = r.forward(ids, pos, ones, aux=True)[0]
        del r
    if len(logits_of) == 2:
        a, b = logits_of["static_graph"], logits_of["static_eager"]
        rel = float((a - b).norm() / b.norm())
        emit(
            {
                "what": "graph_vs_eager_logits",
                "rel_err": rel,
                "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
            },
            base,
        )

    # The engine end to end at batch 1 (auto runner: static + graphs on CUDA).
    engine = SpecEngine(model, steps=3, stop_ids=set(), static_capacity=args.capacity)
    n = args.gen_tokens
    params = GenParams(max_tokens=n, ignore_eos=True)
    engine.plain_generate([prompt], params)  # warm: graphs of this context bucket
    t = time.perf_counter()
    plain = engine.plain_generate([prompt], params)[0]
    s = time.perf_counter() - t
    emit(
        {
            "what": "engine_plain",
            "tokens": n,
            "ms_per_token": round(s * 1000 / n, 3),
            "verify_ms_per_token": round(plain.stats.verify_ms / (n - 1), 3),
        },
        base,
    )
    engine.set_drafter(random_drafter(model, draft_vocab_size=32000, aux_layer_ids=aux_ids))
    engine.generate([prompt], params)
    t = time.perf_counter()
    spec = engine.generate([prompt], params)[0]
    s = time.perf_counter() - t
    st = spec.stats
    emit(
        {
            "what": "engine_spec_random_drafter",
            "tokens": n,
            "ms_per_token": round(s * 1000 / n, 3),
            "accept_len": round(st.accept_len or 0, 3),
            "verify_ms_per_cycle": round(st.verify_ms / st.spec_verify_ct, 3),
            "draft_ms_per_cycle": round(st.draft_ms / st.spec_verify_ct, 3),
            "same_tokens_as_plain": spec.token_ids == plain.token_ids,
        },
        base,
    )


if __name__ == "__main__":
    main()
