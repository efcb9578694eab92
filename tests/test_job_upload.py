"""What `ray job submit --working-dir .` uploads (pipeline/run.py `job_runtime_env`): the shipped
drafter the config starts from, and not the others (18.8 MiB each: Ray warns about every file
over 10 MiB it uploads, and `make demo` printed that warning for both on every start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pydantic")

from pipeline.run import job_runtime_env

# No Ray in this process (its job test starts a head in subprocesses), yet unmarked `ray_free`:
# it runs in the first pytest, which had ~60 s less to do than the second (scripts/test_suite.py)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(f"drafters/{d.name}/" for d in (REPO / "drafters").iterdir() if d.is_dir())


def test_the_demo_uploads_only_the_drafter_it_starts_from():
    env = job_runtime_env(str(REPO / "configs" / "smollm2-cpu.yaml"), str(REPO))
    assert len(SHIPPED) == 2
    assert "drafters/smollm2-135m-offpolicy/" not in env["excludes"]
    assert "drafters/smollm2-135m-base/" in env["excludes"]


def test_a_run_from_scratch_or_a_hub_drafter_uploads_none(tmp_path):
    for init in ("scratch", "org/some-eagle3-drafter"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"drafter: {{init: {init}}}\n")
        env = job_runtime_env(str(cfg), str(REPO))
        assert set(SHIPPED) <= set(env["excludes"]), init


def test_an_absolute_path_to_a_shipped_drafter_keeps_it(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"drafter: {{init: {REPO / 'drafters' / 'smollm2-135m-base'}}}\n")
    env = job_runtime_env(str(cfg), str(REPO))
    assert "drafters/smollm2-135m-base/" not in env["excludes"]
    assert "drafters/smollm2-135m-offpolicy/" in env["excludes"]


def test_the_runtime_env_takes_the_jobs_overrides(capsys):
    """`runtime-env CONFIG --set drafter.init=...`: the excludes follow the resolved config."""
    from pipeline.run import env_main

    init = "drafter.init=drafters/smollm2-135m-base"
    assert env_main(["runtime-env", str(REPO / "configs" / "smollm2-cpu.yaml"), "--working-dir",
                     str(REPO), "--set", init]) == 0  # fmt: skip
    excludes = json.loads(capsys.readouterr().out)["excludes"]
    assert "drafters/smollm2-135m-base/" not in excludes
    assert "drafters/smollm2-135m-offpolicy/" in excludes


@pytest.mark.slow  # a Ray head of its own, in subprocesses: no Ray in this process
@pytest.mark.timeout(900)
def test_a_job_with_drafter_init_overridden_finds_that_drafter(tmp_path_factory):
    """`bash scripts/demo.sh drafter.init=drafters/smollm2-135m-base`: a real `ray job submit`
    to a real head, the runtime env made as the demo makes it (with the job's overrides), and the
    job's preflight (the run's first check) finds the overridden drafter in its upload. Before the
    excludes took the overrides, it failed there: `drafters/smollm2-135m-base does not exist`."""
    from ray_head import RayHead

    tmp = tmp_path_factory.mktemp("ray")  # short: Ray's socket paths must fit 107 bytes
    head = RayHead(tmp)
    try:
        job = head.submit(
            REPO / "configs" / "smollm2-cpu.yaml",
            None,
            overrides=("drafter.init=drafters/smollm2-135m-base",),
            entrypoint=("-m", "pipeline.preflight"),
        )
    finally:
        head.shutdown()
    out = job.stdout + job.stderr
    assert job.returncode == 0 and "preflight: ok" in out, out[-4000:]
    env = json.loads((tmp / "runtime-env.json").read_text())
    assert "drafters/smollm2-135m-base/" not in env["excludes"]
