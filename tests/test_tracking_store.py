"""The default MLflow store lives in the run directory, so re-running from another working
directory finds the same runs; a state.json naming runs the store does not have is an error that
says what to do, never a silent new parent (real MLflow on sqlite, the real driver)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

for _dep in ("mlflow", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
from mlflow.tracking import MlflowClient

from pipeline.config import parse_config
from pipeline.loop import run_loop
from pipeline.state import RunState
from pipeline.tracking import UnknownRuns

# no Ray, unmarked: `make test` runs it in the shared-Ray pytest, the shorter of the two (2026-12-05: 390 s against 844 s)


def test_default_store_is_the_run_dirs_and_unknown_runs_are_an_error(
    tiny_target, tmp_path, monkeypatch
):
    cfg = parse_config({"name": "st", "target": {"model": str(tiny_target)},
                        "data": {"prompts_per_round": 4, "heldout_prompts": 2}})  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunState(config_digest=cfg.digest(), stopped_because="budget: 1 rounds").save(run_dir)
    for cwd in ("a", "b"):  # a finished run, re-run from two working directories
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        run_loop(cfg, run_dir)
        assert not list((tmp_path / cwd).iterdir())  # no mlflow.db, no mlruns/ here
    state = json.loads((run_dir / "state.json").read_text())
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("eagle-loop").experiment_id])
    assert [r.info.run_id for r in runs] == [state["parent_run_id"]]  # one parent, reused
    assert runs[0].info.artifact_uri.startswith((run_dir / "mlartifacts").as_uri())
    assert state["tracking_uri"] == f"sqlite:///{run_dir}/mlflow.db"

    other = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": f"sqlite:///{tmp_path}/x.db"})}
    )  # fmt: skip
    with pytest.raises(UnknownRuns) as e:
        run_loop(other, run_dir)
    msg = str(e.value)
    assert f"parent {state['parent_run_id']}" in msg and "tracking.tracking_uri" in msg
    assert f"it was made with sqlite:///{run_dir}/mlflow.db" in msg
    assert json.loads((run_dir / "state.json").read_text()) == state  # untouched


def test_tracking_credentials_never_reach_the_unknown_runs_message(tmp_path):
    """A state.json from before the fix may hold `user:password@`; the message masks it."""
    from pipeline.config import TrackingConfig
    from pipeline.tracking import Tracker

    tracker = Tracker(TrackingConfig(), tmp_path)
    with pytest.raises(UnknownRuns) as e:
        tracker.check_known(
            {"parent": "0" * 32}, "state.json", "https://me:hunter2@mlflow.example/"
        )
    assert "https://me:***@mlflow.example/" in str(e.value) and "hunter2" not in str(e.value)


@pytest.mark.slow
def test_a_tracking_server_down_past_the_retries_stops_with_a_message(tmp_path, monkeypatch):
    """Issue 51: a real `mlflow server`, stopped after the run began. A blip is MLflow's client's
    to retry (benchmarks/fault_probes.py mlflow_blip: 20 s down, 0 metrics lost); an outage that
    outlasts its retries (none here, to be quick) stops the stage with a message that names the
    server and says the re-run resumes, where MLflow's own error named neither."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx
    from conftest import free_port

    from pipeline.config import TrackingConfig
    from pipeline.tracking import Tracker, TrackingUnavailable

    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [str(mlflow), "server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/m.db"],
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.5)
        tracker = Tracker(TrackingConfig(tracking_uri=f"http://127.0.0.1:{port}"))
        run = tracker.start_run("r")
        tracker.log(run, {"data/x": 1.0})
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(TrackingUnavailable) as err:
        tracker.log(run, {"data/x": 2.0})
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "unreachable" in msg and "resumes" in msg, msg
    # a resume while the server is down: not "the store does not have these runs", whose fix
    # (a new run directory or state.json moved aside) would start duplicate MLflow runs
    with pytest.raises(TrackingUnavailable):
        tracker.check_known({"parent": run}, "state.json", None)


def test_a_run_directory_copied_to_another_machine_keeps_its_paths_and_its_store(
    tiny_target, tmp_path
):
    """A climb moves between machines as its run directory: packed (`eagle-loop pack`: without
    a finished round's checkpoints), unpacked in another folder, the old one gone, state.json's
    paths and the sqlite store's artifact folder follow the copy, and the next round's runs log
    beside it (before: every path, and every artifact of a new run, still named the old
    folder)."""
    import shutil
    import tarfile

    from pipeline.pack import main as pack_main
    from pipeline.pack import plan_pack
    from pipeline.tracking import Tracker

    cfg = parse_config({"name": "mv", "target": {"model": str(tiny_target)}})
    old = (tmp_path / "gpu-a" / "run").resolve()
    old.mkdir(parents=True)
    tracker = Tracker(cfg.tracking, old)
    parent = tracker.start_run("mv")
    report = old / "bench" / "round-000" / "round-000.json"
    report.parent.mkdir(parents=True)
    report.write_text("{}")
    tracker.log_artifact(parent, report)
    state = RunState(config_digest=cfg.digest(), parent_run_id=parent, tracking_uri=tracker.uri)
    state.round(0).done.update(
        bench={"json": str(report)}, train={"drafter_dir": str(old / "train/round-000/drafter")}
    )
    state.save(old)
    (old / "train/round-000/drafter").mkdir(parents=True)
    (old / "train/round-000/drafter/model.safetensors").write_bytes(b"d" * 100)
    (old / "train/round-000/ray/ckpt").mkdir(parents=True)  # a finished round's checkpoint
    (old / "train/round-000/ray/ckpt/train_state.pt").write_bytes(b"c" * 5000)
    carry, parts, left = plan_pack(old)
    assert Path("train/round-000/drafter/model.safetensors") in carry
    assert not any("ray" in p.parts for p in carry) and sum(left.values()) == 5000
    assert {
        "top level: state, summary, config, MLflow store",
        "mlartifacts",
        "bench",
        "train",
    } <= set(parts)
    assert pack_main(["--run-dir", str(old), "--out", str(tmp_path / "run.tar")]) == 0
    shutil.rmtree(tmp_path / "gpu-a")  # the first machine is gone
    with tarfile.open(tmp_path / "run.tar") as tar:
        tar.extractall(tmp_path / "gpu-b", filter="data")
    new = (tmp_path / "gpu-b" / "run").resolve()

    moved = RunState.load_or_new(new, cfg.digest())
    assert moved.rounds[0].done["bench"]["json"] == str(new / "bench/round-000/round-000.json")
    assert moved.rounds[0].drafter_dir == str(new / "train/round-000/drafter")
    assert moved.tracking_uri == f"sqlite:///{new}/mlflow.db"
    here = Tracker(cfg.tracking, new)
    here.check_known(moved.run_ids(), "state.json", moved.tracking_uri)  # the copy has the runs
    child = here.start_run("round-1", parent)
    here.log_artifact(child, new / "bench" / "round-000" / "round-000.json")
    client = MlflowClient(here.uri)
    for run_id in (parent, child):
        uri = client.get_run(run_id).info.artifact_uri
        assert uri.startswith((new / "mlartifacts").as_uri()), uri
    got = client.download_artifacts(parent, "round-000.json", str(tmp_path))
    assert Path(got).read_text() == "{}" and not (tmp_path / "gpu-a").exists()
    moved.save(new)
    assert json.loads((new / "state.json").read_text())["run_dir"] == str(new)
