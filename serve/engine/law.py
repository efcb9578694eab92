"""The law a sampled request draws from (temperature, top_k, top_p): one definition for the
target's acceptance and the drafter's proposals."""

from __future__ import annotations

import torch
from torch import Tensor


def sampling_probs(
    logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> Tensor:
    """The law a request samples from: softmax(logits / T) over the last dim, cut to its `top_k`
    most probable tokens when `top_k` > 0, then to its nucleus when `top_p` < 1 (the most
    probable tokens, in decreasing order, up to and including the first whose running sum of
    the renormalised top-k law reaches `top_p`; the top token always stays), and renormalised:
    top-k first, as vLLM and SGLang apply them (ties at the k-th probability: the sort's order)."""
    p = torch.softmax(logits.float() / temperature, -1)
    top_k = top_k if 0 < top_k < p.shape[-1] else 0
    if top_p >= 1 and not top_k:
        return p
    sp, idx = p.sort(-1, descending=True)
    if top_k:
        sp[..., top_k:] = 0.0
        sp = sp / sp.sum(-1, keepdim=True)
    if top_p < 1:
        before = sp.cumsum(-1) - sp  # mass of the tokens ranked above each one
        sp = sp.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(p).scatter(-1, idx, sp / sp.sum(-1, keepdim=True))


# Where a sampled batch's random numbers come from: one generator for the whole batch (or None:
# torch's global one), or one generator per row. The engine gives each row of a seeded request
# its own, seeded alike, and draws every row's numbers from it in the row's own order: a request
# then draws what it draws alone, whatever its batchmates (the benchmark compares two drafters
# on the same draws, and an OpenAI `seed` means the same reply whoever else is served).
Draws = torch.Generator | list[torch.Generator] | None


def uniform(rows: int, n: int, gens: Draws) -> Tensor:
    """[rows, n] uniform numbers in [0, 1)."""
    if not isinstance(gens, list):
        return torch.rand(rows, n, generator=gens)
    if len(gens) != rows:
        raise ValueError(f"{len(gens)} generators for {rows} rows")
    return torch.cat([torch.rand(1, n, generator=g) for g in gens])


def draw(probs: Tensor, gens: Draws) -> Tensor:
    """One token per row of probs [rows, V] -> [rows], drawn from that row's law."""
    if not isinstance(gens, list):
        return torch.multinomial(probs, 1, generator=gens).squeeze(-1)
    rows = zip(probs, gens, strict=True)
    return torch.cat([torch.multinomial(p[None], 1, generator=g) for p, g in rows]).squeeze(-1)


def row_draws(gens: Draws, b: int) -> torch.Generator | None:
    """Row b's generator: its own, or the batch's."""
    return gens[b] if isinstance(gens, list) else gens
