"""Ray Train's torch process group on loopback when the whole run is on this host.

Ray Train (2.60) sets MASTER_ADDR to rank 0's node IP and lets torch create the rendezvous
TCPStore, whose server listens on every interface (`*:<port>`) whatever MASTER_ADDR says; torch
has no bind-address option. When rank 0's node IP is a loopback address (the project starts Ray
with `_node_ip_address="127.0.0.1"`), `LoopbackTorchConfig` has rank 0 open the listening socket
itself on 127.0.0.1 and hand it to the store (`master_listen_fd`), the other ranks join it there,
and gloo is told to use the loopback interface (GLOO_SOCKET_IFNAME, unless already set). NCCL's
bootstrap socket is left to NCCL (untested here on loopback: no multi-GPU host); set
`NCCL_SOCKET_IFNAME=lo` in `runtime_env.env_vars` to pin it. On a multi-node cluster the workers
must reach each other, so Ray's own setup runs unchanged; docs/architecture.md says what to
firewall.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_STORE: list[Any] = []  # rank 0: the listening socket and the store, alive with the worker


def _loopback_ifname() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def _host_store(world_size: int, timeout_s: int) -> int:
    """Rank 0: a store whose server listens on 127.0.0.1 only; returns its port."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(16, 4 * world_size))
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    _STORE[:] = [sock, store]
    return port


def _join(backend: str, rank: int, world_size: int, port: int, timeout_s: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    timeout = timedelta(seconds=timeout_s)
    store = _STORE[1] if rank == 0 else dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


class _LoopbackTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        from ray.train._internal.utils import get_address_and_port

        addr, _ = worker_group.execute_single(0, get_address_and_port)
        if addr not in LOOPBACK:
            return super().on_start(worker_group, backend_config)  # workers on several hosts
        import ray
        from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
        from ray.train.torch.config import _set_torch_distributed_env_vars

        backend = backend_config.backend
        if backend is None:
            gpus = worker_group.get_resources_per_worker().get("GPU", 0)
            backend = "nccl" if gpus > 0 else "gloo"
        n, timeout_s = len(worker_group), backend_config.timeout_s
        if not isinstance(worker_group, V1WorkerGroup):  # as Ray's own setup does
            worker_group.execute(_set_torch_distributed_env_vars)
        port = worker_group.execute_single(0, _host_store, n, timeout_s)
        ray.get(
            [
                worker_group.execute_single_async(i, _join, backend, i, n, port, timeout_s)
                for i in range(n)
            ]
        )


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """TorchConfig whose rendezvous binds 127.0.0.1 when rank 0 runs on a loopback node."""

    @property
    def backend_cls(self):
        return _LoopbackTorchBackend
