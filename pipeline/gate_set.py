"""The gate set: the train stage's fixed eval set (`data.gate_prompts` per source, carved by
actors/prompts.py `plan_prompts`), its target replies and states made once per run in
<run>/data/gate/, in the first round that trains, and read by every round's training
(docs/training.md, "The gate")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.config import Config
from pipeline.console import data_line, stage
from pipeline.layout import RunDir
from pipeline.round_plan import first_round_skips
from pipeline.state import Clock, RunState


def gate_due(cfg: Config, state: RunState, r: int) -> bool:
    """Round r makes the gate set: one is asked for, none was made, and round r trains."""
    made = any(rs.is_done("gate_set") for rs in state.rounds)
    return bool(cfg.data.gate_prompts) and not made and not (r == 0 and first_round_skips(cfg))


def gate_dirs(state: RunState, run_dir: Path) -> list[Path]:
    """The gate set's folder once it was made (what training evaluates on), else none."""
    return [RunDir(run_dir).gate()] if any(rs.is_done("gate_set") for rs in state.rounds) else []


def make_gate_set(cfg: Config, run_dir: Path, plan, clock: Clock | None = None) -> dict:
    """The gate set's replies and states in <run>/data/gate/, through the data stage's own path,
    so they are made as round data is (generated, or ids only where the trainer computes
    states), and a call on a folder already made keeps its intact batches and remakes the
    others (healing, resume). Not time-boxed: an eval set cut short would judge rounds on another
    set; the budget plan's data share holds it, and its round's own data gets what it leaves."""
    from actors.generate import run_generate

    t0 = clock.elapsed() if clock else 0.0
    what = f"{len(plan.gate)} prompts, once per run: every round's eval set"
    with stage("gate set", None, what) as st:
        data = cfg.data.model_copy(update={"self_prompts_per_round": 0})  # the gate's prompts only
        res = run_generate(
            cfg.target, data, [p.messages for p in plan.gate], RunDir(run_dir).gate(), cfg.digest()
        )
        rec = {**dataclasses.asdict(res), "fresh_prompts": len(plan.gate)}
        rec["wall_s"] = clock.elapsed() - t0 if clock else res.seconds
        st.result = data_line(rec)
    return rec
