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
