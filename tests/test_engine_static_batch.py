"""Batched streams on the static runner (`SpecEngine(static_batch=...)`, issue 56): a batch of
concurrent requests, each in its own row of the static KV cache at its own length, gives each
request exactly the tokens it gets alone, greedy, plain decoding, chains and trees, with rows
that accept different counts each cycle and leave at different lengths (a batch of 3 runs
padded to 4 rows, as with graphs). On CPU the same code
runs without graphs; the `gpu` test repeats it with the CUDA graphs of each batch size."""

from __future__ import annotations

import pytest
import torch
from test_engine_device_cycle import SHAPES, prompts, two_token_drafter

from serve.engine import GenParams, SpecEngine, StaticEagleDraft

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LIMITS = [5, 40, 19, 33]  # rows leave the batch at different cycles


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


def _engine(target, shape: dict | None, batch: int) -> tuple[SpecEngine, list[int]]:
    """A static engine of `batch` rows and the batch sizes its target's forwards saw."""
    shape = shape or {}
    engine = SpecEngine(target, steps=shape.get("steps", 3), topk=shape.get("topk", 1),
                        num_draft_tokens=shape.get("num_draft_tokens"), runner="static",
                        static_capacity=160, static_batch=batch, stop_ids=set())  # fmt: skip
    if shape:
        engine.set_drafter(two_token_drafter(target))
        assert isinstance(engine.drafter, StaticEagleDraft)
    engine.static.bucket_rows = True  # as with graphs: 3 rows run as 4, padded (CPU: no graphs)
    engine.static.padded_prefill = True  # and prompts padded to a length bucket
    seen: list[int] = []  # the rows of each target pass, host-side (forward) or device (verify)
    forward, verify = engine.static.forward, engine.static.verify

    def counted(ids, *a, **kw):
        seen.append(ids.shape[0])
        return forward(ids, *a, **kw)

    def counted_verify(ids, *a, **kw):
        seen.append(1 if ids.dim() == 1 else ids.shape[0])
        return verify(ids, *a, **kw)

    engine.static.forward, engine.static.verify = counted, counted_verify
    return engine, seen


def _outputs(target, shape: dict | None, batch: int):
    engine, seen = _engine(target, shape, batch)
    params = GenParams(max_tokens=40)
    if shape:
        out = engine.generate(prompts(), params, max_tokens_each=LIMITS)
    else:
        out = engine.plain_generate(prompts(), params, max_tokens_each=LIMITS)
    return [(g.token_ids, g.stats.accept_hist) for g in out], seen


def _check(target, shape: dict | None) -> None:
    alone, seen1 = _outputs(target, shape, 1)
    together, seen4 = _outputs(target, shape, 4)
    grouped, seen3 = _outputs(target, shape, 3)  # a group of 3, then one alone
    assert together == alone and grouped == alone
    assert [len(t) for t, _ in alone] == LIMITS
    assert set(seen1) <= {1} and max(seen4) == 4 and max(seen3) == 3
    assert {1, 2, 3, 4} <= set(seen4)  # the batch shrank as rows left it
    if shape:
        hist = [sum(h) for h in zip(*(h for _, h in together), strict=True)]
        assert sum(n > 0 for n in hist) >= 2, hist  # cycles accepted different counts


@pytest.mark.parametrize("shape", [None, *SHAPES], ids=["plain", "chain-3", "tree-3x3x7", "tree-5x4x12"])  # fmt: skip
def test_a_batch_gives_each_request_the_tokens_it_gets_alone(two_token_lm, shape):
    """Greedy, the static runner without graphs (CPU): 4 requests as one batch, and as a group
    of 3 and one alone, emit and accept exactly what each does alone."""
    _check(two_token_lm, shape)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [None, *SHAPES], ids=["plain", "chain-3", "tree-3x3x7", "tree-5x4x12"])  # fmt: skip
