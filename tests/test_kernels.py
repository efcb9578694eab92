"""serve/engine/kernels.py's few-rows matmul (`few_rows_linear`) and the static runner that runs
its steps through it (`fused_matmuls`): on a CPU under triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 without a GPU), on CUDA in the `gpu` test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_engine_static_batch import ragged_steps  # noqa: E402

from serve.engine.kernels import few_rows_linear  # noqa: E402
from serve.engine.step import _rms  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _close(dtype: torch.dtype) -> dict:
    # bf16: within a rounding or two of outputs of a few units (the order of the fp32 sums
    # differs from torch's, and the interpreter rounds fp32 -> bf16 its own way)
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 13, 64])
def test_few_rows_linear_computes_what_the_eager_modules_do(dtype, rows):
    """The add + RMSNorm prologue (its new residual too), the SwiGLU prologue and the bare matmul
    give what the eager functions give: K 96 (one block and a ragged one), N 80 (three column
    blocks, the last ragged), with and without a bias, 1 to 64 rows."""
    g = torch.Generator().manual_seed(rows)
    K, N = 160, 80

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, d, w, bias = randn(rows, K), randn(rows, K), randn(N, K) / 10, randn(N)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    h, y = few_rows_linear(x, w, bias, d, (nw, 1e-5))
    ref_h = x + d
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0 if dtype == torch.float32 else 8e-3)
    torch.testing.assert_close(y, F.linear(_rms(ref_h, nw, 1e-5), w, bias), **_close(dtype))
    gu = randn(rows, 2 * K)
    gate, up = gu.chunk(2, -1)
    none, y = few_rows_linear(gu, w, swiglu=True)
    assert none is None
    torch.testing.assert_close(y, F.linear(F.silu(gate) * up, w), **_close(dtype))
    torch.testing.assert_close(few_rows_linear(x, w)[1], F.linear(x, w), **_close(dtype))


def test_a_runner_with_fused_matmuls_equals_the_one_without(tiny_lm, monkeypatch):
    """The static runner's steps through the few-rows kernel (norms and SwiGLU inside) give the
    logits and aux states of its steps without it, over 3 ragged rows run as 4: a chain, a tree,
    a commit of different paths, a chain again and a one-token step."""
    from serve.engine import StaticTargetRunner, static

    g = torch.Generator().manual_seed(4)
    target = copy.deepcopy(tiny_lm)
    with torch.no_grad():  # norms of ones would hide a norm read from the wrong weight
        for name, p in target.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
    bare = StaticTargetRunner(target, 64, max_batch=4)
    fused = StaticTargetRunner(target, 64, max_batch=4, fused_matmuls=True)
    calls = []
    monkeypatch.setattr(static, "few_rows_linear", lambda *a, **k: calls.append(1) or few_rows_linear(*a, **k))  # fmt: skip
    want = ragged_steps(bare, 4)
    assert not calls
    got = ragged_steps(fused, 4)
    assert len(calls) >= 4 * 4 * 2, "the fused runner's steps ran the kernel"  # 4 a layer
    for e, f in zip(want, got, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@cuda
def test_fused_matmuls_on_cuda_with_graphs():
    """On CUDA with graphs (fp32, TF32 off; then bf16 against the bf16 runner without them)."""
    from test_gpu_perf_paths import tiny_llama

    from serve.engine import StaticTargetRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.bfloat16):
        target = tiny_llama("cuda").to(dtype)
        bare = StaticTargetRunner(target, 128, max_batch=4)
        fused = StaticTargetRunner(target, 128, max_batch=4, fused_matmuls=True)
        want, got = (ragged_steps(r, 5, vocab=500) for r in (bare, fused))
        for e, f in zip(want, got, strict=True):
            torch.testing.assert_close(f, e, **_close(dtype))
