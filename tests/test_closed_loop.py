"""The closed loop end to end, run as users run it on a cluster (`ray start --head` on loopback,
`ray job submit`, sqlite MLflow), with a tiny learnable target, once: round 0 learns from
prompts, simulated users talk to the live server, round 1 learns from the recorded traffic. The
job is stopped while round 1 trains and submitted again: it must end as one uninterrupted run
would, with 2 rounds, the same shards, one MLflow parent with 2 children, and per-domain figures
in the summary and MLflow. Then the promotion gate and the collapse check against a live server:
a deliberately broken drafter is not promoted and the serving drafter stays; a drafter whose
served acceptance collapsed raises the error, and the serving drafter is back.

One run covers what tests/test_loop_e2e.py (three loops) and this module (one more) checked
separately. It starts Ray clusters of its own, so it runs after the shared Ray is down
(conftest: `own_cluster`)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port
from ray_head import RayHead
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
# setup (the whole killed and resumed run) counts toward the first test's timeout
pytestmark = [pytest.mark.slow, pytest.mark.own_cluster, pytest.mark.timeout(2400)]
# The benchmark: 8 held-out prompts x 24 tokens (the training answers' length), one request at
# a time, every round measured at the configured shape (chain-2) whatever shape it then serves.
STEPS, BENCH_PROMPTS, BENCH_TOKENS = 2, 8, 24
# What round 0's drafter must serve there: 3.0 when both drafts are always right. Measured here
# (2026-12-04, 2 cores shared): a random drafter of the loop's shape (`untrained`, through the
# same benchmark on the same server, checked below 1.5 in every run) 1.043 (24 tokens in 23
# verifies); the trainer's own init with no optimizer step at all (opt.step() removed) 2.19: its
# draft vocab comes from the data, where this target's two answer tokens dominate, so it guesses
# right about half the time; trained, 3 runs: round 0 2.79, 2.83 and 2.34, round 1 2.83 and 2.88.
# Round 0's drafter differs between runs (the eval split hashes shard files whose batch key holds
# the target's path), hence the spread, which reaches down to 0.15 above the trainer that learns
# nothing: this benchmark cannot tell those two apart, and a bar between them failed a clean CI
# run (2.34 < 2.5). What it must catch is a loop that serves an untrained drafter (1.04); the
# training tests catch a trainer that does not learn (test_train_step_learns_a_rule, the Ray
# workers' loss in test_train_ray). The bar sits 0.76 above the one, 0.54 below the lowest run.
TRAINED_ACCEPT_LEN = 1.8


def _config(tmp: Path, target: Path) -> dict:
    return {
        "name": "closed",
        "target": {"model": str(target)},
        "data": {"source": {"builtin": 0.5, "traffic": 0.5}, "first_round_prompts": 12, "prompts_per_round": 8,
                 "heldout_prompts": BENCH_PROMPTS, "user_prompts": 8, "max_new_tokens": BENCH_TOKENS,
                 "batch_size": 6, "num_actors": 2},
        "drafter": {"draft_vocab_size": 512},
        "train": {"num_workers": 2, "first_round_epochs": 8, "epochs": 2, "lr": 0.003, "ttt_length": 2,
                  "tokens_per_batch": 256, "checkpoint_every": 4},
        "serve": {"steps": STEPS, "topk": 1, "port": free_port(), "record_traffic": True, "simulate_users": 6,
                  "simulate_concurrency": 2},
        "bench": {"num_prompts": BENCH_PROMPTS, "max_tokens": BENCH_TOKENS, "warmup": 1,
                  "concurrency": [1], "steps_sweep": [], "collapse_predicted": 1.2},
        "stop": {"accept_len": 9.0, "max_rounds": 2},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "closed"},
    }  # fmt: skip


def _state(run_dir: Path) -> dict:
    path = run_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _manifests(run_dir: Path) -> dict[str, str]:
    return {
        p.parent.name: p.read_text() for p in sorted((run_dir / "data").glob("*/manifest.json"))
    }


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory, two_token_target) -> dict:
    """The run: submitted, stopped while round 1 trains, submitted again. The head is gone when
    this returns (the gate tests start their own Ray in-process)."""
    tmp = tmp_path_factory.mktemp("closed")
    cfg = _config(tmp, two_token_target)
    config = tmp / "closed.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp / "run"
    head = RayHead(tmp_path_factory.mktemp("ray"))
    try:
        job = head.submit(config, run_dir, wait=False)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
        job_id = head.job_id(job)
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            rounds = _state(run_dir).get("rounds", [])
            if (
                len(rounds) > 1
                and "generate" in rounds[1]["done"]
                and list((run_dir / "train").glob("round-001/*"))
            ):
                break
            time.sleep(0.5)
        else:
            pytest.fail("round 1's training never started")
        head.stop_job(job_id)
        assert head.wait_job(job_id, timeout_s=120) == "STOPPED"  # stopped, not run to its end
        at_kill = _state(run_dir)
        shards_at_kill = _manifests(run_dir)
        again = head.submit(config, run_dir)
        assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    finally:
        head.shutdown()
    return {"run_dir": run_dir, "cfg": cfg, "at_kill": at_kill, "shards_at_kill": shards_at_kill}


def test_the_run_stopped_in_round_1s_training_resumes_to_a_whole_run(closed_run, untrained):
    """Killed after round 1's data and before its training ended; the same command again ends
    with 2 rounds, no shard made again, and a drafter a broken trainer could not give."""
    run_dir = closed_run["run_dir"]
    at_kill = closed_run["at_kill"]
    assert {"generate", "train", "bench", "gate", "traffic"} <= set(at_kill["rounds"][0]["done"])
    assert "train" not in at_kill["rounds"][1]["done"], "the job finished before it was stopped"
    assert _manifests(run_dir) == closed_run["shards_at_kill"]  # no shard regenerated
    # the resumed job served round 0's champion before going on: round 1's benchmark swapped
    # the drafter on a live server, as in an uninterrupted run, instead of starting one
    bench = [r["done"]["bench"] for r in _state(run_dir)["rounds"]]
    assert "serve_start_s" in bench[0] and "serve_start_s" not in bench[1], bench
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = summary["rounds"]
    assert [r["round"] for r in rows] == [0, 1]
    assert summary["stopped_because"].startswith("budget: 2 rounds")
    for row in rows:
        assert set(row) >= {"accept_len", "tok_per_s", "baseline_tok_per_s", "speedup", "train_tokens"}  # fmt: skip
        assert row["train_tokens"] > 0
        assert row["steps"] == STEPS  # measured at the pinned shape, whatever shape it served
    # the bar is far above no learning, measured the same way (`untrained`)
    assert untrained["accept_len"] < 1.5 < TRAINED_ACCEPT_LEN, untrained["accept_len"]
    assert untrained["steps"] == STEPS
    assert rows[0]["accept_len"] >= TRAINED_ACCEPT_LEN, (rows, untrained["accept_len"])
    assert summary["champion"]["accept_len"] >= rows[0]["accept_len"]


def test_round_1_learns_from_round_0_traffic(closed_run):
    from serve.traffic import read_traffic

    run_dir = closed_run["run_dir"]
    state = json.loads((run_dir / "state.json").read_text())
    r0, r1 = (r["done"] for r in state["rounds"])
    assert r0["traffic"]["requests"] == 6 and r0["traffic"]["failed"] == 0
    log = list(read_traffic(run_dir / "traffic"))
    assert len(log) == 6  # the simulated users only (once: the resumed job did not ask again)
    assert all(r["completion_ids"] and r["prompt_ids"] and r["temperature"] == 0 for r in log)
    # round 1: its traffic share (half of 8) from the log, the rest fresh, nothing generated twice
    assert r0["generate"]["traffic_records"] == 0 and r1["generate"]["traffic_records"] == 4
    chosen = [json.loads(x) for x in (run_dir / "data/round-001/traffic_selected.jsonl").read_text().splitlines()]  # fmt: skip
    by_id = {r["id"]: r for r in log}
    assert [c["id"] for c in chosen] == r1["generate"]["traffic_ids"]
    # the hardest requests first (served without a drafter counts as 1.0: round 0's shape may be
    # plain), the oldest first among equals
    hardness = lambda r: (r["accept_len"] or 1.0, r.get("time", 0.0))  # noqa: E731
    taken = [hardness(by_id[c]) for c in r1["generate"]["traffic_ids"]]
    rest = [hardness(r) for r in log if r["id"] not in r1["generate"]["traffic_ids"]]
    assert max(taken) <= min(rest), (taken, rest)
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

    run_dir, cfg = closed_run["run_dir"], closed_run["cfg"]
    summary = json.loads((run_dir / "summary.json").read_text())
    state = json.loads((run_dir / "state.json").read_text())
    rows = summary["rounds"]
    assert [r["round"] for r in rows] == [0, 1]
    assert all(set(r["domains"]) == {"builtin"} for r in rows)
    assert rows[0]["promoted"] is True  # the first drafter has nothing to beat
    # round 1 is promoted exactly when it beats round 0 on the same prompts (margin 0)
    gate = state["rounds"][1]["done"]["gate"]
    assert gate["champion_accept_len"] == rows[0]["accept_len"] and gate["champion_round"] == 0
    assert rows[1]["promoted"] is gate["promoted"] is (rows[1]["accept_len"] > rows[0]["accept_len"])  # fmt: skip
    champ = summary["champion"]
    best = max(rows, key=lambda r: r["accept_len"] if r["promoted"] else 0)
    assert champ["round"] == best["round"] and champ["accept_len"] == best["accept_len"]
    client = MlflowClient(cfg["tracking"]["tracking_uri"])
    exp = client.get_experiment_by_name("closed")
    runs = client.search_runs([exp.experiment_id])
    # one parent and one child per round, the stopped job's and the resumed one's together
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert parent.info.run_name == "closed"
    assert sorted(r.info.run_name for r in children) == ["round-0", "round-1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    for run in children:
        m = run.data.metrics
        row = rows[int(run.data.tags["mlflow.runName"].split("-")[1])]
        assert m["bench/builtin/accept_len"] == pytest.approx(row["domains"]["builtin"])
        assert m["gate/promoted"] == float(row["promoted"]) and "bench/builtin/speedup" in m
        # the serving shape each round's benchmark chose (plain when no shape beats plain)
        assert run.data.tags["bench.served_shape"] == row["shape"]
        assert m["bench/served_plain"] == float(row["shape"] == "plain")
        assert m["bench/served_speedup"] == pytest.approx(row["served_speedup"])
        # every chain's speedup when the predictions held; only plain and the measured shapes
        # (chain-5, the probe, among them) when the predicted winners kept losing to their
        # measurements (serve/shape_sweep.py's fallback: seen with another pytest beside this one)
        chains = {"plain", "chain-1", "chain-2", "chain-3", "chain-4", "chain-5"}
        assert {"plain", "chain-5", row["shape"]} <= set(row["shape_speedups"]) <= chains
        # The served shape is the fastest of those surely faster than plain decoding (the low
        # end of the speedup's interval over prompts above 1.0), plain when none is, and its
        # speedup is its measurement (tok/s one request at a time over the baseline's), never a
        # prediction.
        rec = state["rounds"][row["round"]]["done"]["bench"]["shape"]
        speedups, served = row["shape_speedups"], row["shape"]
        sure = {k: v for k, v in speedups.items() if k != "plain" and rec["spreads"][k]["lo"] > 1.0}
        assert served == (max(sure, key=sure.get) if sure else "plain"), rec
        assert row["served_speedup"] == (sure[served] if sure else 1.0), rec
        if served != "plain":
            assert served in rec["measured"], rec
            assert row["served_speedup"] == pytest.approx(rec["served_tok_per_s"] / row["baseline_tok_per_s"])  # fmt: skip
    # the simulated users after round 0 were served with round 0's choice
    from serve.traffic import read_traffic

    served = {r["speculative"] for r in read_traffic(run_dir / "traffic")}
    assert served == {rows[0]["shape"] != "plain"}


@pytest.fixture(scope="module")
def live(closed_run, ray_module):
    """A server with the run's champion drafter, as the loop leaves it serving."""
    from ray import serve

    from pipeline.config import load_config
    from serve.endpoint import deploy_endpoint

    run_dir = closed_run["run_dir"]
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


