"""The static drafter (serve/engine/static_draft.py) against the eager reference `EagleDraft`:
the same drafted tokens (chains and trees) and states after the same extensions, and in the
engine the same drafts, accepted tokens and accept histograms, greedy, on a tiny random Llama
target with a random drafter. On CPU the static code runs without graphs; the `gpu` test runs it
captured as CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from serve.engine import (
    EagleDraft,
    GenParams,
    SpecEngine,
    StaticEagleDraft,
    TargetRunner,
    random_drafter,
)
from serve.engine.drafting import tree_ancestors

AUX = [0, 1, 2]
K = 3
N_TOK = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 30, (6,), generator=g)
    return [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in lengths]


def drafter(target, seed: int = 5) -> EagleDraft:
    return random_drafter(target, draft_vocab_size=2000, aux_layer_ids=AUX, seed=seed)


def record(source) -> list[tuple[str, list]]:
    """Log every proposal of `source` (its methods wrapped in place)."""
    log: list[tuple[str, list]] = []
    propose, propose_tree = source.propose, source.propose_tree

    def chain(steps, temperature, gen, top_p=1.0, top_k=0):
        drafts, q = propose(steps, temperature, gen, top_p, top_k)
        log.append(("chain", drafts.tolist()))
        return drafts, q

    def tree(steps, topk, num_nodes):
        t = propose_tree(steps, topk, num_nodes)
        log.append(("tree", [t.tokens.tolist(), t.parents.tolist(), t.depths.tolist()]))
        return t

    source.propose, source.propose_tree = chain, tree
    return log


def test_static_drafter_equals_eager_over_ragged_extensions(target):
    """Both drafters fed the same prompt extension (left-padded batch of 3) and then extensions
    of 1..K+1 slots with ragged write masks: every chain and tree drafted equals, and so does
    the state. Positions cross span buckets (min_bucket 8) on the way."""
    g = torch.Generator().manual_seed(7)
    base = drafter(target).model
    eager, static = EagleDraft(base), StaticEagleDraft(base, capacity=96, min_bucket=8)
    B, W = 3, 3 * target.config.hidden_size
    lens = torch.tensor([5, 11, 8])
    L = int(lens.max())
    write = torch.arange(L)[None] >= (L - lens)[:, None]  # left padding
    ids = torch.randint(3, 49152, (B, L), generator=g)
    aux = torch.randn(B, L, W, generator=g)
    pos = (write.long().cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        for d in (eager, static):
            d.start(B, 96)
            d.extend(ids, aux, pos, write)
        nxt = lens.clone()  # each row's next position
        for step in range(14):
            n = static.rows  # the buffers' rows past it are padding (3 rows in a bucket of 4)
            torch.testing.assert_close(static.h[:n], eager.h, rtol=1e-5, atol=1e-5)
            assert torch.equal(static.pos[:n], eager.pos)
            ce, _ = eager.propose(K, 0.0, None)
            cs, _ = static.propose(K, 0.0, None)
            assert torch.equal(cs, ce), f"chain differs at cycle {step}"
            for steps, topk, n in [(K, 3, 7), (4, 2, 8), (2, 1, 2)]:
                te, ts = eager.propose_tree(steps, topk, n), static.propose_tree(steps, topk, n)
                for a, b in [(ts.tokens, te.tokens), (ts.parents, te.parents),
                             (ts.depths, te.depths)]:  # fmt: skip
                    assert torch.equal(a, b), f"tree {steps}x{topk}x{n} differs at cycle {step}"
                assert torch.equal(ts.ancestors, tree_ancestors(ts.parents))  # the verify mask
            acc = torch.randint(0, K + 1, (B,), generator=g)  # accepted drafts per row
            w = int(acc.max()) + 1
            keep = torch.arange(w)[None] <= acc[:, None]
            e_ids = torch.randint(3, 49152, (B, w), generator=g)
            e_aux = torch.randn(B, w, W, generator=g)
            e_pos = nxt[:, None] + torch.arange(w)
            for d in (eager, static):
                d.extend(e_ids, e_aux, e_pos, keep)
            nxt = nxt + acc + 1
        assert int(nxt.max()) > 32  # crossed the 8, 16 and 32 slot spans
        keep_rows = torch.tensor([0, 2])
        for d in (eager, static):
            d.select(keep_rows)
        assert torch.equal(static.propose(K, 0.0, None)[0], eager.propose(K, 0.0, None)[0])
    with pytest.raises(ValueError, match="capacity"):
        static.start(1, 97)


@pytest.mark.parametrize(
    "shape",
    [
        dict(steps=K),
        dict(steps=K, topk=3, num_draft_tokens=7),
        dict(steps=5, topk=4, num_draft_tokens=12),
    ],  # fmt: skip
    ids=["chain-3", "tree-3x3x7", "tree-5x4x12"],
)
def test_engine_static_drafter_equals_eager_drafter(target, prompts, shape):
    """With the static target runner (batch 1, the GPU path): the default drafter is the static
    one, and it drafts exactly what the eager reference drafts, with the same accepted tokens and
    accept histograms; the tokens are the target's own greedy ones."""
    params = GenParams(max_tokens=N_TOK)
    logs, outs = [], []
    for static_draft in (False, None):  # None: the default with the static runner
        engine = SpecEngine(target, steps=shape["steps"], topk=shape.get("topk", 1),
                            num_draft_tokens=shape.get("num_draft_tokens"), runner="static",
                            static_capacity=96, static_draft=static_draft)  # fmt: skip
        engine.set_drafter(drafter(target))
        kind = StaticEagleDraft if static_draft is None else EagleDraft
        assert type(engine.drafter) is kind
        logs.append(record(engine.drafter))
        outs.append(engine.generate(prompts, params))
        plain = engine.plain_generate(prompts, params)
        assert [g.token_ids for g in outs[-1]] == [g.token_ids for g in plain]
    assert logs[0] == logs[1] and len(logs[0]) == sum(g.stats.spec_verify_ct for g in outs[0])
    for e, s in zip(*outs, strict=True):
        assert s.token_ids == e.token_ids and s.stats.accept_hist == e.stats.accept_hist


