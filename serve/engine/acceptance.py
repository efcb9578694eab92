"""Acceptance rules: greedy prefix matching (chains and trees) and speculative rejection sampling,
which preserves the target's distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from eagle3.cpu import top1
from serve.engine.drafting import DraftTree, tree_ancestors_by_depth
from serve.engine.law import Draws, draw, row_draws, sampling_probs, uniform

# ----------------------------------------------------------------------------------------------
# Acceptance rules


def greedy_accept(drafts: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """drafts [B, k], target logits [B, k+1, V] -> (accepted count a [B], bonus token [B]):
    the longest prefix of drafts equal to the target's argmax, then the target's own next token."""
    top = top1(logits)  # [B, k+1]
    a = (drafts == top[:, :-1]).long().cumprod(1).sum(1)
    return a, top.gather(1, a[:, None]).squeeze(1)


def rejection_accept(
    drafts: Tensor,
    q: Tensor,
    logits: Tensor,
    temperature: float,
    gen: Draws,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling. Draft d_j (drawn from q_j) is accepted with probability
    min(1, p_j(d)/q_j(d)) while all earlier ones were; at the first rejection the token is drawn
    from norm(max(p_j - q_j, 0)); after k acceptances the bonus is drawn from p_k. The emitted
    tokens are distributed exactly as the target samples them: p is the target's law at
    `temperature`, `top_p` and `top_k` (`sampling_probs`), whatever q is, so a draft outside the
    target's nucleus is always rejected."""
    B, k = drafts.shape
    p = sampling_probs(logits, temperature, top_p, top_k)  # [B, k+1, V]
    pd = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform(B, k, gen)
    a = (u * qd < pd).long().cumprod(1).sum(1)  # u < p/q without dividing by q
    b = torch.arange(B)
    pa = p[b, a]
    qa = torch.where((a < k)[:, None], q[b, a.clamp(max=k - 1)], torch.zeros_like(pa))
    resid = (pa - qa).clamp(min=0)
    mass = resid.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, resid / mass.clamp(min=1e-30), pa)  # p == q: rejection had prob 0
    return a, draw(dist, gen)


