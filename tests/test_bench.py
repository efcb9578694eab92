"""The benchmark client: stats extraction for both server formats, and a full run against the
Serve deployment of a tiny target (sweep, concurrency levels, baseline, JSON, plot, planner), the
run's shared app (conftest.shared_endpoint)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

for _dep in ("fastapi", "ray", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import httpx

from serve.bench import BenchResult, bench_endpoint, measure_baseline_levels, run_bench
from serve.bench_stats import _level, acceptance_per_position, chat_request, extract_stats

# The meta_info of a finished speculative request in sglang 0.5.14 (tokenizer_manager.py:
# _calculate_spec_decoding_metrics); the histogram only reaches the largest count it saw.
SGL_SPEC_META = {
    "id": "9b1c", "finish_reason": {"type": "length", "length": 64}, "prompt_tokens": 31,
    "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
    "completion_tokens": 64, "cached_tokens": 0, "cached_tokens_details": None, "dp_rank": None,
    "e2e_latency": 0.8, "spec_accept_rate": 0.73, "spec_accept_length": 3.2,
    "spec_num_correct_drafts": 44, "spec_num_proposed_drafts": 60, "spec_verify_ct": 20,
    "spec_accepted_drafts": 44, "spec_proposed_drafts": 60,
    "spec_correct_drafts_histogram": [2, 3, 1], "spec_accept_histogram": [2, 3, 1],
}  # fmt: skip


def test_extract_stats_reads_engine_usage():
    ours = {
        "choices": [{"message": {"content": "hi"}}],
        "usage": {"completion_tokens": 12, "spec_verify_ct": 5, "spec_accepted_tokens": 6,
                  "spec_accept_hist": [2, 1, 1, 1], "draft_ms": 10.0, "verify_ms": 20.0, "spec_steps": 3},
    }  # fmt: skip
    s = extract_stats(ours, latency_s=0.5)
    assert s.accept_len == 12 / 5 and s.tok_per_s == 24
    assert s.accept_hist == (2, 1, 1, 1) and s.steps == 3 and s.accepted_drafts == 6
    plain = {"usage": {"completion_tokens": 8, "spec_verify_ct": 0}}
    assert extract_stats(plain, 1.0).accept_len is None
    with pytest.raises(ValueError, match="completion_tokens"):
        extract_stats({"choices": []}, 1.0)


def test_extract_stats_reads_sglang_meta_info():
    # native /generate: meta_info at the top level
    native = {"text": "hi", "output_ids": list(range(64)), "meta_info": SGL_SPEC_META}
    s = extract_stats(native, latency_s=2.0)
    assert s.accept_len == 3.2 and s.verify_ct == 20 and s.accepted_drafts == 44
    assert s.accept_hist == (2, 3, 1)  # spec_correct_drafts_histogram
    assert s.verify_ms == 2000.0 and s.draft_ms == 0.0  # SGLang reports no draft/verify split
    # chat completion sent with return_meta_info: under choices[0]; usage has no spec fields
    chat = {
        "id": "9b1c", "object": "chat.completion", "created": 1795970937, "model": "default",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi",
                                             "reasoning_content": None, "tool_calls": None},
                     "logprobs": None, "finish_reason": "length", "matched_stop": None,
                     "meta_info": SGL_SPEC_META}],
        "usage": {"prompt_tokens": 31, "total_tokens": 95, "completion_tokens": 64,
                  "prompt_tokens_details": None, "reasoning_tokens": 0},
        "metadata": {"weight_version": "default"},
    }  # fmt: skip
    assert extract_stats(chat, 2.0) == s
    # a server without a drafter (shape seen from sglang 0.5.14 on CPU): no spec fields
    base_meta = {k: v for k, v in SGL_SPEC_META.items() if not k.startswith("spec_")}
    base = extract_stats({**chat, "choices": [{**chat["choices"][0], "meta_info": base_meta}]}, 1.0)
    assert (base.completion_tokens, base.verify_ct, base.accept_len, base.accept_hist) == (
        64,
        None,
        None,
        None,
    )


def test_sglang_histograms_of_different_lengths_are_padded():
    a = extract_stats({"meta_info": SGL_SPEC_META}, 1.0)  # [2, 3, 1]
    b = extract_stats({"meta_info": {**SGL_SPEC_META, "spec_correct_drafts_histogram": [4]}}, 1.0)
    lv = _level([a, b], 1, True, 3, 2.0)
    assert lv.accept_hist == (6, 3, 1, 0)  # steps 3: positions 0..3
    assert acceptance_per_position(lv.accept_hist) == (0.4, 0.1, 0.0)


def test_chat_request_asks_sglang_for_meta_info():
    path, body = chat_request("hi", 16, True, 3)
    assert path == "/v1/chat/completions" and body["return_meta_info"] is True
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "stream" not in body
    assert (body["speculative"], body["steps"], body["ignore_eos"]) == (True, 3, False)
    assert chat_request("hi", 16, False, None, ignore_eos=True)[1]["ignore_eos"] is True


def test_acceptance_per_position():
    assert acceptance_per_position((2, 3, 0, 5)) == (0.8, 0.5, 0.5)
    assert acceptance_per_position(()) == ()


@pytest.fixture
def endpoint(shared_endpoint):
    """The run's one Serve app (conftest.shared_endpoint; tests/test_serve.py's too): the tiny
    target with a random drafter (it accepts next to nothing), 2 draft steps."""
    return shared_endpoint


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
    # The headline figures are the first concurrency level's, speculative vs plain.
    spec1, base1 = r.levels[0], r.levels[1]
    assert (spec1.concurrency, spec1.speculative, base1.concurrency, base1.speculative) == (
        1, True, 1, False,
    )  # fmt: skip
    assert (r.tok_per_s, r.baseline_tok_per_s) == (spec1.tok_per_s, base1.tok_per_s)
    assert r.accept_len == pytest.approx(sum(spec1.accept_lens) / 4) and len(spec1.accept_lens) == 4
    assert r.accept_len < 1.5  # an untrained drafter: next to nothing is accepted
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


PROMPTS = [
    [{"role": "user", "content": f"Say something about {w}."}] for w in ("rain", "tea", "maps")
]
SMALL = {
    "num_prompts": 3,
    "max_tokens": 6,
    "concurrency": [1, 2],
    "warmup": 1,
    "steps_sweep": [1, 2],
}


def test_baseline_from_another_server_or_given_figures(endpoint, tmp_path):
    """The SGLang way (server steps fixed at launch, baseline from a server without a drafter),
    run against the embedded deployment, whose `speculative: false` requests are a baseline."""
    base = measure_baseline_levels(endpoint.url, PROMPTS, SMALL)
    assert [lv["concurrency"] for lv in base["levels"]] == [1, 2]
    assert all(lv["accept_len"] is None and not lv["speculative"] for lv in base["levels"])

    given = run_bench(
        endpoint.url, PROMPTS, SMALL, tmp_path, tag="given", baseline=base, fixed_steps=2
    )
    assert given.sweep == () and given.steps == 2  # no sweep: the server's steps are fixed
    got = [lv for lv in given.levels if not lv.speculative]
    assert [lv.tok_per_s for lv in got] == [lv["tok_per_s"] for lv in base["levels"]]
    assert given.baseline_tok_per_s == base["levels"][0]["tok_per_s"]
    assert given.extra["settings"]["baseline"] == "given (cached) figures"

    by_url = run_bench(endpoint.url, PROMPTS, SMALL, tmp_path, tag="url", baseline_url=endpoint.url)
    assert by_url.extra["settings"]["baseline"] == endpoint.url and len(by_url.sweep) == 2
    assert [lv.speculative for lv in by_url.levels] == [True, False, True, False]
    with pytest.raises(ValueError, match="no level at concurrency 4"):
        run_bench(endpoint.url, PROMPTS, dict(SMALL, concurrency=[4]), tmp_path, baseline=base)


def test_bench_endpoint_on_the_embedded_engine(endpoint, tmp_path):
    assert endpoint.info()["path"] and endpoint.info()["engine"] == "embedded"
    r = bench_endpoint(
        endpoint, PROMPTS, SMALL, tmp_path, baseline_cache=tmp_path / "b.json", tag="ep"
    )
    # No fixed steps: the server ran each request with the sweep's steps (k+1 histogram bins).
    assert [(lv.steps, len(lv.accept_hist)) for lv in r.sweep] == [(1, 2), (2, 3)]
    assert r.extra["settings"]["baseline"] == "same server, speculative: false"
    assert r.extra["baseline_cached"] is False and not (tmp_path / "b.json").exists()
    assert json.loads(Path(r.json_path).read_text())["extra"]["baseline_cached"] is False


def test_baseline_on_the_first_prompts_only(endpoint, tmp_path):
    """`bench.baseline_prompts`: the no-drafter pass times only the first N prompts (a speed
    figure), the drafter is still scored on all of them; per-domain speedups are left out."""
    cfg = dict(SMALL, concurrency=[1], steps_sweep=[], baseline_prompts=2)
    r = run_bench(endpoint.url, PROMPTS, cfg, tmp_path, tag="few", domains=["a", "b", "a"])
    spec, base = r.levels
    assert (spec.speculative, spec.requests) == (True, len(PROMPTS))
    assert (base.speculative, base.requests) == (False, 2)
    assert r.extra["settings"]["baseline_prompts"] == 2
    assert all(d["speedup"] is None and d["accept_len"] for d in r.domains.values())


def test_acceptance_on_every_prompt_batched_and_speed_on_the_first_few(endpoint, tmp_path):
    """`bench.accept_concurrency`: accept_len, its histogram and the per-domain figures come
    from one pass over every prompt, that many requests in flight (the server batches them); the
    speed levels, speculative and baseline, time the baseline's prompts only."""
    prompts = [[{"role": "user", "content": f"Count to {i} in words."}] for i in range(6)]
    cfg = dict(SMALL, num_prompts=6, concurrency=[1], steps_sweep=[], baseline_prompts=2,
               accept_concurrency=3)  # fmt: skip
    doms = ["a", "b", "a", "b", "a", "a"]
    r = run_bench(endpoint.url, prompts, cfg, tmp_path, tag="acc", domains=doms)
    spec, base = r.levels
    assert (spec.speculative, spec.requests, base.requests) == (True, 2, 2)
    acc = r.extra["acceptance_level"]
    assert (acc["requests"], acc["concurrency"], acc["speculative"]) == (6, 3, True)
    assert r.accept_len == pytest.approx(statistics.fmean(acc["accept_lens"]))
    assert sum(r.accept_len_hist["counts"]) == 6 and r.costs["accept_len"] == r.accept_len
    assert {d: v["requests"] for d, v in r.domains.items()} == {"a": 4, "b": 2}
    assert all(v["tok_per_s"] is None and v["speedup"] is None for v in r.domains.values())
    assert r.tok_per_s == spec.tok_per_s and r.extra["settings"]["accept_concurrency"] == 3
    assert measure_baseline_levels(endpoint.url, prompts, cfg)["levels"][0]["requests"] == 2