def test_static_drafter_in_a_ragged_batch_and_sampling(target, prompts):
    """With the eager batched runner (static_draft=True): rows finish at different lengths
    (select shrinks the static buffers), greedy and seeded sampling give what the eager drafter
    gives."""
    limits = [5, 16, 9, 12, 3, 16]
    runs = []
    for static_draft in (False, True):
        engine = SpecEngine(target, steps=K, static_draft=static_draft)
        engine.set_drafter(drafter(target))
        assert isinstance(engine.target, TargetRunner) and engine.static is None
        log = record(engine.drafter)
        greedy = engine.generate(prompts, GenParams(max_tokens=16), max_tokens_each=limits)
        sampled = engine.generate(prompts[:3], GenParams(max_tokens=12, temperature=0.8, seed=3))
        runs.append((log, greedy, sampled))
    (le, ge, se), (ls, gs, ss) = runs
    assert le == ls
    assert [g.token_ids for g in gs] == [g.token_ids for g in ge]
    assert [len(g.token_ids) for g in gs] == limits
    assert [g.token_ids for g in ss] == [g.token_ids for g in se]


@pytest.mark.gpu
@cuda
def test_graphed_drafter_equals_eager_on_cuda():
    """fp32 on the GPU (TF32 off): the engine with the drafter's CUDA graphs (the default on
    CUDA, all captured at start-up) emits HF greedy tokens and drafts what the same drafter run
    without graphs drafts, chain and tree, and captures no graph after start-up. The reference
    is a `StaticEagleDraft(graphs=False)` handed to `set_drafter` (it runs as given): turning
    graphs off after `set_drafter` would leave the start-up captures in place (issue 50)."""
    from test_gpu_perf_paths import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama("cuda")
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 11, 40, 7)]
    for shape in (dict(), dict(topk=2, num_draft_tokens=6)):
        runs = []
        for graphs in (True, False):
            engine = SpecEngine(model, steps=3, stop_ids=set(), static_capacity=128, **shape)
            d = random_drafter(model, draft_vocab_size=256, aux_layer_ids=[2, 0, 1])
            d.model.to("cuda")
            engine.set_drafter(d if graphs else StaticEagleDraft(d.model, 128, graphs=False))
            assert isinstance(engine.drafter, StaticEagleDraft)
            assert engine.drafter.use_graphs is graphs
            log = record(engine.drafter)
            out = engine.generate(ps, GenParams(max_tokens=24))
            plain = engine.plain_generate(ps, GenParams(max_tokens=24))
            assert [r.token_ids for r in out] == [r.token_ids for r in plain]
            assert engine.late_captures() == 0, f"{shape}: graphs captured inside requests"
            runs.append((log, out, engine.drafter.graph_keys()))
        assert runs[0][0] == runs[1][0], f"{shape}: the graphed drafter drafts differently"
        assert runs[0][2] and not runs[1][2]