def test_a_batch_gives_each_request_the_tokens_it_gets_alone_on_cuda(two_token_lm, shape):
    """The same on CUDA (fp32, TF32 off) with the graphs of each batch size and span."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    _check(copy.deepcopy(two_token_lm).cuda(), shape)


def test_the_static_runner_refuses_more_prompts_than_rows(two_token_lm):
    engine, _ = _engine(two_token_lm, None, 2)
    with pytest.raises(
        ValueError, match=r"3 prompts: StaticTargetRunner\(max_batch=2\) holds 1 to 2"
    ):
        engine.static.prefill(prompts()[:3], aux=False)


def test_batched_plain_decoding_stops_where_each_request_stops_alone(two_token_lm):
    """Plain greedy decoding of a batch with a stop token and limits that are no multiple of the
    device loop's 8 steps: the device loop (rows leave at the reads) and the host loop give
    each request the tokens and finish reason it gets alone."""
    from test_engine_device_cycle import B

    outs = []
    for batch, glue in ((1, True), (4, True), (4, False)):
        engine = SpecEngine(two_token_lm, runner="static", static_capacity=160, stop_ids={B},
                            static_batch=batch, device_glue=glue)  # fmt: skip
        out = engine.plain_generate(prompts(), GenParams(max_tokens=40), max_tokens_each=[1, 5, 19, 40])  # fmt: skip
        outs.append([(g.token_ids, g.stats.finish_reason) for g in out])
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert {why for _, why in outs[0]} == {"stop", "length"}


@pytest.mark.parametrize("shape", SHAPES, ids=["chain-3", "tree-3x3x7", "tree-5x4x12"])
def test_the_device_cycles_of_a_batch_equal_its_host_cycles(two_token_lm, shape):
    """A batch of 4 on the device-side cycles (one host read a cycle; finished rows leave after
    it) drafts, emits and accepts exactly what the host-side cycles (the reference) do."""
    from test_engine_static_draft import record

    runs = []
    for glue in (False, True):
        engine, _ = _engine(two_token_lm, shape, 4)
        engine.device_glue = glue
        log = record(engine.drafter)
        out = engine.generate(prompts(), GenParams(max_tokens=40), max_tokens_each=LIMITS)
        runs.append((log, [(g.token_ids, g.stats.accept_hist) for g in out]))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
def test_a_seeded_request_samples_in_a_batch_of_rows_what_it_samples_alone(tiny_lm, shape):
    """Sampling on the static runner's rows (the host-side cycle; each row its own generator),
    a random target whose draws matter: a seeded request's reply does not depend on its
    batchmates."""
    from serve.engine import random_drafter

    params = GenParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, num_draft_tokens=7)
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (4, 17, 9, 25)]
    outs = []
    for batch in (1, 4):
        engine = SpecEngine(tiny_lm, random_drafter(tiny_lm, draft_vocab_size=500, aux_layer_ids=[2, 0, 1]),
                            steps=3, topk=3 if shape == "tree" else 1, runner="static",
                            static_capacity=64, static_batch=batch)  # fmt: skip
        out = engine.generate(ps, params, speculative=shape != "plain", max_tokens_each=[12, 5, 9, 12])  # fmt: skip
        outs.append([r.token_ids for r in out])
    assert outs[1] == outs[0]
    assert len({tuple(t) for t in outs[0]}) == 4


def test_the_compiled_step_equals_the_eager_one_over_ragged_rows(tiny_lm):
    """The static runner's step functions traced whole by torch.compile (aot_eager on CPU: the
    trace and its functionalized graph without code generation; a GPU runs inductor, the
    default) give the eager step's logits and aux states over a ragged batch of 3 rows padded
    to 4: a chain, a tree, then a chain again after each row kept a different path."""
    from serve.engine import StaticTargetRunner

    eager = StaticTargetRunner(tiny_lm, 64, max_batch=4)
    comp = StaticTargetRunner(tiny_lm, 64, max_batch=4, compiled=True, compile_backend="aot_eager")
    for e, c in zip(ragged_steps(eager, 3), ragged_steps(comp, 3), strict=True):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    assert comp._fns["attn_in"] is not eager._fns["attn_in"]  # the compiled wrapper ran


def ragged_steps(r, seed: int, vocab: int = 49152) -> list[torch.Tensor]:
    """Logits and aux states of a static runner's steps over 3 ragged rows run as 4: a prefill, a
    chain verify, a tree verify, a commit of a different path in each row, a chain again and a
    one-token step (plain decoding's)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 12, 8)]
    ids = torch.randint(3, vocab, (3, 4), generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    r.set_aux_layers([2, 0, 1])
    r.bucket_rows = True
    _, _, _, valid = r.prefill(ps, aux=True)
    pos = valid.sum(1)[:, None] + torch.arange(4)
    ones = torch.ones(3, 4, dtype=torch.bool)
    a = r.forward(ids, pos, ones, aux=True)
    b = r.forward(ids, pos, ones, aux=True, tree=tree.expand(3, 4, 4))
    r.commit(keep)
    c = r.forward(ids, pos + keep.sum(1, keepdim=True), ones, aux=True)
    one = r.forward(ids[:, :1], pos[:, :1] + 4, ones[:, :1])
    return [t for pair in (a, b, c, one) for t in pair if t is not None]


def test_a_compiled_runner_compiles_one_code_for_every_verify_width(tiny_lm):
    """Start-up captures a verify of each shape's width (a chain of k verifies k + 1 tokens, the
    tree 13): widths 2 to 13 of one row add no compiled code after the first of them, and plain
    decoding's width 1 keeps a code of its own (its static kernels)."""
    from torch._dynamo.utils import counters

    from serve.engine import StaticTargetRunner

    comp = StaticTargetRunner(tiny_lm, 128, compiled=True, compile_backend="aot_eager")
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    g = torch.Generator().manual_seed(6)
    _, _, _, valid = comp.prefill([torch.randint(3, 49152, (9,), generator=g).tolist()], aux=False)
    made = []
    for q in (1, 2, 3, 5, 13):
        pos = valid.sum(1)[:, None] + torch.arange(q)
        ids = torch.randint(3, 49152, (1, q), generator=g)
        with torch.inference_mode():  # as the engine runs it
            comp.forward(ids, pos, torch.ones(1, q, dtype=torch.bool))  # not committed
        made.append(counters["stats"]["unique_graphs"])
    assert made[2:] == [made[1]] * 3 and made[1] > made[0], f"codes after each width: {made}"


def test_a_compiled_batch_compiles_one_code_for_every_row_count_and_span(tiny_lm):
    """Start-up captures every row bucket at every span; with one compiled code per (rows,
    width, span) that is dozens of compiles a server waits for (an H100, 2026-12-07: one 16-row
    engine had not finished its start and warm-up batches in 4 minutes). Batches of 2 to 8 rows
    over contexts of several lengths add no compiled code after the first batch of several
    rows: rows and span are dynamic (seen failing without: 5, 10, 15, 20 codes)."""
    from torch._dynamo.utils import counters

    from serve.engine import StaticTargetRunner

    comp = StaticTargetRunner(tiny_lm, 128, max_batch=8, compiled=True, compile_backend="aot_eager")
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    g = torch.Generator().manual_seed(5)
    made = []
    for rows, length in ((2, 6), (3, 20), (5, 9), (8, 40)):
        ps = [torch.randint(3, 49152, (length + r,), generator=g).tolist() for r in range(rows)]
        _, _, _, valid = comp.prefill(ps, aux=False)
        pos = valid.sum(1)[:, None]
        comp.forward(torch.randint(3, 49152, (rows, 1), generator=g), pos, torch.ones(rows, 1, dtype=torch.bool))  # fmt: skip
        comp.release()
        made.append(counters["stats"]["unique_graphs"])
    assert made[1:] == [made[0]] * 3, f"compiled codes after each batch: {made}"


@pytest.mark.parametrize("padded", [False, True], ids=["chunks", "padded"])
def test_a_compiled_prefill_compiles_one_code_for_every_prompt_length(tiny_lm, padded):
    """A prefill runs the step's own functions (`_core`): compiled, prompts of every length add
    no code after the first prefill of one row and the first of several (the model's modules
    launched about 45 kernels a layer, 29 ms of an H100's prefill of an everyday prompt), and
    its last logits and aux states are the eager runner's (`TargetRunner`); in chunks and
    padded to length buckets (the graphed prefill's forward)."""
    from torch._dynamo.utils import counters

    from serve.engine import StaticTargetRunner, TargetRunner

    comp = StaticTargetRunner(tiny_lm, 128, max_batch=4, compiled=True, compile_backend="aot_eager")
    comp.bucket_rows = comp.padded_prefill = padded
    comp.set_aux_layers([0, 1, 2])
    eager = TargetRunner(tiny_lm)
    eager.set_aux_layers([0, 1, 2])
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    g = torch.Generator().manual_seed(7)
    before, made = counters["stats"]["unique_graphs"], []
    for lengths in ((3,), (9,), (40,), (2, 5), (17, 30, 8), (1, 11, 6, 25)):
        ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
        with torch.inference_mode():  # as the engine runs it
            logits, aux, ids, valid = comp.prefill(ps, aux=True)
            ref_logits, ref_aux, ref_ids, ref_valid = eager.prefill(ps, aux=True)
        comp.release()
        made.append(counters["stats"]["unique_graphs"])
        assert torch.equal(ids, ref_ids) and torch.equal(valid, ref_valid)
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(aux * valid[..., None], ref_aux * valid[..., None], atol=2e-4, rtol=1e-4)  # fmt: skip
    assert before < made[0] < made[3], f"the prefill runs the compiled step: {before}, {made}"
    assert made[1:3] == [made[0]] * 2 and made[4:] == [made[3]] * 2, f"codes after each: {made}"


def test_a_padded_prefill_equals_the_eager_one_and_a_join_writes_only_its_rows(tiny_lm):
    """The prefill GPUs replay as one graph (`serve/engine/prefill.py`), run here without one:
    prompts padded to a length bucket, 3 rows run as 4 (the padding row repeats the first),
    give the eager runner's last logits and aux states; 3 prompts that join a running row run
    as 4 rows from row 1 (the padding past the last row repeats row 1), get what they get alone,
    and leave row 0's cache as it was."""
    from serve.engine import StaticTargetRunner, TargetRunner

    comp = StaticTargetRunner(tiny_lm, 128, max_batch=4)
    comp.bucket_rows = comp.padded_prefill = True
    comp.set_aux_layers([0, 1, 2])
    eager = TargetRunner(tiny_lm)
    eager.set_aux_layers([0, 1, 2])
    g = torch.Generator().manual_seed(9)

    def check(ps, got):
        logits, aux, _, valid = got
        ref_logits, ref_aux, _, _ = eager.prefill(ps, aux=True)
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(aux * valid[..., None], ref_aux * valid[..., None], atol=2e-4, rtol=1e-4)  # fmt: skip

    for lengths in ((3,), (17,), (2, 5, 9), (40, 33)):
        ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
        check(ps, comp.prefill(ps, aux=True))
        comp.release()
    ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 20, 4, 11)]
    comp.prefill(ps[:1], aux=True)
    assert comp.kv is not None
    row0 = comp.kv[:, :, 0].clone()
    check(ps[1:], comp.prefill(ps[1:], aux=True, join=True))
    assert torch.equal(comp.kv[:, :, 0], row0), "a join wrote into a running row"
    assert comp.lengths == [6, 20, 4, 11]


