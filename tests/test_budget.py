"""The wall-time budget plan (pipeline/budget.py): rounds sized so the run fits."""

from __future__ import annotations

import pytest

from pipeline.budget import (
    MIN_STAGE_S,
    USER_TOKEN_SHARE,
    BudgetError,
    Measured,
    Rates,
    plan_disk,
    plan_round,
    plan_vs_actual,
)

# no Ray, unmarked: `make test` runs it in the shared-Ray pytest, the shorter of the two (2026-12-05: 390 s against 844 s)

BENCH_S, USER_S = 7.0, 5.0  # seconds per request: a 2-core machine's figures
TWO_CORES = Rates(BENCH_S, USER_S)


def test_round_zero_reserves_every_rounds_benchmark_and_its_users_and_splits_the_rest():
    p = plan_round(0, 2, 900.0, TWO_CORES, bench_requests=[32, 26], traffic_requests=24)
    bench0, bench1 = BENCH_S * 32, BENCH_S * 26
    users = USER_S * 24
    work = 900.0 - bench0 - bench1 - users  # data + training of both rounds
    assert (p.bench_s, p.traffic_s) == (bench0, users)
    assert p.data_s + p.train_s == pytest.approx(work * 2 / 3)  # round 0 weighs two
    assert p.data_s + p.train_s + p.bench_s + p.traffic_s == pytest.approx(p.budget_s)
    assert p.data_s > p.train_s > 0


def test_later_rounds_use_the_seconds_per_request_the_last_round_took():
    done = {"bench": {"wall_s": 100.0}, "gate": {"wall_s": 4.0}, "traffic": {"wall_s": 48.0}}
    rates = TWO_CORES.measured(done, bench_requests=26, traffic_requests=24)
    assert rates == Rates(4.0, 2.0)
    last = plan_round(1, 2, 400.0, rates, [26], traffic_requests=24)  # the last runs no users
    assert (last.budget_s, last.bench_s, last.traffic_s) == (400.0, 104.0, 0.0)
    mid = plan_round(1, 3, 500.0, rates, [26, 26], traffic_requests=24)
    assert mid.traffic_s == 48.0
    assert mid.data_s + mid.train_s == pytest.approx((500.0 - 2 * 104.0 - 48.0) / 2)
    # the server's start is not a benchmark's cost where the next round swaps the drafter
    started = {**done, "bench": {"wall_s": 120.0, "serve_start_s": 20.0}}
    assert TWO_CORES.measured(started, bench_requests=26, traffic_requests=24) == rates
    # ...and is, where the round stopped its server (a GPU server the next stages need)
    stopped = {**done, "bench": {"wall_s": 120.0, "serve_start_s": 20.0, "server_stopped": True}}
    assert TWO_CORES.measured(stopped, 26, 24) == Rates((120.0 + 4.0) / 26, 2.0)
    # a stage the round did not run keeps the rate it was planned with
    assert Rates(9.0, 3.0).measured({"bench": {"wall_s": 52.0}}, 26, 24) == Rates(2.0, 3.0)


def test_a_slower_machine_gets_less_data_and_training_time_and_still_fits():
    fast, slow = Rates(2.5, 2.0), Rates(5.0, 4.0)
    a = plan_round(1, 3, 600.0, fast, [24, 24], 24)
    b = plan_round(1, 3, 600.0, slow, [24, 24], 24)
    assert b.data_s < a.data_s and b.train_s < a.train_s
    for p in (a, b):
        assert p.data_s + p.train_s + p.bench_s + p.traffic_s == pytest.approx(p.budget_s)


def test_round_zero_leaves_round_one_its_benchmark():
    """The demo on 2026-12-01: round 0 was planned with 2/3 of 780 s and took its plan (data 86,
    training 81, benchmark 221, users 121 s), which left round 1 271 s against a 221 s benchmark:
    refused mid-run. Planned with every round's benchmark reserved, a round 0 that takes its plan
    leaves round 1 a plannable round, and one with less left is refused."""
    reqs = [32, 26]
    p0 = plan_round(0, 2, 780.0, TWO_CORES, reqs, 24)
    done = {"bench": {"wall_s": p0.bench_s}, "traffic": {"wall_s": p0.traffic_s}}
    rates = TWO_CORES.measured(done, reqs[0], 24)
    left = 780.0 - p0.budget_s
    p1 = plan_round(1, 2, left, rates, reqs[1:], 24)
    assert p1.data_s + p1.train_s >= 2 * MIN_STAGE_S
    with pytest.raises(BudgetError, match="stop.max_wall_minutes"):
        plan_round(1, 2, left - p1.data_s - p1.train_s, rates, reqs[1:], 24)