def test_capture_plan_covers_the_configured_shape_and_the_chains(target):
    """What `SpecEngine.capture` captures on a GPU (the shapes, the spans); on CPU, nothing."""
    from serve.engine.buckets import span_buckets

    assert span_buckets(256, 4096) == [256, 512, 1024, 2048, 4096]
    assert span_buckets(256, 3000) == [256, 512, 1024, 2048, 3000]
    assert span_buckets(256, 96) == [96]
    engine = SpecEngine(target, drafter(target), steps=5, topk=4, num_draft_tokens=12,
                        runner="static", static_capacity=96)  # fmt: skip
    assert engine.capture_shapes() == [(1, 1, 2), (2, 1, 3), (3, 1, 4), (4, 1, 5), (5, 1, 6),
                                       (5, 4, 12)]  # fmt: skip
    engine.steps, engine.topk = 7, 1
    assert engine.capture_shapes()[-1] == (7, 1, 8)
    assert engine.capture() == {} and engine.drafter.graph_keys() == []  # no graphs on CPU
    static = engine.static
    assert static is not None and static.capture([(1, False), (4, True)]) == 0


@pytest.mark.gpu
@cuda
def test_capture_at_start_up_covers_the_requests():
    """Building the engine with a drafter captures every graph that the configured tree, the
    chains and plain decoding replay, at every span: requests then capture nothing new."""
    from test_gpu_perf_paths import tiny_llama

    model = tiny_llama("cuda")
    d = random_drafter(model, draft_vocab_size=256, aux_layer_ids=[2, 0, 1])
    d.model.to("cuda")
    engine = SpecEngine(model, d, steps=3, topk=2, num_draft_tokens=6, stop_ids=set(),
                        static_capacity=512, capture_chains=(1, 3))  # fmt: skip
    assert isinstance(engine.drafter, StaticEagleDraft)
    target_keys, draft_keys = set(engine.static._graphs), engine.drafter.graph_keys()
    assert {span for _, _, span, _ in target_keys} == {256, 512}  # (rows, width, span, aux)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 300)]
    engine.generate(ps, GenParams(max_tokens=24))  # the tree; the long prompt spans 512
    for k in (1, 3):
        engine.generate(ps, GenParams(max_tokens=24, steps=k, topk=1))
    engine.plain_generate(ps, GenParams(max_tokens=24))
    assert set(engine.static._graphs) == target_keys
    assert engine.drafter.graph_keys() == draft_keys


def stand_in_graphs(d: StaticEagleDraft) -> None:
    """`d` on the graph path on CPU: its `_capture` replaced by a stand-in whose replay reruns
    the function on the static inputs (the real capture is CUDA's: the `gpu` tests)."""
    from serve.engine.static_draft import _Graph

    def stand_in(fn, args, span):
        g = _Graph(None, tuple(a.clone() for a in args), None)

        class Replay:
            def replay(self):
                g.outputs = fn(*g.inputs, span)

        g.graph = Replay()
        return g

    d.use_graphs, d.min_bucket, d._capture = True, 32, stand_in


