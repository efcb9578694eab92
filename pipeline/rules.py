"""Stop rules and the per-round summary: pure functions of the recorded rounds."""

from __future__ import annotations

from typing import Any, Protocol

from pipeline.config import StopConfig


class BenchLimits(Protocol):
    collapse_accept_len: float
    collapse_predicted: float


def round_row(index: int, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bench, train = done["bench"], done["train"]
    return {
        "round": index,
        "accept_len": bench["accept_len"],
        # the settings it was measured at (0: greedy)
        "temperature": ((bench.get("extra") or {}).get("settings") or {}).get("temperature", 0.0),
        "tok_per_s": bench["tok_per_s"],
        "baseline_tok_per_s": bench["baseline_tok_per_s"],
        "speedup": bench["speedup"],
        "train_tokens": train["train_tokens"],
        "steps": bench.get("steps"),
        # the serving shape the benchmark chose (serve/shapes.py) and each shape's speedup
        "shape": (bench.get("shape") or {}).get("served"),
        "served_speedup": (bench.get("shape") or {}).get("served_speedup", bench["speedup"]),
        "shape_speedups": (bench.get("shape") or {}).get("speedups") or {},
        "wall_s": round(sum(rec.get("wall_s", 0.0) for rec in done.values()), 1),
        "domains": {d: v.get("accept_len") for d, v in (bench.get("domains") or {}).items()},
        "promoted": (done.get("gate") or {}).get("promoted", True),
        "champion_accept_len": (done.get("gate") or {}).get("champion_accept_len"),
        "traffic_records": (done.get("generate") or {}).get("traffic_records", 0),
        # data on disk once the round's landed: its peak (earlier rounds outside the window gone)
        "disk_bytes": (done.get("generate") or {}).get("disk_bytes"),
        # training's held-out simulation of the drafter it exported (the gate reads the same)
        "predicted_accept_len": (train.get("eval_metrics") or {}).get("sim_accept_len"),
        # the drafter the round started from, on the same held-out samples (fine-tuning only)
        "predicted_start_accept_len": (train.get("start_eval_metrics") or {}).get("sim_accept_len"),
        "kept_start": bool(train.get("kept_start")),
        # the keep-the-start decision's evidence: paired gain over the start, its SE, z
        "gate_gain": (train.get("gate") or {}).get("gain"),
        "gate_gain_se": (train.get("gate") or {}).get("gain_se"),
        "stage_s": {k: round(v["wall_s"], 1) for k, v in done.items() if "wall_s" in v},
    }


def rows_of(rounds: list[Any]) -> list[dict[str, Any]]:
    """The summary rows (`round_row`) of the benchmarked rounds among `RunState.rounds`."""
    return [round_row(rs.index, rs.done) for rs in rounds if rs.is_done("bench")]


def costs(rows: list[dict[str, Any]], cpus: int, gpus: int) -> dict[str, Any]:
    """What each round's gain cost, and how well the simulated acceptance (held-out training
    samples) predicted the served one. A round's gain is over the round before; round 0's over
    no drafter (1.0) where it trained from scratch, and None where it started from a trained
    drafter the run never benchmarked (a fine-tune, or `train.first_round: skip`): counting
    from 1.0 there credited a climb's first round with the whole of its start. Cost is the
    round's wall time times the machine's CPUs (or GPUs, when it has any)."""
    per_round, prev = [], 1.0
    for r in rows:
        unmeasured = r["round"] == rows[0]["round"] and (
            r.get("predicted_start_accept_len") is not None or not r["train_tokens"]
        )
        gain = None if unmeasured else r["accept_len"] - prev
        minutes = r["wall_s"] / 60.0
        item = {"round": r["round"], "gain": None if gain is None else round(gain, 4),
                "wall_min": round(minutes, 2)}  # fmt: skip
        key, used, digits = (
            ("gain_per_gpu_hour", minutes / 60.0 * gpus, 4)
            if gpus
            else ("gain_per_cpu_minute", minutes * cpus, 5)
        )
        item[key] = round(gain / used, digits) if used and gain is not None else None
        per_round.append(item)
        prev = max(prev, r["accept_len"]) if r.get("promoted", True) else prev
    pairs = [
        (r["predicted_accept_len"], r["accept_len"]) for r in rows if r.get("predicted_accept_len")
    ]
    err = sum(abs(p - a) for p, a in pairs) / len(pairs) if pairs else None
    return {"cpus": cpus, "gpus": gpus, "per_round": per_round,
            "sim_accept_mean_abs_error": None if err is None else round(err, 4),
            "sim_accept_pairs": [[round(p, 3), round(a, 3)] for p, a in pairs]}  # fmt: skip


def curve(rows: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    """What each round's accept_len cost so far: the training tokens of the rounds up to it (each
    round's training data once, as `train.data_rounds` chose it) and their machine minutes, GPU
    minutes (wall time x the cluster's GPUs) when there are GPUs, else wall minutes. A loop that
    climbs shows accept_len rising with both; the price of a round is its step to the right, and
    one training job on the same data sits at the same tokens (benchmarks/climb_vs_scratch.py)."""
    tokens, minutes, points = 0, 0.0, []
    for r in rows:
        tokens += r["train_tokens"]
        minutes += r["wall_s"] / 60.0 * (gpus or 1)
        points.append({"round": r["round"], "train_tokens": tokens,
                       "minutes": round(minutes, 2), "accept_len": r["accept_len"],
                       "domains": r.get("domains") or {},
                       "promoted": r.get("promoted", True)})  # fmt: skip
    return {"minutes": "GPU minutes" if gpus else "wall minutes", "points": points}


def sim_vs_bench(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's exported drafter as training's held-out simulation predicted it and as the
    benchmark measured it (`rounds`), the drafter each fine-tuning round started from likewise
    (`starts`: its simulation on the round's held-out samples against the serving drafter's
    benchmark), and whether the simulation ranks them all as the benchmark does: the export
    picks by the simulation, so a poor rank agreement means it picks blind."""
    both = [
        (r["round"], r["predicted_accept_len"], r["accept_len"])
        for r in rows
        if r.get("predicted_accept_len") is not None and r.get("accept_len") is not None
    ]
    starts = [
        (r["round"], r["predicted_start_accept_len"], r["champion_accept_len"])
        for r in rows
        if r.get("predicted_start_accept_len") and r.get("champion_accept_len")
    ]
    return {
        "rounds": [[i, round(p, 3), round(a, 3)] for i, p, a in both],
        "starts": [[i, round(p, 3), round(a, 3)] for i, p, a in starts],
        "rank_agreement": kendall_tau([(p, a) for _, p, a in both + starts]),
    }


def kendall_tau(pairs: list[tuple[float, float]]) -> float | None:
    """Rank agreement of (predicted, measured) pairs: +1 when the simulation orders the drafters
    as the benchmark does, -1 when it reverses them; None below 2 pairs. Ties count neither way."""
    n = len(pairs)
    if n < 2:
        return None
    score = 0
    for i in range(n):
        for j in range(i + 1, n):
            dp, da = pairs[i][0] - pairs[j][0], pairs[i][1] - pairs[j][1]
            score += (dp * da > 0) - (dp * da < 0)
    return round(score / (n * (n - 1) / 2), 4)


def required_accept_len(stop: StopConfig, bench: dict[str, Any]) -> float | None:
    """The accept_len that the tok/s goal needs at the measured verify/draft costs (planner)."""
    if stop.tok_per_s is None:
        return None
    from pipeline.plan import plan

    p = plan(
        baseline_tps=bench["baseline_tok_per_s"],
        verify_ms=bench["verify_ms"],
        draft_ms=bench.get("draft_ms", 0.0),
        steps=bench.get("steps"),
        target_tps=stop.tok_per_s,
    )
    return p["required_accept_len"]


def stop_reason(
    stop: StopConfig,
    rows: list[dict[str, Any]],
    last_bench: dict[str, Any],
    elapsed_s: float,
    next_round_refused: str | None = None,
) -> str | None:
    """Why the loop stops after the last recorded round, or None to go on. First match wins, in
    the order: goal reached, plateau, budget. `next_round_refused`: the budget planner's reason
    the next round cannot be planned in what is left (plan_round's BudgetError), so the loop
    stops exactly where the planner would refuse."""
    if not rows:
        return None
    last = rows[-1]
    if stop.accept_len is not None and last["accept_len"] >= stop.accept_len:
        return f"target: accept_len {last['accept_len']:.3f} >= {stop.accept_len}"
    need = required_accept_len(stop, last_bench)
    if need is not None and last["accept_len"] >= need:
        return f"target: tok/s goal {stop.tok_per_s} met (accept_len {last['accept_len']:.3f} >= required {need:.3f})"
    if len(rows) > stop.plateau_rounds:
        gains = [
            rows[-i]["accept_len"] - rows[-i - 1]["accept_len"]
            for i in range(1, stop.plateau_rounds + 1)
        ]
        if all(g < stop.plateau_eps for g in gains):
            return (
                f"plateau: accept_len gained < {stop.plateau_eps} for {stop.plateau_rounds} rounds"
            )
    if len(rows) >= stop.max_rounds:
        return f"budget: {stop.max_rounds} rounds"
    if stop.max_wall_minutes is not None:
        if elapsed_s / 60 >= stop.max_wall_minutes:
            return f"budget: wall time {elapsed_s / 60:.1f} >= {stop.max_wall_minutes} min"
        if next_round_refused:
            return f"budget: the next round does not fit: {next_round_refused}"
    return None


def still_stopped(stop: StopConfig, rounds: list[Any], elapsed_s: float) -> str | None:
    """Why a finished run stays finished under these stop rules (None: they let it go on, as a
    later submit that raises them asks): `stop_reason` over its rounds' records (`RunState`
    rounds) as the loop judged them when it stopped."""
    done = [rs for rs in rounds if rs.is_done("bench")]
    if not done:
        return "no round benchmarked"
    return stop_reason(stop, rows_of(rounds), done[-1].done["bench"], elapsed_s)


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per round: accept_len overall and per domain (held-out prompts), speed and
    speedup of the configured shape, the serving shape chosen and its speedup (`served`), the
    training tokens, the traffic records learnt from, the held-out simulation of the drafter
    the round started from and of the one it exports (`sim`; `kept` when no trained state beat
    the start, which is then exported unchanged), and whether the round was promoted."""
    domains = list(dict.fromkeys(d for r in rows for d in r.get("domains") or {}))
    head = (
        f"{'round':>5} {'accept_len':>10} "
        + "".join(f"{d[:9]:>10}" for d in domains)
        + f" {'tok/s':>7} {'speedup':>7} {'shape':>11} {'served':>6} {'train_tok':>9}"
        + f" {'traffic':>7} {'sim start>end':>13} {'promoted':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        doms = "".join(f"{(r.get('domains') or {}).get(d) or 0:>10.3f}" for d in domains)
        lines.append(
            f"{r['round']:>5} {r['accept_len']:>10.3f} {doms} {r['tok_per_s']:>7.1f} "
            f"{r['speedup']:>7.2f} {r.get('shape') or '-':>11} "
            f"{r.get('served_speedup') or r['speedup']:>6.2f} {r['train_tokens']:>9} "
            f"{r.get('traffic_records', 0):>7} {_sim_cell(r):>13} "
            f"{'yes' if r.get('promoted', True) else 'no':>8}"
        )
    return "\n".join(lines)


def _sim_cell(r: dict[str, Any]) -> str:
    start, end = r.get("predicted_start_accept_len"), r.get("predicted_accept_len")
    if r.get("kept_start") and start:
        return f"{start:.2f} kept"
    if start and end:
        return f"{start:.2f}>{end:.2f}"
    return f"{end:.2f}" if end else "-"


# ---- the promotion gate and the collapse check -------------------------------------------------


class AcceptanceCollapsed(RuntimeError):
    """A drafter that serves at about 1.0 while its offline accuracy predicts much more: the
    silent failure of draft-model reloads that drop weights or export keys (docs/serving.md)."""


def promote(candidate: float, champion: float | None, margin: float) -> bool:
    """The new drafter replaces the serving one only when it beats it, on the same prompts and
    settings, by more than `margin`; the first drafter of a run has nothing to beat."""
    return champion is None or candidate > champion + margin


def collapse_problem(
    drafter: str, served: float | None, predicted: float | None, bench: BenchLimits
) -> str | None:
    """The 'acceptance collapsed' message when a drafter serves below
    `bench.collapse_accept_len` though its held-out accuracy predicts `bench.collapse_predicted`
    or more; None otherwise."""
    if served is None or predicted is None:
        return None
    if served < bench.collapse_accept_len and predicted >= bench.collapse_predicted:
        return (
            f"acceptance collapsed: drafter {drafter} serves accept_len {served:.3f} but its "
            f"held-out accuracy predicts {predicted:.2f}. The served weights are not the trained "
            "ones: check the export (config.json keys, d2t/t2d, aux layer ids) and that the "
            "engine reloaded the draft model after the swap"
        )
    return None
