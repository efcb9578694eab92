"""The fast training path (eagle3/fast.py) computes what the reference `ttt_forward` computes.

CPU tests run the fast path with its dense step-0 attention (flex attention has no CPU backward) and
check the flex pieces forward-only; `gpu` tests run the compiled flex path on CUDA in bf16."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import Eagle3Config
from eagle3.fast import (
    doc_causal_block_mask,
    doc_ids,
    fast_soft_labels,
    fast_ttt_forward,
    lse_merge,
    split_lm_head,
)
from eagle3.model import Eagle3Drafter, ttt_attention
from eagle3.vocab import build_vocab_map, target_soft_labels


def small_cfg(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=90, draft_vocab_size=40, target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
    )  # fmt: skip
    base.update(kw)
    return Eagle3Config(**base)


def drafter(cfg: Eagle3Config, seed: int, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))
    for p in model.parameters():  # norms away from 1 so their gradients are exercised
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()  # RoPE frequencies stay fp32 in bf16 training
    return model


def batch(cfg: Eagle3Config, cu: list[int], seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    aux = torch.randn(T, 3 * cfg.target_hidden_size, generator=g)
    tp = torch.softmax(3 * torch.randn(T, cfg.draft_vocab_size, generator=g), -1)
    valid = torch.rand(T, generator=g) > 0.2
    pos = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:], strict=True)])
    to = dict(device=device)
    return ids.to(**to), aux.to(dtype=dtype, **to), tp.to(**to), valid.to(**to), cu, pos.to(**to)


def run(fn, model, b, ttt):
    model.zero_grad(set_to_none=True)
    out = fn(*b, ttt_length=ttt)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    return out, grads


def reference(model):
    def fwd(*a, **k):
        if model.fc.weight.dtype == torch.float32:
            return model.ttt_forward(*a, **k)
        # The reference promotes RoPE'd q/k to fp32; with bf16 weights it needs autocast.
        with torch.autocast(model.fc.weight.device.type, dtype=model.fc.weight.dtype):
            return model.ttt_forward(*a, **k)

    return fwd


def fast(model, **opts):
    return lambda *a, **k: fast_ttt_forward(model, *a, **k, **opts)


def test_fast_path_matches_reference_on_cpu():
    cfg = small_cfg()
    model = drafter(cfg, seed=0)
    b = batch(cfg, [0, 13, 20, 37], seed=1)
    ref, g_ref = run(reference(model), model, b, ttt=4)
    out, g = run(fast(model, attention="dense", compiled=False), model, b, ttt=4)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.stack(out.step_losses), torch.stack(ref.step_losses), rtol=1e-5, atol=1e-5
    )
    assert out.counted.tolist() == ref.counted.tolist()
    assert out.correct.tolist() == ref.correct.tolist()
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_padding_the_row_to_a_fixed_length_changes_nothing():
    """`pad_to` (one compiled shape per run) adds a dummy sample with no loss: the loss, the
    per-step figures and every gradient are those of the unpadded row."""
    cfg = small_cfg()
    model = drafter(cfg, seed=0)
    b = batch(cfg, [0, 13, 20, 37], seed=1)
    want, g_want = run(fast(model, attention="dense", compiled=False), model, b, ttt=4)
    got, g = run(fast(model, attention="dense", compiled=False, pad_to=64), model, b, ttt=4)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert got.counted.tolist() == want.counted.tolist()
    assert got.correct.tolist() == want.correct.tolist()
    for name in g_want:
        torch.testing.assert_close(g[name], g_want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_still_accumulate_over_two_backwards():
    """Grad accumulation inside one forward must not break accumulation across micro-batches."""
    cfg = small_cfg()
    model = drafter(cfg, seed=2)
    b1, b2 = batch(cfg, [0, 9, 24], seed=3), batch(cfg, [0, 24], seed=4)
    model.zero_grad(set_to_none=True)
    for b in (b1, b2):
        model.ttt_forward(*b, ttt_length=3).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for b in (b1, b2):
        fast_ttt_forward(model, *b, ttt_length=3, attention="dense", compiled=False).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-5, msg=n)


def test_block_mask_and_lse_merge_match_reference_attention():
    """Flex over step-0 keys with our block mask, merged with diagonal keys through the
    log-sum-exp, equals the reference TTT attention (forward; CPU flex has no backward)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(5)
    cu = [0, 100, 131, 256, 300, 384]  # boundaries inside and on 128-blocks
    T, n_q, n_kv, d, steps = cu[-1], 4, 2, 16, 3
    doc = doc_ids(cu, T, "cpu")
    bm = doc_causal_block_mask(doc)
    idx = torch.arange(T)
    want = ((doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None]))[None, None]
    dense = torch.zeros(T, T, dtype=torch.bool)
    for qi in range(T):
        dense[qi] = bm.mask_mod(0, 0, torch.tensor(qi), idx)
    assert torch.equal(dense, want[0, 0])
    # Block lists: every tile holding an allowed pair is listed; "full" tiles are entirely allowed.
    nb = T // 128
    tiles = want[0, 0].view(nb, 128, nb, 128)
    listed = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        listed[qb, bm.kv_indices[0, 0, qb, : bm.kv_num_blocks[0, 0, qb]].long()] = True
        full[qb, bm.full_kv_indices[0, 0, qb, : bm.full_kv_num_blocks[0, 0, qb]].long()] = True
    assert not (listed & full).any()
    assert torch.equal(listed | full, tiles.any(3).any(1))
    assert torch.equal(full, tiles.all(3).all(1))
    q = torch.randn(n_q, T, d, generator=g)
    keys = [
        (torch.randn(n_kv, T, d, generator=g), torch.randn(n_kv, T, d, generator=g))
        for _ in range(steps)
    ]
    ref = ttt_attention(q, keys, cu)
    o0, aux = flex.flex_attention(
        q[None], keys[0][0][None], keys[0][1][None], block_mask=bm, scale=d**-0.5, enable_gqa=True,
        return_aux=flex.AuxRequest(lse=True),
    )  # fmt: skip
    J = 4
    kd = [k.transpose(0, 1) for k, _ in keys[1:]] + [torch.zeros(T, n_kv, d)] * (J - steps + 1)
    vd = [v.transpose(0, 1) for _, v in keys[1:]] + [torch.zeros(T, n_kv, d)] * (J - steps + 1)
    dmask = torch.arange(J) < steps - 1
    out = lse_merge(q.transpose(0, 1).contiguous(), o0, aux.lse, dmask, kd, vd, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_fast_soft_labels_match_reference():
    g = torch.Generator().manual_seed(6)
    V, Vd, H = 300, 64, 16
    d2t, t2d = build_vocab_map(torch.randint(0, 50, (V,), generator=g), Vd)
    head = torch.randn(V, H, generator=g)
    h = torch.randn(70, H, generator=g)
    h[:5] = head[~t2d][:5] * 10  # rows whose argmax is certainly outside the draft vocab
    p_ref, in_ref = target_soft_labels(h, head, d2t, t2d, chunk=16)
    p, inside = fast_soft_labels(h, split_lm_head(head, d2t, t2d), chunk=50)
    torch.testing.assert_close(p, p_ref)
    assert torch.equal(inside, in_ref) and not inside[:5].any() and inside.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cu", [[0, 700, 1024], [0, 300, 301, 999]])  # second: padded to 1024
def test_compiled_flex_path_matches_reference_in_bf16(cu):
    cfg = small_cfg(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=64, vocab_size=1000, draft_vocab_size=500, target_hidden_size=256)  # fmt: skip
    model = drafter(cfg, seed=7, device="cuda", dtype=torch.bfloat16)
    b = batch(cfg, cu, seed=8, device="cuda", dtype=torch.bfloat16)
    ref, g_ref = run(reference(model), model, b, ttt=7)
    out, g = run(fast(model), model, b, ttt=7)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(
        torch.stack(out.step_losses), torch.stack(ref.step_losses), rtol=1e-2, atol=1e-2
    )
    assert out.counted.tolist() == ref.counted.tolist()
    assert (out.correct - ref.correct).abs().max() <= 0.02 * ref.counted.max()
    for name in g_ref:
        rel = (g[name] - g_ref[name]).norm() / g_ref[name].norm().clamp(min=1e-12)
        assert rel < 3e-2, (name, rel.item())
