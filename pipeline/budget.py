"""The wall-time budget as a plan: each round's stages get seconds, sized from what this machine
measured, so the whole run ends inside `stop.max_wall_minutes`.

Stages turn seconds into work themselves, at a clean boundary: the data stage stops handing out
prompt batches when the next one would end past its deadline (actors/generate.py), training fixes
its step count from its first steps' speed (pipeline/train_worker.py). So a machine twice as slow
makes half the data and half the steps, and still ends on time. The plan and, after the round,
what each stage took are recorded side by side (summary.json, MLflow `plan/...`).

Shares: the benchmark and the simulated users of every round still to run are reserved first,
at the seconds per request the last round measured (a first round uses FIRST_BENCH_S_PER_REQUEST
and FIRST_TRAFFIC_S_PER_REQUEST, measured on the embedded default's 2-core machine). What is left
is data and training time, shared by weight: round 0 weighs twice a later round (it trains from
scratch; later rounds fine-tune on what is new). A round's share goes to data and training in
the ratio of `DATA_SHARE`: generation is the expensive part of a round, and a drafter learns more
from new samples than from another epoch over the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DATA_SHARE = 0.55  # of a round's data + training seconds
FIRST_ROUND_WEIGHT = 2.0  # round 0 trains from scratch: twice a later round's share
FIRST_BENCH_S_PER_REQUEST = 7.0  # one benchmark request of 96 tokens (drafter or baseline), 2 cores
FIRST_TRAFFIC_S_PER_REQUEST = 5.0  # a simulated user's request, 128 tokens, 2 cores (measured 4.9)
TRAIN_START_S = 25.0  # Ray Train's worker start-up and the export around the time box (2 cores)
MIN_STAGE_S = 30.0  # below this a stage's start-up dominates: refuse the plan instead


class BudgetError(ValueError):
    """The budget left cannot hold a round; the message says how much it needs."""


@dataclass(frozen=True)
class Rates:
    """Seconds per benchmark request and per simulated user's request: what the last round
    measured, else the first-round figures of the embedded default's machine."""

    bench_s: float = FIRST_BENCH_S_PER_REQUEST
    traffic_s: float = FIRST_TRAFFIC_S_PER_REQUEST

    def measured(self, done: dict[str, dict], bench_requests: int, traffic_requests: int) -> Rates:
        """These rates updated by a round's stage records (`wall_s`); a stage it did not run
        (yet) keeps its rate."""
        bench = sum(float(done.get(k, {}).get("wall_s", 0.0)) for k in ("bench", "gate"))
        traffic = float(done.get("traffic", {}).get("wall_s", 0.0))
        return Rates(
            bench / bench_requests if bench and bench_requests else self.bench_s,
            traffic / traffic_requests if traffic and traffic_requests else self.traffic_s,
        )


@dataclass(frozen=True)
class RoundPlan:
    round: int
    budget_s: float  # what this round may spend
    data_s: float
    train_s: float
    bench_s: float
    traffic_s: float
    bench_s_per_request: float
    traffic_s_per_request: float

    def record(self) -> dict[str, Any]:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}


def plan_round(
    r: int,
    rounds: int,
    remaining_s: float,
    rates: Rates,
    bench_requests: Sequence[int],
    traffic_requests: int,
) -> RoundPlan:
    """Seconds for round `r` of `rounds` with `remaining_s` left. `bench_requests[i]` counts
    the benchmark requests (drafter and baseline) of round r+i, for every round still to run.

    Every round still to run first gets its benchmark and, unless it is the last, its simulated
    users, at `rates`; what is left is the data and training time of those rounds, shared by
    weight (the first round, which trains from scratch, weighs FIRST_ROUND_WEIGHT, later ones
    1). So round 0 leaves room for round 1's benchmark, and the stop rule, which asks this same
    function about the next round (pipeline/loop.py), agrees with it."""
    n = max(1, rounds - r)
    if len(bench_requests) < n:
        raise ValueError(f"plan_round: {n} rounds to run, {len(bench_requests)} request counts")
    bench = [rates.bench_s * bench_requests[i] for i in range(n)]
    users = [rates.traffic_s * traffic_requests if r + i < rounds - 1 else 0.0 for i in range(n)]
    weights = [FIRST_ROUND_WEIGHT if r + i == 0 else 1.0 for i in range(n)]
    work = (remaining_s - sum(bench) - sum(users)) * weights[0] / sum(weights)
    if work < 2 * MIN_STAGE_S:
        raise BudgetError(
            f"stop.max_wall_minutes: {remaining_s:.0f} s left for {n} round(s), of which the "
            f"benchmarks ({sum(bench):.0f} s) and simulated users ({sum(users):.0f} s) leave round "
            f"{r} {work:.0f} s for data and training (needs {2 * MIN_STAGE_S:.0f}); raise the "
            "budget, lower stop.max_rounds, bench.num_prompts or serve.simulate_users"
        )
    return RoundPlan(
        r, bench[0] + users[0] + work, DATA_SHARE * work, (1 - DATA_SHARE) * work, bench[0],
        users[0], rates.bench_s, rates.traffic_s,
    )  # fmt: skip


def plan_vs_actual(plan: dict[str, Any], done: dict[str, dict]) -> dict[str, float]:
    """Per stage, planned and actual seconds (`plan/<stage>_s`, `actual/<stage>_s`)."""
    stages = {"data": "generate", "train": "train", "bench": "bench", "traffic": "traffic"}
    out: dict[str, float] = {}
    for short, stage in stages.items():
        if stage in done:
            out[f"plan/{short}_s"] = float(plan.get(f"{short}_s", 0.0))
            actual = float(done[stage].get("wall_s", 0.0))
            if short == "bench":
                actual += float(done.get("gate", {}).get("wall_s", 0.0))
            out[f"actual/{short}_s"] = actual
    return out
