"""The one Ray start-up of every command line: join the cluster in RAY_ADDRESS, else start a
local Ray bound to loopback (no dashboard), unless this process is already connected."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

START_ATTEMPTS = 3


class RayStartError(RuntimeError):
    """Ray did not start after the bounded retries; the message says why and what to try."""


def _short(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def init_ray(attempts: int = START_ATTEMPTS, **kwargs: Any) -> None:
    """ray.init(**kwargs), retried when it starts a local Ray: Ray 2.60 gives a new raylet a
    hard-coded 30 s to register with its GCS (`_private/node.py`), which a busy 2-core machine
    misses ("The current node timed out during startup"). The processes a failed attempt left
    (this process's new children) are killed before the next one. The only ray.init call."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            ray.init(**kwargs)
            return
        except (ValueError, TypeError):
            raise  # bad arguments, not the machine
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for the timeout
            if kwargs.get("address") not in (None, "local") or attempt == attempts:
                raise RayStartError(
                    f"ray.init failed ({attempt} attempt(s)), last: {_short(e)}; what to try: "
                    "fewer jobs on this machine, or the logs under /tmp/ray/session_latest/logs"
                ) from e
            log.warning("ray.init attempt %d/%d failed: %s; retrying", attempt, attempts, _short(e))
        ray.shutdown()
        for p in me.children(recursive=True):
            if p.pid not in before:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        time.sleep(2.0 * attempt)


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
        init_ray(address=address, runtime_env=env)
    else:  # "local": a new Ray, never one that `ray start` left on this machine
        init_ray(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=num_cpus,
            runtime_env=runtime_env or None,
        )


def reserved_device(num_gpus: float, field: str) -> str:
    """The torch device of a process that reserved `num_gpus` from Ray (`field` names the config
    field): "cuda" when it reserved any (Ray has set CUDA_VISIBLE_DEVICES to its share), "cpu"
    when none. A reservation torch cannot see is refused rather than run on the CPU: a CPU-only
    torch on a GPU node would otherwise serve or regenerate at a hundredth of the speed."""
    import torch

    if num_gpus <= 0:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{field}: {num_gpus} GPU(s) reserved, but torch {torch.__version__} sees no CUDA "
            f"device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); install "
            f"a CUDA build of torch on this node, or set {field}: 0 to run on its CPUs"
        )
    return "cuda"
