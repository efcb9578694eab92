"""The wall-time budget as a plan: each round's stages get seconds, sized from what this machine
measured, so the whole run ends inside `stop.max_wall_minutes`.

Stages turn seconds into work themselves, at a clean boundary: the data stage stops handing out
prompt batches when the next one would end past its deadline (actors/generate.py), training fixes
its step count from its first steps' speed (pipeline/train_worker.py). So a machine twice as slow
makes half the data and half the steps, and still ends on time. The plan and, after the round,
what each stage took are recorded side by side (summary.json, MLflow `plan/...`).

Shares: the benchmark and the simulated users of every round still to run are reserved first,
at seconds per request. A first round takes them from what this machine measured at start-up
(pipeline/measure.py: a plain decode of a few tokens and one benchmark request, `Measured`), a
later round from what the round before it took. What is left is data and training time, shared
by weight: round 0 weighs twice a later round when it trains (often from scratch; later rounds
fine-tune on what is new) and nothing when it serves its base drafter as is
(`train.first_round: skip`). A round's share goes to data and training in the ratio of
`DATA_SHARE`: generation is the expensive part of a round, and a drafter learns more from new
samples than from another epoch over the same ones. A plan in which a training round would get
less than 2 * MIN_STAGE_S is refused before that round starts, naming the settings to change
and the figures (for round 0: before anything runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DATA_SHARE = 0.55  # of a round's data + training seconds
FIRST_ROUND_WEIGHT = 2.0  # round 0 trains from scratch: twice a later round's share
# A simulated user's token costs this share of a benchmark request's token: the users come
# `serve.simulate_concurrency` at a time and the server batches them, with the HTTP path beside
# (`make demo` on 2 cores, 2026-12-01 16:42: 16 users' 128-token requests took 133 s, 24
# benchmark requests of 96 tokens 183 s: 0.82 per token; 0.85 leaves a margin). A ratio of one
# machine's two figures, not a speed: the speed is what this machine measures.
USER_TOKEN_SHARE = 0.85
# A request of the benchmark's acceptance pass (`bench.accept_concurrency`, batched on the
# server) costs this share of one sent alone: in process on one bf16 CPU thread (2026-12-05),
# the 48 held-out prompts of 64 tokens took 36-46 s in batches of 16-48 against about 170 s one
# at a time. Later rounds plan from what the last one took.
BATCHED_REQUEST_SHARE = 0.3
TRAIN_START_S = 25.0  # Ray Train's worker start-up and the export around the time box (2 cores)
# The same on one GPU, where the worker also loads the target (online states), evaluates step 0
# on the gate set and compiles its first step: 62 s around 103 s of steps on an H100
# (2026-12-07), 80 s around 35 s (2026-12-06); round 0 priced 25 s and ran that much past plan.
TRAIN_START_GPU_S = 60.0
MIN_STAGE_S = 30.0  # below this a stage's start-up dominates: refuse the plan instead
# The measuring work (benchmark tokens, shape probes, simulated users, the gate set) is sized to
# the machine before round 0 (pipeline/round_plan.py `size_work`): as configured when that
# leaves data and training WORK_SHARE of the budget, else cut down SCALES until it does; on the
# slowest machines the smallest scale at which every training round still gets 2 * MIN_STAGE_S.
# Data and training are what make a round gain: on a 2-core bf16 CPU the demo's measuring work
# took about 60% of its budget, and a CPU without bf16 decodes 2-4x slower.
WORK_SHARE = 0.45
SCALES = (1.0, 0.75, 0.5, 0.35, 0.25)


def _rounded(record: Any, digits: int) -> dict[str, Any]:
    """A dataclass as the dict a state record keeps, its floats rounded to `digits`."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in asdict(record).items()}


class BudgetError(ValueError):
    """The budget left cannot hold a round; the message says how much it needs."""


@dataclass(frozen=True)
class Sizing:
    """The measuring work a run does on this machine (`size_work`), and what it leaves."""

    scale: float  # of the configured work (1.0: as configured)
    bench_tokens: int  # bench.max_tokens
    shape_chains: list[int]  # bench.shape_chains
    simulate_users: int  # serve.simulate_users
    gate_prompts: int  # data.gate_prompts
    work_share: float  # of the budget left for data and training at this size

    def record(self) -> dict[str, Any]:
        return _rounded(self, 3)


@dataclass(frozen=True)
class Measured:
    """What this machine took at start-up (pipeline/measure.py), on the serving engine."""

    plain_s_per_token: float  # the target alone, one decode step
    spec_s_per_token: float  # a benchmark request, speculative, with the drafter round 0 serves
    spec_tokens: int  # the tokens that request was timed over
    drafter: str  # the drafter it was measured with
    wall_s: float  # what the measurement took, the target's load included

    def record(self) -> dict[str, Any]:
        return _rounded(self, 4)


