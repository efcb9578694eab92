"""The benchmark client: stats extraction for both server formats, and a full run against the
Serve deployment of a tiny target (sweep, concurrency levels, baseline, JSON, plot, planner)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3.checkpoint import save_drafter
from serve.bench import BenchResult, acceptance_per_position, extract_stats, run_bench
from serve.deployment import deploy
from serve.engine import random_drafter


def test_extract_stats_reads_engine_usage_and_sglang_meta_info():
    ours = {
        "choices": [{"message": {"content": "hi"}}],
        "usage": {"completion_tokens": 12, "spec_verify_ct": 5, "spec_accepted_tokens": 6,
                  "spec_accept_hist": [2, 1, 1, 1], "draft_ms": 10.0, "verify_ms": 20.0, "spec_steps": 3},
    }  # fmt: skip
    s = extract_stats(ours, latency_s=0.5)
    assert (
        s.accept_len == 12 / 5
        and s.tok_per_s == 24
        and s.accept_hist == (2, 1, 1, 1)
        and s.steps == 3
    )
    # SGLang's native /generate answer: statistics in a top-level meta_info
    sgl = {
        "text": "hi",
        "meta_info": {"completion_tokens": 64, "spec_verify_ct": 20, "e2e_latency": 1.0},
    }
    s = extract_stats(sgl, latency_s=2.0)
    assert s.accept_len == 3.2 and s.accept_hist is None and s.draft_ms is None
    plain = {"usage": {"completion_tokens": 8, "spec_verify_ct": 0}}
    assert extract_stats(plain, 1.0).accept_len is None
    with pytest.raises(ValueError, match="completion_tokens"):
        extract_stats({"choices": []}, 1.0)


def test_acceptance_per_position():
    assert acceptance_per_position((2, 3, 0, 5)) == (0.8, 0.5, 0.5)
    assert acceptance_per_position(()) == ()


@pytest.fixture(scope="module")
def endpoint(ray_local, tiny_target, tmp_path_factory):
    from ray import serve

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    d = random_drafter(target, draft_vocab_size=4000, seed=1, aux_layer_ids=[0, 1, 2]).model
    ckpt = save_drafter(d.state_dict(), d.cfg, tmp_path_factory.mktemp("bench") / "drafter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from pipeline.config import ServeConfig, TargetConfig  # the driver passes its config sections

    serve_cfg, target_cfg = ServeConfig(port=port, steps=2), TargetConfig(model=str(tiny_target))
    yield deploy(serve_cfg, target_cfg, ckpt, app_name="test-bench", torch_threads=1)
    serve.shutdown()


def test_run_bench_against_the_deployment(endpoint, tmp_path):
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(5)]
    cfg = {
        "num_prompts": 4,
        "max_tokens": 8,
        "concurrency": [1, 2],
        "warmup": 1,
        "steps_sweep": [1, 2],
    }
    r = run_bench(endpoint.url, prompts, cfg, tmp_path, tag="round-000")
    assert isinstance(r, BenchResult)
    assert Path(r.json_path).is_file() and Path(r.plot_path).stat().st_size > 1000
    saved = json.loads(Path(r.json_path).read_text())
    assert saved["speedup"] == pytest.approx(r.speedup) and len(saved["levels"]) == 4

    assert r.steps in (1, 2) and [lv.steps for lv in r.sweep] == [1, 2]
    assert r.speedup == pytest.approx(r.tok_per_s / r.baseline_tok_per_s)
    assert 1.0 <= r.accept_len <= r.steps + 1
    rates = r.acceptance_per_position
    assert len(rates) == r.steps and all(
        0 <= b <= a <= 1 for a, b in zip(rates, rates[1:], strict=False)
    )
    assert r.verify_ms > 0 and r.draft_ms > 0 and r.break_even_accept_len > 0
    spec = [lv for lv in r.levels if lv.speculative]
    base = [lv for lv in r.levels if not lv.speculative]
    assert [lv.concurrency for lv in spec] == [1, 2] == [lv.concurrency for lv in base]
    assert [lv.speculative for lv in r.levels] == [True, False, True, False]
    assert all(lv.requests == 4 and lv.accept_len is None for lv in base)
    assert sum(spec[0].accept_hist) > 0 and sum(r.accept_len_hist["counts"]) == 4

    from pipeline.plan import plan  # the driver hands the measured costs to the planner

    p = plan(**r.costs)
    assert p["break_even_accept_len"] == pytest.approx(r.break_even_accept_len)
