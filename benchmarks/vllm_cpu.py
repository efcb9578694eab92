"""vLLM vs this project's own code on CPU, SmolLM2-135M-Instruct, greedy, built-in prompts.

- serving (no drafter): time until vLLM's server is healthy, output tok/s at batch 1 (requests
  one after another) and batched (all prompts in flight), against the embedded engine's plain
  decoding at batch 1 and batched (`SpecEngine.plain_generate`);
- data stage: generation tok/s of `VLLMTarget.generate` (vLLM) vs `HFTarget.generate` (HF) on
  the same batch of prompts.
Optionally `--drafter DIR`: the same with speculation (accept_len from vLLM's per-request
metrics and from the embedded engine). Prints one JSON line (benchmarks/harness.py).

  .venv/bin/python benchmarks/vllm_cpu.py --prompts 16 --max-tokens 96 [--drafter DIR]
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser  # noqa: E402


def vllm_requests(url: str, prompts: list[list[int]], max_tokens: int, parallel: int) -> dict:
    import httpx

    from actors.vllm_server import spec_stats_from_vllm

    def one(p: list[int]) -> dict:
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()

    with httpx.Client(base_url=url, timeout=1800) as client:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            out = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    spec = [s for r in out if (s := spec_stats_from_vllm(r))]
    res = {"tok_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}
    if spec:
        res["accept_len"] = sum(s["completion_tokens"] for s in spec) / sum(
            s["spec_verify_ct"] for s in spec
        )
    return res


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/vllm-bench")
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()

    import torch

    from actors.chat import prompt_ids
    from actors.hf_backend import HFTarget
    from actors.ports import free_port
    from actors.prompts import builtin_prompts, split_prompts
    from actors.vllm_backend import VLLMTarget
    from actors.vllm_server import VLLMServer
    from pipeline.config import ServeConfig, TargetConfig
    from serve.engine import GenParams, SpecEngine, load_eagle

    torch.set_num_threads(1)
    target_cfg = TargetConfig(model="smollm2", dtype=a.dtype)
    _, held = split_prompts(builtin_prompts(0), 64, 0)
    hf = HFTarget(target_cfg, num_threads=1)
    ids = [prompt_ids(hf.tokenizer, c) for c in held[: a.prompts]]
    out: dict = {"prompts": len(ids), "max_tokens": a.max_tokens, "dtype": a.dtype}

    # vLLM: the target as a folder, one server, plain (and speculative with --drafter)
    serve_cfg = ServeConfig(engine="vllm", port=free_port(), steps=a.steps)
    server = VLLMServer(serve_cfg, target_cfg, Path(a.out) / "logs")
    try:
        out["vllm_load_s"] = server.start(None)
        vllm_requests(server.url, ids[:2], 8, 1)  # warm-up
        out["vllm_plain_bs1"] = vllm_requests(server.url, ids, a.max_tokens, 1)
        out["vllm_plain_batched"] = vllm_requests(server.url, ids, a.max_tokens, len(ids))
        if a.drafter:
            out["vllm_swap_s"] = server.swap_drafter(a.drafter)["seconds"]
            vllm_requests(server.url, ids[:2], 8, 1)
            out["vllm_spec_bs1"] = vllm_requests(server.url, ids, a.max_tokens, 1)
            out["vllm_spec_batched"] = vllm_requests(server.url, ids, a.max_tokens, len(ids))
    finally:
        server.stop()

    # the embedded engine on the same prompts
    t0 = time.perf_counter()
    engine = SpecEngine(hf.model, None, steps=a.steps, stop_ids=set(hf.info().eos_token_ids))
    params = GenParams(max_tokens=a.max_tokens, temperature=0.0)

    def embedded(batch: int, spec: bool) -> dict:
        t = time.perf_counter()
        gens = []
        for i in range(0, len(ids), batch):
            gens += engine.generate(ids[i : i + batch], params, speculative=spec)
        wall = time.perf_counter() - t
        tokens = sum(g.stats.completion_tokens for g in gens)
        res = {"tok_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}
        if spec:
            res["accept_len"] = tokens / sum(g.stats.spec_verify_ct for g in gens)
        return res

    out["embedded_plain_bs1"] = embedded(1, False)
    out["embedded_plain_batched"] = embedded(len(ids), False)
    if a.drafter:
        engine.set_drafter(load_eagle(a.drafter, hf.model))
        out["embedded_spec_bs1"] = embedded(1, True)
    out["embedded_setup_s"] = time.perf_counter() - t0

    # data stage generation: the same prompts in one batch, HF vs vLLM
    if not a.skip_hf:
        t = time.perf_counter()
        new = hf.generate(ids, a.max_tokens, 0.0, 0)
        wall = time.perf_counter() - t
        out["hf_generate"] = {"tok_per_s": sum(map(len, new)) / wall, "tokens": sum(map(len, new))}
    vt = VLLMTarget(target_cfg, num_threads=1, log_dir=Path(a.out) / "target-logs")
    try:
        vt.generate(ids[:2], 8, 0.0, 0)  # starts the server
        out["vllm_target_start_s"] = vt.start_seconds
        t = time.perf_counter()
        new_v = vt.generate(ids, a.max_tokens, 0.0, 0)
        wall = time.perf_counter() - t
        out["vllm_generate"] = {
            "tok_per_s": sum(map(len, new_v)) / wall,
            "tokens": sum(map(len, new_v)),
        }
        if not a.skip_hf:
            out["generate_same_tokens"] = sum(x == y for x, y in zip(new, new_v, strict=True))
    finally:
        vt.close()
    Results("vllm_cpu", "cpu").emit(out)


if __name__ == "__main__":  # vLLM spawns processes: keep module import side-effect free
    main()
