"""`eagle-loop` (pipeline/cli.py): every command's --help has an example, and each exit code of
pipeline/exit_codes.py is returned by its own case, each a real one: a wrong command line, a bad
config, a config the preflight refuses, a run directory another driver holds, a run that stops."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

for _dep in ("mlflow", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import yaml
from conftest import tiny_run_config

from pipeline.cli import COMMANDS, main
from pipeline.exit_codes import BUSY, CONFIG, FAILED, OK, USAGE

ROOT = Path(__file__).resolve().parent.parent


def small_config(tiny_target: Path, tmp: Path, **sections) -> Path:
    """A config the preflight passes in seconds: the tiny target, a few prompts."""
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_run_config(tiny_target, tmp, "cli", **sections)))
    return path


def test_the_console_script_is_declared():
    """`make setup` (pip install -e '.[dev]') installs what pyproject.toml declares."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"] == {"eagle-loop": "pipeline.cli:main"}


def test_top_level_help_lists_every_command_and_the_exit_codes(capsys):
    assert main(["--help"]) == OK
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n    {name}" in out, name
    assert "exit codes:" in out and "example:\n  eagle-loop run --config" in out
    assert main(["--version"]) == OK
    assert capsys.readouterr().out.startswith("eagle-loop ")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_exits_0_with_an_example(name, capsys):
    assert main([name, "--help"]) == OK
    out = capsys.readouterr().out
    assert out.startswith(f"usage: eagle-loop {name}"), out[:200]
    assert f"example:\n  eagle-loop {name} " in out
    assert out.count("example:") == 1


@pytest.mark.parametrize(
    "argv", [[], ["nope"], ["run"], ["runtime-env"], ["node-env"], ["plan", "--verify-ms", "x"]]
)
def test_a_wrong_command_line_is_a_usage_error(argv, capsys):
    assert main(argv) == USAGE
    assert "usage:" in capsys.readouterr().err


def test_run_py_keeps_its_script_form():
    """`ray job submit ... -- python pipeline/run.py` and scripts/demo.sh's `runtime-env`:
    the script still runs from its path; without a config it is a usage error, not IndexError."""
    run = [sys.executable, str(ROOT / "pipeline" / "run.py")]
    done = subprocess.run([*run, "runtime-env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == USAGE and "IndexError" not in done.stderr, done.stderr
    assert "the following arguments are required: config" in done.stderr
    done = subprocess.run(
        [*run, "runtime-env", str(ROOT / "configs" / "smollm2-cpu.yaml")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == OK, done.stderr
    assert ".venv/" in json.loads(done.stdout)["excludes"]
    done = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == OK and "runtime-env CONFIG" in done.stdout


def test_a_bad_config_is_a_config_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  epochz: 2\n")
    for argv in (["run", "--config", str(bad)], ["preflight", "--config", str(bad)],
                 ["runtime-env", str(bad)], ["run", "--config", str(tmp_path / "none.yaml")]):  # fmt: skip
        assert main(argv) == CONFIG, argv
        assert "train.epochz" in capsys.readouterr().err or "none.yaml" in argv[-1]


def test_a_refused_preflight_is_a_config_error(tiny_target, tmp_path, capsys):
    path = small_config(tiny_target, tmp_path, target={"aux_layer_ids": [0, 1, 9]})
    assert main(["preflight", "--config", str(path)]) == CONFIG
    assert main(["run", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == CONFIG
    assert "target.aux_layer_ids" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_missing_engine_is_a_config_error(capsys):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    assert main(["serve", "--engine", "sglang"]) == CONFIG
    assert "pip install -e '.[sglang]'" in capsys.readouterr().err


def test_a_busy_run_dir(tiny_target, tmp_path, monkeypatch, capsys):
    """Another driver's lock on the run directory (a real flock, held here): BUSY, at once
    rather than after the 180 s a driver waits for the one before it."""
    import pipeline.run
    from pipeline.state import hold_run_dir

    monkeypatch.setattr(pipeline.run, "hold_run_dir", partial(hold_run_dir, wait_s=0))
    path, run_dir = small_config(tiny_target, tmp_path), tmp_path / "run"
    with hold_run_dir(run_dir):
        assert main(["run", "--config", str(path), "--run-dir", str(run_dir)]) == BUSY
    assert "is in use by another driver" in capsys.readouterr().err


def test_a_run_that_stops_is_failed(ray_local, tiny_target, tmp_path, capsys):
    """The loop stops before round 0 with its message: state.json names an MLflow run that the
    tracking store does not have (pipeline/tracking.py UnknownRuns)."""
    from pipeline.config import load_config
    from pipeline.state import RunState

    path, run_dir = small_config(tiny_target, tmp_path), tmp_path / "run"
    run_dir.mkdir()
    RunState(config_digest=load_config(path).digest(), parent_run_id="0" * 32).save(run_dir)
    assert main(["run", "--config", str(path), "--run-dir", str(run_dir)]) == FAILED
    assert "does not have: parent " + "0" * 32 in (run_dir / "logs" / "driver.log").read_text()


def test_bench_defaults_to_the_loops_heldout_real_prompts(tmp_path, capsys):
    """Without --prompts-jsonl: the held-out split of real prompts the loop judges rounds on
    (a config's data section, or data.source real), never the built-in generated set."""
    import argparse

    from actors.config import DataConfig
    from actors.prompts import plan_prompts
    from serve.cli import bench_prompts

    ns = argparse.Namespace(prompts_jsonl=None, interleave=False, suite=None, config=None,
                            set=[], heldout=2, seed=None)  # fmt: skip
    convs, domains = bench_prompts(ns)
    held = plan_prompts(DataConfig(heldout_prompts=2)).heldout
    assert convs == [p.messages for p in held] and domains[:3] == ["chat", "coding", "math"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  source: {humaneval: 1.0}\n  heldout_prompts: 3\n")
    convs, domains = bench_prompts(argparse.Namespace(**{**vars(ns), "config": str(cfg),
                                                         "heldout": None}))  # fmt: skip
    assert domains == ["coding"] * 3
    assert "3 prompts, the held-out split of" in capsys.readouterr().err


def test_bench_suite_says_what_it_needs_first(capsys):
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed here")
    argv = ["bench", "--url", "http://127.0.0.1:9", "--prompts-jsonl", "/nonexistent.jsonl",
            "--suite", "gsm8k"]  # fmt: skip
    assert main(argv) == CONFIG  # before the missing prompt file is read
    err = capsys.readouterr().err
    assert "needs the `datasets` package" in err and "network" in err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--suite", "nope"]) == USAGE


@pytest.mark.parametrize("shape", ["5,4", "5,x,12", "0,1,2", "5,4,1"])
def test_bench_refuses_a_bad_shape_naming_the_flag(shape, capsys):
    """`serve.cli bench --shape`: a malformed shape is a usage error naming the flag and the
    form it takes, before any request is sent."""
    from serve.cli import main as serve_main

    with pytest.raises(SystemExit) as e:
        serve_main(["bench", "--url", "http://127.0.0.1:1", "--shape", shape])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape" in err and "num_draft_tokens" in err
