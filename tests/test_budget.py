"""The wall-time budget plan (pipeline/budget.py): rounds sized so the run fits."""

from __future__ import annotations

import pytest

from pipeline.budget import (
    FIRST_BENCH_S_PER_REQUEST,
    BudgetError,
    plan_round,
    plan_vs_actual,
)


def test_round_zero_reserves_benchmark_and_users_and_splits_the_rest():
    p = plan_round(0, 2, 900.0, None, bench_requests=32, traffic_requests=24)
    assert p.budget_s == 600.0  # two rounds to go, the first weighing two
    assert p.bench_s == FIRST_BENCH_S_PER_REQUEST * 32
    assert p.data_s + p.train_s + p.bench_s + p.traffic_s == pytest.approx(p.budget_s)
    assert p.data_s > p.train_s > 0


def test_later_rounds_use_what_the_last_round_took_and_the_last_one_runs_no_users():
    last = {"bench": {"wall_s": 100.0}, "gate": {"wall_s": 5.0}, "traffic": {"wall_s": 60.0}}
    p = plan_round(1, 2, 400.0, last, bench_requests=24, traffic_requests=48)
    assert (p.budget_s, p.bench_s, p.traffic_s) == (400.0, 105.0, 0.0)
    assert p.data_s + p.train_s == pytest.approx(295.0)
    mid = plan_round(1, 3, 500.0, last, bench_requests=24, traffic_requests=48)
    assert mid.budget_s == 250.0 and mid.traffic_s == 60.0


def test_a_slower_machine_gets_less_data_and_training_time_and_still_fits():
    fast = {"bench": {"wall_s": 60.0}, "traffic": {"wall_s": 40.0}}
    slow = {"bench": {"wall_s": 120.0}, "traffic": {"wall_s": 80.0}}
    a = plan_round(1, 3, 600.0, fast, 24, 48)
    b = plan_round(1, 3, 600.0, slow, 24, 48)
    assert b.data_s < a.data_s and b.train_s < a.train_s
    for p in (a, b):
        assert p.data_s + p.train_s + p.bench_s + p.traffic_s == pytest.approx(p.budget_s)


def test_a_budget_that_cannot_hold_a_round_names_the_setting():
    with pytest.raises(BudgetError, match="stop.max_wall_minutes"):
        plan_round(0, 2, 300.0, None, bench_requests=48, traffic_requests=48)


def test_plan_against_actual_per_stage():
    plan = {"data_s": 200.0, "train_s": 150.0, "bench_s": 100.0, "traffic_s": 50.0}
    done = {"generate": {"wall_s": 210.0}, "train": {"wall_s": 140.0}, "bench": {"wall_s": 90.0},
            "gate": {"wall_s": 4.0}}  # fmt: skip
    got = plan_vs_actual(plan, done)
    assert got == {"plan/data_s": 200.0, "actual/data_s": 210.0, "plan/train_s": 150.0,
                   "actual/train_s": 140.0, "plan/bench_s": 100.0, "actual/bench_s": 94.0}  # fmt: skip
