"""The config tree: every shipped config validates; bad input names the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip

from pipeline.config import Config, ConfigError, load_config, parse_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_every_shipped_config_validates():
    names = {c.name for c in CONFIGS}
    assert {"smollm2-cpu.yaml", "llama31-8b-1gpu.yaml", "kimi-k25-8gpu.yaml"} <= names, names
    for path in CONFIGS:
        cfg = load_config(path)
        assert isinstance(cfg, Config)


def test_kimi_config_is_the_seed_scenario():
    cfg = load_config(Path(__file__).parent.parent / "configs" / "kimi-k25-8gpu.yaml")
    assert cfg.target.model == "moonshotai/Kimi-K2.5" and cfg.target.tp_size == 8
    assert cfg.drafter.init == "AQ-MedAI/Kimi-K2-Instruct-eagle3"
    assert cfg.stop.accept_len == 4.5
    assert cfg.runtime_env["env_vars"] == {
        "NCCL_PROTO": "LL",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "SYS",
    }


def test_all_problems_reported_at_once_with_paths(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 0\n  lerning_rate: 1\ndata:\n  batch_size: -1\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert "train.epochs" in msg and "train.lerning_rate" in msg and "data.batch_size" in msg
    assert "unknown field" in msg and "3 problem(s)" in msg


def test_cross_field_error_names_fix():
    with pytest.raises(ConfigError, match="data.path: required when data.source='jsonl'"):
        parse_config({"data": {"source": "jsonl"}})


def test_overrides_go_through_validation(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: x\n")
    assert load_config(f, ["train.epochs=2", "serve.steps=4"]).train.epochs == 2
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(f, ["train.epochs=zero"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_digest_is_stable_and_sensitive():
    a, b = parse_config({}), parse_config({"train": {"epochs": 2}})
    assert a.digest() == parse_config({}).digest() != b.digest()


def test_a_local_ray_fits_every_stage_beside_the_live_server():
    """Run directly, pipeline/run.py starts Ray itself: the embedded server keeps its CPUs
    across rounds, so the next round's trainers and target actors must still fit beside it."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "pipeline"))
    from run import local_num_cpus

    for path in CONFIGS:
        for replicas in (1, 2):  # serve.num_replicas: each replica keeps its CPUs
            cfg = load_config(path)
            cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"num_replicas": replicas})})  # fmt: skip
            n = local_num_cpus(cfg)
            server = cfg.serve.num_cpus * replicas if cfg.serve.num_gpus == 0 else 0
            assert n >= server + cfg.train.num_workers * cfg.train.cpus_per_worker, path.name
            assert n >= server + cfg.data.num_actors, path.name  # actors take >= 1 CPU each


def test_one_set_syntax_for_every_cli():
    """`--set` takes one override or several, and may repeat: the same flag in every CLI."""
    import argparse

    from actors.config import add_set_argument

    ap = argparse.ArgumentParser()
    add_set_argument(ap)
    args = ap.parse_args(["--set", "a.b=1", "c=2", "--set", "d.e=[1, 2]"])
    assert args.set == ["a.b=1", "c=2", "d.e=[1, 2]"]
    assert ap.parse_args([]).set == []


def test_the_data_stage_cli_reads_its_own_sections(tmp_path):
    """`python -m actors.generate` validates target:/data: with the data stage's own classes,
    cross-checks included, and leaves the other sections to their stages."""
    from actors.config import load_data_stage_config

    f = tmp_path / "c.yaml"
    f.write_text("name: x\ntrain:\n  epochs: 3\ntarget:\n  backend: sglang\n")
    cfg = load_data_stage_config(f, ["data.batch_size=4"])
    assert cfg.target.backend == "sglang" and cfg.data.batch_size == 4
    assert cfg.digest() != load_data_stage_config(f).digest()
    with pytest.raises(ConfigError, match="data.capture: 'decode' needs target.backend=hf"):
        load_data_stage_config(f, ["data.capture=decode"])
    with pytest.raises(ConfigError, match="data.lerning"):
        load_data_stage_config(f, ["data.lerning=1"])


