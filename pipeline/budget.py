"""The wall-time budget as a plan: each round's stages get seconds, sized from what this machine
measured, so the whole run ends inside `stop.max_wall_minutes`.

Stages turn seconds into work themselves, at a clean boundary: the data stage stops handing out
prompt batches when the next one would end past its deadline (actors/generate.py), training fixes
its step count from its first steps' speed (pipeline/train_worker.py). So a machine twice as slow
makes half the data and half the steps, and still ends on time. The plan and, after the round,
what each stage took are recorded side by side (summary.json, MLflow `plan/...`).

Shares: round 0 weighs twice a later round (it trains from scratch; later rounds fine-tune on
what is new). Within a round the benchmark and the simulated users take what they took last round (a first round
reserves FIRST_BENCH_S_PER_REQUEST and FIRST_TRAFFIC_S_PER_REQUEST per request, measured on the embedded
default's 2-core machine); what is left of the round goes to data and training in the ratio of
`DATA_SHARE`: generation is the expensive part of a round, and a drafter learns more from new
samples than from another epoch over the same ones.
"""

from __future__ import annotations

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
class RoundPlan:
    round: int
    budget_s: float  # what this round may spend
    data_s: float
    train_s: float
    bench_s: float
    traffic_s: float

    def record(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}


def plan_round(
    r: int,
    rounds: int,
    remaining_s: float,
    last: dict[str, dict] | None,
    bench_requests: int,
    traffic_requests: int,
) -> RoundPlan:
    """Seconds for round `r` of `rounds` with `remaining_s` left. `last` is the previous round's
    stage records (their `wall_s`), None in the first round; `bench_requests` counts the
    drafter's and the baseline's benchmark requests. Round r gets its weight's share of
    what is left over the rounds still to run (the first round, which trains from scratch,
    weighs FIRST_ROUND_WEIGHT, later ones 1); its benchmark and simulated users are reserved
    first (the last round runs no simulated users: nothing would learn from them)."""
    rounds_left = max(1, rounds - r)
    weights = [FIRST_ROUND_WEIGHT if i == 0 else 1.0 for i in range(r, r + rounds_left)]
    budget = remaining_s * weights[0] / sum(weights)
    if last:
        bench = float(last.get("bench", {}).get("wall_s", 0.0)) + float(
            last.get("gate", {}).get("wall_s", 0.0)
        )
        traffic = float(last.get("traffic", {}).get("wall_s", 0.0))
    else:
        bench = FIRST_BENCH_S_PER_REQUEST * bench_requests
        traffic = FIRST_TRAFFIC_S_PER_REQUEST * traffic_requests
    if rounds_left == 1:
        traffic = 0.0
    work = budget - bench - traffic
    if work < 2 * MIN_STAGE_S:
        raise BudgetError(
            f"stop.max_wall_minutes: round {r} has {budget:.0f} s, of which the benchmark "
            f"({bench:.0f} s) and simulated users ({traffic:.0f} s) leave {work:.0f} s for data "
            f"and training (needs {2 * MIN_STAGE_S:.0f}); raise the budget, lower "
            "stop.max_rounds, bench.num_prompts or serve.simulate_users"
        )
    return RoundPlan(r, budget, DATA_SHARE * work, (1 - DATA_SHARE) * work, bench, traffic)


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
