"""The EAGLE-3 drafter: SGLang's `LlamaForCausalLMEagle3` in plain PyTorch.

One decoder layer whose attention reads `cat(input_layernorm(embed(x)), hidden_norm(h))`; `h` is
`fc(cat(aux_low, aux_mid, aux_high))` on the first step and the drafter's own pre-norm output
afterwards. `state_dict()` holds exactly the tensor names SGLang loads; the target's embedding is a
frozen, non-persistent buffer because SGLang always brings the target's own.

Two entry points share the layer:
- `ttt_forward` (training, time-test training over packed samples): the reference attention path,
  explicit math per sample; faster paths must match it (tests/test_model.py).
- `forward_step` (serving): a KV cache indexed by absolute position, so draft entries written past
  the verified prefix are simply overwritten by the next extend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.config import Eagle3Config
from eagle3.cpu import top1

# ----------------------------------------------------------------------------------------------
# RoPE (plain, llama3, yarn), computed as inv_freq + an attention factor on cos/sin.


def rope_parameters(cfg: Eagle3Config) -> tuple[Tensor, float]:
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if not rs or kind == "default":
        return inv_freq.float(), 1.0
    factor = float(rs["factor"])
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind == "llama3":
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(is_mid, mid, scaled).float(), 1.0
    if kind == "yarn":
        old = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)
        beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

        def corr_dim(rot: float) -> float:
            return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        inv = (inv_freq / factor) * ramp + inv_freq * (1 - ramp)

        def mscale(s: float, m: float) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = rs.get("attention_factor")
        if att is None:
            m, m_all = rs.get("mscale", 1.0), rs.get("mscale_all_dim", 0.0)
            att = mscale(factor, m) / mscale(factor, m_all) if m_all else mscale(factor, 1.0)
        return inv.float(), float(att)
    raise ValueError(
        f"rope_scaling.rope_type={kind!r} is not supported; use default, linear, llama3 or yarn"
    )


def rope_cos_sin(inv_freq: Tensor, factor: float, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [*positions.shape, head_dim] (halves layout, as HF Llama)."""
    ang = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------------------------
