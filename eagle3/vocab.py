"""Draft vocabulary: which target tokens the drafter can emit, and the soft targets over them.

SGLang maps a draft id to a target id as `target = draft + d2t[draft]`; `t2d[v]` says whether
target token v is in the draft vocab. The map is built once from the frequencies of loss-masked
tokens and must be kept when fine-tuning an existing drafter (its lm_head rows point at it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle3.cpu import top1


def build_vocab_map(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """Top-N most frequent target tokens, sorted ascending -> (d2t int64 [N], t2d bool [V]).

    Tokens never seen fill the remaining slots in id order, so N is always met."""
    vocab = token_counts.numel()
    if draft_vocab_size > vocab:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} > target vocab {vocab}; lower drafter.draft_vocab_size"
        )
    # Stable order: by count descending, ties by id, so the map is deterministic.
    order = torch.argsort(
        -token_counts.to(torch.float64) + torch.arange(vocab) * 1e-9 / vocab, stable=True
    )
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t.to(torch.int64), t2d


def draft_ids(d2t: Tensor) -> Tensor:
    """Target ids of the draft vocab, in draft order."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def coverage(token_counts: Tensor, t2d: Tensor) -> float:
    """Fraction of counted tokens that the draft vocab can emit."""
    total = float(token_counts.sum())
    return float(token_counts[t2d].sum()) / total if total else 0.0


@torch.no_grad()
def target_soft_labels(
    final_hidden: Tensor, lm_head: Tensor, d2t: Tensor, t2d: Tensor, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    """Target softmax restricted to the draft vocab, and whether the target's argmax is in it.

    final_hidden [T, Ht] is the target's last hidden state (after its final norm); computed in
    chunks so the full [T, V] logits never exist at once."""
    ids = draft_ids(d2t).to(lm_head.device)
    probs, inside = [], []
    for s in range(0, final_hidden.shape[0], chunk):
        logits = final_hidden[s : s + chunk].to(lm_head.dtype) @ lm_head.T
        inside.append(t2d.to(logits.device)[top1(logits)])
        probs.append(torch.softmax(logits[:, ids].float(), dim=-1))
    return torch.cat(probs), torch.cat(inside)
