"""The static path's cycle with its glue on the device (serve/engine/device.py, issue 50)
against the host-side cycle it replaces (`device_glue=False`, the reference): the same drafts,
tokens and accept histograms, greedy, chains and trees; and the device helpers (the tree walk,
the ancestor mask) against their host references. On CPU the same code runs without graphs.

The target answers only two tokens (as conftest's two-token target) and the drafter drafts only
those two, so cycles accept 0..k drafts: rejections, partial paths and full accepts all occur,
and tree siblings repeat tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import tiny_llama_config
from test_engine_static_draft import record
from transformers import LlamaForCausalLM

from serve.engine import (
    DraftTree,
    GenParams,
    SpecEngine,
    StaticEagleDraft,
    random_drafter,
    tree_ancestors,
    tree_greedy_accept,
)
from serve.engine.acceptance import tree_greedy_accept_on_device
from serve.engine.drafting import tree_ancestors_by_depth

V, A, B = 512, 7, 9  # vocab; the two tokens the target answers
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def make_two_token_lm() -> LlamaForCausalLM:
    """A random tiny Llama whose answer is A or B by the sign of one feature of its state."""
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=V, layers=4, hidden=64, max_position_embeddings=512,
                            eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[A, 0], model.lm_head.weight[B, 0] = 20.0, -20.0
    return model


def two_token_drafter(target, seed: int = 5):
    """A random drafter whose draft ids all map to A (even ids) or B (odd ids): its chains and
    trees hold only the target's two answers, siblings repeat tokens."""
    d = random_drafter(target, draft_vocab_size=64, aux_layer_ids=[2, 0, 1], seed=seed)
    d.model.to(target.device)
    ids = torch.arange(64)
    d.model.d2t.copy_(torch.where(ids % 2 == 0, A, B) - ids)
    return d


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 11, 40, 7)]


def run(target, shape: dict, device_glue: bool, seed: int = 5, batch: int = 1, glue=None):
    """(drafts log, generations, plain generations) of one static engine of `batch` rows
    (`glue`: its device cycle's CycleGlue)."""
    engine = SpecEngine(target, steps=shape.get("steps", 3), topk=shape.get("topk", 1),
                        num_draft_tokens=shape.get("num_draft_tokens"), runner="static",
                        static_capacity=160, stop_ids=set(), device_glue=device_glue,
                        static_batch=batch)  # fmt: skip
    engine.glue = glue or engine.glue
    engine.set_drafter(two_token_drafter(target, seed))
    assert isinstance(engine.drafter, StaticEagleDraft)
    log = record(engine.drafter)
    out = engine.generate(prompts(), GenParams(max_tokens=40))
    plain = engine.plain_generate(prompts(), GenParams(max_tokens=40))
    assert engine.late_captures() == 0  # start-up captured every graph (CUDA; 0 on CPU)
    return log, out, plain


def differences(ref, dev) -> list[str]:
    """What differs between two runs' drafts, tokens and accept histograms."""
    (lr, gr, _), (ld, gd, _) = ref, dev
    diff = [] if lr == ld else ["drafts"]
    if [g.token_ids for g in gr] != [g.token_ids for g in gd]:
        diff.append("tokens")
    if [g.stats.accept_hist for g in gr] != [g.stats.accept_hist for g in gd]:
        diff.append("accept_hist")
    return diff


SHAPES = [dict(steps=3), dict(steps=3, topk=3, num_draft_tokens=7),
          dict(steps=5, topk=4, num_draft_tokens=12)]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=["chain-3", "tree-3x3x7", "tree-5x4x12"])
def test_device_cycle_equals_the_host_cycle(two_token_lm, shape):
    """Greedy: the device cycle drafts, emits and accepts exactly what the host cycle does, the
    tokens are the target's own greedy ones, and the cycles accepted from 0 to k drafts."""
    ref, dev = run(two_token_lm, shape, False), run(two_token_lm, shape, True)
    assert differences(ref, dev) == []
    assert [g.token_ids for g in dev[1]] == [g.token_ids for g in dev[2]]  # = plain decoding
    assert [g.token_ids for g in dev[2]] == [g.token_ids for g in ref[2]]  # plain: device = host
    hist = [sum(h) for h in zip(*(g.stats.accept_hist for g in dev[1]), strict=True)]
    assert hist[0] > 0 and sum(hist[2:]) > 0, hist  # rejections and paths of 2 or more
    assert all(g.stats.draft_ms > 0 and g.stats.verify_ms > 0 and g.stats.accept_ms > 0
               for g in dev[1])  # fmt: skip