def test_drafter_graph_bookkeeping_with_a_stand_in_graph(target, prompts):
    """The graph path of `StaticEagleDraft` on CPU, with `_capture` replaced by a stand-in whose
    replay reruns the function on the static inputs: the capture covers every key the shapes'
    requests use (no new key afterwards), and inputs copied in at each replay give the eager
    drafter's drafts, also of a second tree (`capture_trees`). (The real capture is CUDA's: the
    `gpu` tests.)"""
    logs = []
    for graphs in (False, True):
        engine = SpecEngine(target, steps=3, topk=2, num_draft_tokens=6, runner="static",
                            static_capacity=96, capture_chains=(1, 3),
                            capture_trees=((2, 2, 4),))  # fmt: skip
        engine.set_drafter(drafter(target))
        d = engine.drafter
        if graphs:
            stand_in_graphs(d)
            assert engine.capture() == {"drafter": len(d.graph_keys())}
            keys = d.graph_keys()
            assert {k[-1] for k in keys} == {32, 64, 96} and d.captures == len(keys)
        log = record(d)
        more = dict(steps=2, topk=2, num_draft_tokens=4)
        for shape in (dict(), dict(steps=1, topk=1), dict(steps=3, topk=1), more):
            engine.generate(prompts, GenParams(max_tokens=40, **shape))
        logs.append(list(log))
        if graphs:
            assert d.graph_keys() == keys and engine.late_captures() == 0
            engine.generate(prompts[:1], GenParams(max_tokens=8, steps=2, topk=1))  # not captured
            assert engine.late_captures() > 0  # the chain of 2 at each span it reached
    assert logs[0] == logs[1]


def test_a_tree_to_capture_that_cannot_be_drafted_is_refused_at_construction(target):
    """`capture_trees` is checked as a request's shape is (`tree_problem`), before any capture,
    naming the field and the tree."""
    with pytest.raises(ValueError, match=r"capture_trees .*\(2, 2, 40\): num_draft_tokens=40"):
        SpecEngine(target, runner="static", static_capacity=96, capture_trees=((2, 2, 40),))


def test_a_swap_to_the_same_architecture_keeps_the_graphs(target, prompts):
    """The loop's swap between rounds' drafters (one architecture) copies the new weights into
    the graphed drafter's own tensors: no graph is captured again, and its replays draft what a
    fresh engine with the new drafter drafts. A drafter of another architecture is built anew."""
    shape = dict(steps=3, topk=2, num_draft_tokens=6, runner="static", static_capacity=96,
                 capture_chains=(1, 3))  # fmt: skip
    params = GenParams(max_tokens=24)
    engine = SpecEngine(target, **shape)
    engine.set_drafter(drafter(target, seed=5))
    d = engine.drafter
    stand_in_graphs(d)
    engine.capture()
    n = d.captures
    engine.set_drafter(drafter(target, seed=6))
    assert engine.drafter is d and d.captures == n
    fresh = SpecEngine(target, **shape)
    fresh.set_drafter(drafter(target, seed=6))
    runs = []
    for e in (engine, fresh):
        log = record(e.drafter)
        runs.append((log, [g.token_ids for g in e.generate(prompts, params)]))
    assert runs[0] == runs[1] and len(runs[0][0]) > len(prompts)
    assert d.captures == n and engine.late_captures() == 0
    engine.set_drafter(random_drafter(target, draft_vocab_size=1000, aux_layer_ids=AUX, seed=7))
    assert engine.drafter is not d and isinstance(engine.drafter, StaticEagleDraft)