def tree_greedy_accept(
    tree: DraftTree, logits: Tensor, steps: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk each row's tree from the root, always into the child carrying the target's argmax.
    logits [B, M+1, V] over [root, nodes...] -> (accepted count a [B], path node indices [B, steps]
    (1-based, 0-padded), bonus token [B])."""
    top = top1(logits).cpu()  # the walk below reads it element by element
    B = top.shape[0]
    a, path = torch.zeros(B, dtype=torch.long), torch.zeros(B, steps, dtype=torch.long)
    bonus = torch.empty(B, dtype=torch.long)
    for b in range(B):
        children = _children(tree, b)
        cur = 0
        while True:  # into the first child (lowest node) carrying the target's argmax
            want = int(top[b, cur])
            nxt = next((n for t, n in children.get(cur, []) if t == want), None)
            if nxt is None:
                break
            path[b, a[b]] = nxt
            a[b] += 1
            cur = nxt
        bonus[b] = top[b, cur]
    return a, path, bonus


def tree_sample_accept(
    tree: DraftTree,
    logits: Tensor,
    steps: int,
    temperature: float,
    gen: Draws,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative sampling over a draft tree, lossless. A tree's children are fixed candidates
    (the drafter's top-k), not draws, so each is a point-mass draft: at a node with the target's
    law p (`sampling_probs`), its children are tried in order, child c accepted with probability
    p(c); a rejection removes c from p (the residual of a point mass) and renormalises it. The
    first child accepted becomes the node; when none is, the bonus is drawn from what is left of
    p (all of p below a leaf). So every token emitted is drawn from p given the ones before it,
    as the target samples it: P(c_i) = prod_{j<i}(1 - p_j(c_j)) p_i(c_i) = p(c_i). SGLang's
    target-only tree sampling keeps the same law. Same (a, path, bonus) as tree_greedy_accept."""
    logits = logits.cpu()
    B = logits.shape[0]
    a, path = torch.zeros(B, dtype=torch.long), torch.zeros(B, steps, dtype=torch.long)
    bonus = torch.empty(B, dtype=torch.long)
    for b in range(B):
        children, g = _children(tree, b), row_draws(gen, b)
        cur = 0
        while True:
            # the law of the nodes the walk reaches only: a nucleus sorts the whole vocabulary
            p, nxt = sampling_probs(logits[b, cur], temperature, top_p, top_k), None
            left = 1.0  # the mass of p not rejected yet: p / left is the law of what is left
            for t, node in children.get(cur, []):
                pt = float(p[t])
                if float(torch.rand(1, generator=g)) * left < pt:
                    nxt = node
                    break
                p[t], left = 0.0, left - pt
            if nxt is None:  # multinomial normalises what is left
                if not float(p.sum()) > 0:  # rounding rejected all of it (p ~ 1e-7): all of p
                    p = sampling_probs(logits[b, cur], temperature, top_p, top_k)
                bonus[b] = torch.multinomial(p, 1, generator=g)[0]
                break
            path[b, a[b]] = nxt
            a[b] += 1
            cur = nxt
    return a, path, bonus


def _children(tree: DraftTree, b: int) -> dict[int, list[tuple[int, int]]]:
    """Row b's tree as node -> [(token, child node), ...] in node order (the root is node 0,
    node i + 1 is tree entry i), the walks' view of it."""
    children: dict[int, list[tuple[int, int]]] = {}
    for i, (par, t) in enumerate(zip(tree.parents[b].tolist(), tree.tokens[b].tolist(), strict=True)):  # fmt: skip
        children.setdefault(par + 1, []).append((t, i + 1))
    return children


def tree_greedy_accept_on_device(
    tree: DraftTree, logits: Tensor, steps: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`tree_greedy_accept` in tensor ops on the logits' device (no host read, so the static
    path's cycle runs on without a sync), without a loop over the levels (each level was ~10
    small kernels): a node is on the walk when it carries the target's argmax after its parent
    and no earlier sibling does (the host walk keeps the lowest index), and so does every
    ancestor below the root (`tree.ancestors`, or `tree_ancestors_by_depth`), within `steps`
    levels. Children come after their parents, so the path's deepest node has its highest index.
    Same (a, path, bonus), as device tensors; parity with duplicate siblings:
    tests/test_engine_device_cycle.py."""
    top = top1(logits)  # [B, M+1]
    B, M = tree.tokens.shape
    dev = top.device
    par = tree.parents.to(dev) + 1  # node index (root = 0) of each node's parent
    depths = tree.depths.to(dev)
    anc = tree.ancestors if tree.ancestors is not None else tree_ancestors_by_depth(tree.parents, steps)  # fmt: skip
    node = torch.arange(1, M + 1, device=dev)
    hit = tree.tokens.to(dev) == top.gather(1, par)
    earlier = (par[:, :, None] == par[:, None, :]) & (node[:, None] > node[None, :])
    first = hit & ~(earlier & hit[:, None, :]).any(-1)
    picked = torch.cat([torch.ones_like(first[:, :1]), first], 1)  # the root is always kept
    on = ~(anc.to(dev)[:, 1:] & ~picked[:, None, :]).any(-1) & (depths <= steps)
    level = on[:, :, None] & (depths[:, :, None] == torch.arange(1, steps + 1, device=dev))
    path = (level * node[:, None]).sum(1)  # [B, steps]: at most one node a level
    last = (on * node).max(1).values  # 0 (the root) when nothing was accepted
    return on.sum(1), path, top.gather(1, last[:, None]).squeeze(1)


def sample_token(
    logits: Tensor,
    temperature: float,
    gen: Draws,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Tensor:
    """[B, V] -> [B]: argmax at temperature 0, else a draw from `sampling_probs`."""
    if temperature <= 0:
        return top1(logits)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    return draw(probs, gen)
