"""Ray Serve start-up that a busy machine does not break: Serve's own proxy timeouts, a bounded
retry, and waits until the proxy and the app answer. serve/endpoint.py, serve/cli.py and the
tests start Serve only through here; each replica binds its gRPC server here too
(`grpc_on_loopback`).

Why it failed (Ray 2.60, serve/_private/proxy_state.py): the controller gives a new HTTP proxy
actor `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S` (5 s) per readiness check and kills it after
PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD (3, not settable) failed checks in a row, so a proxy
whose worker (a fresh Python importing Serve, FastAPI and uvicorn) takes more than ~15 s to start
is killed before it ran ("cancelled before it started running"), and `serve.start`, which waits on
that actor, raises ActorDiedError. A started proxy is killed the same way after three health
checks slower than `RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S` (10 s). On 2 cores shared with other
Ray instances and training, both happen. The settings are read when the controller process
imports Serve, so they go to the controller through `controller_options.runtime_env` (this also
works when joining a cluster someone else started), not through this process's environment.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import ray
from ray import serve
from ray.serve.schema import ProxyStatus

from actors.cluster import RayStartError, init_ray  # noqa: F401  (re-exported)
from actors.ports import port_problem

log = logging.getLogger("ray.serve")

T = TypeVar("T")

# Serve's proxy timeouts for the controller; a value already in the environment wins.
SERVE_ENV_DEFAULTS: dict[str, str] = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",  # x3 checks: a proxy gets 3 min to start
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",  # a starved proxy is not killed in 30 s
}
START_ATTEMPTS = 3  # fresh Serve starts before giving up
READY_TIMEOUT_S = 200.0  # per attempt, after serve.start: the proxy's 3 x 60 s checks + margin
HTTP_READY_TIMEOUT_S = 120.0  # after serve.run: until the proxy routes to the new app
_RETRYABLE = (ray.exceptions.RayError, TimeoutError, ConnectionError)
HINTS = (
    "what to try: another --port (serve.port) if that one is taken; fewer jobs on this machine; "
    "a longer proxy start, e.g. RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=120; the controller and "
    "proxy logs under /tmp/ray/session_latest/logs/serve/"
)


class ServeStartupError(RayStartError):
    """Serve or the app did not come up after the bounded retries; the message says why."""


def serve_env() -> dict[str, str]:
    """The env vars the Serve controller gets (SERVE_ENV_DEFAULTS, overridden by os.environ)."""
    return {k: os.environ.get(k, v) for k, v in SERVE_ENV_DEFAULTS.items()}


def serve_running() -> bool:
    """Whether this Ray cluster already has a Serve controller."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def serve_until_stopped(url: str, what: dict[str, object], shutdown: Callable[[], None]) -> int:
    """Print where the server answers (one JSON line: scripts and tests wait for it), block until
    Ctrl-C or SIGTERM (a backgrounded shell job ignores SIGINT), then shut it and Ray down."""
    import json
    import signal
    import threading

    print(json.dumps({"url": url, **what}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown()
    ray.shutdown()
    return 0


def check_port(host: str, port: int) -> None:
    """ServeStartupError when a new Serve could not listen on host:port; needs no Ray, so a
    command that starts its own Ray checks it first (serve/cli.py)."""
    if problem := port_problem(host, port):
        raise ServeStartupError(f"Ray Serve not started: {problem}.\n{HINTS}")


def start_serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    attempts: int = START_ATTEMPTS,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Start Serve on host:port (or join the running one) and return once every proxy is
    HEALTHY. An attempt that fails, or stays unready `ready_timeout_s` after serve.start, shuts
    down the Serve it started and tries again, `attempts` times; then ServeStartupError says
    what failed. A Serve already running on the cluster is only waited on, once."""
    ours = not serve_running()
    if not ours:
        attempts = 1  # someone else's Serve (and apps): wait on it, never shut it down
    else:
        check_port(host, port)
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            serve.start(
                http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": serve_env()}},
            )
        except _RETRYABLE as e:  # the proxy was slow or killed; the controller starts another
            log.warning("serve.start attempt %d: %s; waiting for the proxy", attempt, _short(e))
            failures.append(f"attempt {attempt}: serve.start: {_short(e)}")
        try:  # counted from here: creating the controller took ~2 min at load average 30
            _wait_proxies_healthy(time.monotonic() + ready_timeout_s)
            _check_same_http(host, port)
            if failures:
                log.warning("Serve is up after: %s", "; ".join(failures))
            return
        except _RETRYABLE as e:
            failures.append(f"attempt {attempt}: {_short(e)}")
            log.warning("Serve start-up attempt %d/%d failed: %s", attempt, attempts, _short(e))
        if ours:
            serve.shutdown()  # a half-started Serve would keep its broken proxy and port
    raise ServeStartupError(
        f"Ray Serve did not start on {host}:{port} after {attempts} attempt(s):\n  "
        + "\n  ".join(failures)
        + f"\n{HINTS}"
    )


def _check_same_http(host: str, port: int) -> None:
    """A Serve already running on this cluster keeps its own host/port (serve.start only warns)."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    if (http.host, http.port) != (host, port):
        raise ServeStartupError(
            f"Ray Serve already runs on this Ray cluster at {http.host}:{http.port}, so "
            f"serve.host/port {host}:{port} cannot apply; use port {http.port}, or stop that "
            "Serve first (serve.shutdown() / `serve shutdown`)"
        )


def _wait_proxies_healthy(deadline: float) -> None:
    last: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            proxies = serve.status().proxies
        except _RETRYABLE as e:  # a controller call lost to the load: ask again
            last = {"status": _short(e)}
        else:
            if proxies and all(s == ProxyStatus.HEALTHY for s in proxies.values()):
                return
            last = {node[:8]: s.value for node, s in proxies.items()}
        time.sleep(0.5)
    raise TimeoutError(f"proxies not HEALTHY in time: {last or 'none started'}")


def retry(fn: Callable[[], T], what: str, attempts: int = START_ATTEMPTS) -> T:
    """fn(), retried on Ray/timeout errors (a controller call lost to a busy machine); other
    errors (a deployment that fails in its constructor) raise at once."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except _RETRYABLE as e:
            if attempt == attempts:
                raise ServeStartupError(
                    f"{what} failed {attempts} times, last: {_short(e)}\n{HINTS}"
                ) from e
            log.warning("%s attempt %d/%d failed: %s; retrying", what, attempt, attempts, _short(e))
            time.sleep(2.0 * attempt)
    raise AssertionError("unreachable")


def wait_http_ready(url: str, timeout_s: float = HTTP_READY_TIMEOUT_S) -> None:
    """Poll GET url until it answers 200: after serve.run the app is RUNNING but the proxy may
    not have its route yet (404) or may still be starting (connection refused)."""
    url = url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:")
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=10)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = _short(e)
        time.sleep(0.5)
    raise ServeStartupError(f"{url} did not answer 200 in {timeout_s:.0f} s ({last}).\n{HINTS}")


def grpc_on_loopback() -> None:
    """Ray 2.60's replica starts its inter-deployment gRPC server on `[::]:0`, every interface,
    with no option to change it (ray/serve/_private/replica.py, `_on_initialized`, after this
    constructor). On a Ray whose node address is loopback (every Ray the project starts:
    actors/cluster.py), handles reach the replica at 127.0.0.1, so it binds there instead. A Ray
    without that hook serves as before, with a warning naming the listener. Every replica of the
    app calls it in its constructor (serve/deployment.py's engine, serve/router.py's router)."""
    from ray.serve._private import replica

    if ray.util.get_node_ip_address() != "127.0.0.1":
        return  # a routable node: other nodes' handles connect to it
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        log.warning("this Ray's Serve replica has no add_port_to_grpc_server: its gRPC server "
                    "listens on every interface")  # fmt: skip
        return
    if getattr(bind, "loopback", False):
        return

    def loopback(server: Any, address: str) -> int:
        return bind(server, address.replace("[::]", "127.0.0.1", 1))

    loopback.loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = loopback


def _short(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
