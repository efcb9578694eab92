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
