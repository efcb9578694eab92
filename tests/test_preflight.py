"""Preflight (pipeline/preflight.py): every problem that needs no model is found in seconds,
before Ray starts and before an MLflow run exists; a run that fails later ends FAILED in MLflow."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

for _dep in ("mlflow", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import yaml
from conftest import tiny_run_config
from mlflow.tracking import MlflowClient

from pipeline.config import parse_config
from pipeline.preflight import PreflightError, looks_local, preflight


def cfg_for(tiny_target: Path, tmp: Path, **sections):
    return parse_config(tiny_run_config(tiny_target, tmp, "pf", **sections))


def problems(cfg) -> str:
    t0 = time.monotonic()
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    assert time.monotonic() - t0 < 10  # seconds, not the 29-79 s a stage took to fail
    return str(e.value)


def test_local_looking_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for local in ("./x", "../x", "/x/y", "~/x", "runs/typo", "a/b/c", "runs x"):
        assert looks_local(local), local
    for hub in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "org/name"):
        assert not looks_local(hub), hub


def test_each_late_failure_is_now_a_preflight_error(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert "target.aux_layer_ids: [0, 1, 9] invalid for a 4-layer target" in problems(
        cfg_for(tiny_target, tmp_path, target={"aux_layer_ids": [0, 1, 9]})
    )  # was 52 s, after Ray and MLflow
    assert "target.model: '/no/such/target' looks like a local path" in problems(
        cfg_for(tiny_target, tmp_path, target={"model": "/no/such/target"})
    )  # was 29 s
    msg = problems(cfg_for(tiny_target, tmp_path, drafter={"init": "runs/typo/drafter"}))
    assert "drafter.init: 'runs/typo/drafter' looks like a local path" in msg  # was a Hub id
    msg = problems(
        cfg_for(tiny_target, tmp_path, data={"source": "jsonl", "path": "prompts/missing.jsonl"})
    )
    assert "data.path" in msg and "missing.jsonl" in msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    assert f"{bad}:2: not valid JSON" in problems(
        cfg_for(tiny_target, tmp_path, data={"source": "jsonl", "path": str(bad)})
    )
    both = problems(
        cfg_for(
            tiny_target,
            tmp_path,
            target={"aux_layer_ids": [7]},
            drafter={"init": "./nope"},
            data={"heldout_prompts": 10**6},
        )
    )
    assert "3 problem(s)" in both and "data.heldout_prompts" in both
    preflight(cfg_for(tiny_target, tmp_path))  # the valid config passes


def test_drafter_that_does_not_fit_is_refused(tiny_target, tmp_path):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    d = random_drafter(target, draft_vocab_size=500, aux_layer_ids=[0, 1, 2]).model
    out = save_drafter(d.state_dict(), d.cfg, tmp_path / "d", dtype=torch.float32)
    preflight(cfg_for(tiny_target, tmp_path, drafter={"init": str(out)}))
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]
    (out / "config.json").write_text(json.dumps(cfg))
    assert "does not fit target.model" in problems(
        cfg_for(tiny_target, tmp_path, drafter={"init": str(out)})
    )


@pytest.mark.before_ray  # runs before the shared Ray starts (conftest)
def test_run_py_stops_before_ray_and_mlflow(tiny_target, tmp_path):
    import ray

    from pipeline.exit_codes import CONFIG
    from pipeline.run import main

    cfg = cfg_for(tiny_target, tmp_path, target={"aux_layer_ids": [0, 1, 9]})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    t0 = time.monotonic()
    assert main(["--config", str(path), "--run-dir", str(tmp_path / "run")]) == CONFIG
    assert time.monotonic() - t0 < 10
    assert not ray.is_initialized() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "run").exists()


def test_a_failed_run_is_marked_failed_and_leaks_no_secret(
    ray_local, tiny_target, tmp_path, caplog
):
    """Weights that only the stage can find broken: the parent and round runs end FAILED."""
    from ray.exceptions import ActorDiedError

    from pipeline.loop import run_loop

    broken = tmp_path / "target"
    shutil.copytree(tiny_target, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    token = "hf_sEcReT0123456789"  # the secret probe: nowhere in what the run writes or logs
    cfg = cfg_for(
        broken, tmp_path, data={"batch_size": 4}, runtime_env={"env_vars": {"HF_TOKEN": token}}
    )
    # the target worker fails to load the zeroed weights: that error, not any other one
    with caplog.at_level(logging.INFO), pytest.raises(ActorDiedError, match=r"TargetWorker\.__init__"):  # fmt: skip
        run_loop(cfg, tmp_path / "run")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("pf").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["pf", "round-0"]
    assert {r.info.status for r in runs} == {"FAILED"}
    assert "resolved config" in caplog.text and token not in caplog.text
    # every file the run wrote (logs, databases, artifacts too) and the Ray session's logs
    ray_logs = Path(ray_local._private.worker._global_node.get_session_dir_path()) / "logs"
    written = [p for d in (tmp_path, ray_logs) for p in d.rglob("*") if p.is_file()]
    assert any(p.suffix == ".log" for p in written) and any(p.name == "mlflow.db" for p in written)
    assert not [p for p in written if token.encode() in p.read_bytes()]
    assert not [v for r in runs for v in r.data.params.values() if token in v]
