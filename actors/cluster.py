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
LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a node on loopback


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
    host: str = LOOPBACK,
) -> None:
    """Connect this process to Ray. `runtime_env` reaches every worker and actor; inside `ray job
    submit` the job's own runtime_env already applies, so a caller that passes the job's config
    can skip it there with `join_with_runtime_env=False`. `num_cpus` sizes a local Ray only.
    `address` joins that cluster (as RAY_ADDRESS would) without changing this process's
    environment, which child processes would inherit. `host` is the address every listener of a
    local Ray binds (GCS, raylet, workers, the metrics agent); another one is a deliberate choice
    (a config's `ray_host`)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault(LOOPBACK_ENV, "0")
    if address or os.environ.get("RAY_ADDRESS"):
        _private_token_file(create=False)
        env = (runtime_env or None) if join_with_runtime_env else None
        init_ray(address=address, runtime_env=env)
        return
    # "local": a new Ray, never one that `ray start` left on this machine
    _private_token_file(create=True)
    if host == LOOPBACK:
        _keep_loopback()
    init_ray(
        address="local",
        _node_ip_address=host,
        include_dashboard=False,
        num_cpus=num_cpus,
        runtime_env=runtime_env or None,
    )
    node_ip = ray.util.get_node_ip_address()
    if host == LOOPBACK and node_ip != LOOPBACK:
        ray.shutdown()
        raise RayStartError(
            f"the local Ray bound {node_ip}, not {LOOPBACK} (this Ray version ignores "
            f"{LOOPBACK_ENV}=0?); what to try: `ray start --head --node-ip-address {LOOPBACK}` "
            "with that variable exported, and RAY_ADDRESS=127.0.0.1:<port>"
        )


def _keep_loopback() -> None:
    """Make a local Ray's node address stay 127.0.0.1. Ray 2.60 replaces a loopback
    `_node_ip_address` with the routable one (`services.resolve_ip_for_localhost`), and every
    listener follows the node address (GCS, raylet and workers on `*`, the metrics agent on
    0.0.0.0), unless `ray_constants.ENABLE_RAY_CLUSTER` is off: then the node is loopback and so
    is each of them. That constant is read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when `ray` is
    first imported, which `serve.cli` and most callers have done before this, so the variable is
    set for the processes Ray starts and the constant for this one."""
    from ray._private import ray_constants

    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _private_token_file(create: bool) -> None:
    """~/.ray/auth_token readable by its owner only. Ray 2.60 writes the token it generates for a
    new local Ray with the umask's mode (0644), so any local user could read the token and use
    the cluster; written here first (`create`: a new local Ray, which Ray gives token auth by
    default), 0600, Ray keeps it. One already there is made 0600. Not created for a join: a token
    file there turns token auth on for a cluster that may not use it."""
    import secrets
    from pathlib import Path

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return
    path = Path.home() / ".ray" / "auth_token"
    if path.exists():
        if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
            path.chmod(0o600)
        return
    if not create or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return  # Ray reads the token from there and writes none
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # another process wrote one meanwhile
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # what Ray's own generator writes


def cluster_gpus() -> float:
    """GPUs of the Ray cluster this process is connected to (0 on a CPU cluster)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


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
