"""Requests that join a running batch between cycles (continuous batching on the static runner,
issue 56): a request that arrives while a batch runs is prefilled into the rows after the
batch's own and decodes with it from the next cycle, and gets exactly the tokens and accept
histogram it gets alone (greedy: plain, chains, trees), the batch's requests too. CPU, the
static runner's code without graphs, rows padded to power-of-two buckets as with graphs."""

from __future__ import annotations

import pytest
import torch
from test_engine_device_cycle import SHAPES, prompts
from test_engine_static_batch import LIMITS, _engine, _outputs


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


from serve.engine import GenParams

IDS = ["plain", "chain-3", "tree-3x3x7", "tree-5x4x12"]


def _joined(target, shape: dict | None, schedule: dict[int, list[int]], limits=LIMITS):
    """Prompts 0 and 1 start the batch; `schedule` maps the joins callback's n-th call to the
    prompts that join then. Returns the outputs, the rows of each target pass, the calls' free
    rows."""
    engine, seen = _engine(target, shape, 4)
    ps, calls = prompts(), []

    def joins(free: int) -> list[tuple[list[int], int]]:
        calls.append(free)
        return [(ps[i], limits[i]) for i in schedule.get(len(calls), [])]

    run = engine.generate if shape else engine.plain_generate
    out = run(ps[:2], GenParams(max_tokens=40), max_tokens_each=limits[:2], joins=joins)
    return [(g.token_ids, g.stats.accept_hist) for g in out], seen, calls


@pytest.mark.parametrize("shape", [None, *SHAPES], ids=IDS)
def test_requests_that_join_a_running_batch_get_the_tokens_they_get_alone(two_token_lm, shape):
    """Prompt 2 joins at the second call (the batch's first row, 5 tokens, may have left by
    then), prompt 3 at the fourth: each of the 4 requests emits and accepts what it does alone,
    and the target's passes saw the batch grow past its 2 starting rows."""
    alone, _ = _outputs(two_token_lm, shape, 1)
    got, seen, calls = _joined(two_token_lm, shape, {2: [2], 4: [3]})
    assert got == alone
    assert [len(t) for t, _ in got] == LIMITS
    assert max(seen) >= 3 and len(calls) >= 4 and calls[0] == 2


@pytest.mark.parametrize("shape", [None, SHAPES[0]], ids=IDS[:2])
def test_a_request_that_joins_and_ends_at_once_leaves_the_batch_as_it_came(two_token_lm, shape):
    """A joining request with a limit of one token ends at its prefill: its token is the one it
    gets alone and the batch goes on without it; two join at once in one prefill pass."""
    limits = [40, 30, 1, 12]
    alone, _ = _outputs_with(two_token_lm, shape, limits)
    got, _, _ = _joined(two_token_lm, shape, {1: [2, 3]}, limits)
    assert got == alone and [len(t) for t, _ in got] == limits


def _outputs_with(target, shape, limits):
    engine, seen = _engine(target, shape, 1)
    run = engine.generate if shape else engine.plain_generate
    out = run(prompts(), GenParams(max_tokens=40), max_tokens_each=limits)
    return [(g.token_ids, g.stats.accept_hist) for g in out], seen


@pytest.mark.parametrize("shape", [None, SHAPES[0], SHAPES[2]], ids=[IDS[0], IDS[1], IDS[3]])
def test_joins_on_a_target_whose_tokens_depend_on_the_whole_context(shape):
    """The same with a random tiny Llama (its greedy tokens read every cached key and value; the
    two-token target above answers from its last state) and a random drafter: the joining
    prompts' caches go to their own rows and leave the batch's rows as they were."""
    from test_gpu_perf_paths import tiny_llama

    target = tiny_llama("cpu")
    alone, _ = _outputs(target, shape, 1)
    got, seen, _ = _joined(target, shape, {2: [2], 3: [3]})
    assert got == alone and max(seen) >= 3


def test_joins_beyond_the_free_rows_are_refused(two_token_lm):
    engine, _ = _engine(two_token_lm, None, 2)
    ps = prompts()
    with pytest.raises(ValueError, match="joins returned 2 requests for 1 free rows"):
        engine.plain_generate(ps[:1], GenParams(max_tokens=20), joins=lambda free: [(ps[1], 5), (ps[2], 5)])  # fmt: skip