def _random_drafter(target_dir: Path, out: Path, seed: int) -> str:
    """An untrained drafter of the loop's shape (its draft vocab), saved as a trained one is."""
    from transformers import AutoModelForCausalLM

    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    bad = random_drafter(target, draft_vocab_size=512, seed=seed, aux_layer_ids=[0, 1, 2]).model
    return str(save_drafter(bad.state_dict(), bad.cfg, out, dtype=torch.float32))


@pytest.fixture(scope="module")
def untrained(live, tmp_path_factory, two_token_target) -> dict:
    """The benchmark record of an untrained (random) drafter on the live server, through the
    loop's own benchmark on the rounds' prompts and settings: what a trainer that learns nothing
    serves. The champion serves again afterwards."""
    from pipeline.loop import _eval_set
    from pipeline.round_data import run_prompts

    cfg, ep, state = live
    tmp = tmp_path_factory.mktemp("untrained")
    drafter = _random_drafter(two_token_target, tmp / "random", seed=0)
    evalset = _eval_set(cfg, run_prompts(cfg))
    try:
        rs, r, _, _ = _candidate_round(cfg, state, drafter, 1.0, tmp, evalset, ep)
    finally:
        ep.swap_drafter(state["champion"]["drafter_dir"])
    return rs.rounds[r].done["bench"]