def test_round_0_has_its_own_size_and_epochs():
    cfg = parse_config({"data": {"prompts_per_round": 192, "first_round_prompts": 1280},
                        "train": {"epochs": 1, "first_round_epochs": 4}})  # fmt: skip
    assert [cfg.data.prompts_for_round(r) for r in (0, 1, 5)] == [1280, 192, 192]
    assert [cfg.train.for_round(r).epochs for r in (0, 1, 5)] == [4, 1, 1]
    plain = parse_config({"train": {"epochs": 3}})
    assert plain.train.for_round(0).epochs == 3 and plain.data.prompts_for_round(0) == 400


def test_a_round_that_starts_from_a_trained_drafter_takes_the_fine_tuning_recipe():
    cfg = parse_config({"train": {"lr": 1e-3, "warmup_ratio": 0.015, "epochs": 4, "ttt_length": 5,
                                  "finetune": {"lr": 2e-5, "anchor": 1e-4, "ttt_length": 4}}})  # fmt: skip
    scratch = cfg.train.for_round(0, from_drafter=False)
    tuned = cfg.train.for_round(1, 60.0, from_drafter=True)
    assert (scratch.lr, scratch.warmup_ratio, scratch.anchor, scratch.ttt_length) == (1e-3, 0.015, 0.0, 5)  # fmt: skip
    assert (tuned.lr, tuned.warmup_ratio, tuned.anchor, tuned.ttt_length) == (2e-5, 0.1, 1e-4, 4)
    assert tuned.epochs == 4 and tuned.max_seconds == 60.0  # None in the recipe keeps train's
    assert (scratch.gate_z, tuned.gate_z) == (0.0, 2.0)  # only a start has a bar to clear
    off = parse_config({"train": {"lr": 1e-3, "finetune": None}}).train
    assert off.for_round(1, from_drafter=True).lr == 1e-3 and off.for_round(1).anchor == 0.0


def test_first_round_skip_needs_a_drafter_to_serve():
    with pytest.raises(ConfigError, match="train.first_round: skip serves drafter.init"):
        parse_config({"train": {"first_round": "skip"}})
    cfg = parse_config({"train": {"first_round": "skip"}, "drafter": {"init": "org/drafter"}})
    assert cfg.train.first_round == "skip"


