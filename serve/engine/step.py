"""The static target runner's step as pure functions of tensors (no modules, no host reads), so
that torch.compile fuses each one's elementwise work (norms, residual adds, RoPE, the masked
softmax, SwiGLU) into a few kernels and one compiled code serves all layers; and the layer weights
they read (q/k/v and gate/up fused into one matmul each). serve/engine/static.py runs them."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _fuse_linears(owner: torch.nn.Module, name: str, mods: list[torch.nn.Linear]) -> Tensor:
    """One [sum of outputs, in] weight for linears that read the same input (q/k/v, gate/up), so
    a step runs one matmul instead of three or two. The modules' own weights become views of it:
    the model computes exactly as before and no memory is added. Cached on `owner` (a second
    runner on the same model reuses it). Biases stay with the modules (see `_fused_bias`)."""
    cached = owner.__dict__.get(name)
    if cached is not None:
        offs, o = [], 0
        for m in mods:
            offs.append(o)
            o += m.weight.shape[0]
        if all(
            m.weight.data_ptr() == cached[o].data_ptr() for m, o in zip(mods, offs, strict=True)
        ):
            return cached
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat([m.weight for m in mods])
        for m, part in zip(mods, fused.split([m.weight.shape[0] for m in mods]), strict=True):
            m.weight = torch.nn.Parameter(part, requires_grad=m.weight.requires_grad)
    owner.__dict__[name] = fused
    return fused


def _fused_bias(mods: list[torch.nn.Linear]) -> Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
    )


class _LayerWeights(NamedTuple):
    """One decoder layer's tensors as the static runner's pure functions take them (a tuple, so
    torch.compile treats its tensors as inputs: one compiled code for every layer)."""

    norm_in: Tensor
    qkv: Tensor  # [(H + 2 Hkv) d, hidden]
    qkv_bias: Tensor | None
    q_norm: Tensor | None  # Qwen3-style per-head norms
    k_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    norm_post: Tensor
    gate_up: Tensor  # [2 I, hidden]
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerWeights:
        at, mlp = layer.self_attn, layer.mlp
        qkv = [at.q_proj, at.k_proj, at.v_proj]
        gu = [mlp.gate_proj, mlp.up_proj]
        return cls(
            norm_in=layer.input_layernorm.weight,
            qkv=_fuse_linears(at, "_static_qkv", qkv),
            qkv_bias=_fused_bias(qkv),
            q_norm=at.q_norm.weight if hasattr(at, "q_norm") else None,
            k_norm=at.k_norm.weight if hasattr(at, "k_norm") else None,
            o=at.o_proj.weight,
            o_bias=at.o_proj.bias,
            norm_post=layer.post_attention_layernorm.weight,
            gate_up=_fuse_linears(mlp, "_static_gate_up", gu),
            gate_up_bias=_fused_bias(gu),
            down=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
        )


# The step's functions. The matmuls stay cuBLAS calls (or, with the runner's `fused_matmuls`,
# kernels.py's few-rows kernel with the norms and SwiGLU inside, `_rotated` then compiled alone).
# `heads` = (H, Hkv, head dim); `eps` = (norm eps, q/k norm eps).


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF's Llama RMSNorm: fp32 statistics, cast back to x's dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _attn_in(
    x: Tensor,
    d: Tensor,
    w: _LayerWeights,
    cos: Tensor,
    sin: Tensor,
    heads: tuple[int, int, int],
    eps: tuple[float, float],
) -> tuple[Tensor, Tensor]:
    """Add the previous layer's MLP output `d` to the residual `x`, norm, q/k/v in one matmul,
    then `_rotated`. Returns (x, `_rotated`'s [B, q, H + 2 Hkv, d])."""
    x = x + d
    qkv = F.linear(_rms(x, w.norm_in, eps[0]), w.qkv, w.qkv_bias)
    return x, _rotated(qkv, w, cos, sin, heads, eps)


def _rotated(
    qkv: Tensor,
    w: _LayerWeights,
    cos: Tensor,
    sin: Tensor,
    heads: tuple[int, int, int],
    eps: tuple[float, float],
) -> Tensor:
    """q/k norms and RoPE of the q/k/v matmul's output [B, q, (H + 2 Hkv) d]: the rotated
    queries, rotated keys and values in one tensor [B, q, H + 2 Hkv, d], so one kernel writes
    them (`_gqa_views` splits it)."""
    H, Hkv, dh = heads
    B, q = qkv.shape[:2]
    qs, ks, vs = qkv.split([H * dh, Hkv * dh, Hkv * dh], -1)
    qs, ks, vs = qs.view(B, q, H, dh), ks.view(B, q, Hkv, dh), vs.view(B, q, Hkv, dh)
    if w.q_norm is not None and w.k_norm is not None:
        qs, ks = _rms(qs, w.q_norm, eps[1]), _rms(ks, w.k_norm, eps[1])
    qs = qs * cos + _rotate_half(qs) * sin  # cos, sin: [B, q, 1, d]
    ks = ks * cos + _rotate_half(ks) * sin
    return torch.cat([qs, ks, vs], dim=2)


def _gqa_views(rot: Tensor, heads: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """Views of `_attn_in`'s [B, q, H + 2 Hkv, d]: queries [B, Hkv, rep, q, d] (the rep query
    heads of a KV head; flattened, rep x q rows) and the new keys/values [2, B, Hkv, q, d]."""
    H, Hkv, dh = heads
    B, q = rot.shape[:2]
    queries = rot[:, :, :H].view(B, q, Hkv, H // Hkv, dh).permute(0, 2, 3, 1, 4)
    return queries, rot[:, :, H:].view(B, q, 2, Hkv, dh).permute(2, 0, 3, 1, 4)


def _probs(scores: Tensor, mask: Tensor, scale: float, rep: int) -> Tensor:
    """Softmax over key slots in fp32 with the additive mask [B, q, span] (GQA rows: rep x q)."""
    B, Hkv, rows, span = scores.shape
    s = scores.float().view(B, Hkv, rep, rows // rep, span) * scale + mask[:, None, None]
    return torch.softmax(s, dim=-1).to(scores.dtype).view(B, Hkv, rows, span)


def _attn_out_mlp(
    o: Tensor, x: Tensor, w: _LayerWeights, heads: tuple[int, int, int], eps: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """o_proj and its residual add, the post-attention norm, gate/up in one matmul, SwiGLU and
    down_proj. Returns (x, the MLP output): the next layer's `_attn_in` adds it to x."""
    x = x + F.linear(_merged_heads(o, heads), w.o, w.o_bias)
    g, u = F.linear(_rms(x, w.norm_post, eps[0]), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return x, F.linear(F.silu(g) * u, w.down, w.down_bias)


def _merged_heads(o: Tensor, heads: tuple[int, int, int]) -> Tensor:
    """Attention's output [B, H, q, d] (or its [B, Hkv, rep * q, d] view) as [B, q, H * d]."""
    H, _, dh = heads
    B = o.shape[0]
    return o.view(B, H, -1, dh).transpose(1, 2).reshape(B, -1, H * dh)


def _head(
    x: Tensor, d: Tensor, norm: Tensor, eps: float, head: Tensor, head_bias: Tensor | None
) -> Tensor:
    """Last residual add, final norm, lm_head; float logits."""
    return F.linear(_rms(x + d, norm, eps), head, head_bias).float()