def test_a_budget_that_cannot_hold_a_round_names_the_setting():
    with pytest.raises(BudgetError, match="stop.max_wall_minutes"):
        plan_round(0, 2, 500.0, TWO_CORES, bench_requests=[48, 48], traffic_requests=48)


def test_plan_against_actual_per_stage():
    plan = {"data_s": 200.0, "train_s": 150.0, "bench_s": 100.0, "traffic_s": 50.0}
    done = {"generate": {"wall_s": 210.0}, "train": {"wall_s": 140.0}, "bench": {"wall_s": 90.0},
            "gate": {"wall_s": 4.0}}  # fmt: skip
    got = plan_vs_actual(plan, done)
    assert got == {"plan/data_s": 200.0, "actual/data_s": 210.0, "plan/train_s": 150.0,
                   "actual/train_s": 140.0, "plan/bench_s": 100.0, "actual/bench_s": 94.0}  # fmt: skip
    done["gate_set"] = {"wall_s": 30.0}  # made once, inside its round's data share
    assert plan_vs_actual(plan, done)["actual/data_s"] == 240.0


# ---- the planner's start-up measurement ---------------------------------------------------------

MIX = (19, 5)  # the demo's round 0 benchmark: warm-up + 18 drafter requests, warm-up + 4 baseline


def _measured(s_per_token: float) -> Measured:
    """A machine whose plain decode step takes `s_per_token` and whose drafter serves 1.25x it."""
    return Measured(s_per_token, 0.8 * s_per_token, 32, "base", 5.0)


def _demo_round_zero(m: Measured, budget_s: float = 720.0, trains: bool = False):
    rates = Rates.from_measurement(m, MIX, bench_tokens=96, user_tokens=128)
    return plan_round(0, 2, budget_s, rates, [24, 19], 16, first_round_trains=trains)


def test_first_rates_are_the_measured_costs_per_token_of_the_benchmarks_mix():
    m = Measured(0.1, 0.05, 32, "base", 5.0)
    r = Rates.from_measurement(m, (3, 1), bench_tokens=96, user_tokens=128)
    assert r.bench_s == pytest.approx((3 * 0.05 + 1 * 0.1) / 4 * 96)
    assert r.traffic_s == pytest.approx(0.05 * 128 * USER_TOKEN_SHARE)


def test_a_slower_measurement_plans_less_data_and_training_and_still_fits():
    """Half the speed (one core instead of two): the benchmarks and users take twice as long,
    so round 1 gets less time for data and training, and every plan still adds up."""
    fast, slow = _demo_round_zero(_measured(0.065)), _demo_round_zero(_measured(0.13))
    assert (slow.bench_s, slow.traffic_s) == pytest.approx((2 * fast.bench_s, 2 * fast.traffic_s))
    assert fast.data_s == slow.data_s == 0.0  # round 0 serves its base drafter: no data, no steps

    def round_one(p, m):  # round 0 took its plan
        rates = Rates.from_measurement(m, MIX, 96, 128)
        return plan_round(1, 2, 720.0 - p.budget_s, rates, [19], 16, first_round_trains=False)

    f1, s1 = round_one(fast, _measured(0.065)), round_one(slow, _measured(0.13))
    assert s1.data_s < f1.data_s and s1.train_s < f1.train_s
    assert s1.data_s + s1.train_s >= 2 * MIN_STAGE_S


def test_a_round_zero_that_serves_its_base_drafter_leaves_every_second_to_round_one():
    p = _demo_round_zero(_measured(0.065))
    assert p.data_s == p.train_s == 0.0 and p.budget_s == pytest.approx(p.bench_s + p.traffic_s)
    trained = _demo_round_zero(_measured(0.065), trains=True)
    assert trained.data_s > 0 and trained.bench_s == p.bench_s


def test_a_too_slow_measurement_is_refused_with_the_settings_and_figures():
    with pytest.raises(BudgetError) as e:
        _demo_round_zero(_measured(0.3))
    msg = str(e.value)
    for field in ("stop.max_wall_minutes", "bench.num_prompts", "serve.simulate_users"):
        assert field in msg
    assert "720 s left for 2 round(s)" in msg and "43 requests at" in msg
    assert "16 per round at" in msg