@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
def test_a_seeded_request_that_joins_samples_what_it_samples_alone(shape):
    """Sampling (the host-side cycles, each row its own generator) on a random target whose draws
    matter: seeded requests that join a running batch draw what they draw alone, and so do the
    batch's own."""
    from test_gpu_perf_paths import tiny_llama

    from serve.engine import SpecEngine, random_drafter

    target = tiny_llama("cpu")
    params = GenParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, num_draft_tokens=7)
    ps, limits = prompts(), [12, 5, 9, 12]

    def engine(batch: int) -> SpecEngine:
        d = random_drafter(target, draft_vocab_size=500, aux_layer_ids=[2, 0, 1])
        return SpecEngine(target, d, steps=3, topk=3 if shape == "tree" else 1, runner="static",
                          static_capacity=96, static_batch=batch)  # fmt: skip

    spec = shape != "plain"
    alone = [r.token_ids for r in engine(1).generate(ps, params, speculative=spec, max_tokens_each=limits)]  # fmt: skip
    calls: list[int] = []

    def joins(free: int):
        calls.append(free)
        return [(ps[i], limits[i]) for i in {2: [2], 3: [3]}.get(len(calls), [])]

    got = engine(4).generate(ps[:2], params, speculative=spec, max_tokens_each=limits[:2], joins=joins)  # fmt: skip
    assert [r.token_ids for r in got] == alone and len(calls) >= 3
    greedy = engine(1).generate(ps, GenParams(max_tokens=12), speculative=spec, max_tokens_each=limits)  # fmt: skip
    assert [r.token_ids for r in greedy] != alone  # the draws matter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [None, SHAPES[0], SHAPES[2]], ids=[IDS[0], IDS[1], IDS[3]])
def test_joins_on_cuda_with_graphs(shape):
    """The same on CUDA (fp32, TF32 off) with the graphs of each row bucket: the batch grows
    from 2 rows to 4 between cycles (the drafter's buffers move to the bigger bucket)."""
    from test_gpu_perf_paths import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    target = tiny_llama("cuda")
    alone, _ = _outputs(target, shape, 1)
    got, seen, _ = _joined(target, shape, {2: [2], 3: [3]})
    assert got == alone and max(seen) >= 3


def test_start_up_captures_every_row_bucket_so_a_growing_batch_captures_nothing(two_token_lm):
    """`capture` (start-up, each swap) covers the drafter's graphs in every row bucket of the
    runner's batch (stand-in graphs on CPU): a batch that grows from 1 row to 4 as requests join
    and shrinks as they end captures nothing inside its requests, and each request gets its
    tokens alone."""
    from test_engine_device_cycle import two_token_drafter
    from test_engine_static_draft import stand_in_graphs

    from serve.engine import SpecEngine

    engine = SpecEngine(two_token_lm, steps=3, runner="static", static_capacity=160,
                        static_batch=4, stop_ids=set())  # fmt: skip
    engine.set_drafter(two_token_drafter(two_token_lm))
    d = engine.drafter
    stand_in_graphs(d)
    engine.capture()
    n = d.captures
    assert set(d._buckets) == {1, 2, 4} and n > 0
    ps, calls = prompts(), []

    def joins(free: int):
        calls.append(free)
        return [(ps[i], LIMITS[i]) for i in {1: [1], 2: [2, 3]}.get(len(calls), [])]

    out = engine.generate(ps[:1], GenParams(max_tokens=40), max_tokens_each=LIMITS[:1], joins=joins)  # fmt: skip
    assert d.captures == n and engine.late_captures() == 0
    alone, _ = _outputs(two_token_lm, SHAPES[0], 1)
    assert [(g.token_ids, g.stats.accept_hist) for g in out] == alone


def test_each_request_is_answered_as_it_leaves_the_batch(two_token_lm):
    """`on_done` gets each request's final generation the moment it leaves the batch (the
    shortest first), before `generate` returns, joined ones too: the server answers it then."""
    engine, _ = _engine(two_token_lm, SHAPES[0], 4)
    ps, done, calls = prompts(), [], []

    def joins(free: int):
        calls.append(free)
        return [(ps[2], LIMITS[2])] if len(calls) == 2 else []

    out = engine.generate(ps[:2], GenParams(max_tokens=40), max_tokens_each=LIMITS[:2], joins=joins,
                          on_done=lambda r, g: done.append((r, list(g.token_ids), len(calls))))  # fmt: skip
    assert [r for r, _, _ in done] == [0, 2, 1]  # limits 5, 19 (joined), 40
    assert [t for _, t, _ in sorted(done)] == [g.token_ids for g in out]
    assert done[0][2] < len(calls)  # the first was answered while the batch went on