def test_the_compiled_acceptance_equals_the_host_cycle(two_token_lm):
    """The device cycle's acceptance compiled (`CycleGlue`; aot_eager here, the trace without
    code generation; inductor on a GPU) in batches of 4 rows that shrink as requests end: the
    host cycle's drafts, tokens and accept histograms for chains of 2 and 3 and trees of 7 and
    12 tokens, with 4 codes in all (chains, trees; one row, several), not one per row count,
    chain length or tree (seen failing without the length and node marks: 8)."""
    from torch._dynamo.utils import counters

    from serve.engine.device import CycleGlue

    glue = CycleGlue("aot_eager")
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    before = counters["stats"]["unique_graphs"]
    for shape in [dict(steps=2), *SHAPES]:
        ref = run(two_token_lm, shape, False, batch=4)
        dev = run(two_token_lm, shape, True, batch=4, glue=glue)
        assert differences(ref, dev) == [], shape
    assert counters["stats"]["unique_graphs"] - before == 4


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", SHAPES, ids=["chain-3", "tree-3x3x7", "tree-5x4x12"])
def test_device_cycle_equals_the_host_cycle_on_cuda(two_token_lm, shape):
    """The same on CUDA (fp32, TF32 off), with the target's and the drafter's CUDA graphs: no
    graph captured after start-up, the device cycle's tokens are plain decoding's."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    model = copy.deepcopy(two_token_lm).cuda()
    ref, dev = run(model, shape, False), run(model, shape, True)
    assert differences(ref, dev) == []
    assert [g.token_ids for g in dev[1]] == [g.token_ids for g in dev[2]]


def test_device_plain_decoding_stops_where_the_host_loop_does(two_token_lm):
    """Plain greedy decoding with the argmax fed back on the device and a host read every 8
    steps: with a stop token and limits that are no multiple of 8, the same tokens and finish
    reasons as the host loop."""
    outs = []
    for glue in (False, True):
        engine = SpecEngine(two_token_lm, runner="static", static_capacity=160, stop_ids={B},
                            device_glue=glue)  # fmt: skip
        outs.append(engine.plain_generate(prompts(), GenParams(max_tokens=40),
                                          max_tokens_each=[1, 5, 19, 40]))  # fmt: skip
    ref, dev = ([(g.token_ids, g.stats.finish_reason) for g in out] for out in outs)
    assert dev == ref
    assert {why for _, why in dev} == {"stop", "length"}


def test_the_comparison_catches_a_planted_divergence(two_token_lm):
    """The check above is not vacuous: a device run whose drafter differs (another seed) is
    reported as drafting differently."""
    shape = dict(steps=3, topk=3, num_draft_tokens=7)
    ref, dev = run(two_token_lm, shape, False), run(two_token_lm, shape, True, seed=6)
    assert "drafts" in differences(ref, dev)


def random_tree(g: torch.Generator, rows: int, nodes: int, vocab: int) -> DraftTree:
    """Parents before children (each node hangs from the root or an earlier node)."""
    parents = torch.stack([torch.randint(-1, i, (rows,), generator=g) if i else
                           torch.full((rows,), -1) for i in range(nodes)], 1)  # fmt: skip
    depths = torch.zeros(rows, nodes, dtype=torch.long)
    for i in range(nodes):
        p = parents[:, i]
        depths[:, i] = torch.where(p < 0, 1, depths.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1)
    return DraftTree(torch.randint(0, vocab, (rows, nodes), generator=g), parents, depths)


def test_tree_helpers_on_the_device_equal_the_host_walk():
    """Random trees with repeated tokens among siblings (a vocab of 3) and logits whose argmax
    often follows a path: the same accepted count, path and bonus as the host walk, and the
    same ancestor mask as the per-node reference."""
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(30):
        tree = random_tree(g, rows=4, nodes=12, vocab=3)
        depth = int(tree.depths.max())
        logits = torch.randn(4, 13, 3, generator=g)
        want = tree_greedy_accept(tree, logits, depth)
        with_mask = replace(tree, ancestors=tree_ancestors(tree.parents))  # the static drafter's
        for got in (tree_greedy_accept_on_device(tree, logits, depth),
                    tree_greedy_accept_on_device(with_mask, logits, depth + 1)):  # fmt: skip
            (a, path, bonus), (ga, gpath, gbonus) = want, got
            assert torch.equal(a, ga) and torch.equal(bonus, gbonus)
            assert torch.equal(path, gpath[:, :depth]) and not gpath[:, depth:].any()
        assert torch.equal(tree_ancestors_by_depth(tree.parents, depth),
                           tree_ancestors(tree.parents))  # fmt: skip
        accepted += int(want[0].sum())
    assert accepted > 30  # paths were walked, not only roots


def test_the_drafter_in_the_serving_dtype_keeps_fp32_rotary_frequencies(two_token_lm):
    """On a GPU `set_drafter` casts a static drafter to the target's dtype (`_to_dtype`): its
    weights go bf16, its rotary frequencies stay fp32 (in bf16 they would be off by ~1/256)."""
    from serve.engine.loop import _to_dtype

    model = two_token_drafter(two_token_lm).model
    want = model.inv_freq.clone()
    _to_dtype(model, torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16 and model.embed_weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, want)