def test_a_swap_of_a_compiled_drafter_drafts_the_new_weights(target, prompts):
    """The server compiles its drafter (serve.drafter_compile) and swaps rounds' drafters in
    place: the compiled functions must read the weights as inputs, not as constants baked in at
    compile time, or a swap would silently serve the old drafter. aot_eager on CPU (the same
    trace as inductor's); the `gpu` test below runs inductor in CUDA graphs."""
    shape = dict(steps=3, topk=2, num_draft_tokens=6, runner="static", static_capacity=96)
    engine = SpecEngine(target, drafter_compile="aot_eager", **shape)
    engine.set_drafter(drafter(target, seed=5))
    d = engine.drafter
    engine.generate(prompts, GenParams(max_tokens=8))  # compiled with seed 5's weights
    assert d._compiled_fns
    engine.set_drafter(drafter(target, seed=6))
    assert engine.drafter is d
    fresh = SpecEngine(target, **shape)
    fresh.set_drafter(drafter(target, seed=6))
    runs = []
    for e in (engine, fresh):
        log = record(e.drafter)
        runs.append((log, [g.token_ids for g in e.generate(prompts, GenParams(max_tokens=24))]))
    assert runs[0] == runs[1] and len(runs[0][0]) > len(prompts)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_a_swap_keeps_the_cuda_graphs_and_drafts_the_new_weights(backend):
    """fp32 on the GPU (TF32 off): after a swap to a drafter of the same architecture the
    captured graphs (compiled by inductor too, as the server runs them) replay the new weights:
    the same drafts as that drafter without graphs, and no graph captured by the swap or by the
    requests after it."""
    from test_gpu_perf_paths import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama("cuda")
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 11, 40, 7)]

    def new(seed: int) -> EagleDraft:
        d = random_drafter(model, draft_vocab_size=256, aux_layer_ids=[2, 0, 1], seed=seed)
        d.model.to("cuda")
        return d

    engine = SpecEngine(model, new(1), steps=3, topk=2, num_draft_tokens=6, stop_ids=set(),
                        static_capacity=128, drafter_compile=backend)  # fmt: skip
    graphed, n = engine.drafter, engine.drafter.captures
    engine.set_drafter(new(2))
    assert engine.drafter is graphed and graphed.captures == n
    ref = SpecEngine(model, steps=3, topk=2, num_draft_tokens=6, stop_ids=set(),
                     static_capacity=128)  # fmt: skip
    ref.set_drafter(StaticEagleDraft(new(2).model, 128, graphs=False))
    runs = []
    for e in (engine, ref):
        log = record(e.drafter)
        runs.append((log, [r.token_ids for r in e.generate(ps, GenParams(max_tokens=24))]))
    assert runs[0] == runs[1]
    assert engine.late_captures() == 0 and graphed.captures == n


@pytest.mark.parametrize(
    "shape",
    [dict(steps=K), dict(steps=5, topk=4, num_draft_tokens=12)],
    ids=["chain-3", "tree-5x4x12"],
)
def test_a_compiled_drafter_drafts_what_the_eager_one_drafts(target, prompts, shape):
    """`compile_backend`: each graphed function traced whole by torch.compile (fullgraph, so a
    break is an error). Here with the aot_eager backend (the trace and its functionalized graph,
    no code generation: inductor's C++ build would take minutes on 2 cores); a GPU runs inductor
    (the `gpu` test below). Same drafts, tokens and accept histograms as the eager drafter, in
    a ragged batch of the static runner's rows, whose contexts cross spans of 32 and 64 slots
    (one compiled code reads both: `span_arg`)."""
    runs = []
    for backend in (None, "aot_eager"):
        engine = SpecEngine(target, steps=shape["steps"], topk=shape.get("topk", 1),
                            num_draft_tokens=shape.get("num_draft_tokens"), runner="static",
                            static_capacity=96, static_batch=3)  # fmt: skip
        d = StaticEagleDraft(drafter(target).model, 96, graphs=False, min_bucket=32,
                             compile_backend=backend)  # fmt: skip
        engine.set_drafter(d)
        log = record(engine.drafter)
        out = engine.generate(
            prompts[:3], GenParams(max_tokens=N_TOK), max_tokens_each=[4, N_TOK, 9]
        )
        runs.append((log, [(g.token_ids, g.stats.accept_hist) for g in out], len(d._compiled_fns)))
    assert runs[1][:2] == runs[0][:2] and runs[0][2] == 0 and runs[1][2] > 0


def capture_by_running(d: StaticEagleDraft, monkeypatch) -> None:
    """`d` on the graph path on CPU through its real `_capture`, with CUDA's capture replaced by
    running the function (at capture and at each replay): what `_capture` hands the compiled
    code (its static copies of the arguments, their marks) is what runs."""
    import serve.engine.static_draft as sd

    class Replay:
        def __init__(self, fn):
            self.replay = fn

    monkeypatch.setattr(sd, "capture_graph", lambda fn, pool: (Replay(fn), fn()))
    d.use_graphs, d._pool = True, "stand-in"