@pytest.mark.parametrize(
    "budget, refusal",
    [({"max_wall_minutes": 0.05}, r"stop\.max_wall_minutes: \d+ s left for 2 round"),
     ({"round_minutes": 0.05}, r"stop\.round_minutes: \d+ s left for 1 round")],
    ids=["run", "round"],
)  # fmt: skip
def test_the_loop_measures_this_machine_and_refuses_before_round_0(
    tiny_target, tmp_path, budget, refusal
):
    """The real measurement (tiny target, in process, no Ray) and a budget it shows cannot hold
    the rounds (or a round, `stop.round_minutes`): the run stops before any round's MLflow run
    or stage, with the planner's message, and the measured figures are kept for the record."""
    import json

    from pipeline.budget import BudgetError
    from pipeline.config import parse_config
    from pipeline.loop import run_loop

    cfg = parse_config({
        "target": {"model": str(tiny_target)},
        "data": {"source": "builtin", "heldout_prompts": 4, "user_prompts": 8},
        "drafter": {"draft_vocab_size": 512},
        "serve": {"steps": 2, "simulate_users": 4},
        "bench": {"num_prompts": 4, "max_tokens": 16, "warmup": 1},
        "stop": {"accept_len": None, "max_rounds": 2, **budget},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    })  # fmt: skip
    with pytest.raises(BudgetError, match=refusal) as e:
        run_loop(cfg, tmp_path / "run")
    assert "Measured at start-up" in str(e.value) and "no round was started" in str(e.value)
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    (r0,) = state["rounds"]
    assert r0["mlflow_run_id"] is None and set(r0["done"]) == {"measure"}
    m = r0["done"]["measure"]
    assert m["plain_s_per_token"] > 0 and m["spec_s_per_token"] > 0 and m["spec_tokens"] == 16
    assert m["drafter"] == "random (untrained)" and m["wall_s"] > 0


def test_the_start_up_measurement_is_one_bounded_request_whatever_the_benchmarks_length(
    tiny_target,
):
    """What keeps the measurement short is what it decodes, not a clock: a plain decode of
    PLAIN_TOKENS and one speculative request of at most SPEC_TOKENS tokens, however long the
    benchmark's requests are (the test above: `bench.max_tokens` when fewer)."""
    from pipeline.config import parse_config
    from pipeline.measure import SPEC_TOKENS, measure_machine

    cfg = parse_config({
        "target": {"model": str(tiny_target)},
        "drafter": {"draft_vocab_size": 512},
        "serve": {"steps": 2},
        "bench": {"num_prompts": 4, "max_tokens": 4 * SPEC_TOKENS},
    })  # fmt: skip
    m = measure_machine(cfg, [{"role": "user", "content": "Name three colours."}])
    assert m.spec_tokens == SPEC_TOKENS and m.drafter == "random (untrained)"


def test_the_plan_counts_every_chain_the_shape_choice_measures():
    """serve/shape_sweep.py measures every chain of bench.shape_chains but the configured shape
    on the baseline's prompts; the planner counted two of them and planned the demo's benchmark
    short (116 s planned, 127 s taken)."""
    from pipeline.config import parse_config
    from pipeline.round_plan import bench_mix

    bench = {"warmup": 1, "num_prompts": 12, "baseline_prompts": 4, "shape_chains": [1, 2, 3, 4, 5]}
    tree = parse_config({"serve": {"steps": 5, "topk": 4, "num_draft_tokens": 12}, "bench": bench})
    assert bench_mix(tree, 0) == (1 + 12 + 5 * 4, 1 + 4)
    chain3 = parse_config({"serve": {"steps": 3, "topk": 1}, "bench": bench})
    assert bench_mix(chain3, 0)[0] == 1 + 12 + 4 * 4  # chain-3 is the configured shape's figure


