"""Stop rules, run state and the MLflow seam (real MLflow on sqlite)."""

from __future__ import annotations

import pytest

for _dep in ("mlflow", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)

import mlflow  # noqa: E402

from pipeline.config import StopConfig, TrackingConfig
from pipeline.rules import kendall_tau, round_row, sim_vs_bench, stop_reason
from pipeline.state import RunState
from pipeline.tracking import Tracker


def rows(*acc):
    return [{"round": i, "accept_len": a, "tok_per_s": 10.0, "baseline_tok_per_s": 8.0, "speedup": 1.25,
             "train_tokens": 1} for i, a in enumerate(acc)]  # fmt: skip


BENCH = {"baseline_tok_per_s": 82.5, "verify_ms": 30.0, "draft_ms": 0.0, "steps": None}


def test_stop_rules_in_order():
    s = StopConfig(accept_len=2.5, plateau_eps=0.05, plateau_rounds=2, max_rounds=5)
    assert stop_reason(s, rows(2.0), BENCH, 0) is None
    assert stop_reason(s, rows(2.0, 2.6), BENCH, 0).startswith("target: accept_len")
    assert stop_reason(s, rows(2.0, 2.02, 2.03), BENCH, 0).startswith("plateau")
    assert stop_reason(s, rows(1.5, 1.8, 2.0, 2.2, 2.4), BENCH, 0).startswith("budget: 5 rounds")
    s2 = StopConfig(accept_len=None, max_rounds=9, max_wall_minutes=1)
    assert stop_reason(s2, rows(1.5), BENCH, 61).startswith("budget: wall time")
    # the budget planner's refusal of the next round (plan_round's BudgetError) stops the loop
    assert stop_reason(s2, rows(1.5), BENCH, 30, None) is None
    got = stop_reason(s2, rows(1.5), BENCH, 30, "stop.max_wall_minutes: 30 s left")
    assert got == "budget: the next round does not fit: stop.max_wall_minutes: 30 s left"


def test_the_simulations_rank_agreement_with_the_benchmark():
    assert kendall_tau([(1.8, 2.1)]) is None
    assert kendall_tau([(1.8, 2.1), (1.9, 2.4), (2.0, 2.5)]) == 1.0
    assert kendall_tau([(1.8, 2.5), (1.9, 2.4)]) == -1.0
    # round 1 started from round 0's drafter (sim 1.83, served 2.12) and exported one at 1.87
    # that served 2.30: two pairs, ordered alike
    rows = [{"round": 0, "accept_len": 2.12, "wall_s": 60.0},
            {"round": 1, "accept_len": 2.30, "wall_s": 60.0, "predicted_accept_len": 1.87,
             "predicted_start_accept_len": 1.83, "champion_accept_len": 2.12}]  # fmt: skip
    got = sim_vs_bench(rows)
    assert got["rounds"] == [[1, 1.87, 2.3]] and got["starts"] == [[1, 1.83, 2.12]]
    assert got["rank_agreement"] == 1.0


