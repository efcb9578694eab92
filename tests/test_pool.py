"""The base drafter's prompt pool (actors/pool.py): real prompts the demo never benchmarks nor
gives its simulated users, multi-turn with bounded context, distinct, at least 50k."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip

from actors.pool import CONTEXT_CHARS, TURN_CHARS, build_pool
from actors.prompts import demo_prompt_keys, load_jsonl_prompts, plan_prompts, prompt_key
from actors.sources import bounded_turns, parse_conversation
from pipeline.config import load_config

# no Ray, unmarked: `make test` runs it in the shared-Ray pytest, the shorter of the two (2026-12-05: 390 s against 844 s)

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


# ---- data.source: pool, the product's source of the whole pool ---------------------------------

GPU_CONFIG = REPO / "configs" / "smollm2-1gpu.yaml"


def _pool_config(**data):
    return load_config(GPU_CONFIG, [f"data.{k}={v}" for k, v in {"source": "pool", **data}.items()])


def test_the_pool_source_never_yields_a_held_out_user_or_benchmark_prompt(tmp_path):
    real = plan_prompts(load_config(GPU_CONFIG, ["data.source=real"]).data)
    # an eval file holding a prompt the pool has: the pool must leave it out too
    some = build_pool(set()).prompts[123]
    eval_file = tmp_path / "mine.jsonl"
    eval_file.write_text(json.dumps({"messages": some.messages}) + "\n")
    plan = plan_prompts(_pool_config().data, eval_files=[str(eval_file)])
    convs = [c for d in plan.train.values() for c in d]
    train = {prompt_key(c) for c in convs}
    assert len(train) == len(convs) > 49_000  # ~50k, less the held-out, users' and gate sets
    # judged on exactly what `real` would judge on, with the same users
    assert [p.messages for p in plan.heldout] == [p.messages for p in real.heldout]
    assert [p.messages for p in plan.users] == [p.messages for p in real.users]
    held = [p.messages for p in plan.heldout + plan.users]
    held += [p.messages for f in sorted((REPO / "benchmarks/prompts").glob("*.jsonl"))
             for p in load_jsonl_prompts(f)]  # fmt: skip
    held.append(some.messages)
    held_keys = {prompt_key(c) for c in held}
    assert not train & held_keys
    starts = {prompt_key(c[:n]) for c in convs for n in range(1, len(c))}
    assert not starts & held_keys  # nor the context a training prompt continues
    assert plan.weights == dict.fromkeys(("chat", "coding", "math"), 1 / 3) and not plan.replies


def test_successive_rounds_take_disjoint_slices_and_a_resumed_round_the_same(tmp_path):
    from actors.prompts import round_slices
    from pipeline.round_data import keep_slice

    plan = plan_prompts(_pool_config().data)
    earlier, seen = [], set()
    for r, n in enumerate([3000, 5000, 4000]):
        prompts, slices = round_slices(plan, n, earlier)
        for d, (a, b) in slices.items():  # each domain continues where the rounds before ended
            assert a == sum(c.get(d, 0) for c in earlier) and b > a
        assert sum(b - a for a, b in slices.values()) == n
        keys = {prompt_key(c) for c in prompts}
        assert len(keys) == n and not keys & seen  # nothing trained on twice
        seen |= keys
        # the round resumed (same earlier draws) takes the same prompts, and its record agrees
        again, same = round_slices(plan, n, earlier)
        assert again == prompts and same == slices
        keep_slice(tmp_path / f"{r}.json", r, slices)
        keep_slice(tmp_path / f"{r}.json", r, same)
        earlier.append({s: b - a for s, (a, b) in slices.items()})
    # a resume that would take another slice (a changed config or state) is refused, by file
    with pytest.raises(RuntimeError, match=r"2\.json: round 2 began on prompt slices"):
        keep_slice(tmp_path / "2.json", 2, {"chat": [0, 4000]})


def test_a_round_begun_early_keeps_its_fresh_count_whatever_traffic_comes(tmp_path):
    """A round's data begun early (pipeline/round_data.py start_early) takes its fresh prompts
    before its traffic is known; the round's own stage then finds its slice.json and takes the
    same prompts, the traffic on top, so the batches made early are its own (same batch keys)."""
    from pipeline.round_data import fresh_prompts
    from pipeline.state import RunState

    cfg = _pool_config(prompts_per_round=512, first_round_prompts=512)
    plan, state = plan_prompts(cfg.data), RunState(config_digest="d")
    early, _, slices = fresh_prompts(cfg, state, 0, plan, tmp_path, traffic=0)
    assert len(early) == 512
    later, _, same = fresh_prompts(cfg, state, 0, plan, tmp_path, traffic=100)
    assert later == early and same == slices
    # a round not begun takes what its traffic leaves
    assert len(fresh_prompts(cfg, state, 0, plan, tmp_path / "not-begun", traffic=100)[0]) == 412


def test_the_pool_mixes_only_with_traffic_and_has_no_source_replies():
    from actors.config import ConfigError

    assert _pool_config().data.sources() == {"pool": 1.0}
    mixed = load_config(GPU_CONFIG, ["data.source={pool: 0.75, traffic: 0.25}"])
    assert mixed.data.sources() == {"pool": 0.75, "traffic": 0.25}
    with pytest.raises(ConfigError, match=r"data.source: .*mixes pool with other prompt sources"):
        load_config(GPU_CONFIG, ["data.source={pool: 0.5, sharegpt: 0.5}"])
    with pytest.raises(ConfigError, match=r"data.dataset_replies: 0.5 with data.source pool"):
        _pool_config(dataset_replies=0.5)


def test_pool_turns_last_gives_each_user_turn_alone_and_still_leaves_out_the_held_out():
    """`data.pool_turns: last` (the climb's prompt shape, docs/training.md): each ShareGPT prompt
    is one user turn, no context, and the held-out, users' and gate prompts stay out (a last
    turn can equal one of them where its context made it differ before)."""
    plan = plan_prompts(_pool_config(pool_turns="last").data)
    convs = [c for d in plan.train.values() for c in d]
    assert len(convs) > 30_000  # fewer than with context: repeated turns ("continue") count once
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
    held = {prompt_key(p.messages) for p in plan.heldout + plan.users + plan.gate}
    assert not {prompt_key(c) for c in convs} & held


# ---- the pool against the starting drafter, and its domains -------------------------------------


def test_the_pool_never_yields_a_prompt_the_starting_drafter_was_trained_on():
    """The climb starts from the shipped base, which regenerated and learned 36,241 pool prompts
    (its first build's 11,665 and the base climb's three rounds'; benchmarks/drafter_prompt_keys.py
    rebuilds them from the configs); none may come back. Seen failing without the dedup (the
    loop's plan not reading drafter.init's key file): 10,837 of the first build's were in it."""
    from actors.prompt_keys import KEY_FILE, key_hash, read_key_file
    from benchmarks.drafter_prompt_keys import SHIPPED, base_prompts
    from pipeline.round_data import run_prompts

    cfg = load_config(REPO / "configs" / "smollm2-1gpu-climb.yaml")
    assert Path(cfg.drafter.resolved_init()) == REPO / "drafters" / "smollm2-135m-base"
    base = {prompt_key(c) for c in base_prompts()}
    assert len(base) == 36_241
    # the shipped key files list exactly what each drafter's build trained on
    for name, prompts in SHIPPED.items():
        shipped = read_key_file(REPO / "drafters" / name / KEY_FILE)
        assert shipped == {key_hash(c) for c in prompts()}, f"{name}: stale {KEY_FILE}"
    plan = run_prompts(cfg)  # the loop's own plan: it reads drafter.init's key file
    pool = {prompt_key(c) for d in plan.train.values() for c in d}
    assert len(pool) > 15_000  # 15,760 chat prompts
    assert not pool & base
    # and the pool still holds every other prompt: only those were left out
    assert pool | base >= {prompt_key(c) for d in plan_prompts(cfg.data).train.values() for c in d}


