"""The closed loop end to end, run as users run it (`python pipeline/run.py`, its own local Ray,
sqlite MLflow), with a tiny random target: round 0 learns from prompts, simulated users talk to
the live server, round 1 learns from the recorded traffic; per-domain figures reach the summary
and MLflow. Then the promotion gate and the collapse check against a live server: a deliberately
broken drafter is not promoted and the serving drafter stays; a drafter whose served acceptance
collapsed raises the error, and the serving drafter is back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _config(tmp: Path, tiny_target: Path) -> dict:
    return {
        "name": "closed",
        "target": {"model": str(tiny_target)},
        "data": {"source": {"builtin": 0.5, "traffic": 0.5}, "first_round_prompts": 12, "prompts_per_round": 8,
                 "heldout_prompts": 4, "user_prompts": 8, "max_new_tokens": 24, "batch_size": 6,
                 "num_actors": 2},
        "drafter": {"draft_vocab_size": 512},
        "train": {"num_workers": 2, "first_round_epochs": 8, "epochs": 2, "lr": 0.003, "ttt_length": 2,
                  "tokens_per_batch": 256, "checkpoint_every": 4},
        "serve": {"steps": 2, "port": free_port(), "record_traffic": True, "simulate_users": 6,
                  "simulate_concurrency": 2},
        "bench": {"num_prompts": 4, "max_tokens": 16, "warmup": 1, "collapse_predicted": 1.2},
        "stop": {"accept_len": 9.0, "max_rounds": 2},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "closed"},
    }  # fmt: skip


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory, two_token_target) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("closed")
    cfg = _config(tmp, two_token_target)
    (tmp / "closed.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp / "run"
    done = subprocess.run(
        [sys.executable, "pipeline/run.py", "--config", str(tmp / "closed.yaml"), "--run-dir",
         str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return run_dir, cfg


def test_round_1_learns_from_round_0_traffic(closed_run):
    from serve.traffic import read_traffic

    run_dir, _ = closed_run
    state = json.loads((run_dir / "state.json").read_text())
    r0, r1 = (r["done"] for r in state["rounds"])
    assert r0["traffic"]["requests"] == 6 and r0["traffic"]["failed"] == 0
    log = list(read_traffic(run_dir / "traffic"))
    assert len(log) == 6  # the simulated users only: benchmark requests are never recorded
    assert all(r["completion_ids"] and r["prompt_ids"] and r["temperature"] == 0 for r in log)
    # round 1: its traffic share (half of 8) from the log, the rest fresh, nothing generated twice
    assert r0["generate"]["traffic_records"] == 0 and r1["generate"]["traffic_records"] == 4
    chosen = [json.loads(x) for x in (run_dir / "data/round-001/traffic_selected.jsonl").read_text().splitlines()]  # fmt: skip
    by_id = {r["id"]: r for r in log}
    assert [c["id"] for c in chosen] == r1["generate"]["traffic_ids"]
    served = sorted(by_id[c]["accept_len"] for c in r1["generate"]["traffic_ids"])
    rest = sorted(r["accept_len"] for r in log if r["id"] not in r1["generate"]["traffic_ids"])
    assert served[-1] <= rest[0]  # the hardest requests first
    manifest = json.loads((run_dir / "data/round-001/manifest.json").read_text())
    assert manifest["num_samples"] == 8  # 4 captured from the log + 4 fresh prompts
    # the captured samples hold exactly the served tokens
    from safetensors import safe_open

    seqs = []
    for sh in manifest["shards"]:
        with safe_open(str(run_dir / "data/round-001" / sh["file"]), "pt") as f:
            ids, offs = f.get_tensor("input_ids"), f.get_tensor("offsets")
            seqs += [ids[offs[i] : offs[i + 1]].tolist() for i in range(len(offs) - 1)]
    for c in chosen:
        assert c["prompt_ids"] + c["completion_ids"] in seqs


def test_summary_and_mlflow_carry_domains_and_promotion(closed_run):
    from mlflow.tracking import MlflowClient

    run_dir, cfg = closed_run
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = summary["rounds"]
    assert [r["round"] for r in rows] == [0, 1]
    assert all(set(r["domains"]) == {"builtin"} for r in rows)
    assert rows[0]["promoted"] is True  # the first drafter has nothing to beat
    # round 1 is promoted exactly when it beats round 0 on the same prompts (margin 0)
    gate = json.loads((run_dir / "state.json").read_text())["rounds"][1]["done"]["gate"]
    assert gate["champion_accept_len"] == rows[0]["accept_len"] and gate["champion_round"] == 0
    assert rows[1]["promoted"] is gate["promoted"] is (rows[1]["accept_len"] > rows[0]["accept_len"])  # fmt: skip
    champ = summary["champion"]
    best = max(rows, key=lambda r: r["accept_len"] if r["promoted"] else 0)
    assert champ["round"] == best["round"] and champ["accept_len"] == best["accept_len"]
    client = MlflowClient(cfg["tracking"]["tracking_uri"])
    exp = client.get_experiment_by_name("closed")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]  # fmt: skip
    assert len(children) == 2
    for run in children:
        m = run.data.metrics
        assert m["bench/builtin/accept_len"] == pytest.approx(
            rows[int(run.data.tags["mlflow.runName"].split("-")[1])]["domains"]["builtin"]
        )
        assert "gate/promoted" in m and "bench/builtin/speedup" in m
        # the serving shape each round's benchmark chose (plain when no shape beats plain)
        row = rows[int(run.data.tags["mlflow.runName"].split("-")[1])]
        assert run.data.tags["bench.served_shape"] == row["shape"]
        assert m["bench/served_plain"] == float(row["shape"] == "plain")
        assert m["bench/served_speedup"] == pytest.approx(row["served_speedup"])
        assert set(row["shape_speedups"]) == {"plain", "chain-1", "chain-2", "chain-3", "chain-4",
                                              "chain-5"}  # fmt: skip
        assert row["shape"] == "plain" or row["served_speedup"] > 1.0
    # the simulated users after round 0 were served with round 0's choice
    from serve.traffic import read_traffic

    served = {r["speculative"] for r in read_traffic(run_dir / "traffic")}
    assert served == {rows[0]["shape"] != "plain"}


@pytest.fixture(scope="module")
def live(closed_run, ray_local):
    """A server with the run's champion drafter, as the loop leaves it serving."""
    from ray import serve

    from pipeline.config import load_config
    from serve.deployment import deploy_endpoint

    run_dir, _ = closed_run
    cfg = load_config(next(run_dir.parent.glob("closed.yaml")))
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"port": free_port(), "record_traffic": False})})  # fmt: skip
    state = json.loads((run_dir / "state.json").read_text())
    ep = deploy_endpoint(cfg.serve, cfg.target, state["champion"]["drafter_dir"], run_dir / "serve")
    yield cfg, ep, state
    ep.shutdown()
    serve.shutdown()


