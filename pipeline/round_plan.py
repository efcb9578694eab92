"""The loop's budget glue (`stop.max_wall_minutes`): the start-up measurement, once; each
round's plan from it or from what the round before took; the stop rule's question whether the
next round fits; the seconds a data or training stage may still spend. And every round's disk
plan, with or without a time budget. The arithmetic is pipeline/budget.py's, the measurement
pipeline/measure.py's."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

from actors.prompt_record import conversation_chars
from pipeline.budget import (
    BATCHED_REQUEST_SHARE,
    CHARS_PER_TOKEN,
    MIN_STAGE_S,
    SCALES,
    TEMPLATE_TOKENS,
    TRAIN_START_GPU_S,
    TRAIN_START_S,
    WORK_SHARE,
    BudgetError,
    Measured,
    Rates,
    RoundPlan,
    Sizing,
    measuring_s,
    plan_disk,
    plan_round,
)
from pipeline.config import Config
from pipeline.console import detail
from pipeline.layout import RunDir
from pipeline.state import Clock, RunState
from pipeline.tracking import Tracker


def first_round_skips(cfg: Config) -> bool:
    """Round 0 serves `drafter.init` as it is: no data, no training (train.first_round)."""
    return cfg.train.first_round == "skip"


def measure_once(cfg: Config, state: RunState, messages: list, tracker: Tracker) -> None:
    """The start-up measurement (pipeline/measure.py) into round 0's record, once: a resumed
    run plans with the figures it started with."""
    rs = state.round(0)
    if rs.is_done("measure"):
        return
    from pipeline.measure import measure_machine

    m = measure_machine(cfg, messages)
    rs.done["measure"] = m.record()  # its wall_s: the measurement, the target's load included
    detail.info("start-up measurement: %s", rs.done["measure"])
    tracker.log(state.parent_run_id, {f"measured/{k}": v for k, v in m.record().items() if k != "drafter"})  # fmt: skip


# The smallest measuring work (`sized`): below these a figure stops meaning what it says.
MIN_BENCH_TOKENS = 32  # a request's first tokens are a reply's opening, its easiest to draft
MIN_USERS = 4  # one round of `serve.simulate_concurrency` (4) users
MIN_GATE_PROMPTS = 8  # per source: 24 samples, still several eval batches for the paired SE


def sized(cfg: Config, scale: float) -> Config:
    """`cfg` with its measuring work at `scale` of what it configures, never below the minimums
    above: benchmark tokens a request, the shape choice's chains (those of 2-3 drafted tokens
    kept longest: they won every shape choice measured on a CPU), simulated users, gate set."""
    if scale >= 1.0:
        return cfg
    b, s, d = cfg.bench, cfg.serve, cfg.data

    def cut(n: int, least: int) -> int:
        return min(n, max(least, round(n * scale)))

    keep = max(1, round(len(b.shape_chains) * scale)) if b.shape_chains else 0
    chains = sorted(sorted(b.shape_chains, key=lambda k: (abs(k - 2.5), k))[:keep])
    return cfg.model_copy(update={
        "bench": b.model_copy(update={"max_tokens": cut(b.max_tokens, MIN_BENCH_TOKENS),
                                      "shape_chains": chains}),
        "serve": s.model_copy(update={"simulate_users": cut(s.simulate_users, MIN_USERS)}),
        "data": d.model_copy(update={"gate_prompts": cut(d.gate_prompts, MIN_GATE_PROMPTS)}),
    })  # fmt: skip


def size_work(cfg: Config, state: RunState, elapsed_s: float) -> Sizing:
    """The measuring work this machine can afford, from the start-up measurement: the largest
    of SCALES at which round 0's plan leaves data and training WORK_SHARE of each time budget
    (`budgets`), else the one that leaves them most while still fitting. BudgetError when not
    even the smallest fits, saying how many minutes would."""
    fits: list[Sizing] = []
    refusal = None
    for scale in SCALES:
        c = sized(cfg, scale)
        try:
            budgeted_plan(c, state, 0, elapsed_s)
        except BudgetError as e:
            refusal = e
            continue
        share = min(
            max(0.0, left - _measuring_s(c, state, alone)) / max(left, 1e-9)
            for left, alone in budgets(c, elapsed_s)
        )  # data and training's, under the tighter budget
        b = c.bench
        fits.append(Sizing(scale, b.max_tokens, list(b.shape_chains), c.serve.simulate_users,
                           c.data.gate_prompts, share))  # fmt: skip
        if share >= WORK_SHARE:
            return fits[-1]
    if fits:
        return max(fits, key=lambda z: z.work_share)
    # c is the smallest size here: the minutes at which it leaves data and training their share
    left, alone = next((b for b in budgets(c, elapsed_s) if _refuses(c, state, *b)), budgets(c, elapsed_s)[0])  # fmt: skip
    need = _measuring_s(c, state, alone)
    spent = 0.0 if alone else c.stop.max_wall_minutes * 60 - left
    minutes = math.ceil((spent + need / (1 - WORK_SHARE)) / 60)
    raise BudgetError(
        f"{refusal}; even at the smallest measuring work ({SCALES[-1]:.0%}: "
        f"{c.bench.max_tokens} benchmark tokens a request, shape chains "
        f"{c.bench.shape_chains}, {c.serve.simulate_users} simulated users) they take "
        f"{need:.0f} s: on this machine set "
        f"stop.{'round' if alone else 'max_wall'}_minutes={minutes}"
    )


def _measuring_s(c: Config, state: RunState, alone: bool) -> float:
    """Seconds the benchmarks and simulated users take: of round 0 `alone`, else of the run."""
    n = 1 if alone else c.stop.max_rounds
    return measuring_s(0, c.stop.max_rounds, rates(c, state, 0), _bench_counts(c, 0)[:n],
                       c.serve.simulate_users, n)  # fmt: skip


def _refuses(c: Config, state: RunState, left: float, alone: bool) -> bool:
    try:
        round_plan(c, state, 0, left, alone)
    except BudgetError:
        return True
    return False


def size_once(cfg: Config, state: RunState, clock: Clock) -> None:
    """Size the run's measuring work before round 0 (`size_work`), once: kept in round 0's
    record, so a resumed run keeps the sizing it started with. A BudgetError carries the
    measured speeds it priced from."""
    rs = state.round(0)
    if rs.is_done("sizing"):
        return
    try:
        rs.done["sizing"] = size_work(cfg, state, clock.elapsed()).record()
    except BudgetError as e:
        m = rs.done["measure"]
        raise BudgetError(
            f"{e}. Measured at start-up ({m['wall_s']:.0f} s): plain decoding "
            f"{1 / m['plain_s_per_token']:.1f} tok/s, speculative {1 / m['spec_s_per_token']:.1f} "
            f"tok/s with {m['drafter']}; no round was started"
        ) from None


def sized_config(cfg: Config, state: RunState) -> Config:
    """`cfg` as this run measures: its recorded sizing applied (as configured without one)."""
    z = state.rounds[0].done.get("sizing") if state.rounds else None
    return sized(cfg, z["scale"]) if z else cfg


def _bench_counts(cfg: Config, r: int) -> list[int]:
    return [bench_requests(cfg, i) for i in range(r, cfg.stop.max_rounds)]


def plan_record(
    cfg: Config, state: RunState, r: int, clock: Clock, tracker: Tracker, child: str
) -> dict:
    """Round r's seconds per stage, from the budget left and what the last round took (round
    0: what the start-up measurement took, kept in its plan record, so in summary.json)."""
    p = budgeted_plan(cfg, state, r, clock.elapsed())
    rec = {**p.record(), "start_s": round(clock.elapsed(), 1)}
    if r == 0 and state.rounds[0].is_done("measure"):
        rec["measured"] = state.rounds[0].done["measure"]
    if r == 0 and state.rounds[0].is_done("sizing"):
        rec["sizing"] = state.rounds[0].done["sizing"]
    detail.info("round %d plan (s): %s", r, rec)
    tracker.log(child, {f"plan/{k}": v for k, v in rec.items() if k != "round"})
    return rec


def budgets(cfg: Config, elapsed_s: float) -> list[tuple[float, bool]]:
    """(seconds, alone) of each time budget a round is planned against, `elapsed_s` into the
    run: what `stop.max_wall_minutes` leaves of the whole run, and `stop.round_minutes`, the
    round's own (`alone`)."""
    out = []
    if cfg.stop.max_wall_minutes:
        out.append((cfg.stop.max_wall_minutes * 60 - elapsed_s, False))
    if cfg.stop.round_minutes:
        out.append((cfg.stop.round_minutes * 60, True))
    return out


