"""The drafters shipped in the repository (drafters/smollm2-135m-base, the on-policy base the
GPU configs start from, and drafters/smollm2-135m-offpolicy, the demo's `drafter.init`): each fits the embedded target by the compat check, keeps the format's size and
sharing rules, and is what the suite's first vLLM start serves.

vLLM starts once here (about 40 s+ on 2 cores): SmolLM2 (fp32, the session's converted HF folder
`smollm2_hf`) with the shipped drafter, for every check of vLLM serving a real drafter: greedy
output equal to the embedded engine's plain decoding, accept length within 3% of the embedded
engine's, the server counters, the benchmark with a cached baseline and no restart, and a broken
checkpoint refused without a restart. That the project's own export has this drafter's format is
tests/test_vllm.py's cheap format test; its one vLLM start is the shifted-layer-ids check, which
needs the shaped tiny target (on SmolLM2 shifting the ids costs almost nothing)."""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from actors.vllm_server import vllm_available

DRAFTERS = Path(__file__).resolve().parents[1] / "drafters"
SHIPPED = [DRAFTERS / "smollm2-135m-base", DRAFTERS / "smollm2-135m-offpolicy"]
EVERYDAY = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "everyday.jsonl"
STEPS = 3
MAX_TOKENS = 32


@pytest.mark.parametrize("BASE", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_drafter_fits_the_embedded_target(BASE):
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
    # one format for every shipped drafter: vLLM starts with the first only (below)
    from test_vllm import drafter_format

    assert drafter_format(BASE) == drafter_format(SHIPPED[0])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="no Python with vllm: make setup-vllm")
@pytest.mark.parametrize("BASE", SHIPPED[:1], ids=lambda p: p.name)
def test_vllm_serves_the_shipped_drafter(BASE, ray_local, smollm2_hf, smollm2_gguf_lm, tmp_path):
    """vLLM started once, SmolLM2 (fp32) with the shipped drafter: greedy output equal to the
    embedded engine's plain decoding (fp32 greedy: speculation changes nothing), accept length
    above 1.3 and within 3% of the embedded engine's with the same drafter and prompts, the
    server-wide counters against the embedded cycle, the benchmark from vLLM's own figures with a
    cached baseline and no restart, and a broken checkpoint refused before any restart.

    The base drafter only: the off-policy one is in its format, field by field (the test
    above), and a second vLLM start cost 52-78 s of the suite's 900."""
    from conftest import free_port
    from test_vllm import complete, pooled
    from transformers import AutoTokenizer

    from actors.chat import prompt_ids
    from actors.engine_server import BaselineCache, DrafterRejected
    from actors.prompts import load_jsonl_prompts
    from actors.vllm_server import baseline_key, deploy_vllm
    from pipeline.config import ServeConfig, TargetConfig
    from serve.bench import bench_endpoint, bench_settings_key, measure_baseline_levels
    from serve.engine import GenParams, SpecEngine, load_eagle

    # The reference is the GGUF itself as transformers dequantises it (the session's copy, not the
    # converted folder vLLM loads), copied: the engine reroutes the target's linears and hooks
    # its layers, and the session's model must stay as it was for the tests after this one.
    lm = copy.deepcopy(smollm2_gguf_lm).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_hf)  # the GGUF's tokenizer (test_hf_folder)
    chats = [p.messages for p in load_jsonl_prompts(EVERYDAY)[:4]]
    ids = [prompt_ids(tok, m) for m in chats]
    torch.set_num_threads(1)
    engine = SpecEngine(lm, load_eagle(BASE, lm), steps=STEPS, stop_ids=set())
    p = GenParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    gens = engine.generate(ids, p)
    plain = engine.generate(ids, p, speculative=False)
    del engine, lm
    verify = sum(g.stats.spec_verify_ct for g in gens)
    ours = sum(g.stats.completion_tokens for g in gens) / verify
    ours_cycle = sum(g.stats.accepted_drafts + g.stats.spec_verify_ct for g in gens) / verify

    serve_cfg = ServeConfig(engine="vllm", port=free_port(), steps=STEPS, extra_args=["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4"])  # fmt: skip
    # the session's converted folder as the model: deploy_vllm converts no GGUF of its own
    target_cfg = TargetConfig(model=str(smollm2_hf), dtype="float32")
    t0 = time.monotonic()
    ep = deploy_vllm(serve_cfg, target_cfg, BASE, tmp_path / "logs")
    timings = {"load_s": round(time.monotonic() - t0, 1)}
    try:
        assert ep.status()["model_dir"] == str(smollm2_hf)
        spec = complete(ep.url, ids)
        for s, g in zip(spec, plain, strict=True):
            assert s["choices"][0]["token_ids"] == g.token_ids
        theirs = pooled(spec)
        assert theirs > 1.3, (
            f"vLLM accepted almost nothing ({theirs:.3f}): the drafter did not load"
        )
        assert abs(theirs - ours) <= 0.03 * ours, (theirs, ours)
        # the server-wide counters say the same as the per-request figures
        counters = ep.spec_counters()
        assert abs(counters.accept_len - ours_cycle) <= 0.03 * ours_cycle, (counters, ours_cycle)
        assert len(counters.per_pos) == STEPS and counters.per_pos[0] >= counters.per_pos[-1]

        # The benchmark scores the endpoint: per-request accept_len from the responses, the
        # counters per level alongside, the baseline from the cache, with no restart. The cached
        # figures are measured on this server (vLLM ignores `speculative: false`, so they are no
        # real baseline): what is checked is that bench_endpoint takes them and starts nothing.
        bench_cfg = {"num_prompts": 4, "max_tokens": MAX_TOKENS, "concurrency": [1, 4], "warmup": 1, "steps_sweep": []}  # fmt: skip
        cache = tmp_path / "baseline.json"
        key = f"{baseline_key(target_cfg)}|{bench_settings_key(chats, bench_cfg)}"
        cached = measure_baseline_levels(ep.url, chats, bench_cfg)
        BaselineCache(cache).put(key, cached)
        starts = len(ep.status()["starts"])
        res = bench_endpoint(ep, chats, bench_cfg, tmp_path / "bench", baseline_cache=cache)
        assert res.extra["baseline_cached"] is True and res.steps == STEPS
        assert len(ep.status()["starts"]) == starts  # the baseline cost no restart
        base = [x for x in res.levels if not x.speculative]
        assert [x.tok_per_s for x in base] == [lv["tok_per_s"] for lv in cached["levels"]]
        lv = [x for x in res.levels if x.speculative]
        assert all(x.accept_len and x.accept_len > 1.15 for x in lv)
        for x, cnt in zip(lv, res.extra["server_counters"], strict=True):
            cycle = 1 + sum(a * n for a, n in enumerate(x.accept_hist)) / sum(x.accept_hist)
            assert cnt["accept_len"] == pytest.approx(cycle, rel=1e-6)
        assert len(res.acceptance_per_position) == STEPS
        saved = json.loads(Path(res.json_path).read_text())
        assert saved["accept_len"] == res.accept_len and saved["extra"]["server_counters"]

        # A broken checkpoint is refused before any restart; the drafter keeps serving.
        bad = tmp_path / "bad"
        shutil.copytree(BASE, bad)
        (bad / "model.safetensors").write_bytes(b"not safetensors")
        with pytest.raises(DrafterRejected):
            ep.swap_drafter(bad)
        assert len(ep.status()["starts"]) == starts and ep.status()["drafter"] == str(BASE)
    finally:
        ep.shutdown()
    print(json.dumps({"vllm_accept_len": theirs, "embedded_accept_len": ours, **timings}))
