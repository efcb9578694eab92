"""The one Ray start-up of every command line: join the cluster in RAY_ADDRESS, else start a
local Ray bound to loopback (no dashboard), unless this process is already connected."""

from __future__ import annotations

import os
from typing import Any


def start_ray(
    runtime_env: dict[str, Any] | None = None,
    num_cpus: int | None = None,
    join_with_runtime_env: bool = True,
    address: str | None = None,
) -> None:
    """Connect this process to Ray. `runtime_env` reaches every worker and actor; inside `ray job
    submit` the job's own runtime_env already applies, so a caller that passes the job's config
    can skip it there with `join_with_runtime_env=False`. `num_cpus` sizes a local Ray only.
    `address` joins that cluster (as RAY_ADDRESS would) without changing this process's
    environment, which child processes would inherit."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        env = (runtime_env or None) if join_with_runtime_env else None
        ray.init(address=address, runtime_env=env)
    else:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=num_cpus,
            runtime_env=runtime_env or None,
        )
