"""The batched GPU decoder (actors/batch_decode.py), run on the CPU without graphs: token for
token against transformers' own greedy `generate`, state for state against its hidden states,
with more prompts than rows (so finished rows are refilled) and prompts of different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.batch_decode import BatchDecoder, decoder_problem

pytestmark = pytest.mark.ray_free  # no Ray: `make test` runs it in the second pytest

EOS = 5


def _model(**over) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=EOS, pad_token_id=0, **over,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(6, 96, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_hf_generate_with_refill():
    model = _model()
    prompts = _prompts(11)
    dec = BatchDecoder(model, rows=4, capacity=64, eos_ids=[EOS], sync_every=3)
    got, stats = dec.generate(prompts, max_new_tokens=24)
    want = [_hf_greedy(model, p, 24) for p in prompts]
    assert got == want
    assert stats.tokens == sum(len(w) for w in want)
    assert stats.prefills > 1  # 11 prompts through 4 rows: rows were refilled


def test_stops_at_eos_and_at_capacity():
    model = _model()
    # Bias the head so EOS wins after a few tokens for some rows: replies end early.
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6 * model.lm_head.weight[7]
    prompts = _prompts(6, seed=3)
    dec = BatchDecoder(model, rows=3, capacity=40, eos_ids=[EOS], sync_every=2)
    got, _ = dec.generate(prompts, max_new_tokens=30)
    for p, g in zip(prompts, got, strict=True):
        assert g == _hf_greedy(model, p, min(30, 40 - len(p)))
        assert len(g) <= 40 - len(p)
        assert EOS not in g[:-1]


def test_capture_equals_hf_hidden_states():
    model = _model()
    seqs = _prompts(5, seed=4)
    dec = BatchDecoder(model, rows=2, capacity=64, eos_ids=[EOS])
    got = dec.capture(seqs, aux_layers=[1, 0], max_tokens=40)
    for s, (aux, final) in zip(seqs, got, strict=True):
        # hidden_states[k + 1] is layer k's output (the last entry is after the final norm)
        hs = model(torch.tensor([s]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[2][0], hs[1][0]], dim=-1)
        torch.testing.assert_close(aux, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(final, hs[-1][0], atol=1e-5, rtol=1e-4)


def test_sampling_is_seeded_and_differs_from_greedy():
    model = _model()
    prompts = _prompts(4, seed=5)
    dec = BatchDecoder(model, rows=4, capacity=64, eos_ids=[EOS])
    a, _ = dec.generate(prompts, 16, temperature=1.0, seed=3)
    b, _ = dec.generate(prompts, 16, temperature=1.0, seed=3)
    greedy, _ = dec.generate(prompts, 16)
    assert a == b
    assert a != greedy


def test_qwen_style_biases_match_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=EOS, use_sliding_window=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for la in model.model.layers:
            la.self_attn.q_proj.bias.normal_(0, 0.5)
    prompts = _prompts(3, seed=6)
    got, _ = BatchDecoder(model, rows=2, capacity=48, eos_ids=[EOS]).generate(prompts, 12)
    assert got == [_hf_greedy(model, p, 12) for p in prompts]


def test_refuses_prompts_longer_than_its_capacity():
    dec = BatchDecoder(_model(), rows=2, capacity=16, eos_ids=[EOS])
    with pytest.raises(ValueError, match="prompt 1: 20 tokens"):
        dec.generate([[7] * 4, [7] * 20], 4)


def test_capture_refuses_sequences_past_its_capacity():
    dec = BatchDecoder(_model(), rows=1, capacity=8, eos_ids=[EOS])
    with pytest.raises(ValueError, match="capture: a sequence of 12 tokens"):
        dec.capture([[7] * 12], [1])


def test_names_what_it_cannot_run():
    model = _model(hidden_act="gelu")
    assert "not SiLU" in decoder_problem(model)
    with pytest.raises(ValueError, match="target.model"):
        BatchDecoder(model, rows=2, capacity=16, eos_ids=[EOS])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_decoder_matches_hf_on_the_gpu(compiled):
    """The graphed (and compiled) step on CUDA, fp32: the same tokens as HF's greedy decode,
    with refill, and captured states equal to HF's."""
    model = _model().cuda()
    prompts = _prompts(13, seed=7)
    dec = BatchDecoder(model, rows=4, capacity=64, eos_ids=[EOS], sync_every=4, compiled=compiled)
    assert dec.graphs
    got, stats = dec.generate(prompts, max_new_tokens=24)
    want = [_hf_greedy(model, p, 24) for p in prompts]
    assert got == want and stats.prefills > 1
    again, _ = dec.generate(prompts[:5], max_new_tokens=24)  # the graph is reused
    assert again == want[:5]
    s = prompts[0] + want[0]
    aux, final = dec.capture([s], [1])[0]
    hs = model(torch.tensor([s]).cuda(), output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, hs[2][0], atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_data_stage_generates_with_it_on_the_gpu():
    """HFTarget.generate (what the target actors call) takes the batched decoder on CUDA."""
    from actors.hf_backend import HFTarget

    model = _model().cuda()
    t = HFTarget.from_model(model)
    prompts = _prompts(6, seed=8)
    assert t.generate(prompts, 16) == [_hf_greedy(model, p, 16) for p in prompts]
    assert t._dec is not None and t._dec.graphs
