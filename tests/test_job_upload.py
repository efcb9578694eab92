"""What `ray job submit --working-dir .` uploads (pipeline/run.py `job_runtime_env`): the shipped
drafter the config starts from, and not the others (18.8 MiB each: Ray warns about every file
over 10 MiB it uploads, and `make demo` printed that warning for both on every start)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic")

from pipeline.run import job_runtime_env

pytestmark = pytest.mark.ray_free

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