def budgeted_plan(cfg: Config, state: RunState, r: int, elapsed_s: float) -> RoundPlan:
    """Round r's plan under each time budget set, the one that gives it the least seconds; the
    first budget that cannot hold it raises its BudgetError. The one call behind the plan, the
    stop rule's question whether the next round fits, and the sizing."""
    plans = [round_plan(cfg, state, r, left, alone) for left, alone in budgets(cfg, elapsed_s)]
    return min(plans, key=lambda p: p.budget_s)


def round_plan(cfg: Config, state: RunState, r: int, remaining_s: float, alone: bool = False):
    """plan_round for round r of this run with `remaining_s` left (BudgetError if none fits);
    `alone`: the seconds are round r's own."""
    return plan_round(
        r,
        cfg.stop.max_rounds,
        remaining_s,
        rates(cfg, state, r),
        _bench_counts(cfg, r),
        cfg.serve.simulate_users,
        first_round_trains=not first_round_skips(cfg),
        alone=alone,
    )


def rates(cfg: Config, state: RunState, r: int) -> Rates:
    """Seconds per benchmark and per simulated user's request for planning round r: what round
    r-1 measured, its own plan's rates for a stage it has not run (yet); round 0: the start-up
    measurement's."""
    if r == 0:
        m = Measured(**state.rounds[0].done["measure"])
        mix = bench_mix(cfg, 0)
        rates = Rates.from_measurement(m, mix, cfg.bench.max_tokens, cfg.data.max_new_tokens)
        # A GPU server starts in round 0's benchmark: it loads the target and captures its
        # graphs as the start-up measurement did (77 s; the server's start took 61 s of a 90 s
        # benchmark planned at 52 s, an H100, 2026-12-07). A CPU server's start is seconds.
        return replace(rates, start_s=m.wall_s if cfg.serve.num_gpus > 0 else 0.0)
    done = state.rounds[r - 1].done
    plan = done["plan"]
    base = Rates(plan["bench_s_per_request"], plan["traffic_s_per_request"])
    return base.measured(done, bench_requests(cfg, r - 1), cfg.serve.simulate_users)