def test_gate_keeps_the_serving_drafter_when_the_new_one_is_worse(live, tmp_path, two_token_target):
    from pipeline.loop import _eval_set, _gate
    from pipeline.round_data import run_prompts

    cfg, ep, state = live
    champion = state["champion"]
    broken = _random_drafter(two_token_target, tmp_path / "random", seed=7)
    evalset = _eval_set(cfg, run_prompts(cfg))
    rs, r, tracker, child = _candidate_round(cfg, state, broken, 1.0, tmp_path, evalset, ep)
    assert rs.rounds[r].done["bench"]["accept_len"] < champion["accept_len"]
    rec = _gate(cfg, rs, r, ep, tracker, child)
    assert rec["promoted"] is False and rec["champion_accept_len"] == champion["accept_len"]
    assert ep.info()["path"] == champion["drafter_dir"]  # the serving drafter is back
    assert rs.champion["drafter_dir"] == champion["drafter_dir"]


def test_collapsed_acceptance_is_an_error_naming_the_drafter(live, tmp_path):
    from pipeline.loop import _eval_set, _gate
    from pipeline.round_data import run_prompts
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
    evalset = _eval_set(cfg, run_prompts(cfg))
    rs, r, tracker, child = _candidate_round(cfg, state, str(dropped), predicted, tmp_path, evalset, ep)  # fmt: skip
    with pytest.raises(AcceptanceCollapsed, match=f"acceptance collapsed: drafter {dropped}"):
        _gate(cfg, rs, r, ep, tracker, child)
    assert ep.info()["path"] == champion["drafter_dir"]
