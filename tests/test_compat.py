"""Compatibility checks on real checkpoint folders (headers and configs only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import expected_tensors, save_drafter
from eagle3.config import Eagle3Config
from pipeline.compat import check_compat, main

# no Ray, unmarked: `make test` runs it in the first pytest, which ends sooner (scripts/test_suite.py)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub_offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub reads it at call time (no 25 s of retries)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def drafter_cfg(**kw) -> Eagle3Config:
    """A drafter shaped for the `tiny_target` fixture (4 layers, hidden 64, 4/2 heads)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        draft_vocab_size=512,
        target_hidden_size=64,
        aux_layer_ids=[0, 1, 2],
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    )
    return Eagle3Config(**{**base, **kw})


def make_drafter(folder: Path, cfg: Eagle3Config, seed: int = 0, dtype=torch.bfloat16) -> Path:
    g = torch.Generator().manual_seed(seed)
    state = {
        n: torch.randn(s, generator=g) for n, (s, dt) in expected_tensors(cfg).items() if dt is None
    }
    used = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    state["d2t"] = used - torch.arange(cfg.draft_vocab_size)
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][used] = True
    return save_drafter(state, cfg, folder, dtype=dtype)


def fields(items: list[dict]) -> set[str]:
    return {m["field"] for m in items}


def test_matching_pair_is_compatible(tmp_path, tiny_target, capsys):
    cfg = drafter_cfg()
    d = make_drafter(tmp_path / "d", cfg)
    rep = check_compat(d, tiny_target)
    assert rep.compatible, rep.table()
    assert rep.mode == "drafter-target" and rep.mismatches == [] and rep.warnings == []
    rows = {r.field: r for r in rep.rows}
    assert rows["fc.weight in_features vs 3 x target hidden"].left == 192
    assert rows["aux_layer_ids (vLLM: input of layer j)"].left == [1, 2, 3]
    # parameter split: core (fc + midlayer + norm), lm_head, and the target's frozen embedding
    h, i = 64, 128
    core = (
        h * 3 * h + 64 * 2 * h + 2 * (32 * 2 * h) + h * 64 + 3 * i * h + 4 * h
    )  # fc q k v o mlp norms
    assert rows["params trainable core (fc+midlayer+norm)"].left == core
    assert rows["params lm_head (trainable, draft vocab)"].left == 512 * h
    assert rows["params embedding (frozen, the target's)"].right == 49152 * h
    assert rows["tensor d2t"].status == "ok" and rows["tensor t2d"].left == "BOOL [49152]"
    assert main(["--drafter", str(d), "--target", str(tiny_target)]) == 0
    assert "COMPATIBLE" in capsys.readouterr().out


def test_mismatched_pair_lists_every_mismatch(tmp_path, tiny_target):
    cfg = drafter_cfg(
        hidden_size=32, intermediate_size=48, head_dim=8, target_hidden_size=48,
        vocab_size=1000, draft_vocab_size=100, aux_layer_ids=[1, 5, 9],
        rope_theta=500000.0, max_position_embeddings=512,
    )  # fmt: skip
    d = make_drafter(tmp_path / "d", cfg)
    rep = check_compat(d, tiny_target)
    assert not rep.compatible
    assert fields(rep.mismatches) == {
        "hidden_size",
        "target_hidden_size",
        "fc.weight in_features vs 3 x target hidden",
        "vocab_size",
        "t2d length",
        "aux_layer_ids (SGLang: output of layer k)",
    }
    by_field = {m["field"]: m for m in rep.mismatches}
    assert by_field["fc.weight in_features vs 3 x target hidden"]["left"] == 144
    assert by_field["fc.weight in_features vs 3 x target hidden"]["right"] == 192
    assert "[5, 9]" in by_field["aux_layer_ids (SGLang: output of layer k)"]["fix"]
    assert fields(rep.warnings) == {"rope_theta", "max_position_embeddings"}
    assert all(m["fix"] for m in rep.mismatches)