def test_the_benchmark_samples_at_its_temperature(endpoint, tmp_path):
    """`bench.temperature`, `top_p`, `top_k`, `seed`: every request the benchmark sends (drafted
    and plain) samples at them, and the result says which settings its figures are at."""
    from serve.bench import _builder

    cfg = dict(SMALL, concurrency=[1], steps_sweep=[], temperature=0.9, top_p=0.8, top_k=7, seed=5)
    sent = []

    def build(prompt, max_tokens, speculative, steps):
        path, body = _builder(cfg, None)(prompt, max_tokens, speculative, steps)
        sent.append(body)
        return path, body

    r = run_bench(endpoint.url, PROMPTS, cfg, tmp_path, tag="sampled", build=build)
    assert {(b["temperature"], b["top_p"], b["top_k"], b["seed"]) for b in sent} == {(0.9, 0.8, 7, 5)}  # fmt: skip
    assert {b["speculative"] for b in sent} == {True, False} and r.accept_len >= 1.0
    s = r.extra["settings"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["seed"]) == (0.9, 0.8, 7, 5)
    # greedy requests carry no cut, and one that is off (-1 or 0) is not sent
    assert "top_k" not in _builder(dict(cfg, temperature=0.0), None)("hi", 4, True, 2)[1]
    assert "top_k" not in _builder(dict(cfg, top_k=0), None)("hi", 4, True, 2)[1]


