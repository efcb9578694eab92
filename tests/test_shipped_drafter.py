"""The base drafter shipped in the repository (drafters/smollm2-135m-base, the demo's
`drafter.init`): it fits the embedded target by the compat check, keeps the format's size and
sharing rules, and speculates in vLLM with the target's own greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from actors.vllm_server import vllm_available

BASE = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-base"


def test_the_shipped_drafter_fits_the_embedded_target():
    from eagle3.compat import check_compat

    rep = check_compat(BASE, "smollm2")
    assert rep.compatible, rep.table()
    size = (BASE / "model.safetensors").stat().st_size
    assert size <= 25 * 2**20, f"{size / 2**20:.1f} MiB"
    with safe_open(str(BASE / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names - {"d2t", "t2d"}}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert not any("embed" in n for n in names)  # the engine takes the target's embedding
    assert dtypes == {"BF16"}
    cfg = json.loads((BASE / "config.json").read_text())
    assert d2t.numel() == cfg["draft_vocab_size"] and int(t2d.sum()) == d2t.numel()
    assert torch.equal(torch.arange(d2t.numel()) + d2t, t2d.nonzero().squeeze(-1))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="no Python with vllm: make setup-vllm")
def test_vllm_speculates_with_the_shipped_drafter(ray_local, tmp_path):
    """vLLM loads the shipped drafter beside SmolLM2 (fp32): greedy output equal to the embedded
    engine's plain decoding, and an accept length within 3% of the embedded engine's."""
    from test_vllm import complete, free_port, pooled

    from actors.chat import prompt_ids
    from actors.prompts import load_jsonl_prompts
    from actors.vllm_server import deploy_vllm
    from pipeline.config import ServeConfig, TargetConfig
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    lm, tok = load_target("smollm2", dtype="float32")
    everyday = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "everyday.jsonl"
    chats = [p.messages for p in load_jsonl_prompts(everyday)[:4]]
    ids = [prompt_ids(tok, m) for m in chats]
    torch.set_num_threads(1)
    engine = SpecEngine(lm, load_eagle(BASE, lm), steps=3, stop_ids=set())
    p = GenParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    gens = engine.generate(ids, p)
    plain = engine.generate(ids, p, speculative=False)
    ours = sum(g.stats.completion_tokens for g in gens) / sum(g.stats.spec_verify_ct for g in gens)
    serve_cfg = ServeConfig(engine="vllm", port=free_port(), steps=3, extra_args=["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4"])  # fmt: skip
    ep = deploy_vllm(serve_cfg, TargetConfig(model="smollm2", dtype="float32"), BASE, tmp_path / "logs")  # fmt: skip
    try:
        spec = complete(ep.url, ids)
    finally:
        ep.shutdown()
    for s, g in zip(spec, plain, strict=True):
        assert s["choices"][0]["token_ids"] == g.token_ids
    theirs = pooled(spec)
    assert theirs > 1.3, f"vLLM accepted almost nothing ({theirs:.3f}): the drafter did not load"
    assert abs(theirs - ours) <= 0.03 * ours, (theirs, ours)