@pytest.mark.parametrize("graphs", [False, True], ids=["direct", "graph-path"])
def test_a_compiled_drafter_compiles_one_code_for_every_row_bucket(target, prompts, monkeypatch, graphs):  # fmt: skip
    """Batches of 2, 3 and 5 rows (buckets of 2, 4 and 8) add no compiled drafter code after
    the first: rows are dynamic for batches of several rows, so an engine of 16 rows compiles
    its shapes twice (one row, several), not once per bucket (a 16-row engine on an H100 had
    not finished start-up and warm-up in 4 minutes, 2026-12-07). `graph-path`: through
    `_capture` with a stand-in for CUDA's capture (it reruns the function at each replay), whose
    static copies of the arguments must keep the marks (a clone drops them)."""
    from torch._dynamo.utils import counters

    # fast_linear off: the CPU-only fp32 trick pads 1 and 3 rows, specialising the rows (a GPU
    # never runs it)
    engine = SpecEngine(target, steps=K, runner="static", static_capacity=96, static_batch=8,
                        fast_linear=False)  # fmt: skip
    d = StaticEagleDraft(drafter(target).model, 96, graphs=False, compile_backend="aot_eager")
    engine.set_drafter(d)
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    if graphs:
        capture_by_running(d, monkeypatch)
    made = []
    for rows in (2, 3, 5):
        engine.generate([prompts[i % len(prompts)] for i in range(rows)], GenParams(max_tokens=6))
        made.append(counters["stats"]["unique_graphs"])
    assert made[1:] == [made[0]] * 2, f"compiled codes after each batch: {made}"


def test_a_compiled_drafter_compiles_one_code_for_every_span(target, monkeypatch):
    """Start-up's capture over three spans (32, 64 and 96 slots) compiles one code per
    extension width, chain and tree, not one per span: the span reaches the code as a dynamic
    size (`span_arg`). A 16-row engine with every chain had not finished start-up in 4 minutes
    on an H100 (2026-12-07), compiling each (shape, rows, span) apart. Through `_capture`, with a
    stand-in for CUDA's capture that runs the function."""
    from torch._dynamo.utils import counters

    d = StaticEagleDraft(drafter(target).model, 96, graphs=False, min_bucket=32,
                         compile_backend="aot_eager")  # fmt: skip
    capture_by_running(d, monkeypatch)
    torch._dynamo.reset()  # codes another test compiled for the same functions would serve
    before = counters["stats"]["unique_graphs"]
    d.capture([(3, 1, 4), (2, 2, 4)])  # a chain of 3 and a tree of 3 nodes
    keys = d.graph_keys()
    assert {k[-1] for k in keys} == {32, 64, 96}
    shapes = {k[:-1] for k in keys}  # extensions of 1-4 entries, the chain, the tree
    assert counters["stats"]["unique_graphs"] - before == len(shapes) == 6


@pytest.mark.gpu
@cuda
def test_the_inductor_compiled_drafter_in_cuda_graphs_drafts_what_the_eager_one_drafts():
    """fp32 on the GPU (TF32 off): the drafter's graphed functions compiled by inductor draft,
    chain and tree, what the same drafter drafts without compiling or graphs, one row and a
    batch of 3; the tokens are plain greedy decoding's."""
    from test_gpu_perf_paths import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama("cuda")
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 11, 40)]
    for shape in (dict(), dict(topk=2, num_draft_tokens=6)):
        for batch in (1, 3):
            runs = []
            for backend, graphs in ((None, False), ("inductor", True)):
                engine = SpecEngine(model, steps=3, stop_ids=set(), static_capacity=128,
                                    static_batch=batch, **shape)  # fmt: skip
                d = random_drafter(model, draft_vocab_size=256, aux_layer_ids=[2, 0, 1])
                d.model.to("cuda")
                engine.set_drafter(StaticEagleDraft(d.model, 128, graphs=graphs, compile_backend=backend))  # fmt: skip
                log = record(engine.drafter)
                out = engine.generate(ps, GenParams(max_tokens=24))
                plain = engine.plain_generate(ps, GenParams(max_tokens=24))
                assert [r.token_ids for r in out] == [r.token_ids for r in plain]
                runs.append((log, [r.token_ids for r in out]))
            assert runs[1] == runs[0], (
                f"{shape}, batch {batch}: the compiled drafter drafts differently"
            )