def test_cli_measures_each_shape_sampled(endpoint, tmp_path, capsys):
    """`serve.cli bench --temperature --top-p --shape --shape-chains`: every shape (the tree at
    temperature > 0 included) gets its accept_len and speedup over plain sampling."""
    from serve.cli import main

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Tell a story about {w}."}) + "\n" for w in ("owls", "rain", "maps")))  # fmt: skip
    rc = main(["bench", "--url", endpoint.url, "--prompts-jsonl", str(f), "--max-tokens", "8",
               "--warmup", "0", "--temperature", "0.8", "--top-p", "0.9", "--shape", "2,2,4",
               "--shape-chains", "1,2", "--out", str(tmp_path), "--tag", "sampled"])  # fmt: skip
    assert rc == 0
    shape = json.loads(capsys.readouterr().out)["shape"]
    assert set(shape["accept_lens"]) == set(shape["measured_speedups"]) == {"tree-2x2x4", "chain-1", "chain-2"}  # fmt: skip
    assert all(a >= 1.0 for a in shape["accept_lens"].values())
    saved = json.loads((tmp_path / "sampled.json").read_text())["extra"]["settings"]
    assert (saved["temperature"], saved["top_p"]) == (0.8, 0.9)


def test_cli_benchmarks_a_whole_small_file_by_domain(endpoint, tmp_path, capsys):
    """A user's 10-prompt file is benchmarked whole (no held-out split to leave it short), one
    domain per file or per record, figures per domain in the printed JSON and the result file."""
    from serve.cli import main

    f = tmp_path / "mine.jsonl"
    lines = [{"prompt": f"Name a colour, number {i}."} for i in range(6)]
    lines += [{"prompt": f"What is {i} + {i}?", "domain": "math"} for i in range(4)]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = main(["bench", "--url", endpoint.url, "--prompts-jsonl", str(f), "--max-tokens", "6",
               "--warmup", "0", "--out", str(tmp_path), "--tag", "mine"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {d: v["requests"] for d, v in out["domains"].items()} == {"mine": 6, "math": 4}
    saved = json.loads((tmp_path / "mine.json").read_text())
    assert sum(lv["requests"] for lv in saved["levels"] if lv["speculative"]) == 10
    # each domain's accept_len is the mean of what the server reports for those very requests
    # (greedy, so asking again gives the same figures)
    with httpx.Client(base_url=endpoint.url, timeout=120) as c:
        served = [
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": x["prompt"]}],
                   "max_tokens": 6, "temperature": 0, "record": False}).json()["usage"]["spec_accept_len"]
            for x in lines
        ]  # fmt: skip
    want = {"mine": statistics.fmean(served[:6]), "math": statistics.fmean(served[6:])}
    for name, d in out["domains"].items():
        assert d["accept_len"] == pytest.approx(want[name]) and d["speedup"] > 0
        assert len(d["acceptance_per_position"]) == 2  # the server drafts 2 steps
    total = sum(d["accept_len"] * d["requests"] for d in out["domains"].values()) / 10
    assert out["accept_len"] == pytest.approx(total)  # the overall figure is the same requests


