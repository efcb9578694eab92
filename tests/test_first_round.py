"""A run that starts from a base drafter (`train.first_round: skip`), as users run it
(`python pipeline/run.py`, its own local Ray, sqlite MLflow), with a tiny random target: round 0
makes no data and trains nothing, it serves and benchmarks `drafter.init` as it is, and the
simulated users talk to it; round 1 fine-tunes it on their traffic plus fresh prompts, keeping
its draft vocabulary. `drafter.init` is a relative folder, found from the working directory.
The budget plan is sized from the start-up measurement, which summary.json carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]  # run.py starts its own Ray


def _base_drafter(target: Path, out: Path) -> Path:
    """A drafter in the shipped format: bf16, its own 512-token vocab map, no embedding."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.hf_backend import resolve_aux_layer_ids
    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    lm = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    aux = resolve_aux_layer_ids(None, lm.config.num_hidden_layers)
    d = random_drafter(lm, draft_vocab_size=512, seed=3, aux_layer_ids=aux).model
    return save_drafter(d.state_dict(), d.cfg, out, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_target) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("first")
    base = _base_drafter(tiny_target, tmp / "drafters" / "tiny-base")
    cfg = {
        "name": "first",
        "target": {"model": str(tiny_target)},
        "data": {"source": {"builtin": 0.5, "traffic": 0.5}, "prompts_per_round": 8,
                 "heldout_prompts": 4, "user_prompts": 8, "max_new_tokens": 24, "batch_size": 6,
                 "num_actors": 1, "gate_prompts": 12},
        "drafter": {"init": "drafters/tiny-base"},  # relative: from the working directory
        "train": {"first_round": "skip", "num_workers": 1, "epochs": 2, "lr": 0.003,
                  "ttt_length": 2, "tokens_per_batch": 256, "checkpoint_every": 4},
        "serve": {"steps": 2, "port": free_port(), "record_traffic": True, "simulate_users": 4,
                  "simulate_concurrency": 2},
        # The random target's replies fall mostly outside the base's 512-token draft vocab, so
        # held-out accuracy (over in-vocab positions only) says nothing about serving here: the
        # collapse check (tests/test_closed_loop.py has its own) is off for this run.
        "bench": {"num_prompts": 4, "max_tokens": 16, "warmup": 1, "collapse_predicted": 99,
                  "temperature": 0.7, "top_p": 0.9},  # judged sampled, as users are served
        "stop": {"accept_len": None, "max_rounds": 2, "max_wall_minutes": 20},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "first"},
    }  # fmt: skip
    (tmp / "first.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, str(REPO / "pipeline/run.py"), "--config", "first.yaml", "--run-dir",
         "run"], cwd=tmp, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return tmp / "run", base


