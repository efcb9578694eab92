"""The server's continuous batching (issue 56): a request that arrives while a greedy batch runs
on the static runner joins that batch between its cycles instead of waiting for it to end, and
gets exactly its greedy answer alone; one that arrives as the batch ends runs in the next engine
call. The deployment's own class on the tiny target (the static runner's code on CPU), no Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve.engine import GenParams, random_drafter


@pytest.fixture(scope="module")
def server(tiny_target):
    from serve.deployment import SpecServer

    torch.set_num_threads(1)
    srv = SpecServer.func_or_class({"model": str(tiny_target)}, {"steps": 3, "runner": "static", "static_batch": 4})  # fmt: skip
    srv.engine.set_drafter(random_drafter(srv.engine.target.model, draft_vocab_size=2000, aux_layer_ids=[0, 1, 2]))  # fmt: skip

    async def run(job):  # `serve.batch`'s queue needs a Serve replica: one job a call here
        return (await asyncio.to_thread(srv._run_sync, [job]))[0]

    srv._run = run
    return srv


def body(text: str, n: int, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


def _calls(srv) -> list[int]:
    """Wrap the engine's generate: the batch sizes of its calls."""
    calls, real = [], srv.engine.generate

    def counted(prompts, *a, **kw):
        calls.append(len(prompts))
        return real(prompts, *a, **kw)

    srv.engine.generate = counted
    return calls


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_a_request_that_arrives_mid_batch_joins_it(server, speculative):
    """b arrives while a (160 tokens) runs: it joins a's batch (one engine call) and gets its
    answer as it leaves the batch, while a still runs; both are their greedy answers alone."""
    calls = _calls(server)
    try:

        async def run():
            a = await server._job(body("a long one", 160, speculative=speculative), chat=True, stream=True)  # fmt: skip
            b = await server._job(body("a short one", 12, speculative=speculative), chat=True, stream=False)  # fmt: skip
            ta = asyncio.ensure_future(server._submit(a))
            streamed = await a.queue.get()  # a's batch runs: its first tokens are out
            gb = await server._submit(b)
            assert a.seen < 160  # b has its answer while a still decodes in the batch
            ga = await ta
            while (item := await a.queue.get()) is not None:
                streamed += item
            return a, b, ga, gb, streamed

        a, b, ga, gb, streamed = asyncio.run(run())
    finally:
        del server.engine.generate
    assert calls == [1], calls  # one engine call: b joined a's batch
    alone = [server.engine.generate([j.prompt], GenParams(max_tokens=j.params.max_tokens, ignore_eos=True),
                                    speculative=speculative)[0].token_ids for j in (a, b)]  # fmt: skip
    assert [ga.token_ids, gb.token_ids] == alone and streamed == ga.token_ids
    assert len(gb.token_ids) == 12 and server.counts["completion_tokens"] >= 172


def test_a_sampled_request_never_joins_a_greedy_batch(server):
    """Joins take requests of the running batch's key (its sampling settings): a sampled one
    waits for the next engine call."""
    calls = _calls(server)
    try:

        async def run():
            a = await server._job(body("a long one", 120), chat=True, stream=True)
            b = await server._job(body("sampled", 8, temperature=0.8, seed=3), chat=True, stream=False)  # fmt: skip
            ta = asyncio.ensure_future(server._submit(a))
            await a.queue.get()
            gb = await server._submit(b)
            return await ta, gb

        ga, gb = asyncio.run(run())
    finally:
        del server.engine.generate
    assert sorted(calls) == [1, 1] and len(ga.token_ids) == 120 and len(gb.token_ids) == 8


def test_the_join_queue_takes_equal_requests_one_by_one():
    """Two equal requests (same prompt and settings) wait to join: a batch with one free row
    takes one, the other still waits (and `close` hands it back to run next); a request of
    other settings is never offered, nor one once the batch ended."""
    from serve.jobs import JoinQueue, _Job

    async def run():
        q = JoinQueue()
        a, b = (_Job([1, 2, 3], GenParams(max_tokens=4), speculative=True) for _ in range(2))
        other = _Job([1, 2, 3], GenParams(max_tokens=4, temperature=0.5), speculative=True)
        assert q.offer(a) is None  # no batch runs
        q.open(a.key)
        assert q.offer(a) is not None and q.offer(b) is not None and q.offer(other) is None
        first = q.take(1, lambda j: True)
        left = q.close()
        assert first == [a] and first[0] is a and len(left) == 1 and left[0] is b
        assert q.offer(b) is None

    asyncio.run(run())