@pytest.mark.timing  # the chooser compares measured speeds: a busy core can upset one
def test_shape_chooser_serves_plain_decoding_when_the_drafter_is_broken(endpoint, tmp_path):
    """A drafter with random weights (accept ~1.0): every chain and the configured shape are
    slower than plain decoding, so the benchmark chooses plain, the record says so, and the
    deployment then answers requests without drafting."""
    import dataclasses

    import httpx

    from pipeline.loop import _serve
    from pipeline.rules import format_table, round_row
    from serve.shapes import Shape

    cfg = dict(SMALL, concurrency=[1], steps_sweep=[], shape_chains=[1, 2, 3], max_tokens=12)
    r = bench_endpoint(endpoint, PROMPTS, cfg, tmp_path, baseline_cache=tmp_path / "b.json")
    assert r.accept_len < 1.2  # the drafter is broken
    shape = r.shape
    assert shape["served"] == "plain" and shape["served_speedup"] == 1.0, shape
    assert set(shape["speedups"]) == {"plain", "chain-1", "chain-2", "chain-3"}
    # none is served faster than plain: each either is not surely faster (the low end of its
    # interval reaches 1.0) or is capped by its own requests' timings (accept_len x verify /
    # (draft + verify) <= 1). Timed beside another pytest, plain decoding was once measured at a
    # busier moment than every chain (a clean clone's CI, 2026-12-06): the intervals alone then
    # cleared 1.0, and the ceilings kept plain served, as they must.
    ceil = shape["ceilings"]
    assert all(shape["spreads"][k]["lo"] <= 1.0 or ceil[k] <= 1.0
               for k in shape["speedups"] if k != "plain"), shape  # fmt: skip
    assert {"chain-2", "chain-3"} <= set(shape["measured"])  # configured; the acceptance probe
    assert len(shape["chain_acceptance_per_position"]) == 3 and shape["costs"]["draft_step_ms"] > 0
    assert json.loads(Path(r.json_path).read_text())["shape"]["served"] == "plain"
    row = round_row(0, {"bench": dataclasses.asdict(r), "train": {"train_tokens": 0}})
    assert (row["shape"], row["served_speedup"]) == ("plain", 1.0) and "plain" in format_table(
        [row]
    )
    body = {"messages": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    try:
        _serve(None, tmp_path, None, endpoint, shape)  # what the loop's serve stage does
        assert endpoint.info()["shape"] == "plain"
        got = httpx.post(f"{endpoint.url}/v1/chat/completions", json=body, timeout=60).json()
        assert got["usage"]["speculative"] is False and got["usage"]["spec_verify_ct"] == 0
        # a request that asks for drafting still drafts (the next benchmark does)
        asked = dict(body, speculative=True)
        got = httpx.post(f"{endpoint.url}/v1/chat/completions", json=asked, timeout=60).json()
        assert got["usage"]["speculative"] is True and got["usage"]["spec_verify_ct"] > 0
    finally:
        endpoint.set_shape(endpoint.shape)  # the module's other tests expect the configured one
    assert endpoint.info()["shape"] == "chain-2" == Shape.parse({"steps": 2}).name