def test_round_0_serves_the_base_drafter_untrained_and_its_users_traffic_is_recorded(base_run):
    from serve.traffic import read_traffic

    run_dir, base = base_run
    state = json.loads((run_dir / "state.json").read_text())
    r0, r1 = (r["done"] for r in state["rounds"])
    assert r0["generate"]["skipped"] and not (run_dir / "data" / "round-000").exists()
    assert r0["train"]["skipped"] and r0["train"]["train_tokens"] == 0
    served = Path(r0["train"]["drafter_dir"])
    assert served == run_dir / "train" / "round-000" / "drafter"
    assert (served / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert r0["bench"]["accept_len"] >= 1.0 and r0["gate"]["promoted"]
    assert r0["traffic"]["requests"] == 4 and r0["traffic"]["failed"] == 0
    records = list(read_traffic(run_dir / "traffic"))
    assert len(records) == 4  # the users sample at the settings the rounds are judged at
    assert {(x["temperature"], x["top_p"]) for x in records} == {(0.7, 0.9)}
    settings = r0["bench"]["extra"]["settings"]
    assert (settings["temperature"], settings["top_p"]) == (0.7, 0.9)
    rows = json.loads((run_dir / "summary.json").read_text())["rounds"]
    assert [r["temperature"] for r in rows] == [0.7, 0.7]


def test_round_1_fine_tunes_the_base_drafter_on_the_traffic_keeping_its_vocab(base_run):
    run_dir, base = base_run
    state = json.loads((run_dir / "state.json").read_text())
    r1 = state["rounds"][1]["done"]
    assert r1["generate"]["traffic_records"] == 4  # half of its 8 prompts from the users' log
    manifest = json.loads((run_dir / "data" / "round-001" / "manifest.json").read_text())
    assert manifest["num_samples"] == 8 and r1["train"]["train_tokens"] > 0
    want = load_file(str(base / "model.safetensors"))
    for folder in (run_dir / "train" / "round-001" / "init" / "drafter", Path(r1["train"]["drafter_dir"])):  # fmt: skip
        got = load_file(str(folder / "model.safetensors"))
        assert got["d2t"].equal(want["d2t"]) and got["t2d"].equal(want["t2d"])
    # its key file lists the prompts it trained on: 4 fresh ones and the served requests' (a
    # user may have asked twice; the base had none), unless it exported its start unchanged
    from actors.prompt_keys import KEY_FILE, read_key_file

    made = read_key_file(run_dir / "data" / "round-001" / KEY_FILE)
    assert 5 <= len(made) <= 8
    keys = read_key_file(Path(r1["train"]["drafter_dir"]) / KEY_FILE)
    assert keys == (frozenset() if r1["train"].get("kept_start") else made)


def test_the_plan_comes_from_the_start_up_measurement(base_run):
    run_dir, _ = base_run
    summary = json.loads((run_dir / "summary.json").read_text())
    p0, p1 = summary["plans"]
    m = p0["measured"]
    assert m["plain_s_per_token"] > 0 and m["spec_s_per_token"] > 0 and m["spec_tokens"] == 16
    assert m["drafter"] == "drafters/tiny-base"
    assert p0["data_s"] == p0["train_s"] == 0.0  # round 0 makes no data and trains nothing
    # drafter: 1 warm-up + 4 prompts + 16 shape-choice probes (bench.shape_chains' default
    # 1..5 but the configured chain of serve.steps=2: 4 chains x 4 prompts); plain: 1 + 4
    per_token = (21 * m["spec_s_per_token"] + 5 * m["plain_s_per_token"]) / 26
    assert p0["bench_s_per_request"] == pytest.approx(per_token * 16, abs=0.01)
    assert p1["data_s"] > 0 and p1["train_s"] > 0
    assert [r["round"] for r in summary["rounds"]] == [0, 1]


def test_round_1_makes_the_gate_set_once_and_its_training_is_judged_on_it(base_run):
    """The first round that trains (round 1: round 0 serves its start) makes the gate set in
    <run>/data/gate/, of prompts none of its training took, and its training evaluates there:
    every evaluation scores the same gate samples, and the keep-the-start decision is logged."""
    from actors.prompt_keys import KEY_FILE, key_hash, read_key_file
    from actors.prompts import plan_prompts
    from pipeline.config import load_config

    run_dir, _ = base_run
    r0, r1 = (r["done"] for r in json.loads((run_dir / "state.json").read_text())["rounds"])
    assert "gate_set" not in r0 and r1["gate_set"]["num_samples"] == 12
    gate = json.loads((run_dir / "data" / "gate" / "manifest.json").read_text())
    assert gate["num_samples"] == 12 and Path(r1["gate_set"]["manifest"]).parent.name == "gate"
    plan = plan_prompts(load_config(run_dir / "config.resolved.yaml").data)
    trained = read_key_file(run_dir / "data" / "round-001" / KEY_FILE)
    assert len(plan.gate) == 12 and not {key_hash(p.messages) for p in plan.gate} & trained
    evals = [json.loads(x) for x in (run_dir / "train" / "round-001" / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    evals = [m for m in evals if "eval_tokens" in m]
    assert evals[0]["step"] == 0 and len({m["eval_tokens"] for m in evals}) == 1
    g = r1["train"]["gate"]
    assert (
        g["batches"] >= 2
        and g["z"] == 2.0
        and g["replaced_start"] == (not r1["train"]["kept_start"])
    )


def test_a_finished_run_goes_on_where_a_later_submit_raises_its_stop_rules(base_run):
    """The run stopped on `budget: 2 rounds`. Under its own stop rules it stays finished;
    submitted with stop.max_rounds=3 (the config digest leaves `stop` out: it decides when a run
    ends, not what its rounds make) it runs round 2 from its records, in the same MLflow parent
    run, and stops on the new rules. Last in this module: it adds a round to the shared run."""
    from pipeline.config import load_config
    from pipeline.rules import still_stopped
    from pipeline.state import RunState

    run_dir, _ = base_run
    state0 = json.loads((run_dir / "state.json").read_text())
    st = RunState.load_or_new(run_dir, state0["config_digest"])
    given = run_dir.parent / "first.yaml"
    assert still_stopped(load_config(given).stop, st.rounds, st.elapsed_s) == "budget: 2 rounds"
    assert still_stopped(load_config(given, ["stop.max_rounds=3"]).stop, st.rounds, 0.0) is None

    done = subprocess.run(
        [sys.executable, str(REPO / "pipeline/run.py"), "--config", "first.yaml", "--run-dir",
         "run", "--set", "stop.max_rounds=3"], cwd=run_dir.parent, capture_output=True,
        text=True, timeout=1500,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "run extended (it stopped: budget: 2 rounds)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2]
    assert summary["stopped_because"] != "budget: 2 rounds"  # the new rules' verdict on round 2
    state = json.loads((run_dir / "state.json").read_text())
    assert state["parent_run_id"] == state0["parent_run_id"]
    r1, was = state["rounds"][1]["done"], state0["rounds"][1]["done"]
    assert all(r1[k] == was[k] for k in ("generate", "train", "bench", "gate"))  # not redone
    assert "traffic" not in was and r1["traffic"]["requests"] > 0  # no longer the last: users ask
