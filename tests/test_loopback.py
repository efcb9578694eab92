"""Every listener the training stage starts binds loopback: Ray Train's torch rendezvous store
and gloo's sockets (pipeline/rendezvous.py), checked from inside real Ray Train workers. With
Ray's own TorchConfig the store listened on *:<port>."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# On a Ray of its own, so scripts/test_suite.py runs it beside the shared-Ray tests: its time is
# Ray Train starting two workers, not CPU.
pytestmark = pytest.mark.own_cluster

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def test_train_workers_listen_on_loopback_only(ray_module, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.rendezvous import LoopbackTorchConfig

    def _report_listeners(config: dict) -> None:
        """Inside a worker (defined here: pickled by value), after the process group is up:
        this process's listening sockets."""
        import psutil
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)  # the group works
        rank = dist.get_rank()
        listening = [
            c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"
        ]
        Path(config["out"], f"rank-{rank}.json").write_text(json.dumps([t.item(), listening]))

    TorchTrainer(
        _report_listeners,
        train_loop_config={"out": str(tmp_path)},
        torch_config=LoopbackTorchConfig(),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="loopback", storage_path=str(tmp_path / "ray")),
    ).fit()
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [total for total, _ in reports] == [2.0, 2.0]
    ips = [ip for _, listening in reports for ip in listening]
    assert ips and not [ip for ip in ips if ip not in LOOPBACK], ips


# A command's own Ray, started as serve.cli does it (`ray` imported first, then start_ray), in a
# process whose environment lacks RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (a user's shell): it prints
# every TCP listener of itself and the processes its Ray started, once a worker has run and the
# metrics agent listens, and the mode of the token file Ray uses.
OWN_RAY = """
import json, os, stat, sys, time
from pathlib import Path

import psutil
import ray

from actors.cluster import start_ray

start_ray(num_cpus=1)
ray.get(ray.remote(lambda: None).remote())  # a worker process, listening too
me = psutil.Process()

def listeners():
    out = []
    for p in [me, *me.children(recursive=True)]:
        try:
            out += [(p.name(), " ".join(p.cmdline())[:80], c.laddr.ip, c.laddr.port)
                    for c in p.net_connections("tcp") if c.status == "LISTEN"]
        except psutil.Error:
            pass
    return out

deadline = time.monotonic() + 120  # liveness only: the agent starts after ray.init returns
while not any("agent" in cmd.lower() for _, cmd, _, _ in listeners()) and time.monotonic() < deadline:
    time.sleep(1)
token = Path.home() / ".ray" / "auth_token"
print(json.dumps({"listeners": listeners(), "token_mode": oct(stat.S_IMODE(token.stat().st_mode)),
                  "node_ip": ray.util.get_node_ip_address()}))
ray.shutdown()
"""


def test_a_commands_own_ray_listens_on_loopback_only_and_keeps_its_token_private(tmp_path):
    """Ray 2.60 swaps a loopback node address for the routable one unless told otherwise when it
    is imported (actors/cluster.py _keep_loopback): GCS, raylet and workers then listened on `*`
    and the metrics agent on 0.0.0.0. And it wrote ~/.ray/auth_token 0644."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                                           "RAY_ADDRESS", "RAY_AUTH_MODE")}  # fmt: skip
    env["HOME"] = str(tmp_path)  # Ray writes the token under ~/.ray: a home of its own
    done = subprocess.run([sys.executable, "-c", OWN_RAY], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name for name, *_ in got["listeners"]}
    assert {"gcs_server", "raylet"} <= names, got["listeners"]  # it saw Ray's own processes
    outside = [x for x in got["listeners"] if x[2] not in LOOPBACK]
    assert not outside, outside
    assert got["token_mode"] == "0o600"
    assert got["node_ip"] == "127.0.0.1"
