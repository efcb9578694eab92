"""Stop rules and the per-round summary: pure functions of the recorded rounds."""

from __future__ import annotations

from typing import Any

from pipeline.config import StopConfig


def round_row(index: int, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bench, train = done["bench"], done["train"]
    return {
        "round": index,
        "accept_len": bench["accept_len"],
        "tok_per_s": bench["tok_per_s"],
        "baseline_tok_per_s": bench["baseline_tok_per_s"],
        "speedup": bench["speedup"],
        "train_tokens": train["train_tokens"],
        "steps": bench.get("steps"),
        "wall_s": round(sum(rec.get("wall_s", 0.0) for rec in done.values()), 1),
    }


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
    stop: StopConfig, rows: list[dict[str, Any]], last_bench: dict[str, Any], elapsed_s: float
) -> str | None:
    """Why the loop stops after the last recorded round, or None to go on. First match wins, in
    the order: goal reached, plateau, budget."""
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
        # Rounds grow (data accumulates): one at least as long as the last would not fit.
        nxt = last.get("wall_s", 0.0)
        if (elapsed_s + nxt) / 60 > stop.max_wall_minutes:
            return (
                f"budget: another round (>= {nxt / 60:.1f} min) would pass the wall time "
                f"{stop.max_wall_minutes} min"
            )
    return None


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'round':>5} {'accept_len':>10} {'tok/s':>8} {'baseline':>8} {'speedup':>7} {'train_tok':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['round']:>5} {r['accept_len']:>10.3f} {r['tok_per_s']:>8.1f} "
            f"{r['baseline_tok_per_s']:>8.1f} {r['speedup']:>7.2f} {r['train_tokens']:>10}"
        )
    return "\n".join(lines)