def test_a_round_that_cannot_fit_the_disk_is_refused_with_the_figures_and_the_fix():
    """Issue 49's round 1 as the plan sees it: 8,192 samples of 912 tokens (round 0 measured)
    at SmolLM2's 4,613 B a token need 37.9 GB; 34 GB free refuses it before it generates, where
    the data stage failed 63 s in. Ids only (online states, 5 B a token) it fits; and a window
    of 3 such rounds is refused even when one fits now."""
    free = 34_050_957_312
    with pytest.raises(BudgetError) as e:
        plan_disk(1, 8192, 912, True, 4613, 1, 0, 0, free, online=False)
    msg = str(e.value)
    assert "round 1's data needs about 35.31 GiB" in msg and "8192 samples x 912 tokens" in msg
    assert "31.71 GiB free" in msg and "round 1 was not started" in msg
    assert "data.states: online" in msg and "train.data_rounds" in msg
    ok = plan_disk(1, 8192, 912, True, 5, 1, 0, 0, free, online=True)
    assert ok.round_bytes == int(8192 * 912 * 5 * 1.1)
    plan_disk(1, 8192, 912, True, 4613, 1, 0, 0, 2 * free, online=False)  # fits alone
    with pytest.raises(BudgetError, match="3 round\\(s\\) of it in the train.data_rounds window"):
        plan_disk(1, 8192, 912, True, 4613, 3, 0, 0, 2 * free, online=False)


def test_the_loop_refuses_a_round_the_disk_cannot_hold_before_it_generates(tiny_target, tmp_path):
    """The loop plans round 0's disk from its prompts' characters before the data stage starts
    (no Ray here: generating would need it): refused with the figures, nothing generated."""
    import json

    from pipeline.config import parse_config
    from pipeline.loop import run_loop

    cfg = parse_config({
        "target": {"model": str(tiny_target)},
        "data": {"source": "builtin", "heldout_prompts": 4, "max_new_tokens": 10**9,
                 "max_length": 10**9},  # a billion tokens a sample: no disk holds 400 of them
        "drafter": {"draft_vocab_size": 512},
        "stop": {"accept_len": None, "max_rounds": 1},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    })  # fmt: skip
    with pytest.raises(BudgetError, match=r"disk: round 0's data needs about [\d.]+ GiB"):
        run_loop(cfg, tmp_path / "run")
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert set(state["rounds"][0]["done"]) == set()
    assert not (tmp_path / "run" / "data" / "round-000").exists()


# ---- the measuring work sized to the machine (pipeline/round_plan.py size_work) ----------------


def _demo_state(s_per_token: float):
    """The demo's config and a run state holding a start-up measurement of `s_per_token` a
    plain decode step (the drafter serving 1.25x it)."""
    from pipeline.config import load_config
    from pipeline.state import RunState

    cfg = load_config("configs/smollm2-cpu.yaml")
    state = RunState(config_digest=cfg.digest())
    state.round(0).done["measure"] = _measured(s_per_token).record()
    return cfg, state


def test_a_slow_measurement_sizes_the_measuring_work_down_instead_of_refusing():
    """On a CPU without bf16 (SmolLM2 at about 4 tok/s) the demo's benchmarks and users alone
    took more than its budget, and it refused to start. Sized down, the same measurement plans
    both rounds, and a fast machine keeps the work as configured."""
    from pipeline.round_plan import round_plan, size_work, sized

    cfg, slow = _demo_state(0.25)
    budget = cfg.stop.max_wall_minutes * 60 - 20.0
    with pytest.raises(BudgetError):  # as configured, it does not fit
        round_plan(cfg, slow, 0, budget)
    z = size_work(cfg, slow, 20.0)  # 20 s into the run
    assert z.scale < 1.0 and z.work_share > 0
    small = sized(cfg, z.scale)
    assert (small.bench.max_tokens, small.serve.simulate_users) == (
        z.bench_tokens,
        z.simulate_users,
    )
    assert small.bench.max_tokens < cfg.bench.max_tokens
    assert small.bench.num_prompts == cfg.bench.num_prompts  # every prompt still judged
    assert 2 in small.bench.shape_chains and len(small.bench.shape_chains) < 5
    p0 = round_plan(small, slow, 0, budget)  # both rounds plan
    assert p0.bench_s + p0.traffic_s < budget
    cfg, fast = _demo_state(0.06)  # bf16 on 2 cores: 16 tok/s
    z = size_work(cfg, fast, 20.0)
    assert z.scale == 1.0 and z.bench_tokens == cfg.bench.max_tokens and z.simulate_users == 12


