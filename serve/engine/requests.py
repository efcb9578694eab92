"""Request records of the embedded engine: sampling parameters, per-request statistics (SGLang's
accounting: accept_len = completion_tokens / verify passes) and the finished generation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------------------------
# Requests and their statistics

# (request index, new token ids) -> True to stop that request (its client is gone); called once
# per engine step for every request still running, so a stop takes effect at the next step
TokenCallback = Callable[[int, list[int]], bool | None]


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