@pytest.mark.gpu
@cuda
def test_the_graphed_prefill_equals_the_ungraphed_one_on_cuda():
    """On CUDA (fp32, TF32 off) start-up captures the prefill graph of every row and length
    bucket; prompts of several lengths, batches of 1 to 3 rows and a join then replay them
    (no capture) and give the last logits and aux states of the runner without graphs."""
    from test_gpu_perf_paths import tiny_llama

    from serve.engine import StaticTargetRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    target = tiny_llama("cuda")
    graphed = StaticTargetRunner(target, 128, max_batch=4)
    bare = StaticTargetRunner(target, 128, max_batch=4, graphs=False, compiled=False)
    for r in (graphed, bare):
        r.set_aux_layers([0, 1])
    graphed.capture([(1, False)], rows=(1, 2, 3, 4))
    n = graphed.captures
    g = torch.Generator().manual_seed(10)
    for lengths, join in (((3,), False), ((40,), False), ((5, 17, 9), False), ((12, 30), True)):
        ps = [torch.randint(3, 100, (k,), generator=g).tolist() for k in lengths]
        if join:
            for r in (graphed, bare):
                r.prefill([[5, 6, 7]], aux=True)
        outs = [r.prefill(ps, aux=True, join=join) for r in (graphed, bare)]
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b.to(a.device), atol=1e-4, rtol=1e-4)
        for r in (graphed, bare):
            r.release()
    assert graphed.captures == n, "a prefill captured a graph after start-up"


def test_a_long_prompt_is_prefilled_in_chunks(tiny_lm):
    """Prompts longer than `PREFILL_CHUNK` run chunk by chunk (each causal, attending to the
    chunks before it), a one-token tail joined to the chunk before: the last logits and aux
    states are the eager runner's, for rows whose prompts end in different chunks."""
    from serve.engine import StaticTargetRunner, TargetRunner

    comp = StaticTargetRunner(tiny_lm, 128, max_batch=4)
    comp.PREFILL_CHUNK = 8
    comp.set_aux_layers([0, 1, 2])
    eager = TargetRunner(tiny_lm)
    eager.set_aux_layers([0, 1, 2])
    g = torch.Generator().manual_seed(8)
    for lengths in ((17,), (8, 9, 3, 25), (16,)):
        ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
        logits, aux, _, valid = comp.prefill(ps, aux=True)
        ref_logits, ref_aux, _, _ = eager.prefill(ps, aux=True)
        comp.release()
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(aux * valid[..., None], ref_aux * valid[..., None], atol=2e-4, rtol=1e-4)  # fmt: skip
