"""The start-up measurement the budget plan is sized from: what this machine takes, measured once
before round 0 (seconds), instead of figures measured on another machine.

In the driver, on the serving engine's code and thread count (`serve.num_cpus` torch threads),
with the target loaded as the server loads it:
  1. a plain decode of PLAIN_TOKENS tokens (the target alone, after a warm-up), and
  2. one benchmark request, greedy and speculative, of the first benchmark prompt with the
     drafter round 0 will serve, timed over its first SPEC_TOKENS tokens (`bench.max_tokens`
     when fewer): a cycle costs the same all along a short request, so the rest would only
     repeat it. A run from scratch has no drafter yet; it times an untrained one of the same
     shape (it accepts about one token per verify, as a drafter trained for minutes does).
It measures the embedded engine, the one the server runs (config.py refuses a budget with
another `serve.engine`). The figures are logged, kept in round 0's plan record (state.json,
summary.json `plans`) and MLflow (`measured/...`), and a resumed run reuses them.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from pipeline.budget import Measured
from pipeline.config import Config

log = logging.getLogger("eagle_loop")

PLAIN_TOKENS = 8  # a plain decode step costs the same every token: a few show it
SPEC_TOKENS = 32  # SmolLM2 on 1 thread, an untrained drafter: about 5 s


def measure_machine(cfg: Config, messages: list[dict[str, str]]) -> Measured:
    """Time a plain decode and one benchmark request of `messages` (the first benchmark prompt)."""
    import torch

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, math.ceil(cfg.serve.num_cpus)))  # as the server runs
    try:
        plain_s, spec_s, spec_tokens = _time_engine(cfg, messages)
    finally:
        torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the target was freed on return: give its memory back
    init = cfg.drafter.init
    return Measured(
        plain_s_per_token=plain_s / PLAIN_TOKENS,
        spec_s_per_token=spec_s / spec_tokens,
        spec_tokens=spec_tokens,
        drafter="random (untrained)" if init in ("scratch", "previous") else init,
        wall_s=time.perf_counter() - t0,
    )


def _time_engine(cfg: Config, messages: list[dict[str, str]]) -> tuple[float, float, int]:
    """(seconds of the plain decode, of the speculative request, that request's tokens), on the
    target loaded where the server loads it."""
    import torch

    from actors.chat import prompt_ids
    from serve.engine.loading import load_eagle, load_target, random_drafter
    from serve.engine.loop import SpecEngine
    from serve.engine.static_draft import serving_drafter_compile

    t, s = cfg.target, cfg.serve
    gpu = s.num_gpus > 0 and torch.cuda.is_available()
    lm, tok = load_target(
        t.model, t.gguf_file, t.dtype, t.revision, t.trust_remote_code, "cuda" if gpu else None
    )
    if cfg.drafter.init in ("scratch", "previous"):
        drafter = random_drafter(lm, cfg.drafter.draft_vocab_size)
    else:
        drafter = load_eagle(cfg.drafter.resolved_init(), lm)
    engine = SpecEngine(lm, drafter, steps=s.steps, topk=s.topk, num_draft_tokens=s.num_draft_tokens,
                        drafter_compile=serving_drafter_compile(s.drafter_compile, "cuda" if gpu else "cpu"))  # fmt: skip
    ids = [prompt_ids(tok, messages)]
    engine.plain_generate(ids, _params(2))  # warm-ups: the first call of each path pays
    engine.generate(ids, _params(2))  # one-time costs a benchmark's warm-up request pays
    plain_s = _timed(lambda: engine.plain_generate(ids, _params(PLAIN_TOKENS)))
    spec_tokens = min(SPEC_TOKENS, cfg.bench.max_tokens)
    return plain_s, _timed(lambda: engine.generate(ids, _params(spec_tokens))), spec_tokens


def _params(n: int) -> Any:
    from serve.engine.requests import GenParams

    return GenParams(max_tokens=n, ignore_eos=True)  # exactly n tokens, as the benchmark sends


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def machine() -> tuple[int, int]:
    """(CPUs this driver may run on, GPUs of the Ray cluster): the cost units of summary.json.
    CPUs from the affinity mask, not Ray's logical count (`taskset -c 0 make demo` is 1 CPU)."""
    import os

    gpus = 0
    try:
        import ray

        if ray.is_initialized():
            gpus = int(ray.cluster_resources().get("GPU", 0))
    except ImportError:
        pass
    return len(os.sched_getaffinity(0)), gpus
