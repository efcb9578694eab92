"""`serve.cli swap` swaps only the server its --url names (issue 43): with two servers on one
machine, each serving an app named `eagle3`, swap joined the newest local Ray and would have
swapped the other server's drafter. Now the server publishes an instance id on GET /drafter and
swap checks it through the Serve handle it reached. Two real servers: one on this module's Ray,
one `serve.cli serve` with a Ray of its own (hence own_cluster)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

for _dep in ("fastapi", "ray"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
from conftest import free_port

pytestmark = pytest.mark.own_cluster
REPO = Path(__file__).resolve().parent.parent


def test_swap_against_another_servers_cluster_is_refused(ray_module, tiny_target, drafters, capsys):  # fmt: skip
    from serve.cli import main
    from serve.endpoint import deploy, shutdown

    here = deploy({"port": free_port()}, {"model": str(tiny_target)}, drafters["good1"])
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=str(REPO))
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-other-", dir="/tmp")  # its own Ray
    cmd = [sys.executable, "-m", "serve.cli", "serve", "--target", str(tiny_target),
           "--drafter", drafters["good1"], "--port", str(free_port())]  # fmt: skip
    other = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert other.stdout is not None
        line = next(x for x in other.stdout if x.startswith("{"))  # printed once it answers
        other_url = json.loads(line)["url"]
        theirs = httpx.get(f"{other_url}/drafter", timeout=60).json()
        ours = httpx.get(f"{here.url}/drafter", timeout=60).json()
        assert theirs["app"] == ours["app"] == "eagle3" and theirs["instance"] != ours["instance"]

        # This process is on its own Ray, where `eagle3` is the other server's namesake.
        capsys.readouterr()
        assert main(["swap", "--url", other_url, "--drafter", drafters["good2"]]) == 1
        err = capsys.readouterr().err
        assert "swap refused" in err and theirs["instance"] in err and ours["instance"] in err
        assert httpx.get(f"{here.url}/drafter", timeout=60).json()["swaps"] == ours["swaps"]
        assert httpx.get(f"{other_url}/drafter", timeout=60).json()["swaps"] == theirs["swaps"]
        # the server this Ray does hold is swapped as before
        assert main(["swap", "--url", here.url, "--drafter", drafters["good2"]]) == 0
        assert httpx.get(f"{here.url}/drafter", timeout=60).json()["swaps"] == ours["swaps"] + 1
    finally:
        other.send_signal(signal.SIGTERM)  # serve.cli shuts its Serve and Ray down
        try:
            other.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(other.pid, signal.SIGKILL)
        shutdown("eagle3")
        from ray import serve

        serve.shutdown()
