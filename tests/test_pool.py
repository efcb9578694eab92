"""The base drafter's prompt pool (actors/pool.py): real prompts the demo never benchmarks nor
gives its simulated users, multi-turn with bounded context, distinct, at least 50k."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip

from actors.pool import CONTEXT_CHARS, TURN_CHARS, build_pool, demo_prompt_keys
from actors.prompts import load_jsonl_prompts, plan_prompts, prompt_key
from actors.sources import bounded_turns, parse_conversation
from pipeline.config import load_config

pytestmark = pytest.mark.ray_free  # no Ray: `make test` runs it in the second pytest

REPO = Path(__file__).resolve().parents[1]


def test_pool_leaves_out_every_prompt_the_demo_benchmarks_or_gives_its_users():
    cfg = load_config(REPO / "configs" / "smollm2-cpu.yaml")
    plan = plan_prompts(cfg.data)
    demo = [p.messages for p in plan.heldout + plan.users]
    demo += [p.messages for p in load_jsonl_prompts(REPO / "benchmarks/prompts/everyday.jsonl")]
    excluded = demo_prompt_keys(cfg.data, cfg.bench.eval_files or [])
    assert {prompt_key(c) for c in demo} <= excluded
    pool = build_pool(excluded)
    keys = [prompt_key(p.messages) for p in pool.prompts]
    assert len(set(keys)) == len(keys) >= 50_000
    assert not set(keys) & excluded
    # nor is a held-out or user prompt the start of a pool prompt (context of a training prompt)
    starts = {prompt_key(p.messages[:n]) for p in pool.prompts for n in range(1, len(p.messages))}
    assert not starts & excluded
    # without the exclusion the pool holds every sourced demo prompt: the exclusion removes them
    sourced = {prompt_key(p.messages) for p in plan.heldout + plan.users}
    assert sourced <= {prompt_key(p.messages) for p in build_pool(set()).prompts}
    assert sum(pool.left_out.values()) >= len(sourced)
    assert set(pool.counts) == {"sharegpt", "humaneval", "lm_eval"}
    for p in (p for p in pool.prompts if p.source == "sharegpt"):  # the others are as the demo's
        m = p.messages
        assert m[0]["role"] == m[-1]["role"] == "user"
        assert len(m[-1]["content"]) <= TURN_CHARS
        assert sum(len(x["content"]) for x in m) <= CONTEXT_CHARS
    assert sum(len(p.messages) > 1 for p in pool.prompts) > 20_000  # multi-turn


def test_bounded_turns_keep_context_dropping_the_oldest_turns_first():
    conv = parse_conversation([
        {"from": "gpt", "value": "Hello!"},  # leading assistant turn: dropped
        {"from": "human", "value": "a" * 40}, {"from": "gpt", "value": "b" * 40},
        {"from": "human", "value": "c" * 30}, {"from": "gpt", "value": "d" * 10},
        {"from": "human", "value": "e" * 25}, {"from": "human", "value": "no"},
    ])  # fmt: skip
    got = bounded_turns(conv, max_turn_chars=35, max_context_chars=70)
    # "a"*40 is over the turn limit, "no" too short; "c" keeps no context (80 more would not
    # fit, and "b" alone would lead with the assistant); "e" keeps "c" and "d" (65 in all)
    assert [[m["content"][0] for m in c] for c in got] == [["c"], ["c", "d", "e"]]
    whole = bounded_turns(conv, max_turn_chars=40, max_context_chars=1000)
    assert whole[-1] == conv[:5]  # within the bounds, the whole conversation so far
