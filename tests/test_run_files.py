"""Files a resume reads survive a crash: state.json heals from its copy (or is rebuilt) when found
empty or torn, and metrics.jsonl is appended across attempts, never rewritten."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip
from pipeline.state import RoundState, RunState
from pipeline.train_worker import MetricsLog


def test_an_empty_or_torn_state_heals_from_its_copy_or_is_rebuilt(tmp_path, caplog):
    state = RunState(config_digest="d1", parent_run_id="p", rounds=[RoundState(0, "r0", {"train": {"x": 1}})])  # fmt: skip
    state.save(tmp_path)
    path = tmp_path / "state.json"
    with caplog.at_level(logging.WARNING, logger="pipeline.state"):
        for damage in ("", '{"config_digest": "d1", "rounds": [{"ind'):
            path.write_text(damage)
            got = RunState.load_or_new(tmp_path, "d1")
            assert got.rounds[0].done == {"train": {"x": 1}} and got.parent_run_id == "p"
        assert "resuming from its copy" in caplog.text
        path.write_text("")
        (tmp_path / "state.json.bak").write_text("{")
        fresh = RunState.load_or_new(tmp_path, "d1")
    assert fresh.rounds == [] and "rebuilt from nothing" in caplog.text
    assert [p.name.split("-")[0] for p in tmp_path.glob("state.json.damaged-*")] == ["state.json.damaged"]  # fmt: skip
    fresh.save(tmp_path)  # the next save makes both whole again
    with pytest.raises(ValueError, match="another config"):  # a real mismatch still refuses
        RunState.load_or_new(tmp_path, "d2")


def test_metrics_are_appended_across_attempts_and_a_torn_line_is_skipped(tmp_path):
    def log(start: int) -> MetricsLog:
        return MetricsLog(tmp_path, True, start_step=start, k=1, sim_steps=1, total=9, world=1)

    first = log(0)
    for step in range(1, 5):
        first._write({"step": step, "loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    again = log(2)  # resumed from the step-2 checkpoint: steps 3.. are redone
    again._write({"step": 3, "loss": 30.0})
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(before)  # nothing rewritten
    assert [(m["step"], m["loss"]) for m in again.read()] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert all(json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[:4])