# Modules, named exactly as SGLang's checkpoint.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(2 * h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., T, 2H] -> q [..., Hq, T, d], k/v [..., Hkv, T, d] with RoPE applied."""
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.n_heads, self.head_dim).transpose(-2, -3)
        k = self.k_proj(x).view(*shape, self.n_kv, self.head_dim).transpose(-2, -3)
        v = self.v_proj(x).view(*shape, self.n_kv, self.head_dim).transpose(-2, -3)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        # RoPE tables are fp32; keep q/k in the weights' dtype (bf16 weights outside autocast).
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype), v


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """Residual + MLP; returns the pre-norm hidden state the next step feeds back."""
        h = hidden + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class TTTOutput:
    loss: Tensor  # weighted sum over steps of masked soft cross-entropy
    step_losses: list[Tensor]
    correct: Tensor  # [k] correct top-1 predictions per step (counts, float)
    counted: Tensor  # [k] positions counted per step
    step_logits: list[Tensor] | None = None  # per-step [T, Vd] logits when asked for


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed_weight: Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        if embed_weight is None:
            embed_weight = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        # Frozen target embedding: not in state_dict (SGLang brings the target's own).
        self.register_buffer("embed_weight", embed_weight.detach().clone(), persistent=False)
        inv_freq, att = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_factor = att

    # -- helpers ---------------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def project(self, hidden: Tensor) -> Tensor:
        """Target aux states (3·Ht wide) go through fc; the drafter's own states pass as they are."""
        return self.fc(hidden) if hidden.shape[-1] == self.fc.in_features else hidden

    def logits(self, prenorm: Tensor) -> Tensor:
        return self.lm_head(self.norm(prenorm))

    # -- training --------------------------------------------------------------------------
    def ttt_forward(
        self,
        input_ids: Tensor,  # [T] packed tokens x_0..x_{T-1}
        aux_hidden: Tensor,  # [T, 3·Ht] target aux states at each position
        target_p: Tensor,  # [T, Vd] target softmax over the draft vocab at each position
        valid: Tensor,  # [T] bool: loss mask already joined with "target argmax in draft vocab"
        cu_seqlens: list[int],  # sample boundaries in the packed sequence
        position_ids: Tensor,  # [T] position inside each sample
        ttt_length: int,
        step_decay: float = 0.8,
        return_logits: bool = False,
    ) -> TTTOutput:
        """Time-test training. Step i at packed index t reads token x_{t+1+i} and either the target
        state h_t (i=0) or step i-1's output, sits at RoPE position pos_t + i, attends to step-0
        keys of its sample at indices <= t plus its own diagonal keys of steps 1..i, and learns the
        target's distribution at t+1+i (the token x_{t+2+i}), masked by `valid[t+2+i]`."""
        T = input_ids.shape[0]
        seg_end = torch.empty(T, dtype=torch.long, device=input_ids.device)
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            seg_end[s:e] = e
        idx = torch.arange(T, device=input_ids.device)
        # Step i at index t is scored when token t+2+i is a loss token of the same sample.
        masks = [
            (idx + 2 + i < seg_end) & valid[(idx + 2 + i).clamp(max=T - 1)]
            for i in range(ttt_length)
        ]
        # A row's step-i output is needed only if step i or a later one scores it (its hidden
        # carries over, its diagonal keys serve only itself): prompt rows drop out after their
        # step-0 keys, about 30% of the rows of chat data. Asking for logits keeps every row.
        live = [torch.ones_like(valid, dtype=torch.bool)] * ttt_length
        if not return_logits:
            acc = torch.zeros_like(masks[0])
            for i in reversed(range(ttt_length)):
                acc = acc | masks[i]
                live[i] = acc
        hidden = self.project(aux_hidden)  # [T, H]: every row's step-0 keys are needed
        rows = idx
        keys: list[tuple[Tensor, Tensor, Tensor]] = []  # (k, v, their rows) of steps 0..i
        total = hidden.new_zeros((), dtype=torch.float32)
        step_losses, correct, counted, all_logits = [], [], [], []
        for i in range(ttt_length):
            src = rows + 1 + i  # token fed at this step
            tok = input_ids[src.clamp(max=T - 1)]
            x = self.midlayer.attn_input(self.embed(tok), hidden)
            cos, sin = rope_cos_sin(self.inv_freq, self.rope_factor, position_ids[rows] + i)
            q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)
            keys.append((k, v, rows))
            keep = live[i][rows]  # the rows this step computes on past its keys
            rows, hidden, q = rows[keep], hidden[keep], q[:, keep]
            diag = [(kj[:, live[i][rj]], vj[:, live[i][rj]]) for kj, vj, rj in keys[1:]]
            attn = ttt_attention(q, [keys[0][:2], *diag], cu_seqlens, rows)  # [R, Hq·d]
            hidden = self.midlayer.finish(hidden, attn)
            logits = self.logits(hidden)
            if return_logits:
                all_logits.append(logits.detach())
            logp = F.log_softmax(logits.float(), dim=-1)
            tgt = target_p[(rows + 1 + i).clamp(max=T - 1)]
            m = masks[i][rows].float()
            n = m.sum()
            loss_i = -((tgt * logp).sum(-1) * m).sum() / n.clamp(min=1.0)
            total = total + (step_decay**i) * loss_i
            step_losses.append(loss_i.detach())
            correct.append(((top1(logp) == top1(tgt)).float() * m).sum().detach())
            counted.append(n.detach())
        return TTTOutput(
            total, step_losses, torch.stack(correct), torch.stack(counted), all_logits or None
        )

    # -- serving ---------------------------------------------------------------------------
    def forward_step(
        self,
        input_ids: Tensor,  # [B, n] tokens x_{t+1}
        hidden: Tensor,  # [B, n, 3·Ht] target aux states, or [B, n, H] drafter states
        positions: Tensor,  # [B, n] absolute positions t (the cache slots written)
        cache: DrafterCache,
        write: Tensor | None = None,  # [B, n] bool: which entries are real (padding is not)
    ) -> tuple[Tensor, Tensor]:
        """One drafter pass over n new entries per row; returns (pre-norm hidden, draft logits)."""
        hidden = self.project(hidden)
        x = self.midlayer.attn_input(self.embed(input_ids), hidden)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_factor, positions)
        q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)  # [B, H, n, d]
        cache.write(k, v, positions, write)
        attn = cache.attend(q, positions)
        out = self.midlayer.finish(hidden, attn)
        return out, self.logits(out)


