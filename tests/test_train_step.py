"""The training step without Ray: packing, soft labels, schedule, metrics, one step, resume state."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from actors.shards import Sample, iter_samples, read_shard, write_shard
from eagle3.config import Eagle3Config
from eagle3.train_step import (
    STATE_FILE,
    Anchor,
    Batch,
    ShardSet,
    SoftTargets,
    TTTModule,
    eval_metrics,
    eval_step,
    load_training_state,
    lr_factor,
    make_optimizer,
    make_scheduler,
    matmul_macs_per_token,
    pack,
    rank_order,
    save_training_state,
    scratch_drafter,
    sim_accept_len,
    split_eval,
    step_metrics,
    steps_per_epoch,
    token_counts,
    train_step,
)
from eagle3.vocab import build_vocab_map, target_soft_labels

V, HT = 300, 32  # HT = drafter hidden: SGLang feeds the drafter the target's embedding


def small_cfg(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=V, draft_vocab_size=120, target_hidden_size=HT, aux_layer_ids=[0, 1, 2],
    )  # fmt: skip
    base.update(kw)
    return Eagle3Config(**base)


def synthetic_batch(lengths: list[int], seed: int = 0, prompt: int = 3) -> Batch:
    """Chat-like samples whose tokens follow a fixed rule (x_{t+1} = 7·x_t + 3 mod V) so there is
    something to learn; the first `prompt` tokens of each sample carry no loss."""
    g = torch.Generator().manual_seed(seed)
    ids, cu = [], [0]
    for L in lengths:
        x = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(L - 1):
            x.append((7 * x[-1] + 3) % V)
        ids += x
        cu.append(cu[-1] + L)
    emb = torch.randn(V, HT, generator=g)
    ids_t = torch.tensor(ids)
    nxt = torch.tensor([(7 * x + 3) % V for x in ids])
    return Batch(
        input_ids=ids_t,
        loss_mask=torch.cat([torch.arange(L) >= prompt for L in lengths]),
        aux_hidden=torch.cat([emb[ids_t], emb[ids_t] * 0.5, emb[nxt]], -1).to(torch.bfloat16),
        final_hidden=emb[nxt].to(torch.bfloat16),  # the target "knows" the next token
        cu_seqlens=cu,
        position_ids=torch.cat([torch.arange(L) for L in lengths]),
        keys=[f"s{seed}:{i}" for i in range(len(lengths))],
    )


# ----------------------------------------------------------------------------------------------
# Packing and sharding of batches


def test_pack_covers_every_sample_once_within_budget():
    lengths = [5, 300, 17, 64, 64, 1, 128, 99, 250, 3] * 7
    bins = pack(lengths, budget=256, seed=3)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(min(lengths[i], 256) for i in b) <= 256 for b in bins)
    # Nearly full bins: no more bins than 10% over the lower bound.
    assert len(bins) <= math.ceil(1.1 * sum(min(n, 256) for n in lengths) / 256) + 1
    assert pack(lengths, 256, seed=3) == bins  # deterministic
    assert pack(lengths, 256, seed=4) != bins


def test_rank_order_splits_bins_between_ranks_in_lockstep():
    n, world = 11, 3
    orders = [rank_order(n, r, world, seed=0, epoch=2) for r in range(world)]
    assert all(len(o) == steps_per_epoch(n, world) == 4 for o in orders)
    assert set().union(*map(set, orders)) == set(range(n))
    assert all(b % world == r for r, o in enumerate(orders) for b in o)  # each rank its own share
    assert orders == [rank_order(n, r, world, seed=0, epoch=2) for r in range(world)]
    assert orders != [rank_order(n, r, world, seed=0, epoch=3) for r in range(world)]
    assert rank_order(1, 1, 2, 0, 0) == [0]  # fewer bins than ranks: reuse, never an empty step


def test_shardset_reads_samples_as_written_and_truncates(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            torch.randint(0, V, (L,), generator=g).tolist(),
            [0] * 2 + [1] * (L - 2),
            torch.randn(L, 3 * HT, generator=g).to(torch.bfloat16),
            torch.randn(L, HT, generator=g).to(torch.bfloat16),
        )
        for L in (7, 12, 5)
    ]
    info = write_shard(tmp_path / "s.safetensors", samples)
    data = ShardSet([tmp_path / "s.safetensors"], [info.sha256])
    assert [s.length for s in data.samples] == [7, 12, 5]
    ref = list(iter_samples(read_shard(tmp_path / "s.safetensors")))
    b = data.load([data.samples[2], data.samples[1]], budget=10)  # the 12-token sample is cut to 10
    assert b.cu_seqlens == [0, 5, 15] and b.tokens == 15
    assert torch.equal(b.input_ids[:5], ref[2]["input_ids"].long())
    assert torch.equal(b.aux_hidden[5:], ref[1]["aux_hidden"][:10])
    assert torch.equal(b.final_hidden[5:], ref[1]["final_hidden"][:10])
    assert b.position_ids.tolist() == list(range(5)) + list(range(10))
    counts = token_counts([tmp_path / "s.safetensors"], V)
    want = torch.zeros(V, dtype=torch.int64)
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask, strict=True):
            want[t] += m
    assert torch.equal(counts, want)


def test_eval_split_is_stable_when_data_grows():
    from eagle3.train_step import SampleRef

    old = [SampleRef(0, i, 10, f"aaaa:{i}") for i in range(200)]
    new = old + [SampleRef(1, i, 10, f"bbbb:{i}") for i in range(200)]
    tr0, ev0 = split_eval(old, 0.1)
    tr1, ev1 = split_eval(new, 0.1)
    assert 5 < len(ev0) < 40 and len(tr0) + len(ev0) == 200
    assert {s.key for s in ev0} <= {s.key for s in ev1}
    assert not {s.key for s in tr0} & {s.key for s in ev1}
    assert len(split_eval(old[:3], 0.01)[1]) == 1  # a tiny set still gets one eval sample
    assert split_eval(old, 0.0)[1] == []


# ----------------------------------------------------------------------------------------------
# Soft labels


def test_soft_targets_match_target_softmax_and_align_valid():
    g = torch.Generator().manual_seed(1)
    b = synthetic_batch([9, 6, 11])
    head = torch.randn(V, HT, generator=g) * 3
    counts = torch.randint(0, 50, (V,), generator=g)
    d2t, t2d = build_vocab_map(counts, 120)
    soft = SoftTargets(head, d2t, t2d, torch.float32, "cpu")
    tp, valid = soft(b)
    probs, inside = target_soft_labels(b.final_hidden, head, d2t, t2d)
    T = b.tokens
    seg_end = torch.tensor([9] * 9 + [15] * 6 + [26] * 11)
    need = torch.tensor([t + 1 < seg_end[t] and bool(b.loss_mask[t + 1]) for t in range(T)])
    torch.testing.assert_close(tp[need], probs[need], rtol=1e-5, atol=1e-6)
    assert torch.all(tp[~need] == 0)
    # valid[t]: token t is a loss token AND the target's argmax at t-1 (predicting t) is a draft token.
    want = torch.zeros(T, dtype=torch.bool)
    want[1:] = b.loss_mask[1:] & inside[:-1]
    assert torch.equal(valid[need.roll(1)], want[need.roll(1)])
    assert (
        0 < int(valid.sum()) < int(b.loss_mask.sum())
    )  # some argmaxes fall outside the draft vocab
    # Second visit: `inside` comes from the cache, and nothing changes.
    tp2, valid2 = soft(b)
    assert len(soft.inside) == 3
    assert torch.equal(tp2, tp) and torch.equal(valid2, valid)


# ----------------------------------------------------------------------------------------------
# Schedule, metrics, FLOPs


def test_lr_schedule_warms_up_then_decays_to_ten_percent():
    total, warm = 200, 0.05
    f = [lr_factor(s, total, warm) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # 10 warmup steps
    assert all(a <= b for a, b in zip(f[:10], f[1:10], strict=False))
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert lr_factor(total, total, warm) == pytest.approx(0.1)
    assert lr_factor(0, 10, 0.0) == pytest.approx(1.0)


def test_sim_accept_len_chains_conditional_accuracies():
    assert sim_accept_len([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert sim_accept_len([1.0, 1.0, 1.0, 1.0], 3) == pytest.approx(4.0)  # capped at steps+1
    assert sim_accept_len([0.0, 1.0], 2) == pytest.approx(1.0)
    m = step_metrics(2.0, [8, 3], [10, 6], 1e-3, 500, 0.5, sim_steps=2)
    assert m["acc_0"] == pytest.approx(0.8) and m["acc_1"] == pytest.approx(0.5)
    assert m["tok_per_s"] == pytest.approx(1000) and m["sim_accept_len"] == pytest.approx(
        1 + 0.8 + 0.4
    )


def test_matmul_macs_of_the_smollm2_drafter():
    cfg = Eagle3Config(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, draft_vocab_size=8192, target_hidden_size=576, aux_layer_ids=[1, 14, 26],
    )  # fmt: skip
    qkv = 1152 * (9 + 3 + 3) * 64
    per_step = qkv + 576 * 576 + 3 * 576 * 1536 + 576 * 8192
    assert matmul_macs_per_token(cfg, 3) == 3 * per_step + 3 * 576 * 576


# ----------------------------------------------------------------------------------------------
# One step


def _setup(seed: int = 0, dtype=None):
    cfg = small_cfg()
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(V, HT, generator=torch.Generator().manual_seed(0))
    head = emb * 4  # the synthetic final_hidden are these rows: argmax = the rule's next token
    counts = torch.rand(V, generator=g)
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    model = scratch_drafter(cfg, torch.randn(V, HT, generator=g), head, None, d2t, t2d, seed)
    module = TTTModule(model)
    opt = make_optimizer(module, 3e-3, 0.0)
    sched = make_scheduler(opt, 100, 0.05)
    soft = SoftTargets(head, d2t, t2d, torch.float32, "cpu")
    return cfg, model, module, opt, sched, soft


def test_train_step_learns_a_rule():
    cfg, model, module, opt, sched, soft = _setup()
    b = synthetic_batch([40, 30, 50])
    # init_from_target: the drafter's head starts at the target's rows of the draft vocab.
    assert torch.equal(model.lm_head.weight, soft.draft_rows)
    first = train_step(module, b, soft, opt, sched, 3, 0.5, None)
    for _ in range(40):
        last = train_step(module, b, soft, opt, sched, 3, 0.5, None)
    assert last.loss < 0.5 * first.loss
    acc0 = last.correct[0] / last.counted[0]
    assert acc0 > 0.8 > first.correct[0] / first.counted[0]
    assert sched.get_last_lr()[0] < 3e-3  # the schedule moved
    sums = eval_step(module, b, soft, 3, None)
    ev = eval_metrics(sums, 3, 3)
    assert ev["acc_0"] == pytest.approx(float(sums[3] / sums[6]))
    assert ev["loss"] < first.loss


def test_bf16_autocast_step_tracks_fp32():
    *_, module, opt, sched, soft = _setup()
    b = synthetic_batch([40, 30])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = module(b.input_ids, b.aux_hidden, *soft(b), b.cu_seqlens, b.position_ids, 3)
    out32 = module(b.input_ids, b.aux_hidden.float(), *soft(b), b.cu_seqlens, b.position_ids, 3)
    assert float(out16.loss) == pytest.approx(float(out32.loss), rel=0.03)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32


def test_fast_path_wrapper_matches_reference():
    """TTTModule(path="fast") runs eagle3.fast's fused step; in fp32 it must give the reference
    loss, and with `cast` its gradients land on the fp32 master weights."""
    import eagle3.fast  # noqa: F401 - plain torch: an ImportError is a failure, never a skip

    *_, module, opt, sched, soft = _setup()
    b = synthetic_batch([20, 12])
    tp, valid = soft(b)
    args = (b.input_ids, b.aux_hidden.float(), tp, valid, b.cu_seqlens, b.position_ids, 3)
    ref = module(*args)
    fast = TTTModule(module.drafter, "fast")(*args)
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-4, atol=1e-4)
    cast = TTTModule(module.drafter, "fast", cast=torch.bfloat16)(*args)
    cast.loss.backward()
    assert float(cast.loss) == pytest.approx(float(ref.loss), rel=0.03)
    grads = [p.grad for p in module.drafter.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_training_state_round_trip_continues_exactly(tmp_path):
    b1, b2 = synthetic_batch([30, 20], seed=1), synthetic_batch([25, 25], seed=2)
    *_, module, opt, sched, soft = _setup()
    train_step(module, b1, soft, opt, sched, 3, 0.5, None)
    state = save_training_state(tmp_path, module, opt, sched, step=1)
    assert state is not None and "d2t" in state and "t2d" in state and "fc.weight" in state
    want = train_step(module, b2, soft, opt, sched, 3, 0.5, None)

    *_, module2, opt2, sched2, soft2 = _setup(seed=99)  # different init, overwritten by the load
    assert load_training_state(tmp_path, module2, opt2, sched2) == 1
    got = train_step(module2, b2, soft2, opt2, sched2, 3, 0.5, None)
    assert got.loss == want.loss
    assert sched2.get_last_lr() == sched.get_last_lr()
    for p, q in zip(module.parameters(), module2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_target_dtype_auto_follows_the_hardware():
    from eagle3.cpu import cpu_has_native_bf16
    from eagle3.train_step import target_dtype

    want = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert target_dtype("auto", "cpu") == want
    assert target_dtype("auto", "cuda") == torch.bfloat16
    assert target_dtype("float32", "cuda") == torch.float32


class _Payload:
    """Stands for any pickled object a tampered checkpoint could carry (code runs on load)."""

    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_training_state_loads_tensors_only(tmp_path):
    """torch.load(weights_only=True): a checkpoint carrying an arbitrary object is refused
    instead of executed (main loaded with weights_only=False)."""
    *_, module, opt, sched, _ = _setup()
    save_training_state(tmp_path, module, opt, sched, step=1)
    payload = torch.load(tmp_path / STATE_FILE, weights_only=True)  # what it writes is plain
    payload["extra"] = _Payload()
    torch.save(payload, tmp_path / STATE_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_training_state(tmp_path, module, opt, sched)


def test_resume_skips_any_unreadable_checkpoint_and_names_it(tmp_path, capsys):
    """The newest checkpoint that loads is resumed, whatever the others' bytes make torch raise:
    random bytes raise UnpicklingError and a corrupted byte ValueError (UnicodeDecodeError here),
    neither of which resume skipped (only FileNotFoundError, RuntimeError and EOFError), so
    every retry of the run failed on the same file."""
    from pipeline.train_worker import load_newest_readable

    *_, module, opt, sched, _ = _setup()
    dirs = {s: tmp_path / f"step-{s:07d}" for s in (1, 2, 3)}
    for s, d in dirs.items():
        d.mkdir()
        save_training_state(d, module, opt, sched, step=s)
    noise = torch.randint(
        0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    (dirs[3] / STATE_FILE).write_bytes(noise.numpy().tobytes())
    raw = bytearray((dirs[2] / STATE_FILE).read_bytes())
    at = raw.index(b"optim")  # a key of the pickle, stored uncompressed: no longer UTF-8
    raw[at] = 0xFF
    (dirs[2] / STATE_FILE).write_bytes(bytes(raw))

    *_, module2, opt2, sched2, _ = _setup(seed=99)
    newest_first = [dirs[3], dirs[2], dirs[1]]
    assert load_newest_readable(newest_first, module2, opt2, sched2) == 1
    said = capsys.readouterr().out
    for s, err in ((3, "UnpicklingError"), (2, "UnicodeDecodeError")):
        assert f"checkpoint {dirs[s] / STATE_FILE} is unreadable ({err}" in said, said
    assert "resumed from checkpoint step-0000001 at step 1" in said
    for p, q in zip(module.parameters(), module2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert load_newest_readable([dirs[3], dirs[2]], module2, opt2, sched2) is None


def test_the_export_replaces_the_drafter_folder_atomically(tmp_path):
    """A failed export leaves the previous one whole (it was deleted before the new one was
    written); a good one replaces it, with no temp folder left beside."""
    from eagle3.checkpoint import CheckpointError, load_drafter, save_drafter
    from pipeline.best import write_drafter_dir

    cfg, model, *_ = _setup()
    dest = tmp_path / "drafter"
    save_drafter(model.state_dict(), cfg, dest)
    before = load_drafter(dest)[1]
    broken = {k: v for k, v in model.state_dict().items() if k != "fc.weight"}
    with pytest.raises(CheckpointError):
        write_drafter_dir(dest, None, broken, cfg)
    assert torch.equal(load_drafter(dest)[1]["fc.weight"], before["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]

    other = _setup(seed=3)[1]
    src = tmp_path / "given"
    save_drafter(other.state_dict(), cfg, src)
    write_drafter_dir(dest, src, {}, cfg)
    assert torch.equal(load_drafter(dest)[1]["fc.weight"], load_drafter(src)[1]["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "given"]


def test_the_anchor_pulls_each_weight_and_reports_its_term():
    """The anchor's units are per weight (each gradient gains 2·anchor·(θ−θ₀)), its term is
    reported beside the loss, and a stronger anchor keeps the weights nearer their start."""
    drift = {}
    for w in (0.0, 1.0):
        *_, module, opt, sched, soft = _setup()
        anchor = Anchor(module, w)
        b = synthetic_batch([40, 30, 50])
        first = train_step(module, b, soft, opt, sched, 3, 0.5, None, anchor)
        assert first.anchor_loss == 0.0  # the first step starts at θ₀
        for _ in range(9):
            before = float(anchor.distance2())  # the θ the next step's term is taken at
            out = train_step(module, b, soft, opt, sched, 3, 0.5, None, anchor)
        assert out.anchor_loss == pytest.approx(w * before, rel=1e-4)
        n = sum(p.numel() for _, p in anchor.start)
        assert anchor.drift_rms() == pytest.approx((float(anchor.distance2()) / n) ** 0.5)
        drift[w] = anchor.drift_rms()
    assert 0 < drift[1.0] < drift[0.0]
    # the gradient of the term alone is 2·anchor·(θ−θ₀) per weight
    *_, module, opt, sched, soft = _setup()
    anchor = Anchor(module, 0.5)
    p, p0 = anchor.start[0]
    with torch.no_grad():
        p.add_(1.0)
    module.zero_grad()
    anchor().backward()
    assert torch.allclose(p.grad, 2 * 0.5 * (p - p0).detach())
