"""Attention kernels of the static runner (Triton): split-K attention of q new entries over the
cache at batch 1, then a merge of the slices."""

from __future__ import annotations

import torch
from torch import Tensor

try:  # the static runner's GPU attention kernel; CPU-only installs have no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None


# Attention of q new entries over the cache at batch 1, split over the key slots (flash
# decoding). cuBLAS's batched products give only Hkv blocks of work for [rep*q, span] scores and
# take three kernels (scores, softmax, products) plus an index copy for the new keys/values; here
# Hkv x SPLITS programs each take a slice of the slots with an online softmax in fp32, the program
# whose slice holds the new slots writes the new keys/values into the cache (and uses them), and
# a second kernel merges the slices, one program per row. Rows are the GQA rows of `_attn_in`
# (row r is new entry r % q); `mask` [q, span] is additive (0 or -inf).
ATTN_SPLITS = 16
ATTN_BLOCK_N = 64

if triton is not None:

    @triton.jit
    def _attn_split_kernel(
        Q,
        K,
        V,
        New,
        Base,
        Mask,
        Part,
        Stats,
        stride_qh,
        stride_qr,
        stride_qt,
        stride_kh,
        stride_kn,
        stride_vh,
        stride_vn,
        stride_nc,
        stride_nh,
        stride_nq,
        R,
        q,
        span,
        chunk,
        scale,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        rows = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, D)
        live = rows < R
        at_q = Q + h * stride_qh + (rows // q) * stride_qr + (rows % q) * stride_qt
        qv = tl.load(at_q[:, None] + dims[None, :], mask=live[:, None])
        base = tl.load(Base)
        m_i = tl.full([BLOCK_R], -1e30, tl.float32)  # finite: a slice may be fully masked
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        start = sp * chunk
        for j in range(0, chunk, BLOCK_N):
            cols = start + j + tl.arange(0, BLOCK_N)
            ok = (cols < start + chunk) & (cols < span)
            rel = cols - base
            new = ok & (rel >= 0) & (rel < q)
            old = ok & ~new
            at_k = K + h * stride_kh + cols[:, None] * stride_kn + dims[None, :]
            at_v = V + h * stride_vh + cols[:, None] * stride_vn + dims[None, :]
            at_n = New + h * stride_nh + rel[:, None] * stride_nq + dims[None, :]
            k_new = tl.load(at_n, mask=new[:, None], other=0.0)
            v_new = tl.load(at_n + stride_nc, mask=new[:, None], other=0.0)
            tl.store(at_k, k_new, mask=new[:, None])
            tl.store(at_v, v_new, mask=new[:, None])
            k = tl.load(at_k, mask=old[:, None], other=0.0) + k_new
            sc = tl.dot(qv, tl.trans(k), input_precision=PREC) * scale
            add = tl.load(
                Mask + (rows % q)[:, None] * span + cols[None, :],
                mask=live[:, None] & ok[None, :],
                other=float("-inf"),
            )
            sc = sc + add
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(at_v, mask=old[:, None], other=0.0) + v_new
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        at = h * SPLITS + sp
        tl.store(Part + (at * BLOCK_R + rows[:, None]) * D + dims[None, :], acc)
        tl.store(Stats + (at * 2) * BLOCK_R + rows, m_i)
        tl.store(Stats + (at * 2 + 1) * BLOCK_R + rows, l_i)

    @triton.jit
    def _attn_merge_kernel(
        Part,
        Stats,
        Out,
        R,
        BLOCK_R: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        h = tl.program_id(0)
        r = tl.program_id(1)
        dims = tl.arange(0, D)
        at = h * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(Stats + (at * 2) * BLOCK_R + r)
        w = tl.exp(m - tl.max(m, 0))
        total = tl.sum(w * tl.load(Stats + (at * 2 + 1) * BLOCK_R + r), 0)
        part = tl.load(Part + (at[:, None] * BLOCK_R + r) * D + dims[None, :])
        out = tl.sum(part * w[:, None], 0) / total
        tl.store(Out + (h * R + r) * D + dims, out)


def triton_attention_ok(device: torch.device, head_dim: int) -> bool:
    """Whether `_split_attention` can run: triton present, CUDA, a power-of-two head dim."""
    pow2 = head_dim >= 16 and not (head_dim & (head_dim - 1))
    return triton is not None and device.type == "cuda" and pow2


def _split_attention(
    queries: Tensor,
    k: Tensor,
    v: Tensor,
    new_kv: Tensor,
    base: Tensor,
    mask: Tensor,
    scale: float,
) -> Tensor:
    """softmax(queries k^T * scale + mask) v over the first `span` = mask.shape[1] slots of the
    cache views k, v [Hkv, capacity, d], after writing the q new keys/values `new_kv`
    [2, Hkv, q, d] at slots base..base+q-1 (`base`: a one-element int64 device tensor). queries
    [Hkv, rep, q, d] (views of `_gqa_views`; each row's last dim contiguous). Returns
    [Hkv, rep * q, d]: what `_core`'s CPU path computes (index copy, batched products, softmax),
    with fp32 scores."""
    Hkv, rep, q, D = queries.shape
    R = rep * q
    span = mask.shape[1]
    block_r = max(16, triton.next_power_of_2(R))
    chunk = max(ATTN_BLOCK_N, triton.cdiv(span, ATTN_SPLITS))
    part = torch.empty(Hkv, ATTN_SPLITS, block_r, D, device=queries.device, dtype=torch.float32)
    stats = torch.empty(Hkv, ATTN_SPLITS, 2, block_r, device=queries.device, dtype=torch.float32)
    out = torch.empty(Hkv, R, D, device=queries.device, dtype=queries.dtype)
    _attn_split_kernel[(Hkv, ATTN_SPLITS)](
        queries,
        k,
        v,
        new_kv,
        base,
        mask,
        part,
        stats,
        queries.stride(0),
        queries.stride(1),
        queries.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        new_kv.stride(0),
        new_kv.stride(1),
        new_kv.stride(2),
        R,
        q,
        span,
        chunk,
        scale,
        BLOCK_R=block_r,
        BLOCK_N=ATTN_BLOCK_N,
        D=D,
        SPLITS=ATTN_SPLITS,
        PREC="ieee" if queries.dtype == torch.float32 else "tf32",
    )
    _attn_merge_kernel[(Hkv, R)](part, stats, out, R, BLOCK_R=block_r, D=D, SPLITS=ATTN_SPLITS)
    return out