def test_cli_json_and_exit_code(tmp_path, tiny_target):
    d = make_drafter(tmp_path / "d", drafter_cfg(vocab_size=1000, draft_vocab_size=100))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "pipeline.compat",
        "--drafter",
        str(d),
        "--target",
        str(tiny_target),
        "--json",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert out["compatible"] is False
    assert {"vocab_size", "t2d length"} <= fields(out["mismatches"])
    assert all({"field", "left", "right"} <= set(m) for m in out["mismatches"])


def test_missing_d2t_and_default_aux_ids(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file

    d = make_drafter(tmp_path / "d", drafter_cfg(aux_layer_ids=[]))
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(d / "model.safetensors"))
    rep = check_compat(d, tiny_target)
    rows = {r.field: r for r in rep.rows}
    assert rows["aux_layer_ids (SGLang: output of layer k)"].left == "[1, 1, 0] (SGLang default)"
    assert {"d2t", "tensor d2t"} <= fields(rep.mismatches)


def test_two_drafters_compared_field_by_field(tmp_path):
    a = make_drafter(tmp_path / "a", drafter_cfg(), seed=0)
    b = make_drafter(tmp_path / "b", drafter_cfg(), seed=1, dtype=torch.float32)
    rep = check_compat(a, b)
    assert rep.mode == "drafter-drafter" and rep.compatible
    assert "tensor fc.weight" in fields(rep.warnings)  # bf16 vs fp32 only warns
    assert "config torch_dtype" in fields(rep.warnings)

    c = make_drafter(tmp_path / "c", drafter_cfg(draft_vocab_size=256, aux_layer_ids=[0, 1, 1]))
    rep = check_compat(a, c)
    assert not rep.compatible
    assert fields(rep.mismatches) == {
        "config draft_vocab_size",
        "config aux_layer_ids",
        "tensor lm_head.weight",
        "tensor d2t",
    }
    lm = {m["field"]: m for m in rep.mismatches}["tensor lm_head.weight"]
    assert lm["left"] == "BF16 [512, 64]" and lm["right"] == "BF16 [256, 64]"


def test_bad_inputs_name_the_file_and_fix(tmp_path, tiny_target, hub_offline):
    rep = check_compat(tmp_path / "nope", tiny_target)
    assert not rep.compatible and rep.mismatches[0]["field"] == "drafter config.json"
    assert "no such folder" in rep.mismatches[0]["fix"]

    d = make_drafter(tmp_path / "d", drafter_cfg())
    rep = check_compat(d, tmp_path / "no-target")
    assert fields(rep.mismatches) == {"target config.json"}

    rep = check_compat(d, "no-such-org/no-such-target")
    assert "no-such-org/no-such-target" in rep.mismatches[0]["fix"]

    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:64])
    rep = check_compat(d, tiny_target)
    m = {x["field"]: x for x in rep.mismatches}
    assert "drafter safetensors" in m and "model.safetensors" in m["drafter safetensors"]["fix"]

    (d / "config.json").write_text("{not json")
    rep = check_compat(d, tiny_target)
    assert (
        "config.json" in rep.mismatches[0]["fix"] and "not valid JSON" in rep.mismatches[0]["fix"]
    )


def test_against_the_embedded_smollm2_gguf(tmp_path):
    cfg = drafter_cfg(
        hidden_size=576, target_hidden_size=576, intermediate_size=256, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, aux_layer_ids=[1, 14, 26], rope_theta=100000.0,
        max_position_embeddings=8192, draft_vocab_size=64,
    )  # fmt: skip
    d = make_drafter(tmp_path / "d", cfg)
    rep = check_compat(d, "smollm2")
    assert rep.compatible, rep.table()
    rows = {r.field: r for r in rep.rows}
    assert rows["aux_layer_ids (SGLang: output of layer k)"].right == "valid 0..28 (30 layers)"


def test_config_without_draft_vocab_warns_about_the_lm_head(tmp_path, tiny_target):
    d = make_drafter(tmp_path / "d", drafter_cfg(draft_vocab_size=49152))
    raw = json.loads((d / "config.json").read_text())
    del raw["draft_vocab_size"]
    (d / "config.json").write_text(json.dumps(raw))
    rep = check_compat(d, tiny_target)
    assert rep.compatible and fields(rep.warnings) == {"lm_head source"}
