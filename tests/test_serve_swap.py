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


def test_a_run_never_replaces_another_runs_app_and_two_runs_serve_side_by_side(
    ray_module, tiny_target, drafters
):
    """Issue 51, two runs on one cluster: Serve has one proxy per cluster, and serve.run of an
    app name that exists replaces that app. Run A serves `eagle3` on `/`; run B with the same
    serve.app, or with its own app on A's route, is refused naming the field to change, and A
    keeps serving its drafter; B with its own app and route serves beside A, each request
    reaching its own run's drafter. A resumed A (a new driver: nothing of it in this process)
    may deploy its own app again."""
    from ray import serve

    from pipeline.config import ServeConfig, TargetConfig
    from serve import endpoint
    from serve.endpoint import ServeClaimed, deploy_endpoint

    port, target = free_port(), TargetConfig(model=str(tiny_target))
    a_cfg = ServeConfig(port=port, steps=2)
    b_cfg = ServeConfig(port=port, steps=2, app="eagle3-b", route_prefix="/b")
    try:
        a = deploy_endpoint(a_cfg, target, drafters["good1"], "logs", owner="/runs/a")
        a_digest = httpx.get(f"{a.url}/drafter", timeout=60).json()["digest"]
        with pytest.raises(ServeClaimed, match=r"serve\.app: .*'eagle3'.*/runs/a"):
            deploy_endpoint(a_cfg, target, drafters["good2"], "logs", owner="/runs/b")
        with pytest.raises(ServeClaimed, match=r"serve\.route_prefix: '/' is taken .*'eagle3'"):
            deploy_endpoint(b_cfg.model_copy(update={"route_prefix": "/"}), target,
                            drafters["good2"], "logs", owner="/runs/b")  # fmt: skip
        assert a.info()["path"] == drafters["good1"]
        b = deploy_endpoint(b_cfg, target, drafters["good2"], "logs", owner="/runs/b")
        assert b.url == f"http://127.0.0.1:{port}/b"
        b_digest = httpx.get(f"{b.url}/drafter", timeout=60).json()["digest"]
        assert httpx.get(f"{a.url}/drafter", timeout=60).json()["digest"] == a_digest != b_digest
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for ep, digest in ((a, a_digest), (b, b_digest)):
            r = httpx.post(f"{ep.url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["drafter"] == digest
        endpoint._APPS.pop("eagle3")  # a resumed run A: a new driver process, which holds nothing
        again = deploy_endpoint(a_cfg, target, drafters["good1"], "logs", owner="/runs/a")
        assert again.info()["path"] == drafters["good1"]
    finally:
        serve.shutdown()
