"""Fast training path for the drafter: the same math as `Eagle3Drafter.ttt_forward`, fused.

The reference path in eagle3/model.py stays the definition; this file computes the same loss (within
bf16 rounding) with fewer bytes moved and fewer kernels. tests/test_fast_paths.py holds the parity
tests, benchmarks/train_step.py the speed of a step (the study against the reference and
SpecForge: benchmarks/reports/2026-11-29-h200-training-step.md), docs/performance.md what each
piece buys.

What differs from the reference, and why:
- TTT attention. Step i's query sees step-0 keys (causal within its sample) plus its own diagonal
  keys of steps 1..i. We run one flex-attention pass over the step-0 keys with a block-sparse
  document-causal mask (it also returns the log-sum-exp), then merge the i diagonal scores into
  that softmax through the log-sum-exp: O(T·d) extra work instead of i more key blocks per tile.
  On CPU, where flex attention has no backward, a dense masked pass stands in (same merge).
- lm_head + soft cross-entropy is one autograd function that writes the logits' gradient (bf16)
  while it has the logits, so no fp32 [T, Vd] log-probabilities are kept for backward.
- Weights used once per TTT step (q/k/v, o, gate/up, down, lm_head) accumulate their gradient
  across the 7 steps with one `addmm_` per use instead of autograd's separate sum kernels; the
  gradient is handed to autograd once, on the last use, so hooks (DDP) fire once.
- q/k/v and gate/up run as one matmul each; norms, RoPE, SwiGLU, the merge and the loss's
  elementwise work are compiled (torch.compile) on CUDA, plain PyTorch on CPU.
- The packed row is padded to a multiple of 128 (flex's block size) with a dummy sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.model import Eagle3Drafter, TTTOutput, rope_cos_sin

BLOCK = 128  # flex attention's sparse block size; packed rows are padded to a multiple of it
FLEX_KERNEL_OPTIONS: dict | None = None  # passed to flex_attention (benchmarks try variants)


# ----------------------------------------------------------------------------------------------
# Elementwise pieces (compiled on CUDA). Shapes are static for a given packed length, so each
# compiles once.


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def attn_input(
    emb: Tensor, hidden: Tensor, src: Tensor, w_in: Tensor, w_hid: Tensor, eps: float
) -> Tensor:
    """cat(input_layernorm(embed(x[src])), hidden_norm(hidden)) -> [T, 2H]."""
    return torch.cat([_rms(emb[src], w_in, eps), _rms(hidden, w_hid, eps)], dim=-1)


def add_rms(x: Tensor, y: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Residual add and the following RMSNorm in one pass: (x + y, norm(x + y))."""
    s = x + y
    return s, _rms(s, w, eps)


