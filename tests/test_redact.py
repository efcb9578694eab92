"""Secrets by name are masked everywhere the config is written or logged: one rule
(pipeline/redact.py), applied by dump_config (config.resolved.yaml, train_config.yaml, the driver
log) and by MLflow params (real MLflow on sqlite)."""

from __future__ import annotations

import pytest

for _dep in ("mlflow", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)

from mlflow.tracking import MlflowClient

from pipeline.config import TrackingConfig, dump_config, parse_config
from pipeline.redact import MASK, is_secret, redact
from pipeline.tracking import Tracker

TOKEN = "hf_sEcReT0123456789"


def test_the_rule():
    for key in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD",
                "hfToken", "api-key", "credentials_file", "HUGGING_FACE_HUB_TOKEN"):  # fmt: skip
        assert is_secret(key), key
    for key in ("max_tokens", "max_new_tokens", "tokens_per_batch", "num_key_value_heads",
                "tokenizer", "self_prompt_max_tokens", "key_len"):  # fmt: skip
        assert not is_secret(key), key
    got = redact(
        {
            "env_vars": {"HF_TOKEN": TOKEN, "PATH": "/bin", "EMPTY_TOKEN": ""},
            "args": ["--api-key", TOKEN, "--port", "1", f"--admin-password={TOKEN}"],
            "uri": f"http://alice:{TOKEN}@127.0.0.1:5000",
            "max_tokens": 5,
        }
    )
    assert got == {
        "env_vars": {"HF_TOKEN": MASK, "PATH": "/bin", "EMPTY_TOKEN": ""},
        "args": ["--api-key", MASK, "--port", "1", f"--admin-password={MASK}"],
        "uri": f"http://alice:{MASK}@127.0.0.1:5000",
        "max_tokens": 5,
    }


def test_config_dump_and_mlflow_params_hold_no_secret(tmp_path):
    cfg = parse_config(
        {
            "runtime_env": {"env_vars": {"HF_TOKEN": TOKEN}},
            "serve": {"extra_args": ["--api-key", TOKEN]},
            "target": {"env": {"WANDB_API_KEY": TOKEN}},
            "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/m.db"},
        }
    )
    text = dump_config(cfg)  # config.resolved.yaml, train_config.yaml and the log line
    assert TOKEN not in text and "HF_TOKEN: '***'" in text
    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/m.db"))
    rid = tracker.start_run("r", params=cfg.model_dump(mode="json"))
    params = MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(rid).data.params
    assert not [k for k, v in params.items() if TOKEN in v]
    assert params["runtime_env.env_vars.HF_TOKEN"] == MASK
    assert params["data.max_new_tokens"] == "256"  # was masked too: "token" matched anywhere


def test_secret_env_vars_never_travel_in_a_jobs_runtime_env(tmp_path):
    """Ray puts a job's env_vars on its workers' command lines (`ps`) and in its runtime-env
    agent's log: secrets go to the nodes' environment (`node-env`), the rest with the job."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from pipeline.run import job_runtime_env

    cfg = tmp_path / "c.yaml"
    env = {"HF_TOKEN": "hf_planted", "MLFLOW_TRACKING_PASSWORD": "pw planted", "NCCL_PROTO": "LL"}
    cfg.write_text(yaml.safe_dump({"runtime_env": {"env_vars": env}}))
    job = job_runtime_env(str(cfg), str(tmp_path))
    assert job["env_vars"]["NCCL_PROTO"] == "LL"
    assert "hf_planted" not in json.dumps(job) and "pw planted" not in json.dumps(job)
    run = Path(__file__).resolve().parents[1] / "pipeline" / "run.py"
    out = subprocess.run([sys.executable, str(run), "node-env", str(cfg)], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.splitlines() == ["export HF_TOKEN=hf_planted", "export MLFLOW_TRACKING_PASSWORD='pw planted'"]  # fmt: skip