def _expand_kv(t: Tensor, n_heads: int) -> Tensor:
    return t.repeat_interleave(n_heads // t.shape[-3], dim=-3)


def ttt_attention(
    q: Tensor, keys: list[tuple[Tensor, Tensor]], cu_seqlens: list[int], rows: Tensor | None = None
) -> Tensor:
    """Reference TTT attention, explicit math per sample.

    q [Hq, R, d] are the queries of packed indices `rows` (sorted; None = all T indices);
    keys[0] = step-0 (k, v) [Hkv, T, d] of every index (causal within a sample); keys[j>0] = the
    diagonal keys of step j at the same `rows` (each query sees only its own). Returns [R, Hq·d]."""
    n_heads, R, d = q.shape
    k0, v0 = (_expand_kv(t, n_heads) for t in keys[0])
    kd = [_expand_kv(k, n_heads) for k, _ in keys[1:]]
    vd = [_expand_kv(v, n_heads) for _, v in keys[1:]]
    idx = torch.arange(k0.shape[1], device=q.device) if rows is None else rows
    # the query slice [a, b) of each sample [s, e)
    cuts = torch.searchsorted(idx, torch.tensor(cu_seqlens, device=q.device)).tolist()
    scale = 1.0 / math.sqrt(d)
    outs = []
    for s, e, a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], cuts[:-1], cuts[1:], strict=True):
        if a == b:
            continue
        qs = q[:, a:b].float()
        sc = qs @ k0[:, s:e].float().transpose(-1, -2) * scale  # [H, Lq, L]
        causal = torch.arange(s, e, device=q.device)[None, :] <= idx[a:b, None]
        sc = sc.masked_fill(~causal, float("-inf"))
        diag = [(qs * k[:, a:b].float()).sum(-1, keepdim=True) * scale for k in kd]  # [H, Lq, 1]
        w = torch.softmax(torch.cat([sc, *diag], dim=-1), dim=-1)
        L = e - s
        o = w[..., :L] @ v0[:, s:e].float()
        for j, v in enumerate(vd):
            o = o + w[..., L + j : L + j + 1] * v[:, a:b].float()
        outs.append(o)
    if not outs:
        # No query left (a batch without one loss token): zeros that still reach q, k and v, so
        # every parameter gets a gradient; DDP's reducer fails the next step on any that has none.
        touch = q.sum() + sum(t.sum() for kv in keys for t in kv)
        return q.new_zeros(R, n_heads * d) + 0.0 * touch
    out = torch.cat(outs, dim=1).to(q.dtype)  # [H, R, d]
    return out.transpose(0, 1).reshape(R, n_heads * d)


class DrafterCache:
    """KV cache of the drafter indexed by absolute position: slot p holds the entry written at
    position p. A query at position p attends to slots 0..p of its row. Padding entries are written
    to a spare slot at the end, which no query reaches."""

    def __init__(
        self, cfg: Eagle3Config, batch: int, capacity: int, device=None, dtype=torch.float32
    ):
        shape = (batch, cfg.num_key_value_heads, capacity + 1, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.n_heads = cfg.num_attention_heads

    def write(self, k: Tensor, v: Tensor, positions: Tensor, write: Tensor | None) -> None:
        if int(positions.max()) >= self.capacity:
            raise ValueError(
                f"drafter cache holds {self.capacity} positions; got {int(positions.max())}"
            )
        slots = positions if write is None else torch.where(write, positions, self.capacity)
        b = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(slots)
        # k [B, Hkv, n, d] -> index [B, n] into [B, Hkv, S, d]
        self.k[b, :, slots] = k.transpose(1, 2).to(self.k.dtype)
        self.v[b, :, slots] = v.transpose(1, 2).to(self.v.dtype)

    def attend(self, q: Tensor, positions: Tensor) -> Tensor:
        """q [B, Hq, n, d] at `positions` [B, n] -> [B, n, Hq·d]."""
        B, H, n, d = q.shape
        top = int(positions.max()) + 1  # slots past every query are never read
        k = _expand_kv(self.k[:, :, :top], H)
        v = _expand_kv(self.v[:, :, :top], H)
        visible = torch.arange(top, device=q.device)[None, None, :] <= positions[:, :, None]
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible[:, None]
        )
        return out.transpose(1, 2).reshape(B, n, H * d)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()


def init_from_target(model: Eagle3Drafter, lm_head: Tensor, norm: Tensor | None) -> None:
    """Start the drafter's output head at the target's own rows for the draft vocab: the drafter
    then only has to learn to move its state toward the target's next-next-token state, which
    converges far faster than a random head (fine for scratch init; never for an existing drafter)."""
    used = torch.arange(model.cfg.draft_vocab_size, device=model.d2t.device) + model.d2t
    with torch.no_grad():
        model.lm_head.weight.copy_(lm_head[used.to(lm_head.device)].to(model.lm_head.weight))
        if norm is not None:
            model.norm.weight.copy_(norm.to(model.norm.weight))


def drafter_from_state(
    cfg: Eagle3Config, state: dict[str, Tensor], embed_weight: Tensor
) -> Eagle3Drafter:
    """Build a drafter from a checkpoint's state dict and the target's embedding (strict names)."""
    model = Eagle3Drafter(cfg, embed_weight)
    model.load_state_dict(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    )
    return model