def rope_split(
    qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused q/k/v output [T, (n_q + 2 n_kv) d] -> q [T, n_q, d], k, v [T, n_kv, d], RoPE on q, k."""
    T = qkv.shape[0]
    d = cos.shape[-1]
    q = qkv[:, : n_q * d].view(T, n_q, d).float()
    k = qkv[:, n_q * d : (n_q + n_kv) * d].view(T, n_kv, d).float()
    v = qkv[:, (n_q + n_kv) * d :].view(T, n_kv, d)
    c, s = cos[:, None, :], sin[:, None, :]

    def rot(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    return rot(q).to(qkv.dtype), rot(k).to(qkv.dtype), v.contiguous()


def swiglu(gu: Tensor) -> Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_backward(gu: Tensor, da: Tensor) -> Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    sg = torch.sigmoid(g)
    silu = g * sg
    dg = da.float() * u * sg * (1 + g * (1 - sg))
    du = da.float() * silu
    return torch.cat([dg, du], dim=-1).to(gu.dtype)


def lse_merge(
    q: Tensor,
    o0: Tensor,
    lse0: Tensor,
    dmask: Tensor,
    kd: list[Tensor],
    vd: list[Tensor],
    scale: float,
) -> Tensor:
    """Fold the diagonal keys of steps 1..i into the step-0 softmax.

    q [T, Hq, d]; o0 [1, Hq, T, d] and lse0 [1, Hq, T] (natural log) from the step-0 pass; kd/vd J
    tensors [T, Hkv, d] (zeros past step i); dmask [J] bool says which are real. -> [T, Hq·d]."""
    T, n_q, d = q.shape
    n_kv = kd[0].shape[1]
    g = n_q // n_kv
    qg = q.float().view(T, n_kv, g, d)
    l0 = lse0[0].transpose(0, 1).reshape(T, n_kv, g)
    scores = [
        torch.where(dmask[j], (qg * k.float()[:, :, None, :]).sum(-1) * scale, -math.inf)
        for j, k in enumerate(kd)
    ]
    m = l0
    for s in scores:
        m = torch.maximum(m, s)
    w0 = torch.exp(l0 - m)
    z = w0
    out = o0[0].transpose(0, 1).float().view(T, n_kv, g, d) * w0[..., None]
    for s, v in zip(scores, vd, strict=True):
        w = torch.exp(s - m)
        z = z + w
        out = out + w[..., None] * v.float()[:, :, None, :]
    return (out / z[..., None]).to(q.dtype).reshape(T, n_q * d)


def soft_ce(
    logits: Tensor, target_p: Tensor, src: Tensor, w_rows: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row soft cross-entropy -Σ t·log_softmax(l), argmax, and d(Σ w·ce)/d logits (logits dtype).

    target rows are read at `src` (the step's shift), so no shifted copy of target_p is made."""
    t = target_p[src].float()
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    tsum = t.sum(-1)
    ce = lse * tsum - (t * lf).sum(-1)
    p = torch.exp(lf - lse[:, None])
    dlogits = ((p * tsum[:, None] - t) * w_rows[:, None]).to(logits.dtype)
    return ce, lf.argmax(-1), dlogits


@dataclass(frozen=True)
class Kernels:
    attn_input: Callable
    add_rms: Callable
    rope_split: Callable
    swiglu: Callable
    swiglu_backward: Callable
    lse_merge: Callable
    soft_ce: Callable
    flex: Callable | None


@cache
def kernels(compiled: bool) -> Kernels:
    """The elementwise pieces, compiled once per process when asked (CUDA)."""
    flex = None
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = flex_attention
    except ImportError:  # very old torch: only the dense path
        pass
    fns = dict(
        attn_input=attn_input,
        add_rms=add_rms,
        rope_split=rope_split,
        swiglu=swiglu,
        swiglu_backward=swiglu_backward,
        lse_merge=lse_merge,
        soft_ce=soft_ce,
        flex=flex,
    )
    if compiled:
        fns = {
            k: (torch.compile(f, dynamic=False) if f is not None else None) for k, f in fns.items()
        }
    return Kernels(**fns)


# ----------------------------------------------------------------------------------------------
# Gradient accumulation across TTT steps.


class GradAccum:
    """Collects one weight's gradient over its uses in a TTT forward with `addmm_`, and hands the
    sum to autograd on the last use (so autograd adds nothing, and grad hooks fire once)."""

    def __init__(self) -> None:
        self.buf: Tensor | None = None
        self.pending = 0

    def add(self, dy_t: Tensor, x: Tensor) -> Tensor | None:
        if self.buf is None:
            self.buf = dy_t @ x
        else:
            self.buf.addmm_(dy_t, x)
        self.pending -= 1
        if self.pending > 0:
            return None
        out, self.buf = self.buf, None
        return out


class AccLinear(torch.autograd.Function):
    """y = x @ w.T whose weight gradient goes through a GradAccum."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, acc: GradAccum) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.acc = acc
        if w.requires_grad:
            acc.pending += 1
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = ctx.acc.add(dy.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(g) * u) that keeps only gu for backward (the product is recomputed)."""

    @staticmethod
    def forward(ctx, gu: Tensor, w: Tensor, acc: GradAccum, k: Kernels) -> Tensor:
        ctx.save_for_backward(gu, w)
        ctx.acc, ctx.k = acc, k
        if w.requires_grad:
            acc.pending += 1
        return F.linear(k.swiglu(gu), w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        gu, w = ctx.saved_tensors
        dw = ctx.acc.add(dy.t(), ctx.k.swiglu(gu)) if ctx.needs_input_grad[1] else None
        dgu = ctx.k.swiglu_backward(gu, dy @ w) if ctx.needs_input_grad[0] else None
        return dgu, dw, None, None


class LmHeadSoftCE(torch.autograd.Function):
    """Σ_rows w_rows · CE(lm_head(z), target) with the logits' gradient made in forward.

    Returns (weighted loss, per-row CE, argmax); only the loss is differentiable. Saving the bf16
    logits gradient instead of fp32 log-probabilities is what keeps [T, Vd] fp32 out of memory."""

    @staticmethod
    def forward(ctx, z, w, acc, target_p, src, w_rows, k: Kernels):
        logits = F.linear(z, w)
        ce, pred, dlogits = k.soft_ce(logits, target_p, src, w_rows)
        del logits
        ctx.save_for_backward(z, w, dlogits)
        ctx.acc = acc
        if w.requires_grad:
            acc.pending += 1
        ctx.mark_non_differentiable(ce, pred)
        return (ce * w_rows).sum(), ce, pred

    @staticmethod
    def backward(ctx, g, _ce, _pred):
        z, w, dlogits = ctx.saved_tensors
        g = g.to(z.dtype)
        dz = (dlogits @ w) * g if ctx.needs_input_grad[0] else None
        dw = ctx.acc.add(dlogits.t(), z * g) if ctx.needs_input_grad[1] else None
        return dz, dw, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Masks for the step-0 pass.


def doc_ids(cu_seqlens: list[int], T: int, device) -> Tensor:
    """Sample index of every packed position (positions past cu_seqlens[-1] get a new one)."""
    return _layout(cu_seqlens, T, device)[0]


def _layout(cu_seqlens: list[int], T: int, device) -> tuple[Tensor, Tensor]:
    """(sample index int32, end of own sample int64) per position, built on the host and copied
    without a device sync (a blocking copy here would stall the GPU queue every step)."""
    bounds = torch.tensor(cu_seqlens[1:], dtype=torch.int64)
    doc = torch.searchsorted(bounds, torch.arange(T), right=True)
    seg_end = torch.cat([bounds, torch.tensor([T])])[doc]
    both = torch.stack([doc, seg_end])
    if torch.device(device).type == "cuda":
        both = both.pin_memory().to(device, non_blocking=True)
    return both[0].to(torch.int32), both[1]


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Block-level bool [nq, nk] -> (count [1,1,nq], indices [1,1,nq,nk]) with True blocks first."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def doc_causal_block_mask(doc: Tensor):
    """Flex BlockMask for "same sample and key <= query" built from block summaries of `doc`
    (samples are contiguous and increasing), without evaluating the mask at every position."""
    from torch.nn.attention.flex_attention import BlockMask

    T = doc.shape[0]
    nb = T // BLOCK
    first, last = doc[::BLOCK], doc[BLOCK - 1 :: BLOCK]
    qb = torch.arange(nb, device=doc.device)[:, None]
    kb = torch.arange(nb, device=doc.device)[None, :]
    some = (kb <= qb) & (last[kb] >= first[qb])  # some (q, k) pair of one sample with k <= q
    full = (kb < qb) & (first[kb] == last[qb])  # both tiles inside one sample, strictly below
    partial = some & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    n_p, i_p = _ordered(partial)
    n_f, i_f = _ordered(full)
    return BlockMask.from_kv_blocks(
        n_p, i_p, n_f, i_f, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, T)
    )


def dense_step0_attention(
    q: Tensor, k0: Tensor, v0: Tensor, doc: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch stand-in for the flex pass (CPU; flex has no CPU backward): returns
    o0 [1, Hq, T, d] and lse0 [1, Hq, T] like flex attention with return_aux lse."""
    T, n_q, d = q.shape
    g = n_q // k0.shape[1]
    qh = q.float().transpose(0, 1)
    kh = k0.float().transpose(0, 1).repeat_interleave(g, dim=0)
    vh = v0.float().transpose(0, 1).repeat_interleave(g, dim=0)
    idx = torch.arange(T, device=q.device)
    allowed = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    sc = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(sc, dim=-1)
    o = torch.softmax(sc, dim=-1) @ vh
    return o.to(q.dtype)[None], lse[None]


# ----------------------------------------------------------------------------------------------
# The training forward.


def fast_ttt_forward(
    model: Eagle3Drafter,
    input_ids: Tensor,
    aux_hidden: Tensor,
    target_p: Tensor,
    valid: Tensor,
    cu_seqlens: list[int],
    position_ids: Tensor,
    ttt_length: int,
    step_decay: float = 0.8,
    attention: str = "auto",
    compiled: bool | None = None,
    pad_to: int | None = None,
) -> TTTOutput:
    """Drop-in for `model.ttt_forward` (same arguments and TTTOutput; no return_logits).

    attention: "flex" (CUDA), "dense" (anywhere, memory O(T²)), "auto" = flex on CUDA.
    compiled: torch.compile the elementwise pieces (default: on CUDA).
    pad_to: pad the packed row to at least this many tokens (a dummy sample with no loss), so
    every batch of a run has one shape: the compiled pieces specialise on the row's length, and
    on an H200 a batch of a new length cost a 36 s recompile (63 s for the first)."""
    dev = input_ids.device
    use_flex = attention == "flex" or (attention == "auto" and dev.type == "cuda")
    kn = kernels(dev.type == "cuda" if compiled is None else compiled)
    T0 = input_ids.shape[0]
    T = max(T0, pad_to or 0)
    T = -(-T // BLOCK) * BLOCK if use_flex else T
    if T != T0:  # pad with a dummy sample that has no loss
        pad = T - T0
        input_ids = F.pad(input_ids, (0, pad))
        aux_hidden = F.pad(aux_hidden, (0, 0, 0, pad))
        target_p = F.pad(target_p, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad))
        position_ids = F.pad(position_ids, (0, pad))
        cu_seqlens = [*cu_seqlens, T]
    doc, seg_end = _layout(cu_seqlens, T, dev)
    mid, attn, cfg = model.midlayer, model.midlayer.self_attn, model.cfg
    n_q, n_kv, d, eps = attn.n_heads, attn.n_kv, attn.head_dim, cfg.rms_norm_eps
    scale = 1.0 / math.sqrt(d)
    dtype = model.fc.weight.dtype

    w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    w_gu = torch.cat([mid.mlp.gate_proj.weight, mid.mlp.up_proj.weight])
    acc = {n: GradAccum() for n in ("qkv", "o", "gu", "down", "lm")}
    hidden = F.linear(aux_hidden.to(dtype), model.fc.weight)
    emb = F.embedding(input_ids, model.embed_weight).to(dtype)
    tgt_arg = target_p.argmax(-1)
    idx = torch.arange(T, device=dev)
    J = max(ttt_length - 1, 1)
    zeros = [torch.zeros(T, n_kv, d, device=dev, dtype=dtype) for _ in range(2 * J)]
    dmasks = torch.arange(J, device=dev)[None, :] < torch.arange(ttt_length, device=dev)[:, None]
    block_mask = doc_causal_block_mask(doc) if use_flex else None
    kd: list[Tensor] = []
    vd: list[Tensor] = []

    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses, correct, counted = [], [], []
    for i in range(ttt_length):
        src = (idx + 1 + i).clamp(max=T - 1)
        x = kn.attn_input(emb, hidden, src, mid.input_layernorm.weight, mid.hidden_norm.weight, eps)
        qkv = AccLinear.apply(x, w_qkv, acc["qkv"])
        cos, sin = rope_cos_sin(model.inv_freq, model.rope_factor, position_ids + i)
        q, kk, v = kn.rope_split(qkv, cos, sin, n_q, n_kv)
        if i == 0:
            k0, v0 = kk, v
        else:
            kd.append(kk)
            vd.append(v)
        if use_flex:
            from torch.nn.attention.flex_attention import AuxRequest

            o0, aux = kn.flex(
                q.transpose(0, 1)[None], k0.transpose(0, 1)[None], v0.transpose(0, 1)[None],
                block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True),
                kernel_options=FLEX_KERNEL_OPTIONS,
            )  # fmt: skip
            lse0 = aux.lse
        else:
            o0, lse0 = dense_step0_attention(q, k0, v0, doc, scale)
        ks = kd + zeros[len(kd) : J]
        vs = vd + zeros[J + len(vd) :]
        o = kn.lse_merge(q, o0, lse0, dmasks[i], ks, vs, scale)
        h, n = kn.add_rms(
            hidden,
            AccLinear.apply(o, attn.o_proj.weight, acc["o"]),
            mid.post_attention_layernorm.weight,
            eps,
        )
        gu = AccLinear.apply(n, w_gu, acc["gu"])
        hidden, z = kn.add_rms(
            h,
            SwiGLUDown.apply(gu, mid.mlp.down_proj.weight, acc["down"], kn),
            model.norm.weight,
            eps,
        )

        lbl = idx + 2 + i  # the token this step predicts
        mask = (lbl < seg_end) & valid[lbl.clamp(max=T - 1)]
        m = mask.float()
        cnt = m.sum()
        w_rows = m * (step_decay**i / cnt.clamp(min=1.0))
        loss_w, ce, pred = LmHeadSoftCE.apply(
            z, model.lm_head.weight, acc["lm"], target_p, src, w_rows, kn
        )
        total = total + loss_w
        step_losses.append((ce * m).sum().detach() / cnt.clamp(min=1.0))
        correct.append(((pred == tgt_arg[src]) & mask).float().sum())
        counted.append(cnt)
    return TTTOutput(total, step_losses, torch.stack(correct), torch.stack(counted))


# ----------------------------------------------------------------------------------------------
# Target soft labels over the draft vocab only.


@dataclass(frozen=True)
class SplitHead:
    """The target's lm_head split into draft-vocab rows and the rest (made once per run)."""

    draft: Tensor  # [Vd, Ht] rows of the draft vocab, in draft order
    rest: Tensor  # [V - Vd, Ht] the other rows, ascending target id
    draft_ids: Tensor  # [Vd] target ids
    rest_ids: Tensor  # [V - Vd]


def split_lm_head(lm_head: Tensor, d2t: Tensor, t2d: Tensor) -> SplitHead:
    dev = lm_head.device
    draft_ids = (torch.arange(d2t.numel(), device=d2t.device) + d2t).to(dev)
    rest_ids = torch.nonzero(~t2d.to(dev)).squeeze(-1)
    return SplitHead(
        lm_head[draft_ids].contiguous(), lm_head[rest_ids].contiguous(), draft_ids, rest_ids
    )


@torch.no_grad()
def fast_soft_labels(
    final_hidden: Tensor, head: SplitHead, chunk: int = 32768
) -> tuple[Tensor, Tensor]:
    """Same result as `eagle3.vocab.target_soft_labels`: softmax over the draft-vocab logits, and
    whether the full-vocab argmax is a draft token. Only [T, Vd] and [T, chunk] logits exist; the
    rest of the vocab is reduced to a running (max, lowest id) pair."""
    h = final_hidden.to(head.draft.dtype)
    ld = h @ head.draft.T
    probs = torch.softmax(ld.float(), dim=-1)
    best_d, arg_d = ld.max(-1)
    id_d = head.draft_ids[arg_d]
    best_r = torch.full_like(best_d, -math.inf)
    id_r = torch.full_like(id_d, torch.iinfo(id_d.dtype).max)
    for s in range(0, head.rest.shape[0], chunk):
        val, arg = (h @ head.rest[s : s + chunk].T).max(-1)
        take = val > best_r  # ascending ids: strict '>' keeps the lowest id on ties
        best_r = torch.where(take, val, best_r)
        id_r = torch.where(take, head.rest_ids[s + arg], id_r)
    inside = (best_d > best_r) | ((best_d == best_r) & (id_d < id_r))
    return probs, inside