@dataclass(frozen=True)
class Rates:
    """Seconds per benchmark request and per simulated user's request: what the last round
    took, or for a first round what this machine measured at start-up (`from_measurement`)."""

    bench_s: float
    traffic_s: float
    start_s: float = 0.0  # the server's start, paid by the first benchmark planned (round 0 only)

    @classmethod
    def from_measurement(
        cls, m: Measured, mix: tuple[int, int], bench_tokens: int, user_tokens: int
    ) -> Rates:
        """A first round's rates. Its benchmark's `mix` (drafter requests, no-drafter baseline
        requests) of `bench_tokens` each, at the measured speculative and plain seconds per
        token, averaged over the mix; a simulated user's request of `user_tokens` at the
        speculative seconds per token times USER_TOKEN_SHARE."""
        drafter, plain = mix
        per_token = (drafter * m.spec_s_per_token + plain * m.plain_s_per_token) / max(1, drafter + plain)  # fmt: skip
        return cls(per_token * bench_tokens, m.spec_s_per_token * user_tokens * USER_TOKEN_SHARE)

    def measured(self, done: dict[str, dict], bench_requests: int, traffic_requests: int) -> Rates:
        """These rates updated by a round's stage records (`wall_s`); a stage it did not run
        (yet) keeps its rate. A benchmark that started the server (`serve_start_s`: the target
        loads, 20 s on 2 cores) counts without it where later rounds swap the drafter only, and
        with it where the round stopped its server (`server_stopped`: a GPU server whose GPUs
        the next round's stages need starts again in the next benchmark)."""
        bench = sum(float(done.get(k, {}).get("wall_s", 0.0)) for k in ("bench", "gate"))
        if not done.get("bench", {}).get("server_stopped"):
            bench -= float(done.get("bench", {}).get("serve_start_s", 0.0))
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
        return _rounded(self, 2)


def plan_round(
    r: int,
    rounds: int,
    remaining_s: float,
    rates: Rates,
    bench_requests: Sequence[int],
    traffic_requests: int,
    first_round_trains: bool = True,
    alone: bool = False,
) -> RoundPlan:
    """Seconds for round `r` of `rounds` with `remaining_s` left. `bench_requests[i]` counts
    the benchmark requests (drafter and baseline) of round r+i, for every round still to run.

    Every round still to run first gets its benchmark and, unless it is the last, its simulated
    users, at `rates`; what is left is the data and training time of those rounds, shared by
    weight (round 0 weighs FIRST_ROUND_WEIGHT when it trains, 0 when it serves its base drafter
    as is; later rounds 1). Refused (BudgetError) when any training round still to run would get
    less than 2 * MIN_STAGE_S: so round 0 leaves round 1 a round, and the stop rule, which asks
    this same function about the next round (pipeline/round_plan.py), agrees with it.

    `alone`: `remaining_s` is round r's own (`stop.round_minutes`): the rounds after it are not
    reserved for, its simulated users are (unless it is the last)."""
    n = 1 if alone else max(1, rounds - r)
    bench, users = _measuring(r, rounds, rates, bench_requests, traffic_requests, n)
    weights = [_weight(r + i, first_round_trains) for i in range(n)]
    free = remaining_s - sum(bench) - sum(users)
    trained = [w for w in weights if w]
    least = free * min(trained) / sum(trained) if trained else 0.0  # the smallest round's share
    if (least < 2 * MIN_STAGE_S) if trained else free < 0:  # none trains: the rest must fit
        field = "stop.round_minutes" if alone else "stop.max_wall_minutes"
        raise BudgetError(
            f"{field}: {remaining_s:.0f} s left for {n} round(s), of which the "
            f"benchmarks ({sum(bench):.0f} s: {sum(bench_requests[:n])} requests at "
            f"{rates.bench_s:.1f} s) and simulated users ({sum(users):.0f} s: "
            f"{traffic_requests} per round at {rates.traffic_s:.1f} s) leave "
            f"{max(0.0, free):.0f} s for data and training, {least:.0f} s for a training round "
            f"(needs {2 * MIN_STAGE_S:.0f}); raise {field}, lower "
            "stop.max_rounds, bench.num_prompts or serve.simulate_users"
        )
    work = free * weights[0] / sum(trained) if weights[0] else 0.0
    return RoundPlan(
        r, bench[0] + users[0] + work, DATA_SHARE * work, (1 - DATA_SHARE) * work, bench[0],
        users[0], rates.bench_s, rates.traffic_s,
    )  # fmt: skip