def next_round_refusal(cfg: Config, state: RunState, r: int, clock: Clock) -> str | None:
    """Why the budget planner would refuse round r+1 (None: it fits), asked after round r's
    gate, with the simulated users that still run before round r+1 counted as planned."""
    if not cfg.stop.planned or r + 1 >= cfg.stop.max_rounds:
        return None
    rs = state.rounds[r]
    pending = 0.0
    if cfg.serve.simulate_users and not rs.is_done("traffic"):
        pending = float((rs.done.get("plan") or {}).get("traffic_s", 0.0))
    try:
        budgeted_plan(cfg, state, r + 1, clock.elapsed() + pending)
    except BudgetError as e:
        return str(e)
    return None


def bench_requests(cfg: Config, r: int) -> int:
    """Requests a round's benchmark sends: warm-up, the drafter's, and the baseline's unless a
    later round reuses it."""
    return sum(bench_mix(cfg, r))


def bench_mix(cfg: Config, r: int) -> tuple[int, int]:
    """(the drafter's requests, the no-drafter baseline's) of round r's benchmark, the
    acceptance pass's (`bench.accept_concurrency`) counted at BATCHED_REQUEST_SHARE each."""
    from serve.bench import timed_prompts

    b = cfg.bench
    plain = 0
    if not (r and b.reuse_baseline):
        plain = b.warmup + (b.baseline_prompts or b.num_prompts)
    spec = b.warmup + timed_prompts(b, b.num_prompts)
    if b.shape_chains and cfg.serve.engine == "embedded":  # the shape choice measures every
        # chain but the configured shape on the baseline's prompts (serve/shape_sweep.py)
        s = cfg.serve
        chains = {k for k in b.shape_chains if (k, 1) != (s.steps, s.topk) or s.num_draft_tokens not in (None, k + 1)}  # fmt: skip
        spec += len(chains) * (b.baseline_prompts or b.num_prompts)
    batched = math.ceil(b.num_prompts * BATCHED_REQUEST_SHARE) if b.accept_concurrency else 0
    return spec * len(b.concurrency) + batched, plain * len(b.concurrency)


