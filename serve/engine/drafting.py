"""Draft sources: the EAGLE-3 drafter (chains and trees), or in tests stubs with the same
methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.cpu import top1
from eagle3.model import DrafterCache, Eagle3Drafter, rope_cos_sin
from serve.engine.law import Draws, draw, sampling_probs

# ----------------------------------------------------------------------------------------------
# Draft sources: the EAGLE-3 drafter, or (in tests) stubs with the same four methods


class DraftSource(Protocol):
    aux_layer_ids: list[int]  # target layers whose outputs `extend` receives (SGLang ids)

    def start(self, batch: int, capacity: int) -> None:
        """Fresh state for a batch whose positions stay below `capacity`."""

    def extend(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        """Verified entries: slot `positions[b, j]` gets token x_{t+1} = ids[b, j] and the target's
        aux state h_t; only entries with `write` are real. Drafting continues from each row's last
        real entry."""

    def propose(
        self,
        steps: int,
        temperature: float,
        gen: Draws,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """Draft `steps` tokens per row: (target ids [B, steps], q [B, steps, V] over the target
        vocab when temperature > 0, else None). Sampled drafts are drawn from the drafter's law
        cut as the request's (`pick_draft`)."""

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch."""

    # Tree drafting (optional): propose_tree(steps, topk, num_nodes) -> DraftTree


@dataclass
class DraftTree:
    """Draft nodes per row, parents before children: tokens [B, M] (target ids), parents [B, M]
    (index of the parent node, -1 = the root x_n), depths [B, M] (1 = child of the root);
    `ancestors` [B, M+1, M+1] (`tree_ancestors`, the root first) when the drafter made the
    verify's mask with the tree (the static drafter: inside its graph, not ~25 launches after)."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    ancestors: Tensor | None = None


def tree_problem(steps: int, topk: int, num_draft_tokens: int | None) -> str | None:
    """Why (steps, topk, num_draft_tokens) cannot be drafted, or None. A tree of `steps` levels
    holds at most topk + (steps-1)·topk² nodes; num_draft_tokens counts them plus the root."""
    if steps < 1 or topk < 1:
        return f"steps={steps}, topk={topk}: both must be >= 1"
    if topk == 1:
        return None  # a chain always verifies steps+1 tokens; num_draft_tokens is for trees
    most = topk + (steps - 1) * topk * topk + 1
    if num_draft_tokens is not None and not 2 <= num_draft_tokens <= most:
        return f"num_draft_tokens={num_draft_tokens}: steps={steps}, topk={topk} allow 2..{most}"
    return None


def tree_ancestors(parents: Tensor) -> Tensor:
    """[B, M] parents -> [B, M+1, M+1] bool 'column is an ancestor of row, or the row itself',
    index 0 being the root."""
    B, M = parents.shape
    anc = torch.zeros(B, M + 1, M + 1, dtype=torch.bool)
    anc[:, 0, 0] = True
    b = torch.arange(B)
    for i in range(1, M + 1):
        anc[:, i] = anc[b, parents[:, i - 1] + 1]
        anc[:, i, i] = True
    return anc


def tree_ancestors_by_depth(parents: Tensor, depth: int) -> Tensor:
    """`tree_ancestors` in `depth` rounds of tensor ops on the parents' device, for trees no
    deeper than `depth` (the draft's steps): each round climbs every node one parent up. No
    host read and no per-node loop, so the static path builds the verify mask on the device
    (parity: tests/test_engine_device_cycle.py)."""
    B, M = parents.shape
    dev = parents.device
    up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), parents.long() + 1], 1)
    idx = torch.arange(M + 1, device=dev).expand(B, M + 1)
    anc = idx[:, :, None] == idx[:, None, :]  # each node itself
    cur = idx
    for _ in range(depth):
        cur = up.gather(1, cur)  # the root is its own parent: climbing stops there
        anc = anc | (cur[:, :, None] == idx[:, None, :])
    return anc