def measuring_s(
    r: int,
    rounds: int,
    rates: Rates,
    bench_requests: Sequence[int],
    traffic_requests: int,
    n: int | None = None,
) -> float:
    """Seconds the benchmarks and simulated users of rounds r.. (the next `n`) take at `rates`."""
    bench, users = _measuring(r, rounds, rates, bench_requests, traffic_requests, n)
    return sum(bench) + sum(users)


def _measuring(
    r: int,
    rounds: int,
    rates: Rates,
    bench_requests: Sequence[int],
    traffic_requests: int,
    n: int | None = None,
) -> tuple[list[float], list[float]]:
    """Per round still to run (the next `n` of them; default all): its benchmark's seconds and
    its simulated users' (none after the last round)."""
    n = max(1, rounds - r) if n is None else n
    if len(bench_requests) < n:
        raise ValueError(f"plan_round: {n} rounds to run, {len(bench_requests)} request counts")
    bench = [
        rates.bench_s * bench_requests[i] + (rates.start_s if i == 0 else 0.0) for i in range(n)
    ]
    users = [rates.traffic_s * traffic_requests if r + i < rounds - 1 else 0.0 for i in range(n)]
    return bench, users


def _weight(r: int, first_round_trains: bool) -> float:
    if r == 0:
        return FIRST_ROUND_WEIGHT if first_round_trains else 0.0
    return 1.0


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
            if short == "data":  # the gate set, made once, comes out of its round's data share
                actual += float(done.get("gate_set", {}).get("wall_s", 0.0))
            out[f"actual/{short}_s"] = actual
    return out


# ---- disk ------------------------------------------------------------------------------------
# A round's shards are planned like its seconds: predicted before it generates, and refused with
# the figures when the disk cannot hold them. Rounds outside the training window
# (`train.data_rounds`) are deleted before a round generates (pipeline/loop.py `_free_data`), so
# at most `window` rounds' data are on disk at once.

# Before any round measured its tokens per sample: a prompt's characters over this, plus the
# chat template's tokens (SmolLM2's default system prompt and role headers are about 30), plus
# `data.max_new_tokens`. English BPE averages about 4 characters a token; 3 leans to more bytes.
CHARS_PER_TOKEN = 3.0
TEMPLATE_TOKENS = 40


@dataclass(frozen=True)
class DiskPlan:
    round: int
    samples: int  # prompts the round generates or captures
    tokens_per_sample: float
    measured: bool  # tokens_per_sample from an earlier round's data (else from characters)
    bytes_per_token: int  # actors/shards.py bytes_per_token: ids only when data.states is online
    round_bytes: int  # the prediction, with the generate stage's margin
    window: int  # rounds whose data are on disk together, at most
    held_bytes: int  # data on disk now (earlier rounds still in the window, this round's part)
    free_bytes: int

    def record(self) -> dict[str, Any]:
        return _rounded(self, 1)


def plan_disk(
    r: int,
    samples: int,
    tokens_per_sample: float,
    measured: bool,
    bytes_per_token: int,
    window: int,
    held_bytes: int,
    own_bytes: int,
    free_bytes: int,
    online: bool,
) -> DiskPlan:
    """Round r's data bytes, refused (BudgetError) when they do not fit: now (`free_bytes` plus
    what round r already wrote, `own_bytes`, on a resume), or once `window` rounds of this size
    are on disk together (the free bytes plus what every round holds now, `held_bytes`, which
    the window's later rounds replace)."""
    from actors.generate import STORAGE_MARGIN

    need = int(samples * tokens_per_sample * bytes_per_token * STORAGE_MARGIN)
    plan = DiskPlan(
        r, samples, tokens_per_sample, measured, bytes_per_token, need, window, held_bytes,
        free_bytes,
    )  # fmt: skip
    if need - own_bytes > free_bytes or window * need > free_bytes + held_bytes:
        fixes = (
            "lower data.prompts_per_round, data.max_new_tokens or train.data_rounds, or free space"
        )
        if not online:
            fixes = "set data.states: online (ids only, 5 B a token), or " + fixes
        how = "measured on the rounds before" if measured else "estimated from prompt characters"
        raise BudgetError(
            f"disk: round {r}'s data needs about {size(need)} ({samples} samples x "
            f"{tokens_per_sample:.0f} tokens, {how}, x {bytes_per_token} B a token), and "
            f"{window} round(s) of it in the train.data_rounds window {size(window * need)}; "
            f"{size(free_bytes)} free and {size(held_bytes)} held by the rounds on disk; "
            f"{fixes}; round {r} was not started"
        )
    return plan


def size(n: float) -> str:
    """Bytes as people read them: 1.23 GiB, 45.6 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
