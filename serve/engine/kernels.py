"""Attention kernels of the static runner (Triton): split-K attention of q new entries over the
cache at batch 1, then a merge of the slices."""

from __future__ import annotations

import os

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


# Matmuls of a few rows (decode and verify steps: one to FUSED_ROWS rows) with the elementwise
# work before them done on the way in. An H100 profile of SmolLM2's step (2026-12-08): each of a
# layer's four cuBLAS matmuls took 3.8 us at one to four rows, half of the step, and the norms and
# SwiGLU before them took three kernels more. Here one program per BLOCK_N columns of W [N, K]
# loads the rows' inputs and
#   PRO 0: uses them as they are;
#   PRO 1 (add + RMSNorm): h = x + d (written by program 0: the new residual), then HF's Llama
#          RMSNorm of h with the weight `nw` (fp32 statistics, rounded as the eager module does);
#   PRO 2 (SwiGLU): silu(g) * u of the gate/up matmul's output [M, 2K],
# then multiplies by W in fp32 (tl.dot) and rounds to the output dtype.
FUSED_ROWS = 64

if triton is not None:

    @triton.jit
    def _rounded(v, dt: tl.constexpr, DOWN: tl.constexpr):
        """v (fp32) in the output dtype, rounded to nearest even as torch rounds (a bare .to() may
        truncate, as triton's CPU interpreter does)."""
        if DOWN:
            return v.to(dt, fp_downcast_rounding="rtne")
        return v.to(dt)

    @triton.jit
    def _few_rows_linear_kernel(
        X,
        D,
        NW,
        W,
        Bias,
        H,
        Y,
        M,
        N,
        K,
        eps,
        stride_x,
        stride_w,
        PRO: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
        DOWN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < M
        dt = Y.dtype.element_ty
        r = tl.zeros([BLOCK_M], tl.float32)
        if PRO == 1:  # the rows' sum of squares first: the norm needs all of K
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                at = live[:, None] & (ks < K)[None, :]
                x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=at, other=0.0)
                d = tl.load(D + rows[:, None] * K + ks[None, :], mask=at, other=0.0)
                h = _rounded(x.to(tl.float32) + d.to(tl.float32), dt, DOWN)
                tl.store(H + rows[:, None] * K + ks[None, :], h, mask=at & (pid == 0))
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, 1)
            r = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            at = live[:, None] & (ks < K)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=at, other=0.0)
            if PRO == 1:
                d = tl.load(D + rows[:, None] * K + ks[None, :], mask=at, other=0.0)
                h = _rounded(x.to(tl.float32) + d.to(tl.float32), dt, DOWN)
                a = _rounded(h.to(tl.float32) * r[:, None], dt, DOWN)
                nw = tl.load(NW + ks, mask=ks < K, other=0.0)
                a = _rounded(nw.to(tl.float32)[None, :] * a.to(tl.float32), dt, DOWN)
            elif PRO == 2:
                u = tl.load(X + rows[:, None] * stride_x + K + ks[None, :], mask=at, other=0.0)
                g = x.to(tl.float32)
                s = _rounded(g / (1.0 + tl.exp(-g)), dt, DOWN)
                a = _rounded(s.to(tl.float32) * u.to(tl.float32), dt, DOWN)
            else:
                a = x.to(dt)
            w = tl.load(W + cols[None, :] * stride_w + ks[:, None], mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)  # fmt: skip
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = _rounded(acc, dt, DOWN)
        tl.store(
            Y + rows[:, None] * N + cols[None, :], out, mask=live[:, None] & (cols < N)[None, :]
        )


def fused_matmuls_problem(device: torch.device) -> str | None:
    """Why `few_rows_linear` cannot run on `device`, or None: it needs triton, and on a CPU
    triton's interpreter (TRITON_INTERPRET=1 before triton is imported; the tests' way)."""
    if triton is None:
        return "needs triton (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"runs on CUDA (on {device.type} only with TRITON_INTERPRET=1, for tests)"
    return None


def few_rows_linear(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    norm: tuple[Tensor, float] | None = None,
    swiglu: bool = False,
) -> tuple[Tensor | None, Tensor]:
    """(h, y) for rows x [..., K] (at most FUSED_ROWS of them) and a weight w [N, K], in one
    kernel: with `residual` d and `norm` (weight, eps), h = x + d and y = RMSNorm(h) @ w.T (+
    bias); with `swiglu`, x is a gate/up output [..., 2K] and y = (silu(gate) * up) @ w.T, h None;
    else y = x @ w.T, h None. Rounded as the eager modules round (tests/test_kernels.py)."""
    lead, K = x.shape[:-1], w.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    assert M <= FUSED_ROWS and w.stride(-1) == 1 and x2.shape[1] == (2 * K if swiglu else K)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    h = d = nw = None
    eps = 0.0
    if norm is not None:
        assert residual is not None
        d = residual.reshape(M, K).contiguous()
        h = torch.empty(M, K, device=x.device, dtype=x.dtype)
        nw, eps = norm
    block_m = max(16, triton.next_power_of_2(M))
    block_n = 32 if N <= 4096 else 64
    _few_rows_linear_kernel[(triton.cdiv(N, block_n),)](
        x2, d if d is not None else x2, nw if nw is not None else w, w,
        bias if bias is not None else w, h if h is not None else y, y,
        M, N, K, float(eps), x2.stride(0), w.stride(0),
        PRO=1 if norm is not None else 2 if swiglu else 0, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(128, triton.next_power_of_2(K)),
        PREC="ieee" if x.dtype == torch.float32 else "tf32", DOWN=x.dtype != torch.float32,
    )  # fmt: skip
    y = y.view(*lead, N)
    return (h.view(*lead, K) if h is not None else None), y