@pytest.mark.parametrize("field", ["max_wall_minutes", "round_minutes"])
def test_a_machine_too_slow_for_the_smallest_work_is_refused_with_the_minutes_that_fit(field):
    from pipeline.round_plan import size_work

    cfg, crawl = _demo_state(2.0)
    if field == "round_minutes":
        cfg = _with_stop(cfg, max_wall_minutes=None, round_minutes=5.0)
    with pytest.raises(BudgetError) as e:
        size_work(cfg, crawl, 20.0)
    msg = str(e.value)
    assert f"stop.{field}: " in msg and "even at the smallest measuring work" in msg
    minutes = int(msg.rsplit(f"stop.{field}=", 1)[1])
    z = size_work(_with_stop(cfg, **{field: float(minutes)}), crawl, 20.0)
    assert z.work_share >= 0.4  # the minutes it names fit, with room to train


def _with_stop(cfg, **stop):
    return cfg.model_copy(update={"stop": cfg.stop.model_copy(update=stop)})


def test_round_minutes_plans_each_round_in_its_own_minutes_however_long_the_run_has_gone():
    """`stop.round_minutes`: round r's plan spends the round's own seconds (its benchmark, its
    users unless it is the last, data and training share the rest), not a share of what the
    run has left, so a resumed run's round fits its minutes whatever ran before. With
    `stop.max_wall_minutes` too, the round gets the smaller plan; a round the minutes cannot
    hold is refused naming stop.round_minutes."""
    from pipeline.round_plan import budgeted_plan

    cfg, state = _demo_state(0.06)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"first_round": "train"})})
    per_round = _with_stop(cfg, max_wall_minutes=None, round_minutes=5.0)
    assert per_round.stop.planned and not _with_stop(cfg, max_wall_minutes=None).stop.planned
    for elapsed in (20.0, 5000.0):  # early, or long after the run's first budget
        p = budgeted_plan(per_round, state, 0, elapsed)
        assert p.budget_s == pytest.approx(300.0)
        assert p.traffic_s > 0 and p.data_s > p.train_s > 0  # round 0 of 2 runs its users
    both = _with_stop(cfg, round_minutes=5.0)  # and the demo's 14 minutes for the run
    assert budgeted_plan(both, state, 0, 20.0).budget_s == pytest.approx(300.0)
    wide = budgeted_plan(_with_stop(cfg, round_minutes=10.0), state, 0, 20.0)
    assert wide.budget_s < 600.0  # the run's 820 s left hold both rounds: less for this one
    with pytest.raises(BudgetError, match="stop.round_minutes: 30 s left"):
        budgeted_plan(_with_stop(per_round, round_minutes=0.5), state, 0, 20.0)


def test_round_minutes_is_refused_without_the_embedded_engine():
    from pipeline.config import Config, load_config

    raw = load_config("configs/smollm2-cpu.yaml").model_dump(mode="json")
    raw["stop"].update(max_wall_minutes=None, round_minutes=5.0)
    raw["serve"]["engine"] = "vllm"
    with pytest.raises(ValueError, match="stop.round_minutes: the budget plan is sized"):
        Config.model_validate(raw)


# ---- the training time box (pipeline/time_box.py) -------------------------------------------


def test_a_compiling_first_step_does_not_price_the_time_box():
    """The box prices a step at its warm time: on an H100 the first step of the fast path took
    46.5 s (compiling) and the next ones 0.07 s; priced at the probe's mean (5.9 s) the
    off-policy climb's round 0 was cut to 22 of its 1,740 steps. The cold step's seconds are
    still spent: they come out of the box."""
    from pipeline.config import TrainConfig
    from pipeline.time_box import PROBE_STEPS, box_total, warm_s

    step_s = [46.5] + [0.07] * (PROBE_STEPS - 1)
    tc = TrainConfig(max_seconds=300.0, eval_every=100)
    total = box_total(1740, PROBE_STEPS, warm_s(step_s), sum(step_s), 1.0, tc)
    assert total == 1740  # (300 - 47 - 2) s at 0.07 s a step and 0.01 s of evaluation: all fit
    tc = TrainConfig(max_seconds=60.0, eval_every=100)
    left = 60.0 - sum(step_s) - 2 * 1.0
    assert box_total(1740, PROBE_STEPS, warm_s(step_s), sum(step_s), 1.0, tc) == PROBE_STEPS + int(
        left / (0.07 + 1.0 / 100)
    )


