"""The wall-time budget plan (pipeline/budget.py): rounds sized so the run fits."""

from __future__ import annotations

import pytest

from pipeline.budget import (
    FIRST_BENCH_S_PER_REQUEST,
    FIRST_TRAFFIC_S_PER_REQUEST,
    MIN_STAGE_S,
    BudgetError,
    Rates,
    plan_round,
    plan_vs_actual,
)


def test_round_zero_reserves_every_rounds_benchmark_and_its_users_and_splits_the_rest():
    p = plan_round(0, 2, 900.0, Rates(), bench_requests=[32, 26], traffic_requests=24)
    bench0, bench1 = FIRST_BENCH_S_PER_REQUEST * 32, FIRST_BENCH_S_PER_REQUEST * 26
    users = FIRST_TRAFFIC_S_PER_REQUEST * 24
    work = 900.0 - bench0 - bench1 - users  # data + training of both rounds
    assert (p.bench_s, p.traffic_s) == (bench0, users)
    assert p.data_s + p.train_s == pytest.approx(work * 2 / 3)  # round 0 weighs two
    assert p.data_s + p.train_s + p.bench_s + p.traffic_s == pytest.approx(p.budget_s)
    assert p.data_s > p.train_s > 0


def test_later_rounds_use_the_seconds_per_request_the_last_round_took():
    done = {"bench": {"wall_s": 100.0}, "gate": {"wall_s": 4.0}, "traffic": {"wall_s": 48.0}}
    rates = Rates().measured(done, bench_requests=26, traffic_requests=24)
    assert rates == Rates(4.0, 2.0)
    last = plan_round(1, 2, 400.0, rates, [26], traffic_requests=24)  # the last runs no users
    assert (last.budget_s, last.bench_s, last.traffic_s) == (400.0, 104.0, 0.0)
    mid = plan_round(1, 3, 500.0, rates, [26, 26], traffic_requests=24)
    assert mid.traffic_s == 48.0
    assert mid.data_s + mid.train_s == pytest.approx((500.0 - 2 * 104.0 - 48.0) / 2)
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
    p0 = plan_round(0, 2, 780.0, Rates(), reqs, 24)
    done = {"bench": {"wall_s": p0.bench_s}, "traffic": {"wall_s": p0.traffic_s}}
    rates = Rates().measured(done, reqs[0], 24)
    left = 780.0 - p0.budget_s
    p1 = plan_round(1, 2, left, rates, reqs[1:], 24)
    assert p1.data_s + p1.train_s >= 2 * MIN_STAGE_S
    with pytest.raises(BudgetError, match="stop.max_wall_minutes"):
        plan_round(1, 2, left - p1.data_s - p1.train_s, rates, reqs[1:], 24)


def test_a_budget_that_cannot_hold_a_round_names_the_setting():
    with pytest.raises(BudgetError, match="stop.max_wall_minutes"):
        plan_round(0, 2, 500.0, Rates(), bench_requests=[48, 48], traffic_requests=48)


def test_plan_against_actual_per_stage():
    plan = {"data_s": 200.0, "train_s": 150.0, "bench_s": 100.0, "traffic_s": 50.0}
    done = {"generate": {"wall_s": 210.0}, "train": {"wall_s": 140.0}, "bench": {"wall_s": 90.0},
            "gate": {"wall_s": 4.0}}  # fmt: skip
    got = plan_vs_actual(plan, done)
    assert got == {"plan/data_s": 200.0, "actual/data_s": 210.0, "plan/train_s": 150.0,
                   "actual/train_s": 140.0, "plan/bench_s": 100.0, "actual/bench_s": 94.0}  # fmt: skip
