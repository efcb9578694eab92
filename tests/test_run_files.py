"""Files a resume reads survive a crash: state.json heals from its copy (or is rebuilt) when found
empty or torn, and metrics.jsonl is appended across attempts, never rewritten; a file created or
renamed into place has its directory synced; state.json keeps no tracking password."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip
from pipeline.state import RoundState, RunState
from pipeline.train_worker import MetricsLog


def test_an_empty_or_torn_state_heals_from_its_copy_or_is_rebuilt(tmp_path, caplog):
    state = RunState(config_digest="d1", parent_run_id="p", rounds=[RoundState(0, "r0", {"train": {"x": 1}})])  # fmt: skip
    state.save(tmp_path)
    path = tmp_path / "state.json"
    with caplog.at_level(logging.WARNING, logger="pipeline.state"):
        for damage in ("", '{"config_digest": "d1", "rounds": [{"ind'):
            path.write_text(damage)
            got = RunState.load_or_new(tmp_path, "d1")
            assert got.rounds[0].done == {"train": {"x": 1}} and got.parent_run_id == "p"
        assert "resuming from its copy" in caplog.text
        path.write_text("")
        (tmp_path / "state.json.bak").write_text("{")
        fresh = RunState.load_or_new(tmp_path, "d1")
    assert fresh.rounds == [] and "rebuilt from nothing" in caplog.text
    assert [p.name.split("-")[0] for p in tmp_path.glob("state.json.damaged-*")] == ["state.json.damaged"]  # fmt: skip
    fresh.save(tmp_path)  # the next save makes both whole again
    with pytest.raises(ValueError, match="another config"):  # a real mismatch still refuses
        RunState.load_or_new(tmp_path, "d2")


def test_metrics_are_appended_across_attempts_and_a_torn_line_is_skipped(tmp_path):
    def log(start: int) -> MetricsLog:
        return MetricsLog(tmp_path, True, start_step=start, k=1, sim_steps=1, total=9, world=1)

    first = log(0)
    for step in range(1, 5):
        first._write({"step": step, "loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    again = log(2)  # resumed from the step-2 checkpoint: steps 3.. are redone
    again._write({"step": 3, "loss": 30.0})
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(before)  # nothing rewritten
    assert [(m["step"], m["loss"]) for m in again.read()] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert all(json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[:4])


def test_state_json_never_holds_the_tracking_password(tmp_path):
    """A tracking URI with `user:password@` (an MLflow server behind basic auth) is saved masked,
    in state.json and in its copy; a resume reads the masked URI back."""
    RunState(config_digest="d1", tracking_uri="https://me:hunter2@mlflow.example/").save(tmp_path)
    for name in ("state.json", "state.json.bak"):
        text = (tmp_path / name).read_text()
        assert "hunter2" not in text and "https://me:***@mlflow.example/" in text, name
    assert RunState.load_or_new(tmp_path, "d1").tracking_uri == "https://me:***@mlflow.example/"


ROOT = Path(__file__).resolve().parents[1]
MAKE_FILES = """
import sys
from actors.files import atomic_write
from serve.traffic import TrafficLog
d = sys.argv[1]
TrafficLog(d + "/traffic", "7").append({"prompt_ids": [1]})
atomic_write(d + "/run/state.json", "{}")
"""


def _syscalls(tmp_path: Path) -> list[str]:
    """The openat/fsync/close/rename calls of a fresh Python that makes a traffic log file and
    writes state.json, as strace sees them: the kernel's view, with no code of ours replaced."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: a directory fsync shows only in the system calls")
    (tmp_path / "run").mkdir()
    out = tmp_path / "strace.txt"
    calls = "trace=openat,fsync,close,rename,renameat,renameat2"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    r = subprocess.run(
        [strace, "-f", "-qq", "-e", calls, "-o", str(out), sys.executable, "-c", MAKE_FILES, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if r.returncode and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    return [re.sub(r"^\d+\s+", "", line) for line in out.read_text().splitlines()]


def _dir_synced_after(calls: list[str], made: str, directory: Path) -> bool:
    """Whether, after the first call matching `made`, `directory` is opened and that fd fsynced
    before it is closed."""
    start = next((i for i, c in enumerate(calls) if re.search(made, c)), None)
    assert start is not None, f"no call matches {made!r}"
    opened = re.compile(
        rf'^openat\(AT_FDCWD, "{re.escape(str(directory))}", O_RDONLY[^)]*\)\s+= (\d+)'
    )
    fds: set[str] = set()
    for c in calls[start + 1 :]:
        if m := opened.match(c):
            fds.add(m[1])
        elif m := re.match(r"^fsync\((\d+)\)\s+= 0", c):
            if m[1] in fds:
                return True
        elif m := re.match(r"^close\((\d+)\)", c):
            fds.discard(m[1])
    return False


def test_a_new_file_is_followed_by_a_sync_of_its_directory(tmp_path):
    """A file's own fsync does not make its directory entry durable: after a power loss a new
    traffic log file, or the rename of state.json into place, can be gone. Each is followed by
    an fsync of the directory (actors/files.fsync_dir)."""
    calls = _syscalls(tmp_path)
    traffic = tmp_path / "traffic"
    created = (
        rf'^openat\(AT_FDCWD, "{re.escape(str(traffic))}/traffic-7-000000\.jsonl", [^)]*O_CREAT'
    )
    assert _dir_synced_after(calls, created, traffic)
    renamed = rf'^rename(at2?)?\(.*"{re.escape(str(tmp_path / "run" / "state.json"))}"'
    assert _dir_synced_after(calls, renamed, tmp_path / "run")


HOLDER = """
import sys, time
from pathlib import Path
from pipeline.state import hold_run_dir
with hold_run_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(run_dir: Path, seconds: float) -> subprocess.Popen:
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), str(seconds)],
        cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_driver_per_run_dir_a_second_waits_then_refuses_naming_the_first(tmp_path):
    """A stopped job's driver can outlive `ray job stop` and overwrite state.json behind the
    resubmitted one (seen in the closed-loop test): the second waits for the first, or refuses
    naming it; a holder killed with SIGKILL frees the directory at once."""
    from pipeline.state import RunDirBusy, hold_run_dir

    first = _holder(tmp_path, 60)
    try:
        with pytest.raises(RunDirBusy, match=rf"pid {first.pid} on .*ray job stop"):
            with hold_run_dir(tmp_path, wait_s=1):
                pass
    finally:
        first.kill()
        first.wait()
    with hold_run_dir(tmp_path, wait_s=0):  # SIGKILL released it
        pass
    brief = _holder(tmp_path, 2)  # lets go by itself while the next driver waits
    t0 = time.monotonic()
    with hold_run_dir(tmp_path, wait_s=30):
        assert time.monotonic() - t0 > 1.5  # only once the first had let go
    brief.wait()