def _candidate_round(cfg, state, drafter: str, predicted: float, tmp: Path, evalset, ep):
    """State with one more round whose drafter is `drafter` (trained metrics `predicted`),
    benchmarked on the live server the way the loop does it."""
    from pipeline.loop import _bench
    from pipeline.state import RoundState, RunState
    from pipeline.tracking import Tracker

    rs = RunState(config_digest="x", champion=state["champion"])
    rs.rounds = [RoundState(index=i, done={}) for i in range(len(state["rounds"]))]
    r = len(rs.rounds)
    rs.rounds.append(RoundState(index=r))
    rs.rounds[r].done["train"] = {"drafter_dir": drafter, "eval_metrics": {"sim_accept_len": predicted}}  # fmt: skip
    tracker = Tracker(cfg.tracking.model_copy(update={"tracking_uri": f"sqlite:///{tmp}/gate.db"}))
    child = tracker.start_run("gate-test")
    ep.swap_drafter(drafter)  # the loop benchmarks the candidate on the live server
    rs.rounds[r].done["bench"] = _bench(cfg, tmp, r, evalset, ep, tracker, child)
    return rs, r, tracker, child


def test_gate_keeps_the_serving_drafter_when_the_new_one_is_worse(live, tmp_path, two_token_target):
    from transformers import AutoModelForCausalLM

    from eagle3.checkpoint import save_drafter
    from pipeline.loop import _eval_set, _gate, _prompts
    from serve.engine import random_drafter

    cfg, ep, state = live
    champion = state["champion"]
    target = AutoModelForCausalLM.from_pretrained(two_token_target, dtype=torch.float32)
    bad = random_drafter(target, draft_vocab_size=512, seed=7, aux_layer_ids=[0, 1, 2]).model
    broken = str(save_drafter(bad.state_dict(), bad.cfg, tmp_path / "random", dtype=torch.float32))
    evalset = _eval_set(cfg, _prompts(cfg))
    rs, r, tracker, child = _candidate_round(cfg, state, broken, 1.0, tmp_path, evalset, ep)
    assert rs.rounds[r].done["bench"]["accept_len"] < champion["accept_len"]
    rec = _gate(cfg, rs, r, ep, tracker, child)
    assert rec["promoted"] is False and rec["champion_accept_len"] == champion["accept_len"]
    assert ep.info()["path"] == champion["drafter_dir"]  # the serving drafter is back
    assert rs.champion["drafter_dir"] == champion["drafter_dir"]


def test_collapsed_acceptance_is_an_error_naming_the_drafter(live, tmp_path):
    from pipeline.loop import _eval_set, _gate, _prompts
    from pipeline.rules import AcceptanceCollapsed

    cfg, ep, state = live
    champion = state["champion"]
    assert champion["accept_len"] > 1.2  # a trained drafter on this target accepts clearly more
    # the champion's checkpoint with its output rows shifted by one draft id: every structural
    # check passes (a lost d2t is refused at load), yet each drafted token is the wrong one, as
    # when an engine keeps other weights than the ones trained
    dropped = tmp_path / "dropped"
    shutil.copytree(champion["drafter_dir"], dropped)
    weights = load_file(dropped / "model.safetensors")
    weights["lm_head.weight"] = torch.roll(weights["lm_head.weight"], 1, dims=0)
    save_file(weights, dropped / "model.safetensors", metadata={"format": "pt"})
    predicted = state["rounds"][champion["round"]]["done"]["train"]["eval_metrics"][
        "sim_accept_len"
    ]
    assert predicted >= cfg.bench.collapse_predicted  # the trained figures promise acceptance
    evalset = _eval_set(cfg, _prompts(cfg))
    rs, r, tracker, child = _candidate_round(cfg, state, str(dropped), predicted, tmp_path, evalset, ep)  # fmt: skip
    with pytest.raises(AcceptanceCollapsed, match=f"acceptance collapsed: drafter {dropped}"):
        _gate(cfg, rs, r, ep, tracker, child)
    assert ep.info()["path"] == champion["drafter_dir"]