def test_a_shrinking_batch_captures_no_drafter_graph_anew(target, prompts):
    """Rows of 3 run in buffers of 4 (the padding rows free ones); as requests finish, the kept
    rows move up in the same buffers, so the graphs captured for the batch serve it to its end
    (stand-in graphs on CPU: `_capture` counted), and the drafts are the eager drafter's."""
    logs, counts = [], []
    for graphs in (False, True):
        engine = SpecEngine(target, steps=3, runner="static", static_capacity=96, static_batch=3)
        engine.set_drafter(drafter(target))
        d = engine.drafter
        if graphs:
            stand_in_graphs(d)
        log = record(d)
        out = engine.generate(prompts[:3], GenParams(max_tokens=24), max_tokens_each=[4, 24, 11])
        logs.append((list(log), [g.token_ids for g in out]))
        counts.append((d.batch, d.captures))
        if graphs:  # a second batch of 3 replays what the first captured
            engine.generate(prompts[3:6], GenParams(max_tokens=24), max_tokens_each=[24, 6, 13])
            assert d.captures == counts[-1][1]
    assert logs[0] == logs[1]
    assert counts[1][0] == 4 and counts[1][1] > 0  # a bucket of 4 rows; graphs were captured


def test_the_server_compiles_its_drafter_on_gpus_only():
    """serve.drafter_compile (inductor by default) reaches the engine on CUDA; a CPU replica and
    the start-up measurement on CPUs draft eagerly; a backend name it does not know is refused
    naming the field."""
    from pydantic import ValidationError

    from serve.config import ServeConfig
    from serve.engine import serving_drafter_compile

    assert ServeConfig().drafter_compile == "inductor"
    assert serving_drafter_compile("inductor", "cuda") == "inductor"
    assert serving_drafter_compile("inductor", "cpu") is None
    assert serving_drafter_compile(None, "cuda") is None
    with pytest.raises(ValidationError, match="drafter_compile"):
        ServeConfig(drafter_compile="inductr")


def test_each_captured_shape_drafts_its_own_shape(target, prompts, monkeypatch):
    """An engine that captures several chains and trees at start-up drafts each request's own
    shape with the compiled drafter, as the eager one does. With torch 2.11's default of not
    guarding a function's constant defaults (`skip_guards_on_constant_func_defaults`), the
    capture's functions, once told apart by a default argument, shared the first tree's (and
    chain's) compiled code: on an H100 (2026-12-07) trees of 6, 8 and 12 tokens all drafted the
    3x2x6 tree (the same accept_len, 1.866). Through `_capture`, with a stand-in for CUDA's
    capture that runs the function."""
    monkeypatch.setattr(torch._dynamo.config, "skip_guards_on_constant_func_defaults", True)
    runs = []
    for backend in (None, "aot_eager"):
        engine = SpecEngine(target, steps=K, runner="static", static_capacity=96,
                            capture_chains=(1, 2, 3), capture_trees=((3, 2, 6), (5, 4, 12)))  # fmt: skip
        d = StaticEagleDraft(drafter(target).model, 96, graphs=False, min_bucket=32,
                             compile_backend=backend)  # fmt: skip
        capture_by_running(d, monkeypatch)
        torch._dynamo.reset()  # codes another test compiled for the same functions would serve
        engine.set_drafter(d)
        log = record(engine.drafter)
        for steps, topk, n in ((3, 2, 6), (5, 4, 12), (2, 1, 3), (3, 1, 4)):
            p = GenParams(max_tokens=N_TOK, steps=steps, topk=topk, num_draft_tokens=n)
            engine.generate(prompts[:1], p)
        runs.append(log)
    assert runs[1] == runs[0]
