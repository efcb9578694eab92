"""The start-up measurement the budget plan is sized from: what this machine takes, measured once
before round 0 (seconds), instead of figures measured on another machine.

In the driver, on the serving engine's code and thread count (`serve.num_cpus` torch threads),
with the target loaded as the server loads it:
  1. a plain decode of PLAIN_TOKENS tokens (the target alone, after a warm-up), and
  2. one benchmark request, greedy and speculative, of the first benchmark prompt with the
     drafter round 0 will serve, timed over its first SPEC_TOKENS tokens (`bench.max_tokens`
     when fewer): a cycle costs the same all along a short request, so the rest would only
     repeat it. A run that starts from scratch has no
     drafter yet; it measures an untrained one shaped like it (accepts about one token per
     verify: what a drafter trained from scratch for minutes serves at).
The figures are logged, kept in round 0's plan record (state.json, summary.json `plans`) and
MLflow (`measured/...`), and a resumed run reuses them (pipeline/loop.py).
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
SPEC_TOKENS = 32  # some 6 draft-verify cycles of a drafter that accepts ~1 (2 cores: 4 s)


def measure_machine(cfg: Config, messages: list[dict[str, str]]) -> Measured:
    """Time a plain decode and one benchmark request of `messages` (the first benchmark prompt)."""
    import torch

    from actors.chat import render
    from serve.engine.loading import load_eagle, load_target, random_drafter
    from serve.engine.loop import SpecEngine
    from serve.engine.requests import GenParams

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, math.ceil(cfg.serve.num_cpus)))  # as the server runs
    try:
        t = cfg.target
        lm, tok = load_target(t.model, t.gguf_file, t.dtype, t.revision, t.trust_remote_code)
        init = cfg.drafter.init
        if init in ("scratch", "previous"):
            drafter = random_drafter(lm, cfg.drafter.draft_vocab_size)
        else:
            drafter = load_eagle(cfg.drafter.resolved_init(), lm)
        s = cfg.serve
        engine = SpecEngine(lm, drafter, steps=s.steps, topk=s.topk, num_draft_tokens=s.num_draft_tokens)  # fmt: skip
        prompt = tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)
        ids = [list(prompt["input_ids"])]
        engine.plain_generate(ids, GenParams(max_tokens=2, ignore_eos=True))  # warm-up
        plain_s = _timed(lambda: engine.plain_generate(ids, _params(PLAIN_TOKENS)))
        spec_tokens = min(SPEC_TOKENS, cfg.bench.max_tokens)
        spec_s = _timed(lambda: engine.generate(ids, _params(spec_tokens)))
    finally:
        torch.set_num_threads(threads)
    return Measured(
        plain_s_per_token=plain_s / PLAIN_TOKENS,
        spec_s_per_token=spec_s / spec_tokens,
        spec_tokens=spec_tokens,
        drafter="random (untrained)" if init in ("scratch", "previous") else init,
        wall_s=time.perf_counter() - t0,
    )


def _params(n: int) -> Any:
    from serve.engine.requests import GenParams

    return GenParams(max_tokens=n, ignore_eos=True)  # exactly n tokens, as the benchmark sends


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
