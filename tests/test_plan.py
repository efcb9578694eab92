"""The throughput planner's numbers (module doc of pipeline.plan has the model)."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.plan import chain_accept_len, main, plan, step_acceptance


def test_seed_numbers():
    r = plan(baseline_tps=82.5, verify_ms=30.0)
    assert r["baseline_step_ms"] == pytest.approx(12.1212, abs=1e-4)
    assert r["break_even_accept_len"] == pytest.approx(2.475)  # 30 ms / 12.12 ms
    # "verify 30 ms vs 12.2 ms decode -> 2.46": the same formula at 82 tok/s
    assert plan(baseline_tps=82.0, verify_ms=30.0)["break_even_accept_len"] == pytest.approx(2.46)

    r = plan(baseline_tps=82.5, verify_ms=30.0, target_tps=150.0)
    assert r["required_accept_len"] == pytest.approx(4.5)
    assert r["required_step_acceptance"] == pytest.approx(0.7778, abs=1e-4)
    r = plan(baseline_tps=82.5, verify_ms=30.0, target_tps=200.0)
    assert r["required_accept_len"] == pytest.approx(6.0)
    assert r["required_step_acceptance"] == pytest.approx(0.8333, abs=1e-4)


def test_k_step_acceptance_and_reachability():
    r = plan(baseline_tps=82.5, verify_ms=30.0, steps=5, target_tps=150.0)
    p = r["required_step_acceptance_k"]
    assert r["reachable"] and p > r["required_step_acceptance"]  # a bounded chain needs more
    assert chain_accept_len(p, 5) == pytest.approx(4.5, abs=1e-9)
    assert r["max_tps_with_steps"] == pytest.approx(200.0)

    r = plan(baseline_tps=82.5, verify_ms=30.0, steps=3, target_tps=200.0)
    assert r["reachable"] is False and r["required_step_acceptance_k"] is None
    assert r["min_steps"] == 5 and "unreachable with 3 steps" in r["note"]


def test_draft_cost_is_per_step():
    r = plan(
        baseline_tps=100.0, verify_ms=20.0, draft_ms=2.0, steps=4, target_tps=150.0, accept_len=3.0
    )
    assert r["cycle_ms"] == pytest.approx(28.0)
    assert r["break_even_accept_len"] == pytest.approx(2.8)
    assert r["required_accept_len"] == pytest.approx(4.2)
    assert r["predicted_tps"] == pytest.approx(3000.0 / 28.0)
    with pytest.raises(ValueError, match="--steps"):
        plan(baseline_tps=100.0, verify_ms=20.0, draft_ms=2.0)


def test_acceptance_inverse_and_edges():
    for steps in (None, 1, 3, 7):
        for p in (0.0, 0.3, 0.6, 0.9):
            assert step_acceptance(chain_accept_len(p, steps), steps) == pytest.approx(p, abs=1e-9)
    assert step_acceptance(0.8) == 0.0 and step_acceptance(5.0, 3) is None
    assert chain_accept_len(1.0) == math.inf and chain_accept_len(1.0, 3) == 4.0


def test_cli_json(capsys):
    rc = main(
        [
            "--baseline-tps",
            "82.5",
            "--verify-ms",
            "30",
            "--target-tps",
            "150",
            "--steps",
            "5",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("break_even_accept_len", "required_accept_len", "required_step_acceptance",
                "required_step_acceptance_k", "reachable"):  # fmt: skip
        assert key in out
    assert (
        main(["--baseline-tps", "82.5", "--verify-ms", "30", "--target-tps", "200", "--steps", "3"])
        == 1
    )
    assert main(["--baseline-tps", "82.5", "--verify-ms", "30", "--draft-ms", "1"]) == 2