def test_each_round_draws_the_pools_domains_by_weight_until_one_runs_out(tmp_path):
    from actors.prompts import fresh_quotas, round_slices
    from pipeline.console import data_line
    from pipeline.round_data import keep_slice

    w = dict.fromkeys(("chat", "coding", "math"), 1 / 3)
    assert fresh_quotas(w, 9000, {"chat": 9000, "coding": 9000, "math": 9000}) == {
        "chat": 3000, "coding": 3000, "math": 3000}  # fmt: skip
    # math has 1,000 left: its share goes to the others, by their weights
    assert fresh_quotas(w, 9000, {"chat": 9000, "coding": 9000, "math": 1000}) == {
        "chat": 4000, "coding": 4000, "math": 1000}  # fmt: skip
    # nothing fresh left anywhere but in chat, then nowhere: reused by weight
    assert fresh_quotas(w, 900, {"chat": 600, "coding": 0, "math": 0}) == {
        "chat": 700, "coding": 100, "math": 100}  # fmt: skip
    assert fresh_quotas({"chat": 1.0, "coding": 0.0}, 10, {"chat": 3, "coding": 9}) == {
        "chat": 10, "coding": 0}  # fmt: skip

    plan = plan_prompts(_pool_config().data)
    sizes = {d: len(c) for d, c in plan.train.items()}
    assert sizes["coding"] > 5_000 and sizes["math"] > 800 and sizes["chat"] > 40_000
    prompts, slices = round_slices(plan, 8192, [])
    counts = {d: b - a for d, (a, b) in slices.items()}
    # a climb round: math gives all it has, chat and coding split the rest evenly
    assert counts["math"] == min(sizes["math"], 8192 // 3)
    assert abs(counts["chat"] - counts["coding"]) <= 1 and sum(counts.values()) == 8192
    keep_slice(tmp_path / "slice.json", 0, slices)
    assert json.loads((tmp_path / "slice.json").read_text())["counts"] == counts
    rec = {"num_samples": 8192, "num_tokens": 1, "fresh_prompts": 8192, "drawn": counts}
    assert f"chat {counts['chat']}, coding {counts['coding']}, math" in data_line(rec)


def test_an_exported_drafter_lists_its_starts_prompts_and_its_rounds(tmp_path):
    from actors.prompt_keys import KEY_FILE, key_hash, read_key_file, write_key_file
    from pipeline.loop import _write_prompt_keys

    init, data, out = tmp_path / "init", tmp_path / "data", tmp_path / "out"
    for d in (init, data, out):
        d.mkdir()
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    write_key_file(init / KEY_FILE, [key_hash(a)])
    write_key_file(data / KEY_FILE, [key_hash(b)])
    assert _write_prompt_keys(out, str(init), [data], {}) == 2
    assert read_key_file(out / KEY_FILE) == {key_hash(a), key_hash(b)}
    # a round that exports its start unchanged learned nothing from its data
    assert _write_prompt_keys(out, str(init), [data], {"kept_start": True}) == 1
    # from scratch: the round's prompts only; the bytes depend on the keys alone
    _write_prompt_keys(out, "scratch", [data], {})
    assert (out / KEY_FILE).read_bytes() == (data / KEY_FILE).read_bytes()


def test_a_resumed_run_keeps_the_pool_it_began_with_when_its_start_is_reshipped(tmp_path):
    """The pool a run draws from leaves out what its starting drafter was trained on as its key
    file was when the run began (pinned in the run dir): each round's slice is recorded as
    offsets into that pool, and a climb's champion shipped in its start's place meanwhile lists
    the climb's own prompts too. A new run from the re-shipped drafter leaves those out."""
    from actors.prompt_keys import KEY_FILE, key_hash, write_key_file
    from pipeline.layout import RunDir
    from pipeline.round_data import run_prompts

    start = tmp_path / "drafter"
    start.mkdir()
    write_key_file(start / KEY_FILE, [key_hash([{"role": "user", "content": "hello"}])])
    cfg = load_config(GPU_CONFIG, ["data.source=pool", f"drafter.init={start}"])
    run = tmp_path / "run"
    began = run_prompts(cfg, run)
    assert RunDir(run).start_keys.is_file()
    learned = [key_hash(c) for c in began.train["chat"][:100]]  # the climb's first slice
    write_key_file(start / KEY_FILE, learned)  # its champion, shipped as the start
    assert run_prompts(cfg, run).train == began.train  # the recorded offsets: the same prompts
    fresh = run_prompts(cfg, tmp_path / "new-run")
    assert not {key_hash(c) for d in fresh.train.values() for c in d} & set(learned)