def test_kendall_tau_counts_concordant_minus_discordant_pairs():
    assert kendall_tau([]) is None and kendall_tau([(1.0, 2.0)]) is None
    # 3 pairs of pairs: (a,b) and (a,c) ordered alike, (b,c) reversed -> (2 - 1) / 3
    assert kendall_tau([(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]) == round(1 / 3, 4)
    # a tie on either side counts neither way
    assert kendall_tau([(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == round(2 / 3, 4)


def test_summary_rows_and_sim_vs_bench_carry_what_each_round_exported():
    """A round row holds training's prediction of the drafter it exported beside the
    benchmark's figure and whether it kept its start; sim_vs_bench ranks the rounds by both."""

    def done(pred, acc, kept=False):
        train = {
            "train_tokens": 1,
            "eval_metrics": {"sim_accept_len": pred},
            "kept_start": kept,
            "start_eval_metrics": {"sim_accept_len": pred} if kept else {},
        }
        return {"train": train, "bench": {"accept_len": acc, "tok_per_s": 1.0,
                                          "baseline_tok_per_s": 1.0, "speedup": 1.0}}  # fmt: skip

    rows = [
        round_row(i, done(*d)) for i, d in enumerate([(1.8, 2.1), (1.9, 2.4), (1.9, 2.4, True)])
    ]
    assert [(r["predicted_accept_len"], r["accept_len"], r["kept_start"]) for r in rows] == [
        (1.8, 2.1, False), (1.9, 2.4, False), (1.9, 2.4, True)]  # fmt: skip
    got = sim_vs_bench(rows)
    assert got["rounds"] == [[0, 1.8, 2.1], [1, 1.9, 2.4], [2, 1.9, 2.4]]
    assert got["rank_agreement"] == round(2 / 3, 4)  # rounds 1 and 2 tie: neither way
    no_sim = round_row(0, {"train": {"train_tokens": 0}, "bench": done(0, 2.0)["bench"]})
    assert sim_vs_bench([no_sim]) == {"rounds": [], "starts": [], "rank_agreement": None}


def test_tok_per_s_goal_uses_the_planner():
    # 150 tok/s at 82.5 tok/s baseline and 30 ms verify needs accept_len 4.5.
    s = StopConfig(accept_len=None, tok_per_s=150, max_rounds=9)
    assert stop_reason(s, rows(4.4), BENCH, 0) is None
    assert "tok/s goal" in stop_reason(s, rows(4.55), BENCH, 0)


def test_state_refuses_other_config(tmp_path):
    st = RunState.load_or_new(tmp_path, "abc")
    st.round(1).done["generate"] = {"manifest": "m"}
    st.save(tmp_path)
    again = RunState.load_or_new(tmp_path, "abc")
    assert again.rounds[1].is_done("generate") and not again.rounds[0].is_done("generate")
    with pytest.raises(ValueError, match="another config"):
        RunState.load_or_new(tmp_path, "zzz")


def test_a_run_from_an_earlier_release_resumes_and_a_changed_field_is_named(tmp_path):
    """A run directory whose state carries another digest resumes where its stored resolved
    config says the same: a field it lacks (a newer release added it) at its default, a secret
    it masks, another stop rule, other shares of a machine (a climb moved to another machine).
    Any other difference is refused, naming the field."""
    import yaml

    from pipeline.config import dump_config, parse_config

    given = {"data": {"batch_size": 8}, "runtime_env": {"env_vars": {"HF_TOKEN": "hf_secret"}}}
    RunState.load_or_new(tmp_path, "an-earlier-releases-digest").save(tmp_path)
    stored = yaml.safe_load(dump_config(parse_config(given)))
    assert stored["runtime_env"]["env_vars"]["HF_TOKEN"] != "hf_secret"  # written masked
    del stored["train"]["continue_kept"]  # as a release before the field wrote it
    (tmp_path / "config.resolved.yaml").write_text(yaml.safe_dump(stored))
    moved = {"target": {"num_gpus_per_actor": 0.75}, "serve": {"num_gpus": 0.25, "num_cpus": 4}}
    same = parse_config({**given, **moved, "stop": {"max_rounds": 9}, "train": {"gpus_per_worker": 0.5}})  # fmt: skip
    st = RunState.load_or_new(tmp_path, same.digest(), same.changes_from)
    assert st.config_digest == same.digest()
    other = parse_config({**given, "data": {"batch_size": 16}, "train": {"ttt_length": 3}})
    with pytest.raises(ValueError, match=r"data.batch_size: 8 -> 16; train.ttt_length: 7 -> 3\)"):  # fmt: skip
        RunState.load_or_new(tmp_path, other.digest(), other.changes_from)


def test_tracker_with_an_outer_run_active(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_name="outer") as outer:
        t = Tracker(TrackingConfig(tracking_uri=uri, experiment="e", registered_model="m"))
        parent = t.start_run("loop", params={"train": {"lr": 0.1}, "hf_token": "s3cret"})
        child = t.start_run("round-0", parent_id=parent)
        t.log(child, {"bench/accept_len": 2.0, "train/loss": float("nan")})
        (tmp_path / "drafter").mkdir()
        (tmp_path / "drafter" / "config.json").write_text("{}")
        t.log_artifact(child, tmp_path / "drafter", "drafter")
        v1 = t.register_champion(child)
        assert t.register_champion(child) == v1  # resume does not add versions
        assert mlflow.active_run().info.run_id == outer.info.run_id
    c = t.client.get_run(child)
    assert c.data.tags["mlflow.parentRunId"] == parent
    assert c.data.metrics == {"bench/accept_len": 2.0}
    p = t.client.get_run(parent)
    assert p.data.params["train.lr"] == "0.1" and p.data.params["hf_token"] == "***"
    assert t.client.get_model_version_by_alias("m", "champion").run_id == child


def test_a_training_curve_reaches_mlflow_whole_in_batches(tmp_path):
    """A round's curve goes in requests of up to MLflow's 1,000 metrics, not one a step: every
    step of every metric arrives, across a batch's edge, and a NaN is left out."""
    t = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="e"))
    run = t.start_run("round-0")
    calls = []
    log_batch = t.client.log_batch
    t.client.log_batch = lambda run_id, metrics: calls.append(len(metrics)) or log_batch(run_id, metrics=metrics)  # fmt: skip
    curve = [(s, {"train/loss": 1.0 / (s + 1), "train/lr": float("nan") if s == 7 else 1e-4})
             for s in range(1, 601)]  # fmt: skip
    t.log_steps(run, curve)
    assert calls == [1000, 199]
    loss = t.client.get_metric_history(run, "train/loss")
    assert sorted(m.step for m in loss) == list(range(1, 601))
    assert len(t.client.get_metric_history(run, "train/lr")) == 599


def test_the_experiment_opens_on_its_runs_and_a_kind_set_by_hand_stays(tmp_path):
    """MLflow 3's UI opens an experiment with no kind in its GenAI view, where there are no runs."""
    from pipeline.tracking import EXPERIMENT_KIND

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(TrackingConfig(tracking_uri=uri, experiment="e"))
    assert (
        t.client.get_experiment(t.experiment_id).tags[EXPERIMENT_KIND[0]]
        == "custom_model_development"
    )
    t.client.set_experiment_tag(t.experiment_id, EXPERIMENT_KIND[0], "finetuning")
    again = Tracker(TrackingConfig(tracking_uri=uri, experiment="e"))  # a resume
    assert again.client.get_experiment(again.experiment_id).tags[EXPERIMENT_KIND[0]] == "finetuning"


def test_the_stop_rules_budget_question_counts_the_users_still_to_run(tmp_path):
    """After round 0's gate, round 1 is planned into what is left minus the simulated users that
    still run before it (80 s planned): 183 s left after them is short of round 1's benchmark
    (19 requests x 7 s = 133 s) plus 60 s; at the same clock with the users already run, 263 s
    is enough. The question is plan_round's own (pipeline/round_plan.round_plan)."""
    from pipeline.config import parse_config
    from pipeline.round_plan import next_round_refusal
    from pipeline.state import Clock

    cfg = parse_config({
        "stop": {"accept_len": None, "max_rounds": 2, "max_wall_minutes": 10},
        "serve": {"simulate_users": 16},
        "data": {"user_prompts": 64},
        "bench": {"num_prompts": 18, "warmup": 1, "baseline_prompts": 4, "reuse_baseline": True},
    })  # fmt: skip
    state = RunState.load_or_new(tmp_path, "abc")
    done = state.round(0).done
    done["plan"] = {"traffic_s": 80.0, "bench_s_per_request": 7.0, "traffic_s_per_request": 5.0}
    done["bench"] = {"wall_s": 168.0}  # 24 requests at 7 s
    state.elapsed_s = 600.0 - 80.0 - 183.0
    got = next_round_refusal(cfg, state, 0, Clock(state))
    assert got is not None and "stop.max_wall_minutes" in got
    done["traffic"] = {"wall_s": 80.0}
    assert next_round_refusal(cfg, state, 0, Clock(state)) is None


def test_the_runs_page_asks_for_model_training_and_hides_a_password():
    """MLflow 3.17's UI opens an experiment in its GenAI view, whatever its kind tag, unless the
    address asks for model training (docs/img/mlflow-experiment-link.png against mlflow-runs.png)."""
    from pipeline.tracking import runs_page

    got = runs_page("http://user:pw@127.0.0.1:5099/", "7")
    assert got.endswith("127.0.0.1:5099/#/experiments/7/runs?workflowType=machine_learning")
    assert "pw" not in got
    assert runs_page("sqlite:////tmp/x/mlflow.db", "7") is None  # no UI address


def test_the_curve_puts_each_rounds_accept_len_against_its_data_and_the_minutes_so_far(tmp_path):
    from pipeline.plots import curve_plot
    from pipeline.rules import curve

    rs = [{"round": i, "accept_len": a, "train_tokens": t, "wall_s": w, "promoted": p,
           "domains": {"chat": a + 0.1, "math": a - 0.1}}
          for i, (a, t, w, p) in enumerate([(2.4, 1000, 120, True), (2.3, 2000, 60, False),
                                            (2.6, 3000, 180, True)])]  # fmt: skip
    gpu = curve(rs, gpus=2)
    assert gpu["minutes"] == "GPU minutes"
    assert [p["minutes"] for p in gpu["points"]] == [4.0, 6.0, 12.0]  # accumulated, x 2 GPUs
    assert [p["train_tokens"] for p in gpu["points"]] == [1000, 3000, 6000]  # so far
    assert [p["promoted"] for p in gpu["points"]] == [True, False, True]
    cpu = curve(rs, gpus=0)
    assert cpu["minutes"] == "wall minutes" and cpu["points"][-1]["minutes"] == 6.0
    png = curve_plot(gpu, tmp_path / "c.png", {"scratch": {"train_tokens": 6000, "minutes": 9.0,
                                                           "accept_len": 2.5}})  # fmt: skip
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_each_rounds_gain_counts_from_what_the_run_measured_before_it():
    """From scratch round 0 gains over no drafter (1.0); a climb from a trained drafter never
    benchmarked its start, so its round 0 has no gain (the base climb of 2026-12-06 credited its
    round 0 with 1.797, the start's whole acceptance). Later rounds gain over the best promoted."""
    from pipeline.rules import costs

    def row(i, a, start=None, tokens=100, promoted=True):
        return {"round": i, "accept_len": a, "wall_s": 600.0, "train_tokens": tokens,
                "predicted_start_accept_len": start, "promoted": promoted}  # fmt: skip

    scratch = costs([row(0, 2.0), row(1, 2.5)], cpus=2, gpus=0)["per_round"]
    assert [r["gain"] for r in scratch] == [1.0, 0.5]
    assert scratch[0]["gain_per_cpu_minute"] == pytest.approx(1.0 / 20)
    climb = costs([row(0, 2.797, start=2.71), row(1, 2.70, start=2.77, promoted=False),
                   row(2, 2.902, start=2.77)], cpus=16, gpus=1)["per_round"]  # fmt: skip
    assert climb[0]["gain"] is None and climb[0]["gain_per_gpu_hour"] is None
    assert [r["gain"] for r in climb[1:]] == [pytest.approx(-0.097), pytest.approx(0.105)]
    skipped = costs([row(0, 2.2, tokens=0), row(1, 2.3)], cpus=2, gpus=0)["per_round"]
    assert skipped[0]["gain"] is None and skipped[1]["gain"] == pytest.approx(0.1)


def test_the_off_policy_climb_stops_on_the_bases_own_held_out_figure():
    """configs/smollm2-1gpu-climb-offpolicy.yaml starts from the drafter that does not fit and
    stops when it accepts what the on-policy base does on the same benchmark (its record)."""
    import json
    from pathlib import Path

    from pipeline.config import load_config

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "configs" / "smollm2-1gpu-climb-offpolicy.yaml")
    base = json.loads((root / "benchmarks/results/2026-12-02-h200-base-rebuild.json").read_text())
    assert cfg.drafter.init == "drafters/smollm2-135m-offpolicy"
    assert cfg.stop.accept_len == base["rounds"][0]["accept_len"]
    assert (cfg.bench.num_prompts, cfg.bench.max_tokens) == (48, 256)  # the base's benchmark
    assert cfg.train.data_rounds is None and cfg.train.patience is None
    assert stop_reason(cfg.stop, rows(2.167, 2.4), BENCH, 0) is None
    assert stop_reason(cfg.stop, rows(2.167, 2.4, 2.66), BENCH, 0).startswith("target: accept_len")
