"""Request records of the embedded engine: sampling parameters, per-request statistics (SGLang's
accounting: accept_len = completion_tokens / verify passes) and the finished generation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from serve.engine.acceptance import sample_token
from serve.engine.law import Draws

# ----------------------------------------------------------------------------------------------
# Requests and their statistics

# (request index, new token ids) -> True to stop that request (its client is gone); called once
# per engine step for every request still running, so a stop takes effect at the next step
TokenCallback = Callable[[int, list[int]], bool | None]
# (request index, its Generation) as the request leaves the batch, before the batch ends
DoneCallback = Callable[[int, "Generation"], None]


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus of the target's law when sampling (law.sampling_probs)
    top_k: int = 0  # sampling: only the k most probable tokens (0 = all); `topk` is the tree's
    steps: int | None = None  # draft steps per cycle; None = the engine's default
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always produce max_tokens
    topk: int | None = None  # tree branching; None = the engine's default (1 = chain)
    num_draft_tokens: int | None = None  # tokens per tree verify incl. the root; None = steps+1


@dataclass
class RequestStats:
    prompt_tokens: int
    completion_tokens: int = 0
    spec_verify_ct: int = 0  # target verify passes (0 without speculation)
    accepted_drafts: int = 0  # draft tokens accepted over all cycles (before max_tokens truncation)
    accept_hist: list[int] = field(default_factory=list)  # [a] = cycles that accepted a drafts
    steps: int = 0
    draft_ms: float = 0.0  # drafter time per cycle summed: extends after verify + draft steps
    verify_ms: float = 0.0  # target forwards after prefill (verify, or decode steps when plain)
    accept_ms: float = 0.0  # device cycle only: acceptance, cache move, host copy (else in verify)
    prefill_ms: float = 0.0  # target prefill + the drafter's extend over the prompt
    total_ms: float = 0.0
    finish_reason: str = "length"

    @property
    def accept_len(self) -> float | None:
        """SGLang's per-request accept length: completion tokens per verify pass."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    @property
    def cycle_accept_len(self) -> float | None:
        """Tokens emitted per cycle, without the prefill token: exactly k+1 when all drafts pass."""
        if not self.spec_verify_ct:
            return None
        return (self.accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct

    def usage(self) -> dict[str, Any]:
        """The OpenAI `usage` object plus the speculative statistics."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": self.spec_verify_ct > 0 or self.steps > 0,
            "spec_accept_len": self.accept_len,
            "spec_cycle_accept_len": self.cycle_accept_len,
            "spec_verify_ct": self.spec_verify_ct,
            "spec_accepted_tokens": self.accepted_drafts,
            "spec_accept_hist": list(self.accept_hist),
            "spec_steps": self.steps,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "accept_ms": round(self.accept_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "total_ms": round(self.total_ms, 3),
        }


@dataclass
class Generation:
    token_ids: list[int]
    stats: RequestStats


# ----------------------------------------------------------------------------------------------
# A running batch


class Rows:
    """Per-request outputs and stats while a batch runs; `active` maps batch rows to requests."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: GenParams,
        stop_ids: set[int],
        on_tokens: TokenCallback | None,
        limits: list[int] | None,
        on_done: DoneCallback | None = None,
    ):
        self.limits = list(limits) if limits is not None else [params.max_tokens] * len(prompts)
        if len(self.limits) != len(prompts) or min(self.limits, default=1) < 1:
            raise ValueError(f"max_tokens_each: need one limit >= 1 per prompt, got {limits}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: every prompt needs at least one token")
        self.out: list[list[int]] = [[] for _ in prompts]
        self.stats = [RequestStats(prompt_tokens=len(p)) for p in prompts]
        self.active = list(range(len(prompts)))
        self.params, self.stop_ids, self.on_tokens = params, stop_ids, on_tokens
        # a seeded request draws from its own generator (law.Draws): what it draws alone
        seed = params.seed
        self.gens = None if seed is None else [torch.Generator().manual_seed(seed) for _ in prompts]
        self.on_done = on_done
        self.started = [time.perf_counter()] * len(prompts)  # each request's: it joined then

    def add(self, prompt: list[int], limit: int, steps: int = 0) -> int:
        """A request joining the running batch in a new last row; returns its index."""
        if not prompt or limit < 1:
            raise ValueError("a joining request needs a prompt token and max_tokens >= 1")
        req = len(self.out)
        self.out.append([])
        self.limits.append(limit)
        self.stats.append(RequestStats(prompt_tokens=len(prompt), steps=steps))
        if steps:
            self.stats[req].accept_hist = [0] * (steps + 1)
        if self.gens is not None and self.params.seed is not None:
            self.gens.append(torch.Generator().manual_seed(self.params.seed))
        self.active.append(req)
        self.started.append(time.perf_counter())
        return req

    def first_token(self, logits: Tensor, reqs: list[int]) -> Tensor:
        """The first token of requests `reqs` from their prefill's logits, drawn as alone."""
        return host_sample(logits, self.params, None if self.gens is None else [self.gens[r] for r in reqs])  # fmt: skip

    def draws(self) -> Draws:
        """The active rows' generators, in batch-row order (None: torch's global one)."""
        return None if self.gens is None else [self.gens[req] for req in self.active]

    def append(self, row: int, tokens: list[int]) -> bool:
        """Add tokens to batch row `row`; True when its request is finished."""
        req = self.active[row]
        room = self.limits[req] - len(self.out[req])
        new = tokens[:room]
        if not self.params.ignore_eos:
            for i, t in enumerate(new):
                if t in self.stop_ids:
                    new = new[: i + 1]
                    self.stats[req].finish_reason = "stop"
                    break
        self.out[req].extend(new)
        self.stats[req].completion_tokens = len(self.out[req])
        if self.on_tokens is not None and new and self.on_tokens(req, new):
            self.stats[req].finish_reason = "cancelled"  # its caller is gone: drop the row now
            return True
        return self.stats[req].finish_reason == "stop" or len(self.out[req]) >= self.limits[req]

    def finish(self, req: int) -> None:
        """Request `req` left the batch: its total time, and its answer to `on_done` now."""
        self.stats[req].total_ms = (time.perf_counter() - self.started[req]) * 1000
        if self.on_done is not None:
            self.on_done(req, Generation(self.out[req], self.stats[req]))

    def charge(self, field_name: str, ms: float) -> None:
        for req in self.active:
            setattr(self.stats[req], field_name, getattr(self.stats[req], field_name) + ms)

    def results(self) -> list[Generation]:
        """Every request's, in index order (each timed when it left the batch: `finish`)."""
        return [Generation(o, s) for o, s in zip(self.out, self.stats, strict=True)]


def host_sample(logits: Tensor, params: GenParams, gen: Draws) -> Tensor:
    """`sample_token` at the request's temperature, top_p and top_k, its result on the host:
    argmax on the logits' device, sampling on the CPU (the engine's generator is a CPU one)."""
    if params.temperature > 0:
        logits = logits.cpu()
    return sample_token(logits, params.temperature, gen, params.top_p, params.top_k).cpu()