def stage_seconds(rs, stage: str, clock: Clock, train_overhead: float = 0.0) -> float | None:
    """Seconds `stage` ("data" or "train") may still spend by the round's plan (None: no plan).
    Time the data stage did not use goes to training. The training box holds the steps only:
    `train_overhead` (`train_overhead_s`) comes out of it."""
    p = rs.done.get("plan")
    if not p:
        return None
    end = p["start_s"] + p["data_s"] + (p["train_s"] if stage == "train" else 0.0)
    overhead = train_overhead if stage == "train" else 0.0
    return max(MIN_STAGE_S, end - clock.elapsed() - overhead)


def train_overhead_s(state: RunState, r: int, run_dir: Path, gpu: bool = False) -> float:
    """Seconds a round's training stage spends around its box of steps: Ray Train's start, the
    loads, step 0's evaluation, the first step's compile, the export, the driver's records. As
    the last round before r that trained measured it (its stage's wall_s less its steps'
    seconds, train/round-N/phases.json); before any did, TRAIN_START_GPU_S where training runs
    on GPUs (`gpu`), else TRAIN_START_S (2 cores)."""
    from pipeline.time_box import PHASES

    for i in range(r - 1, -1, -1):
        wall = (state.rounds[i].done.get("train") or {}).get("wall_s")
        phases = RunDir(run_dir).train(i) / PHASES
        if wall is not None and phases.is_file():
            steps = json.loads(phases.read_text()).get("steps")
            if steps is not None:
                return max(0.0, float(wall) - float(steps))
    return TRAIN_START_GPU_S if gpu else TRAIN_START_S


def disk_plan(cfg: Config, state: RunState, r: int, run_dir: Path, prompts: list) -> dict:
    """Round r's disk plan (pipeline/budget.py `plan_disk`), before it generates: its samples
    at the tokens per sample the last round with data measured (before any: estimated from the
    characters of its fresh `prompts`), at the bytes a token takes in its shards. BudgetError
    when they do not fit beside the data the rounds on disk hold."""
    from actors.hf_backend import resolve_aux_layer_ids
    from actors.shards import bytes_per_token
    from eagle3.target_weights import read_target_info

    t, d = cfg.target, cfg.data
    info = read_target_info(t.model, t.revision, t.gguf_file)
    aux = resolve_aux_layer_ids(t.aux_layer_ids, info.num_layers)
    online = cfg.states() == "online"
    made = [g for rs in state.rounds[:r] if (g := rs.done.get("generate") or {}).get("num_samples")]
    if made:
        tokens, measured = made[-1]["num_tokens"] / made[-1]["num_samples"], True
    else:
        each = [
            min(d.max_length, conversation_chars(c) / CHARS_PER_TOKEN
                + TEMPLATE_TOKENS + d.max_new_tokens)
            for c in prompts
        ]  # fmt: skip
        tokens, measured = sum(each) / max(1, len(each)), False
    rounds = cfg.stop.max_rounds
    p = plan_disk(
        r,
        d.prompts_for_round(r) + d.self_prompts_per_round,
        tokens,
        measured,
        bytes_per_token(info.hidden_size, len(aux), online),
        min(cfg.train.data_rounds or rounds, rounds),
        held_bytes=data_bytes(RunDir(run_dir).data(r).parent),
        own_bytes=data_bytes(RunDir(run_dir).data(r)),
        free_bytes=shutil.disk_usage(_existing(RunDir(run_dir).data(r))).free,
        online=online,
    )
    return p.record()


def data_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
