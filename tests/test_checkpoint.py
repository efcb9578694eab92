"""Drafter checkpoint I/O on real safetensors files with tiny shapes."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.checkpoint import (
    CheckpointError,
    expected_tensors,
    load_drafter,
    read_safetensors_header,
    save_drafter,
)
from eagle3.config import Eagle3Config

# The parameter names SGLang's LlamaForCausalLMEagle3.load_weights maps (python/sglang/srt/models/
# llama_eagle3.py: fc, the midlayer's q/k/v/o, gate/up/down, three norms, the final norm, the
# draft lm_head) plus the d2t/t2d buffers it reads or skips.
SGLANG_NAMES = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def tiny_cfg(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=200,
        draft_vocab_size=40,
        target_hidden_size=24,
        aux_layer_ids=[0, 2, 3],
    )
    return Eagle3Config(**{**base, **kw})


def random_state(cfg: Eagle3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        name: torch.randn(shape, generator=g)
        for name, (shape, dtype) in expected_tensors(cfg).items()
        if dtype is None
    }
    used = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    state["d2t"] = used - torch.arange(cfg.draft_vocab_size)
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][used] = True
    return state


def test_written_names_and_shapes_are_sglangs(tmp_path):
    cfg = tiny_cfg()
    out = save_drafter(random_state(cfg), cfg, tmp_path / "d")
    header = read_safetensors_header(out / "model.safetensors")
    assert set(header) == SGLANG_NAMES
    h, ht = cfg.hidden_size, cfg.target_hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert header["fc.weight"] == ("BF16", (h, 3 * ht))
    assert header["midlayer.self_attn.q_proj.weight"][1] == (q, 2 * h)
    assert header["midlayer.self_attn.k_proj.weight"][1] == (kv, 2 * h)
    assert header["midlayer.self_attn.o_proj.weight"][1] == (h, q)
    assert header["midlayer.mlp.down_proj.weight"][1] == (h, cfg.intermediate_size)
    assert header["lm_head.weight"][1] == (cfg.draft_vocab_size, h)
    assert header["d2t"] == ("I64", (cfg.draft_vocab_size,))
    assert header["t2d"] == ("BOOL", (cfg.vocab_size,))
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert written["torch_dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["d"]  # no temp folder left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_roundtrip_is_bit_exact(tmp_path, dtype):
    cfg = tiny_cfg()
    state = random_state(cfg, seed=1)
    save_drafter(state, cfg, tmp_path / "d", dtype=dtype)
    cfg2, loaded = load_drafter(tmp_path / "d")
    assert replace(cfg2, torch_dtype="x") == replace(cfg, torch_dtype="x")
    assert cfg2.torch_dtype == str(dtype).removeprefix("torch.")
    assert set(loaded) == set(state)
    for name, t in state.items():
        want = t if name in ("d2t", "t2d") else t.to(dtype)
        assert loaded[name].dtype == want.dtype, name
        assert torch.equal(loaded[name], want), name


def test_save_refuses_unknown_and_missing_names(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    state["midlayer.self_attn.qkv_proj.weight"] = torch.zeros(3)
    del state["norm.weight"], state["d2t"]
    with pytest.raises(CheckpointError) as e:
        save_drafter(state, cfg, tmp_path / "d")
    msg = str(e.value)
    assert "midlayer.self_attn.qkv_proj.weight" in msg and "norm.weight" in msg and "'d2t'" in msg
    assert not (tmp_path / "d").exists() and os.listdir(tmp_path) == []


def test_save_refuses_wrong_shape_and_bad_vocab_map(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    state["fc.weight"] = torch.zeros(cfg.hidden_size, 3 * cfg.hidden_size)  # built for Ht = H
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \[32, 96\].*\[32, 72\]"):
        save_drafter(state, cfg, tmp_path / "d")
    state = random_state(cfg)
    state["d2t"][-1] = cfg.vocab_size  # points past the target vocabulary
    with pytest.raises(CheckpointError, match="outside"):
        save_drafter(state, cfg, tmp_path / "d")


def test_save_replaces_an_existing_checkpoint_and_refuses_foreign_folders(tmp_path):
    cfg = tiny_cfg()
    save_drafter(random_state(cfg, seed=1), cfg, tmp_path / "d")
    new = random_state(cfg, seed=2)
    save_drafter(new, cfg, tmp_path / "d", dtype=torch.float32)
    assert torch.equal(load_drafter(tmp_path / "d")[1]["fc.weight"], new["fc.weight"])
    assert sorted(os.listdir(tmp_path)) == ["d"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="notes.txt"):
        save_drafter(new, cfg, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def _write_raw(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_load_lists_every_unknown_and_missing_name(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    state["extra_head.weight"] = torch.zeros(2)
    state["midlayer.self_attn.rotary_emb.inv_freq"] = torch.zeros(2)
    del state["norm.weight"], state["midlayer.hidden_norm.weight"]
    _write_raw(tmp_path / "d", cfg.to_json_dict(), state)
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "d")
    msg = str(e.value)
    for name in (
        "extra_head.weight",
        "rotary_emb.inv_freq",
        "'norm.weight'",
        "midlayer.hidden_norm.weight",
    ):
        assert name in msg
    assert "save_drafter" in msg  # says what would fix it


def test_load_sharded_checkpoint(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_json_dict()))
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[:7],
        "model-00002-of-00002.safetensors": names[7:],
    }
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, str(folder / fname))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    _, loaded = load_drafter(folder)
    assert all(torch.equal(loaded[n], state[n]) for n in state)


def test_load_speculators_layout_and_drops_embedding(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    renamed = {n.replace("midlayer.", "layers.0."): t for n, t in state.items()}
    renamed["embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.target_hidden_size)
    flat = cfg.to_json_dict()
    layer_cfg = {
        k: v
        for k, v in flat.items()
        if k not in ("eagle_config", "eagle_aux_hidden_state_layer_ids")
    }
    spec_config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer_cfg, "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],  # vLLM convention = SGLang [0, 2, 3]
        "norm_before_residual": False,
    }
    _write_raw(tmp_path / "d", spec_config, renamed)
    cfg2, loaded = load_drafter(tmp_path / "d")
    assert cfg2.aux_layer_ids == [0, 2, 3]
    assert (cfg2.hidden_size, cfg2.draft_vocab_size, cfg2.target_hidden_size) == (32, 40, 24)
    assert set(loaded) == SGLANG_NAMES
    assert torch.equal(
        loaded["midlayer.self_attn.q_proj.weight"], state["midlayer.self_attn.q_proj.weight"]
    )


def test_missing_vocab_map_only_allowed_for_full_vocab(tmp_path):
    full = tiny_cfg(draft_vocab_size=200)
    state = random_state(full)
    del state["d2t"], state["t2d"]
    _write_raw(tmp_path / "full", full.to_json_dict(), state)
    _, loaded = load_drafter(tmp_path / "full")
    assert torch.equal(loaded["d2t"], torch.zeros(200, dtype=torch.int64))
    assert bool(loaded["t2d"].all())

    pruned = tiny_cfg()
    state = random_state(pruned)
    del state["d2t"], state["t2d"]
    _write_raw(tmp_path / "pruned", pruned.to_json_dict(), state)
    with pytest.raises(CheckpointError, match="no d2t but draft_vocab_size 40 < vocab_size 200"):
        load_drafter(tmp_path / "pruned")


def test_header_reader_matches_safetensors_and_names_bad_files(tmp_path):
    cfg = tiny_cfg()
    out = save_drafter(random_state(cfg), cfg, tmp_path / "d", dtype=torch.float16)
    f = out / "model.safetensors"
    header = read_safetensors_header(f)
    with safe_open(str(f), framework="pt") as fh:
        for name in fh.keys():
            assert header[name][1] == tuple(fh.get_slice(name).get_shape())
    assert header["norm.weight"][0] == "F16"
    assert read_safetensors_header(out) == header  # a folder reads all its files

    data = f.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*(truncated|past the end)"):
        read_safetensors_header(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"junk\.safetensors: header is not JSON"):
        read_safetensors_header(tmp_path / "junk.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match=r"tiny\.safetensors: 1 bytes"):
        read_safetensors_header(tmp_path / "tiny.safetensors")

    # the loader reports the broken file by name too
    f.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(out)


def test_missing_local_folder_and_unreachable_repo_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        load_drafter(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no-such-org/no-such-drafter: .*HF Hub"):
        load_drafter("no-such-org/no-such-drafter")
    with pytest.raises(CheckpointError, match="no-such-org/no-such-drafter"):
        read_safetensors_header("no-such-org/no-such-drafter")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/config.json: missing"):
        load_drafter(tmp_path / "empty")


def test_drafter_module_state_dict_round_trips(tmp_path):
    """The drafter nn.Module's state_dict is exactly the SGLang checkpoint, both directions."""
    from eagle3.model import Eagle3Drafter

    cfg = tiny_cfg()
    model = Eagle3Drafter(cfg)
    sd = model.state_dict()
    want = expected_tensors(cfg)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: s for k, (s, _) in want.items()}
    ref = random_state(cfg, seed=3)
    sd["d2t"].copy_(ref["d2t"])
    sd["t2d"].copy_(ref["t2d"])
    save_drafter(sd, cfg, tmp_path / "d", dtype=torch.float32)
    cfg2, loaded = load_drafter(tmp_path / "d")
    fresh = Eagle3Drafter(cfg2)
    fresh.load_state_dict(loaded, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], sd[k]) for k in sd)


CHILD = """
import sys, torch
from eagle3.checkpoint import expected_tensors, save_drafter
from eagle3.config import Eagle3Config
cfg = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, vocab_size=2**20, draft_vocab_size=2**20, target_hidden_size=24,
                   aux_layer_ids=[0, 2, 3])
state = {n: torch.ones(s) for n, (s, dt) in expected_tensors(cfg).items() if dt is None}
state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
print("ready", flush=True)
save_drafter(state, cfg, sys.argv[1], dtype=torch.float32)
"""


def test_a_killed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """SIGKILL a writer mid-save (a 128 MB lm_head): `d` still holds the old, loadable checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    cfg = tiny_cfg()
    old = random_state(cfg, seed=5)
    save_drafter(old, cfg, tmp_path / "d", dtype=torch.float32)
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "d")],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while (
        not list(tmp_path.glob(".d.tmp-*")) and child.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    cfg2, loaded = load_drafter(tmp_path / "d")
    assert cfg2.vocab_size == cfg.vocab_size
    assert all(torch.equal(loaded[k], old[k]) for k in old)
