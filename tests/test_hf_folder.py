"""GGUF target -> HF folder (what vLLM loads): the folder holds the GGUF's dequantised weights bit
for bit and the same tokenizer; the tiny random Llama of the vLLM tests loads with transformers.
The conversion checked is the session's `smollm2_hf` (fp32, conftest.py), the folder
tests/test_shipped_drafter.py's vLLM start serves: SmolLM2 is converted once per run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.hf_folder import STAMP, gguf_to_hf, tiny_llama
from eagle3.target_weights import SMOLLM2_GGUF, smollm2_dir


@pytest.mark.slow
def test_smollm2_gguf_converts_bit_for_bit(smollm2_hf, smollm2_gguf_lm):
    out, ref = smollm2_hf, smollm2_gguf_lm
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert got.config.tie_word_embeddings and got.config.num_hidden_layers == 30
    assert "quantization_config" not in json.loads(
        (out / "config.json").read_text()
    )  # vLLM refuses gguf

    tok_ref = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    tok = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "Name three rivers."}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == (
        tok_ref.apply_chat_template(msgs, add_generation_prompt=True)
    )

    # A second call with the same source and dtype reuses the folder (the stamp says what it holds).
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert gguf_to_hf("smollm2", out, dtype="float32") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert json.loads((out / STAMP).read_text())["dtype"] == "float32"


def test_non_gguf_target_and_bad_dtype_are_refused(tmp_path, tiny_target):
    with pytest.raises(ValueError, match="not a GGUF target"):
        gguf_to_hf(str(tiny_target), tmp_path / "x")
    with pytest.raises(ValueError, match="dtype"):
        gguf_to_hf("smollm2", tmp_path / "y", dtype="int8")


def test_tiny_llama_has_vllm_cpu_head_size(tmp_path):
    out = tiny_llama(tmp_path / "t", "smollm2", lm_head_scale=10.0)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["head_dim"] == 32 and cfg["vocab_size"] == 49152
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    plain = tiny_llama(tmp_path / "p", "smollm2")
    scaled = model.lm_head.weight
    base = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).lm_head.weight
    torch.testing.assert_close(scaled, base * 10.0)
    assert AutoTokenizer.from_pretrained(out).chat_template


@pytest.mark.slow
def test_a_gguf_target_loads_from_its_folder_converted_once(
    tmp_path, monkeypatch, smollm2_gguf_lm, tiny_target
):
    """Every process that loads the GGUF target (data actors, trainers' online states, servers)
    loads its HF folder, converted once per machine: the same tensors and the same tokenizer
    (shards record its hash), in under a second where parsing the GGUF took 18 s. A second load
    converts nothing; a target that is not a GGUF file is loaded as it is."""
    import torch as t

    from actors.config import TargetConfig
    from actors.hf_backend import HFTarget, tokenizer_hash
    from eagle3.hf_folder import CACHE_ENV, local_target

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    target = HFTarget(TargetConfig(model="smollm2", dtype="float32"))
    (folder,) = (tmp_path / "gguf").iterdir()  # one folder, no temporary one left behind
    assert (folder / STAMP).is_file()
    ref, got = smollm2_gguf_lm.state_dict(), target.model.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert t.equal(ref[k], got[k]), k
    tok_ref = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    assert tokenizer_hash(target.tokenizer) == tokenizer_hash(tok_ref)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert local_target("smollm2", None, t.float32) == (str(folder), None)
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert local_target(str(tiny_target), None, t.float32) == (str(tiny_target), None)
