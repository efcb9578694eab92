"""The whole loop through `ray job submit` on a local cluster, with a tiny random target.

Two rounds run to completion; then a second run is stopped during round 2's training and
re-submitted: it must finish with exactly 2 MLflow child runs, the same shards, and a complete
summary.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real `ray start --head` on loopback, as users run it."""
    # Token auth on, as Ray 2.60 defaults for local clusters: the head, `ray job submit` and the
    # driver all read ~/.ray/auth_token (made here if missing).
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token")
    bindir = Path(sys.executable).parent
    env["PATH"] = f"{bindir}:{env['PATH']}"  # the job's `python` is this venv's
    token = [str(bindir / "ray"), "get-auth-token", "--generate"]
    subprocess.run(token, check=True, env=env, capture_output=True)
    # Every port this head listens on is a free one: Ray's fixed defaults (client server 10001,
    # dashboard agent 52365) are shared with any other Ray on the machine, and an agent that
    # loses its port leaves the head without a job agent ("No available agent").
    dash, gcs, client, agent = (_free_port() for _ in range(4))
    temp = tmp_path_factory.mktemp("ray")
    log = temp / "ray-start.log"
    # --block, and SIGTERM to stop it: that stops this head's processes only, where
    # `ray stop --force` would kill every Ray on the machine (other test runs' included).
    head = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(gcs), "--ray-client-server-port", str(client),
         "--dashboard-agent-listen-port", str(agent), "--num-cpus", "4",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--disable-usage-stats", f"--temp-dir={temp}"],
        env=dict(env, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"), stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 300
    while "Ray runtime started" not in log.read_text():
        assert head.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(1)
    yield {"address": f"http://127.0.0.1:{dash}", "env": env, "bin": bindir}
    head.terminate()
    try:
        head.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, 9)
        head.wait()


def _config(tmp: Path, tiny_target: Path) -> Path:
    cfg = {
        "name": "e2e",
        "target": {"model": str(tiny_target)},
        "data": {"prompts_per_round": 12, "heldout_prompts": 4, "max_new_tokens": 24, "batch_size": 6,
                 "num_actors": 2},
        "drafter": {"draft_vocab_size": 512},
        "train": {"num_workers": 2, "epochs": 2, "lr": 0.003, "ttt_length": 2, "tokens_per_batch": 256,
                  "checkpoint_every": 2},
        "serve": {"steps": 2, "port": _free_port()},
        "bench": {"num_prompts": 4, "max_tokens": 16, "warmup": 1},
        "stop": {"accept_len": 9.0, "max_rounds": 2},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "e2e"},
    }  # fmt: skip
    path = tmp / "e2e.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _submit(
    head, config: Path, run_dir: Path, wait: bool = True
) -> subprocess.Popen | subprocess.CompletedProcess:
    renv = subprocess.run(
        [sys.executable, "pipeline/run.py", "runtime-env", str(config)],
        cwd=REPO, env=head["env"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    renv_file = config.with_name("runtime-env.json")  # a file, as scripts/demo.sh passes it:
    renv_file.write_text(renv)  # never on the command line, where `ps` shows its env vars
    renv_file.chmod(0o600)
    cmd = [
        str(head["bin"] / "ray"),
        "job",
        "submit",
        "--address",
        head["address"],
        "--runtime-env",
        str(renv_file),
    ]
    if not wait:
        cmd.append("--no-wait")
    cmd += ["--", "python", "pipeline/run.py", "--config", str(config), "--run-dir", str(run_dir)]
    for _ in range(30):  # a fresh head answers "No available agent" until its job agent is up
        done = subprocess.run(
            cmd, cwd=REPO, env=head["env"], capture_output=True, text=True, timeout=1500
        )
        if "No available agent" not in done.stderr + done.stdout:
            break
        time.sleep(2)
    return done


def _child_runs(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id])
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def _manifests(run_dir: Path) -> dict[str, str]:
    return {
        p.parent.name: p.read_text() for p in sorted((run_dir / "data").glob("*/manifest.json"))
    }


def _untrained_accept_len(target: Path, steps: int, num_prompts: int, max_tokens: int) -> float:
    """accept_len of a random drafter (the loop's draft vocab) on the benchmark's held-out
    prompts, greedy, as the benchmark counts it: the bar a trained drafter must clear."""
    import statistics

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.chat import prompt_ids
    from actors.prompts import builtin_prompts, split_prompts
    from serve.engine import GenParams, SpecEngine, random_drafter

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    heldout = split_prompts(builtin_prompts(0), 4, 0)[1][:num_prompts]
    engine = SpecEngine(model, random_drafter(model, draft_vocab_size=512, seed=0), steps=steps)
    gens = engine.generate([prompt_ids(tok, c) for c in heldout], GenParams(max_tokens=max_tokens))
    return statistics.fmean(g.stats.accept_len for g in gens)


def test_two_rounds_then_kill_and_resume(ray_head, tiny_target, tmp_path):
    config = _config(tmp_path, tiny_target)
    run_a = tmp_path / "run-a"
    done = _submit(ray_head, config, run_a)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((run_a / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    assert summary["stopped_because"].startswith("budget: 2 rounds")
    for row in summary["rounds"]:
        assert set(row) >= {
            "accept_len",
            "tok_per_s",
            "baseline_tok_per_s",
            "speedup",
            "train_tokens",
        }
    # The trained drafter beats an untrained one of the same shape on the same held-out prompts.
    untrained = _untrained_accept_len(tiny_target, steps=2, num_prompts=4, max_tokens=16)
    assert summary["rounds"][-1]["accept_len"] > untrained, (summary["rounds"], untrained)
    assert len(_child_runs(tmp_path)) == 2

    # Second run: stop the job while round 2 trains, then submit the same command again.
    run_b = tmp_path / "run-b"
    job = _submit(ray_head, config, run_b, wait=False)
    job_id = next(w for w in job.stdout.split() if w.startswith("raysubmit_"))
    deadline = time.time() + 900
    while time.time() < deadline:
        state = (
            json.loads((run_b / "state.json").read_text())
            if (run_b / "state.json").exists()
            else {}
        )
        rounds = state.get("rounds", [])
        if (
            len(rounds) > 1
            and "generate" in rounds[1]["done"]
            and list((run_b / "train").glob("round-001/*"))
        ):
            break
        time.sleep(2)
    else:
        pytest.fail("round 2 training never started")
    subprocess.run([str(ray_head["bin"] / "ray"), "job", "stop", "--address", ray_head["address"], job_id],
                   env=ray_head["env"], capture_output=True, timeout=120)  # fmt: skip
    state = json.loads((run_b / "state.json").read_text())
    assert "train" not in state["rounds"][1]["done"], "the job finished before it could be stopped"
    shards_before = _manifests(run_b)

    again = _submit(ray_head, config, run_b)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    summary = json.loads((run_b / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1] and summary["stopped_because"]
    assert _manifests(run_b) == shards_before  # no shard regenerated
    children = _child_runs(tmp_path)
    parents = {r.data.tags["mlflow.parentRunId"] for r in children}
    assert len(parents) == 2  # run-a's loop and run-b's loop
    by_parent = {p: sum(r.data.tags["mlflow.parentRunId"] == p for r in children) for p in parents}
    assert sorted(by_parent.values()) == [2, 2]
