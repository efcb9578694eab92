"""Selective reads of the target: config fields and the embedding / LM head / final norm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3.checkpoint import CheckpointError
from eagle3.target_weights import (
    SMOLLM2_GGUF,
    load_target_tensors,
    read_target_config,
    read_target_info,
    resolve_target,
)

V, HT = 300, 32


def kimi_like_target(folder: Path) -> dict[str, torch.Tensor]:
    """A Kimi-K2.5-shaped checkpoint: multimodal wrapper config with `text_config`, the LM under
    `language_model.*`, vision tensors, several shards; shard 2 is garbage and shard 5 absent."""
    folder.mkdir()
    text_config = {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": HT,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "vocab_size": V,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": {"hidden_size": 48},
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    want = {
        "embed": torch.randn(V, HT, generator=g).to(torch.bfloat16),
        "lm_head": torch.randn(V, HT, generator=g).to(torch.bfloat16),
        "norm": torch.randn(HT, generator=g).to(torch.bfloat16),
    }
    decoy = torch.randn(512, 512, generator=g)
    shards = {
        "model-00001-of-00005.safetensors": {
            "language_model.model.embed_tokens.weight": want["embed"],
            "language_model.model.layers.0.mlp.gate_proj.weight": decoy,
        },
        "model-00003-of-00005.safetensors": {
            "language_model.lm_head.weight": want["lm_head"],
            "language_model.model.layers.5.mlp.down_proj.weight": decoy,
        },
        "model-00004-of-00005.safetensors": {
            "language_model.model.norm.weight": want["norm"],
            "mm_projector.proj.0.weight": decoy,
        },
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (folder / "model-00002-of-00005.safetensors").write_bytes(b"\xff" * 4096)  # unreadable
    for name in (
        "vision_tower.blocks.0.attn.qkv.weight",
        "language_model.model.layers.1.self_attn.q_a_proj.weight",
    ):
        weight_map[name] = "model-00002-of-00005.safetensors"
    weight_map["language_model.model.layers.2.mlp.experts.0.up_proj.weight"] = (
        "model-00005-of-00005.safetensors"
    )
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return want


def test_kimi_layout_opens_only_the_needed_shards(tmp_path):
    want = kimi_like_target(tmp_path / "kimi")
    with pytest.raises(SafetensorError):  # the unrelated shard really is unreadable
        safe_open(str(tmp_path / "kimi" / "model-00002-of-00005.safetensors"), framework="pt")
    got = load_target_tensors(tmp_path / "kimi")
    assert set(got) == {"embed", "lm_head", "norm"}
    for role in want:
        assert got[role].dtype == torch.bfloat16
        assert torch.equal(got[role], want[role]), role


def test_kimi_config_reads_nested_text_config(tmp_path):
    kimi_like_target(tmp_path / "kimi")
    info = read_target_info(tmp_path / "kimi")
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (6, HT, V)
    assert info.head_dim == HT // 4
    assert info.rope_theta == 50000.0 and info.rope_scaling["type"] == "yarn"
    assert info.max_position_embeddings == 262144
    assert info.tie_word_embeddings is False
    assert info.architectures == ("KimiK25ForConditionalGeneration",)
    assert info.torch_dtype == "bfloat16"


def test_tiny_target_tensors_and_info(tiny_target):
    got = load_target_tensors(tiny_target)
    with safe_open(str(Path(tiny_target) / "model.safetensors"), framework="pt") as fh:
        assert torch.equal(got["embed"], fh.get_tensor("model.embed_tokens.weight"))
        assert torch.equal(got["lm_head"], fh.get_tensor("lm_head.weight"))
        assert torch.equal(got["norm"], fh.get_tensor("model.norm.weight"))
    assert not torch.equal(got["embed"], got["lm_head"])  # untied target
    info = read_target_info(tiny_target)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (4, 64, 49152)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, 2, 16)
    assert info.rope_theta == 10000.0 and info.rope_scaling is None  # from v5 rope_parameters
    assert info.max_position_embeddings == 1024 and info.rms_norm_eps == 1e-5
    assert info.model_type == "llama" and not info.tie_word_embeddings


def test_tied_target_without_lm_head(tmp_path):
    folder = tmp_path / "tied"
    folder.mkdir()
    cfg = {
        "num_hidden_layers": 2,
        "hidden_size": 8,
        "vocab_size": 20,
        "num_attention_heads": 2,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    embed, norm = torch.randn(20, 8), torch.ones(8)
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": norm},
        str(folder / "model.safetensors"),
    )
    got = load_target_tensors(folder)
    assert torch.equal(got["lm_head"], embed) and torch.equal(got["norm"], norm)


@pytest.fixture
def hub_offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub reads it (at call time); without it each download
    retries an unreachable Hub for ~25 s before failing."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_unknown_layout_and_missing_paths_name_the_fix(tmp_path, hub_offline):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 20, "num_attention_heads": 2}
        )
    )
    save_file({"transformer.wte.weight": torch.zeros(20, 8)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight.*CANDIDATES"):
        load_target_tensors(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"
    ):
        load_target_tensors(folder)
    with pytest.raises(CheckpointError, match="no such folder"):
        read_target_info(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no-such-org/no-such-model"):
        read_target_info("no-such-org/no-such-model")
    (tmp_path / "noconf").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        read_target_info(tmp_path / "noconf")


def test_smollm2_resolves_to_the_wheel_gguf():
    folder, gguf = resolve_target("smollm2", None)
    assert gguf == SMOLLM2_GGUF and (Path(folder) / gguf).is_file()
    assert resolve_target(str(Path(folder) / gguf), None) == (folder, gguf)
    info = read_target_info("smollm2")
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (9, 3, 64)
    assert info.intermediate_size == 1536 and info.tie_word_embeddings


def test_smollm2_tensors_from_gguf():
    got = load_target_tensors("smollm2")
    assert got["embed"].shape == (49152, 576) and got["norm"].shape == (576,)
    assert got["lm_head"] is got["embed"]  # SmolLM2 ties its head
    assert torch.isfinite(got["embed"]).all() and got["embed"].std() > 0


@pytest.mark.slow
def test_smollm2_gguf_tensors_match_transformers(smollm2_gguf_lm):
    model = smollm2_gguf_lm  # the wheel's GGUF, as resolve_target("smollm2") finds it (above)
    got = load_target_tensors("smollm2")
    assert torch.equal(got["embed"], model.model.embed_tokens.weight.detach())
    assert torch.equal(got["norm"], model.model.norm.weight.detach())
    assert torch.equal(got["lm_head"], model.lm_head.weight.detach())


@pytest.mark.slow
def test_a_gguf_config_is_read_once_until_its_file_changes(tmp_path):
    """transformers parses the whole GGUF header for a config (~12 s for SmolLM2): read once per
    file, again when the file's mtime or size changes; each caller gets its own copy."""
    import os
    import shutil

    import eagle3.target_weights as tw

    folder, gguf = resolve_target("smollm2", None)
    copy = tmp_path / gguf
    shutil.copyfile(Path(folder) / gguf, copy)
    first = read_target_config(tmp_path, gguf_file=gguf)
    first["num_hidden_layers"] = -1  # the caller's copy only
    mine = [k for k in tw._GGUF_CONFIGS if k[0] == str(copy)]
    assert (
        len(mine) == 1 and read_target_config(tmp_path, gguf_file=gguf)["num_hidden_layers"] == 30
    )
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file replaced
    assert read_target_config(tmp_path, gguf_file=gguf)["num_hidden_layers"] == 30
    assert len([k for k in tw._GGUF_CONFIGS if k[0] == str(copy)]) == 2  # read again