def test_a_relative_drafter_init_is_found_from_the_working_dir_else_the_checkout(tmp_path, monkeypatch):  # fmt: skip
    from pipeline.config import DrafterConfig

    (tmp_path / "drafters" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # as under `ray job submit --working-dir .`: the repo's copy
    assert DrafterConfig(init="drafters/base").resolved_init() == str(tmp_path / "drafters/base")
    repo = Path(__file__).resolve().parent.parent
    assert DrafterConfig(init="configs").resolved_init() == str(repo / "configs")  # the checkout's
    assert DrafterConfig(init="org/name").resolved_init() == "org/name"  # a Hub id stays
    assert DrafterConfig(init="scratch").resolved_init() == "scratch"


def test_a_time_budget_needs_the_engine_the_start_up_measurement_times():
    with pytest.raises(ConfigError, match="stop.max_wall_minutes: the budget plan is sized"):
        parse_config({"stop": {"max_wall_minutes": 10}, "serve": {"engine": "sglang"}})


def test_early_data_runs_beside_a_cpu_server_and_each_round_times_its_own_baseline():
    with pytest.raises(ConfigError, match="data.early_start: generates on the CPU cores"):
        parse_config({"data": {"early_start": True}, "target": {"num_gpus_per_actor": 1}})
    with pytest.raises(ConfigError, match="bench.reuse_baseline: the first round's baseline"):
        parse_config({"data": {"early_start": True}, "bench": {"reuse_baseline": True}})
    assert parse_config({"data": {"early_start": True}}).data.early_start


def test_early_data_starts_only_where_round_r_leaves_time_to_overlap(tmp_path):
    from pipeline.round_data import start_early
    from pipeline.state import RunState

    cfg = parse_config({"data": {"early_start": True}, "stop": {"max_rounds": 2}})
    state = RunState(config_digest="d")
    assert start_early(cfg, tmp_path, state, 0, None, seconds=0.0) is None  # resumed: none left
    assert start_early(cfg, tmp_path, state, 1, None, seconds=100.0) is None  # the last round
    assert not list(tmp_path.iterdir())


def test_a_round_trains_on_the_data_window_of_train_data_rounds():
    made = ["r0", "r1", "r2", "r3"]  # the rounds that made data, oldest first
    assert parse_config({}).train.data_window(made) == made  # all accumulated data
    assert parse_config({"train": {"data_rounds": 1}}).train.data_window(made) == ["r3"]
    assert parse_config({"train": {"data_rounds": 2}}).train.data_window(made[:1]) == ["r0"]
    with pytest.raises(ConfigError, match="train.data_rounds"):
        parse_config({"train": {"data_rounds": 0}})


def test_states_are_online_where_the_target_fits_beside_the_trainer():
    """`data.states: auto`: online for an HF target trained on GPUs, offline on CPUs (the decode
    keeps the states for free there) and for SGLang/vLLM targets; online with those is refused
    naming the fix. The GPU climb asks for online; the CPU demo stays offline."""
    assert parse_config({"train": {"use_gpu": True}}).states() == "online"
    assert parse_config({}).states() == "offline"
    sglang = {"target": {"backend": "sglang"}, "train": {"use_gpu": True}}
    assert parse_config(sglang).states() == "offline"
    assert parse_config({"data": {"states": "online"}}).states() == "online"
    for backend in ("sglang", "vllm"):
        with pytest.raises(ConfigError, match=rf"data.states: 'online' needs target.backend=hf .*{backend}"):  # fmt: skip
            parse_config({"target": {"backend": backend}, "data": {"states": "online"}})
    configs = Path(__file__).parent.parent / "configs"
    assert load_config(configs / "smollm2-1gpu-climb.yaml").states() == "online"
    assert load_config(configs / "smollm2-cpu.yaml").states() == "offline"


def test_a_gpu_server_stays_between_rounds_only_where_the_next_stages_fit_beside_it():
    """One GPU: a server on all of it stops after its round (the data stage and training need
    the GPU) and the next benchmark starts it again; on a quarter, with the stages on the other
    three quarters, it stays. SGLang and vLLM take a fraction of the whole card: they stop. A
    CPU server holds no GPU. The climb configs share their GPU."""
    gpu = {"target": {"num_gpus_per_actor": 1}, "train": {"use_gpu": True, "num_workers": 1},
           "serve": {"num_gpus": 1}}  # fmt: skip
    assert not parse_config(gpu).serves_through_rounds(1)
    assert parse_config(gpu).serves_through_rounds(2)  # two GPUs: the stages take the other
    shared = {"target": {"num_gpus_per_actor": 0.75},
              "train": {"use_gpu": True, "num_workers": 1, "gpus_per_worker": 0.75},
              "serve": {"num_gpus": 0.25}}  # fmt: skip
    assert parse_config(shared).serves_through_rounds(1)
    wide = {**shared, "train": {"use_gpu": True, "num_workers": 2, "gpus_per_worker": 0.75}}
    assert not parse_config(wide).serves_through_rounds(1)  # training's 1.5 do not fit beside
    assert not parse_config({**shared, "serve": {"num_gpus": 0.25, "engine": "vllm"}}).serves_through_rounds(1)  # fmt: skip
    assert parse_config({}).serves_through_rounds(0)
    configs = Path(__file__).parent.parent / "configs"
    for name in ("smollm2-1gpu-climb.yaml", "smollm2-1gpu-climb-offpolicy.yaml"):
        assert load_config(configs / name).serves_through_rounds(1), name