def pick_draft(
    logits: Tensor,
    temperature: float,
    gen: Draws,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Draft ids and (when sampling) the draft distribution they were drawn from: the drafter's
    softmax at the request's temperature, cut by its top_k and top_p as the target's law is
    (`sampling_probs`). Any q keeps rejection sampling lossless; this one proposes no token the
    target's cut law cannot emit from the drafter's top ranks, so fewer drafts are spent where
    the target's nucleus is narrow."""
    if temperature <= 0:
        return top1(logits), None
    q = sampling_probs(logits.cpu(), temperature, top_p, top_k)  # the generator is a CPU one
    return draw(q, gen).to(logits.device), q


def target_q(model: Eagle3Drafter, q: Tensor) -> Tensor:
    """A draft distribution [B, draft vocab] (host) onto the target's vocab [B, V]."""
    qt = torch.zeros(q.shape[0], model.cfg.vocab_size)
    d_all = torch.arange(q.shape[-1], device=model.d2t.device)
    qt[:, model.draft_to_target(d_all).cpu()] = q
    return qt


def _last_true(mask: Tensor) -> Tensor:
    """Index of the last True per row of a [B, n] mask (every row has one)."""
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, idx, -1).max(1).values


class EagleDraft:
    """The EAGLE-3 chain drafter over a `DrafterCache`; state = the cache plus each row's last
    pre-norm output, draft logits and position."""

    def __init__(self, model: Eagle3Drafter, source: str = ""):
        self.model = model.eval()
        self.cfg = model.cfg
        self.source = source
        self.aux_layer_ids = list(model.cfg.aux_layer_ids)
        self.cache: DrafterCache | None = None
        self.h = self.logits = self.pos = None

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def start(self, batch: int, capacity: int) -> None:
        w = self.model.fc.weight
        self.cache = DrafterCache(self.cfg, batch, capacity, device=w.device, dtype=w.dtype)

    def _prenorm(
        self, ids: Tensor, hidden: Tensor, positions: Tensor, write: Tensor | None
    ) -> Tensor:
        """`Eagle3Drafter.forward_step` without the LM head: only each row's last entry needs
        logits, and the head (draft vocab x H) is most of a draft step's cost. Parity with
        forward_step: tests/test_engine.py::test_drafter_protocol_matches_fresh_recomputation."""
        m, dev = self.model, self.device
        ids, positions = ids.to(dev), positions.to(dev)
        write = write.to(dev) if write is not None else None
        hidden = m.project(hidden.to(dev))
        x = m.midlayer.attn_input(m.embed(ids), hidden)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, positions)
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)
        self.cache.write(k, v, positions, write)
        return m.midlayer.finish(hidden, self.cache.attend(q, positions))

    def extend(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        assert self.cache is not None, "start() first"
        out = self._prenorm(ids, aux.to(self.model.fc.weight.dtype), positions, write)
        b = torch.arange(ids.shape[0], device=self.device)
        last = _last_true(write.to(self.device))
        self.h, self.pos = out[b, last], positions.to(self.device)[b, last]
        self.logits = self.model.logits(self.h)

    def _pick(
        self,
        logits: Tensor,
        temperature: float,
        gen: Draws,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        return pick_draft(logits, temperature, gen, top_p, top_k)

    def propose(
        self,
        steps: int,
        temperature: float,
        gen: Draws,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        assert self.cache is not None and self.logits is not None, "extend() first"
        h, logits, drafts, qs = self.h[:, None], self.logits, [], []
        for j in range(steps):
            d, q = self._pick(logits, temperature, gen, top_p, top_k)
            tok = self.model.draft_to_target(d)
            drafts.append(tok)
            if q is not None:
                qs.append(target_q(self.model, q))
            if j + 1 < steps:
                h = self._prenorm(tok[:, None], h, (self.pos + 1 + j)[:, None], None)
                logits = self.model.logits(h[:, 0])
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def select(self, rows: Tensor) -> None:
        assert self.cache is not None
        self.cache.k, self.cache.v = self.cache.k[rows], self.cache.v[rows]
        self.h, self.logits, self.pos = self.h[rows], self.logits[rows], self.pos[rows]

    def _tree_step(
        self, tok: Tensor, h: Tensor, anc: Tensor, ek: Tensor, ev: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Expand the K frontier nodes of every row at once ([B, K] tokens, [B, K, H] input
        states). Each attends to its row's verified slots, its expanded ancestors (`anc` [B, K, E]
        over the entries `ek`/`ev` [B, Hkv, E, d]) and itself; the tree never touches the cache.
        Returns (pre-norm out [B, K, H], new keys, new values [B, Hkv, K, d])."""
        m, (B, K) = self.model, tok.shape
        depth = ek.shape[2] // K + 1  # the frontier's depth: one expansion per earlier depth
        x = m.midlayer.attn_input(m.embed(tok), h)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, (self.pos + depth)[:, None].expand(B, K))
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)
        top, dev = int(self.pos.max()) + 1, self.device
        prefix = torch.arange(top, device=dev)[None, :] <= self.pos[:, None]
        prefix = prefix[:, None, :].expand(B, K, top)
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        mask = torch.cat([prefix, anc, eye], -1)[:, None]
        keys = torch.cat([self.cache.k[:, :, :top], ek, k], 2)
        vals = torch.cat([self.cache.v[:, :, :top], ev, v], 2)
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return m.midlayer.finish(h, attn.transpose(1, 2).reshape(B, K, -1)), k, v

    def propose_tree(self, steps: int, topk: int, num_nodes: int) -> DraftTree:
        """EAGLE tree drafting (greedy): the root's top-k children, then `steps`-1 times expand
        the k best frontier nodes into k children each, scoring a node by its path's summed draft
        log-probability; keep the `num_nodes` best nodes (a child never outscores its parent, so
        the kept set is a tree)."""
        assert self.cache is not None and self.logits is not None, "extend() first"
        m, K, B, dev = self.model, topk, self.h.shape[0], self.device
        score, d = torch.log_softmax(self.logits.float(), -1).topk(K)  # [B, K]
        toks, scores, parents, depths = (
            [m.draft_to_target(d)],
            [score],
            [torch.full((B, K), -1, device=dev)],
            [torch.ones(B, K, dtype=torch.long, device=dev)],
        )
        f_id, f_tok, f_score = torch.arange(K, device=dev).expand(B, K), toks[0], score
        f_h = self.h[:, None].expand(B, K, self.h.shape[-1])
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)
        ek = self.cache.k.new_zeros(B, self.cache.k.shape[1], 0, self.cache.k.shape[-1])
        ev = ek.clone()
        n_nodes = K
        for j in range(1, steps):
            out, k, v = self._tree_step(f_tok, f_h, anc, ek, ev)
            c_score, c_d = torch.log_softmax(m.logits(out).float(), -1).topk(K)  # [B, K, K]
            c_score = (f_score[..., None] + c_score).reshape(B, K * K)
            toks.append(m.draft_to_target(c_d).reshape(B, K * K))
            scores.append(c_score)
            parents.append(f_id[..., None].expand(B, K, K).reshape(B, K * K))
            depths.append(torch.full((B, K * K), j + 1, device=dev))
            best = c_score.topk(K).indices  # the next frontier
            par = best // K  # which old frontier node each new one hangs from
            e_old = ek.shape[2]
            ek, ev = torch.cat([ek, k], 2), torch.cat([ev, v], 2)
            own = F.one_hot(e_old + par, e_old + K).bool()
            anc = (
                torch.cat(
                    [
                        anc.gather(1, par[..., None].expand(B, K, e_old)),
                        torch.zeros(B, K, K, dtype=torch.bool, device=dev),
                    ],
                    2,
                )
                | own
            )
            f_id, f_tok = n_nodes + best, toks[-1].gather(1, best)
            f_score, f_h = (
                c_score.gather(1, best),
                out.gather(1, par[..., None].expand(B, K, out.shape[-1])),
            )
            n_nodes += K * K
        tok, sc, par_id, dep = (torch.cat(x, 1) for x in (toks, scores, parents, depths))
        if not 1 <= num_nodes <= n_nodes:
            raise ValueError(
                f"num_draft_tokens - 1 = {num_nodes} draft nodes; steps={steps}, topk={K} make 1..{n_nodes}"
            )
        keep = torch.sort(torch.argsort(-sc, dim=1, stable=True)[:, :num_nodes], dim=1).values
        where = torch.full((B, n_nodes + 1), -1, device=dev)  # node id -> kept index (last: root)
        where.scatter_(1, keep, torch.arange(num_nodes, device=dev).expand(B, num_nodes))
        kept_par = par_id.gather(1, keep)
        return DraftTree(
            tok.gather(1, keep), where.gather(1, kept_par % (n_nodes + 1)), dep.gather(1, keep)
        )
