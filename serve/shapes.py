"""Drafting shapes and the rule that picks the one to serve ("never slower than plain decoding").

A shape is how the engine drafts per cycle: `plain` (no drafter), `chain-k` (k draft steps,
topk 1, k+1 tokens per verify) or `tree-SxKxN` (S levels, top-K branches, N tokens per verify,
root included). The benchmark (serve/shape_sweep.py `choose_serving_shape`) measures plain
decoding, the configured shape and one chain of the longest length; every other chain is
predicted from the chain's per-position acceptance and the measured costs:
  accept_len(chain-k) = 1 + q_1 + ... + q_k     (q_i: fraction of cycles accepting >= i drafts)
  cycle_ms(chain-k)   = k x draft_step_ms + verify_ms(k + 1 tokens)
  speedup             = accept_len x plain_step_ms / cycle_ms
verify_ms(width) is interpolated between the widths measured (1 = a plain decode step).
`choose_shape` is the one rule: the fastest shape, measured figures before predicted ones, and
plain when no shape beats plain decoding. The sweep measures every candidate on the whole set of
prompts it is given (a choice made on predictions or a few prompts did not hold on others:
issue 42), and `speedup_spread` reports each measured speedup with its spread over prompts.
`speedup_ceiling` bounds a shape from its own requests' timings alone, so a plain baseline
measured at a slower moment (a busy machine) cannot make a drafter that accepts nothing look
faster than plain decoding.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    steps: int  # 0 = plain decoding (no drafter)
    topk: int = 1
    num_draft_tokens: int | None = None  # tree: tokens per verify incl. the root

    @property
    def plain(self) -> bool:
        return self.steps == 0

    @property
    def width(self) -> int:
        """Tokens the target scores per verify pass."""
        if self.plain:
            return 1
        return (self.num_draft_tokens or self.steps + 1) if self.topk > 1 else self.steps + 1

    @property
    def name(self) -> str:
        if self.plain:
            return "plain"
        if self.topk == 1:
            return f"chain-{self.steps}"
        return f"tree-{self.steps}x{self.topk}x{self.width}"

    def request_fields(self) -> dict[str, object]:
        """The request fields that make the embedded engine draft this shape."""
        if self.plain:
            return {"speculative": False}
        return {"speculative": True, "steps": self.steps, "topk": self.topk,
                "num_draft_tokens": self.width}  # fmt: skip

    @classmethod
    def parse(cls, d: Mapping[str, object] | None) -> Shape | None:
        """From `request_fields`-like or asdict() records; None stays None."""
        if d is None:
            return None
        return cls(int(d.get("steps") or 0), int(d.get("topk") or 1),
                   d.get("num_draft_tokens"))  # type: ignore[arg-type]  # fmt: skip


PLAIN = Shape(0)


def chain_accept_len(acceptance: Sequence[float], steps: int) -> float:
    """Tokens per verify of a chain of `steps` from per-position acceptance (bonus included)."""
    if steps > len(acceptance):
        raise ValueError(f"chain-{steps}: acceptance measured for {len(acceptance)} positions only")
    return 1.0 + sum(acceptance[:steps])


def verify_ms_at(width: int, verify_ms: Mapping[int, float]) -> float:
    """A verify pass of `width` tokens, linear between the measured widths (and beyond the last
    two measured ones)."""
    pts = sorted(verify_ms.items())
    if not pts:
        raise ValueError("no verify cost measured")
    if len(pts) == 1 or width in verify_ms:
        return verify_ms.get(width, pts[0][1])
    lo = max([p for p in pts if p[0] <= width], default=pts[0], key=lambda p: p[0])
    hi = min([p for p in pts if p[0] > width], default=pts[-1], key=lambda p: p[0])
    if lo[0] == hi[0]:  # beyond the widest measured: extend the last segment
        lo, hi = pts[-2], pts[-1]
    return lo[1] + (width - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])


def predict_chain(
    steps: int,
    acceptance: Sequence[float],
    draft_step_ms: float,
    verify_ms: Mapping[int, float],
    plain_step_ms: float,
) -> float:
    """Predicted speedup over plain decoding of chain-`steps` (module doc)."""
    cycle = steps * draft_step_ms + verify_ms_at(steps + 1, verify_ms)
    return chain_accept_len(acceptance, steps) * plain_step_ms / cycle


@dataclass(frozen=True)
class ShapeChoice:
    shape: Shape
    speedups: dict[str, float]  # shape name -> the speedup the choice used
    measured: tuple[str, ...]  # names whose speedup was measured (the others are predicted)
    reason: str


def choose_shape(
    candidates: Sequence[Shape],
    predicted: Mapping[str, float],
    measured: Mapping[str, float],
    min_speedup: float = 1.0,
    lower: Mapping[str, float] | None = None,
    ceiling: Mapping[str, float] | None = None,
) -> ShapeChoice:
    """The shape to serve: the highest speedup over plain decoding among `candidates`, each
    judged by its measured speedup when it has one, else the predicted one. Plain (1.0) when no
    candidate exceeds `min_speedup`. `lower`: the low ends of the measured speedups' intervals
    over prompts (`speedup_spread`); a shape whose interval reaches down to `min_speedup` is not
    served (a broken drafter measured 1.02x on noise is not faster than plain decoding). A
    predicted winner still needs a measurement before it serves: the caller measures it and
    asks again (`needs_measurement`). `ceiling`: the most each shape could gain
    (`speedup_ceiling`); one whose ceiling is not above `min_speedup` is not served."""
    speedups = {PLAIN.name: 1.0}
    for s in candidates:
        if s.plain:
            continue
        v = measured.get(s.name, predicted.get(s.name))
        if v is not None:
            speedups[s.name] = v
    sure = [s for s in candidates if s.name in speedups and not s.plain
            and (lower or {}).get(s.name, speedups[s.name]) > min_speedup
            and (ceiling or {}).get(s.name, speedups[s.name]) > min_speedup]  # fmt: skip
    best = max(sure, key=lambda s: speedups[s.name], default=None)
    if best is None or speedups[best.name] <= min_speedup:
        top = max((s for s in candidates if s.name in speedups and not s.plain),
                  key=lambda s: speedups[s.name], default=None)  # fmt: skip
        why = f"best {top.name} {speedups[top.name]:.2f}x" if top else "no drafting shape"
        if top is not None and ceiling and top.name in ceiling and ceiling[top.name] <= min_speedup:
            why += f", its own timings allow at most {ceiling[top.name]:.2f}x"
        elif top is not None and lower and top.name in lower and speedups[top.name] > min_speedup:
            why += f", its interval down to {lower[top.name]:.2f}x"
        return ShapeChoice(PLAIN, speedups, tuple(measured),
                           f"plain decoding: no shape surely beats it ({why})")  # fmt: skip
    how = "measured" if best.name in measured else "predicted"
    return ShapeChoice(best, speedups, tuple(measured),
                       f"{best.name}: {speedups[best.name]:.2f}x plain decoding ({how})")  # fmt: skip


def needs_measurement(choice: ShapeChoice) -> bool:
    return not choice.shape.plain and choice.shape.name not in choice.measured


@dataclass(frozen=True)
class Spread:
    """A measured speedup over plain decoding and how much it depends on the prompts drawn."""

    speedup: float  # pooled: all completion tokens / all latency, over plain's tok/s
    lo: float  # 5th percentile of the pooled speedup over prompts resampled with replacement
    hi: float  # 95th percentile
    prompts: int
    tokens: int

    def _asdict(self) -> dict[str, float]:
        return dict(self.__dict__)


def speedup_spread(
    tokens: Sequence[int],
    latency_s: Sequence[float],
    plain_tok_per_s: float,
    draws: int = 2000,
    seed: int = 0,
) -> Spread:
    """Pooled speedup of requests run one at a time (tokens[i] in latency_s[i]) over plain
    decoding's pooled tok/s, with a bootstrap 90% interval over the prompts (plain's own noise is
    not in it: its figure may come from a cache). Deterministic for the same inputs (fixed seed),
    so reruns of the same measurements report the same interval."""
    if len(tokens) != len(latency_s) or not tokens or plain_tok_per_s <= 0:
        raise ValueError("speedup_spread: one latency per prompt, at least one, plain > 0")
    n = len(tokens)

    def pooled(idx: Sequence[int]) -> float:
        return sum(tokens[i] for i in idx) / sum(latency_s[i] for i in idx) / plain_tok_per_s

    rng = random.Random(seed)
    boot = sorted(pooled([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return Spread(pooled(range(n)), boot[int(0.05 * (draws - 1))], boot[int(0.95 * (draws - 1))],
                  n, int(sum(tokens)))  # fmt: skip


def speedup_ceiling(
    completion_tokens: int, passes: int, draft_ms: float, verify_ms: float
) -> float | None:
    """The most a shape can gain over plain decoding, from its own requests' timings: each
    verify pass yields completion_tokens / passes tokens and costs draft_ms + verify_ms (totals
    over the requests), while a plain step costs at most a verify pass (it scores one token, the
    verify pass several). So speedup <= accept_len x verify / (draft + verify): prefill and HTTP
    only lower it. None when nothing was verified."""
    if passes <= 0 or verify_ms <= 0:
        return None
    return completion_tokens / passes * verify_ms / (draft_ms + verify_ms)