def test_the_time_box_prices_the_checkpoints_it_will_make():
    """A checkpoint every 4 steps at 2 s each (Ray Train's report waits for its controller's
    poll) costs half a second a step when a step takes 0.03 s: priced, an 8 s box holds about
    ten steps after its probe, where unpriced it ran 192 (about 100 s)."""
    from pipeline.config import TrainConfig
    from pipeline.time_box import PROBE_STEPS, box_total

    tc = TrainConfig(max_seconds=8.0, checkpoint_every=4)
    unpriced = box_total(4000, PROBE_STEPS, 0.03, 2.0, 0.0, tc)
    priced = box_total(4000, PROBE_STEPS, 0.03, 2.0, 0.0, tc, ckpt_s=2.0)
    assert unpriced == PROBE_STEPS + int(6.0 / 0.03)
    assert priced == PROBE_STEPS + int((8.0 - 2.0 - 2.0) / (0.03 + 2.0 / 4)) == PROBE_STEPS + 7


def test_the_training_box_leaves_out_what_the_last_round_spent_around_its_steps(tmp_path):
    """The box holds the steps only: a round's training stage also starts Ray Train, loads,
    evaluates step 0 and exports, 80 s around 35 s of steps on one H100. Round 1's box leaves
    out what round 0 measured around its steps (phases.json); round 0 has TRAIN_START_S, or on
    GPUs TRAIN_START_GPU_S (round 0 of an H100 climb ran 25 s past a plan that priced 2 cores'
    start)."""
    import json

    from pipeline.budget import TRAIN_START_GPU_S, TRAIN_START_S
    from pipeline.layout import RunDir
    from pipeline.round_plan import stage_seconds, train_overhead_s
    from pipeline.state import Clock, RunState
    from pipeline.time_box import PHASES

    state = RunState(config_digest="d")
    assert train_overhead_s(state, 0, tmp_path) == TRAIN_START_S
    assert train_overhead_s(state, 0, tmp_path, gpu=True) == TRAIN_START_GPU_S > TRAIN_START_S
    state.round(0).done["train"] = {"wall_s": 113.0}
    out = RunDir(tmp_path).train(0)
    out.mkdir(parents=True)
    (out / PHASES).write_text(json.dumps({"entered": 0.0, "load": 9.0, "steps": 34.0}))
    assert train_overhead_s(state, 1, tmp_path) == pytest.approx(79.0)
    assert train_overhead_s(state, 1, tmp_path, gpu=True) == pytest.approx(79.0)  # as measured
    rs = state.round(1)
    rs.done["plan"] = {"start_s": 0.0, "data_s": 100.0, "train_s": 200.0}
    clock = Clock(state)  # elapsed ~0: the data stage spent nothing yet
    box = stage_seconds(rs, "train", clock, train_overhead_s(state, 1, tmp_path))
    assert box == pytest.approx(300.0 - 79.0, abs=0.5)


def test_round_zero_prices_a_gpu_servers_start_in_its_benchmark():
    """A GPU server starts in round 0's benchmark, loading the target and capturing its graphs
    as the start-up measurement did: round 0's benchmark is planned with the measurement's wall
    time on top (an H100 climb's round 0 ran 90 s against 52 planned, 61 s of it the start), and
    data and training get that much less; a CPU server's start stays unpriced, and the rounds
    after keep their server up."""
    from pipeline.round_plan import bench_requests, budgeted_plan, rates

    cfg, state = _demo_state(0.06)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"first_round": "train"})})
    cfg = _with_stop(cfg, max_wall_minutes=None, round_minutes=5.0)
    gpu = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"num_gpus": 0.25})})
    wall = state.round(0).done["measure"]["wall_s"]
    assert rates(cfg, state, 0).start_s == 0.0 and rates(gpu, state, 0).start_s == wall
    for c, start in ((cfg, 0.0), (gpu, wall)):
        p = budgeted_plan(c, state, 0, 20.0)
        assert p.bench_s == pytest.approx(rates(c, state, 0).bench_s * bench_requests(c, 0) + start)
        assert p.budget_s == pytest.approx(300.0)
    p = plan_round(0, 2, 900.0, Rates(BENCH_S, USER_S, 60.0), [32, 26], traffic_requests=24)
    assert p.bench_s == BENCH_S * 32 + 60.0  # the first benchmark only
