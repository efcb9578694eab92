"""The driver's side of the embedded engine's Ray Serve app (serve/deployment.py is the replica's,
serve/router.py the HTTP ingress in front of the replicas): `deploy` starts Serve and the app,
`swap_drafter` / `set_shape` reconfigure it in place, `adopt_app` joins one another process
deployed (`serve.cli swap`), `shutdown` ends it; and
`deploy_endpoint`, the one function the driver calls for any engine (`serve.engine`: embedded
here, `sglang` and `vllm` through actors/engine_server.py), returning a `ServingEndpoint`."""

import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ray import serve

from actors.engine_server import DrafterRejected
from actors.sglang_server import deploy_sglang
from serve.config import ServeConfig, batch_problem
from serve.deployment import APP_NAME, SpecServer
from serve.engine import tree_problem
from serve.router import Router
from serve.shapes import Shape
from serve.startup import retry, serve_running, start_serve, wait_http_ready

log = logging.getLogger("ray.serve")

__all__ = [
    "DrafterRejected",
    "Endpoint",
    "ServeClaimed",
    "ServingEndpoint",
    "deploy",
    "deploy_endpoint",
    "swap_drafter",
]


class ServeClaimed(ValueError):
    """Serve on this cluster already runs an application this deploy would replace or shadow,
    deployed by another run or server; the message names the field to change."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # http://host:port[/route_prefix], the OpenAI base without /v1
    app_name: str
    drafter: str | None


_APPS: dict[str, dict[str, Any]] = {}  # app name -> what deploy() bound, for swap_drafter
# serve: knobs that bound a client's waiting (serve/config.py), passed to the replica
LIMIT_KEYS = ("max_ongoing_requests", "max_queued_requests", "retry_after_s", "request_timeout_s", "body_timeout_s")  # fmt: skip


def _as_dict(cfg: Any) -> dict[str, Any]:
    """A pydantic config section or a plain dict (the CLI passes dicts)."""
    return cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)


def deploy(
    serve_cfg: Any,
    target_cfg: Any,
    drafter_dir: str | Path | None,
    *,
    app_name: str | None = None,
    owner: str | None = None,
    num_cpus: float = 1.0,
    torch_threads: int | None = None,
    max_batch_size: int = 8,
    batch_wait_s: float = 0.01,
    model_name: str | None = None,
    traffic_dir: str | Path | None = None,
) -> Endpoint:
    """Start Serve on serve.host:serve.port and run the engine app with `drafter_dir` (None = no
    drafter: plain decoding only) as `app_name` (None: serve.app) on serve.route_prefix; a batch
    waits `batch_wait_s` for mates. Returns its address. A dict `serve_cfg` (the CLI's) goes
    through ServeConfig's validation and defaults. `owner` (a run's directory): the app is that
    run's, and an app of that name another owner deployed is never replaced (ServeClaimed)."""
    s, t = ServeConfig.model_validate(_as_dict(serve_cfg)).model_dump(), _as_dict(target_cfg)
    app_name = app_name or s["app"]
    if s.get("engine", "embedded") != "embedded":
        raise ValueError(
            f"serve.engine={s['engine']!r}: this deployment is the embedded engine; use the SGLang deployment"
        )
    problem = tree_problem(s.get("steps", 3), s.get("topk", 1), s.get("num_draft_tokens"))
    if problem:
        raise ValueError(f"serve.steps/topk/num_draft_tokens: {problem}")
    if problem := batch_problem(max_batch_size, batch_wait_s):  # before Serve starts
        raise ValueError(f"deploy(): {problem}")
    options = {
        "steps": s.get("steps", 3),
        "topk": s.get("topk", 1),
        "num_draft_tokens": s.get("num_draft_tokens"),
        "static_batch": s["static_batch"],
        "drafter_compile": s["drafter_compile"],
        "torch_threads": torch_threads or max(1, int(num_cpus)),
        "max_batch_size": max_batch_size,
        "batch_wait_s": batch_wait_s,
        "model_name": model_name,
        "traffic": _traffic_options(s, traffic_dir),
        **{k: s[k] for k in LIMIT_KEYS},
        "instance": uuid.uuid4().hex[:16],  # this deploy(): what `serve.cli swap` checks
        "owner": owner,  # the run whose app this is: what another run's deploy checks
        "route_prefix": s["route_prefix"],
        "num_replicas": s["num_replicas"],
    }
    actor = {"num_cpus": num_cpus, "num_gpus": s.get("num_gpus", 0.0)}
    host, port = s.get("host", "127.0.0.1"), s.get("port", 8000)
    start_serve(host, port)  # retried; raises ServeStartupError with what to try
    if owner is not None:
        check_claim(app_name, s["route_prefix"], owner)
    _APPS[app_name] = {"target": t, "options": options, "actor": actor}
    drafter = str(drafter_dir) if drafter_dir else None
    _run_app(app_name, drafter)  # a drafter that does not load fails here (DrafterRejected)
    _APPS[app_name]["good"] = drafter
    url = f"http://{host}:{port}{s['route_prefix'].rstrip('/')}"
    wait_http_ready(f"{url}/health")  # the proxy routes to the app only later
    return Endpoint(url, app_name, drafter)


def check_claim(app_name: str, route_prefix: str, owner: str) -> None:
    """ServeClaimed when this cluster's Serve runs an application named `app_name` that another
    owner deployed, or another application on `route_prefix`: serve.run would silently replace
    the first (its target, drafter and users) with ours, and Serve refuses the second only when
    it is already too late for this run. The owner may deploy its own app again (a resumed run
    does); an app that is not RUNNING (a crashed deploy) may be replaced. No Serve: no check."""
    if not serve_running():
        return
    from ray.serve.context import _get_global_client

    apps = _get_global_client().get_serve_details().get("applications", {})
    fix = (f"give this run its own serve.app and serve.route_prefix (e.g. serve.app={app_name}-2 "
           f"serve.route_prefix=/{app_name}-2)")  # fmt: skip
    for name, app in apps.items():
        if name != app_name and app.get("route_prefix") == route_prefix:
            raise ServeClaimed(
                f"serve.route_prefix: {route_prefix!r} is taken on this Ray cluster by the Serve "
                f"application {name!r}; {fix}"
            )
    app = apps.get(app_name)
    if app is None or app.get("status") != "RUNNING":
        return
    theirs = engine_handle(app_name).spec.remote().result(timeout_s=60)["options"].get("owner")
    if theirs != owner:
        raise ServeClaimed(
            f"serve.app: the Serve application {app_name!r} on this Ray cluster belongs to "
            f"{'the run in ' + theirs if theirs else 'another server (serve.cli)'}; this run "
            f"would replace its target and drafter under its clients: {fix}, or delete that "
            f"application if it is finished (`serve delete {app_name}`)"
        )


def _traffic_options(s: dict[str, Any], traffic_dir: str | Path | None) -> dict[str, Any] | None:
    if not s.get("record_traffic"):
        return None
    if traffic_dir is None:
        raise ValueError(
            "serve.record_traffic: true needs a traffic directory (the run dir's traffic/)"
        )
    return {
        "dir": str(traffic_dir),
        "max_bytes": int(float(s.get("traffic_max_mb", 64)) * 2**20),
        "max_files": int(s.get("traffic_max_files", 8)),
        "redact": s.get("traffic_redact"),
    }


def engine_handle(app_name: str = APP_NAME) -> Any:
    """A handle to the app's engine replicas (`SpecServer`), behind its router."""
    return serve.get_deployment_handle(SpecServer.name, app_name)


def serve_bounds(opts: dict[str, Any]) -> dict[str, Any]:
    """Serve's own bounds, for when every replica holds max_ongoing_requests: the proxy (or the
    router's handle) queues up to max_queued_requests more and answers the rest 503 with
    Retry-After (the engine replica's own 503 comes first, past max_batch_size +
    max_queued_requests waiting). Serve takes no queue of 0 (-1 means none at all): our 0, no
    request waiting for the engine, leaves Serve a queue of 1 and the replica's 503 the rule."""
    return {
        "max_ongoing_requests": int(opts.get("max_ongoing_requests", 256)),
        "max_queued_requests": max(1, int(opts.get("max_queued_requests", 32))),
        "backpressure_config": {"retry_after_s": float(opts.get("retry_after_s", 2))},
    }


def _run_app(app_name: str, drafter: str | None) -> None:
    """Declare the app, its router in front of `serve.num_replicas` engine replicas, with
    `drafter`; the last good drafter rides along as the fallback a restarted replica serves
    when the declared one does not load."""
    spec = _APPS[app_name]
    user_config = {"drafter": drafter, "fallback": spec.get("good"), "shape": spec.get("shape")}
    opts = spec["options"]
    bounds = serve_bounds(opts)
    dep = SpecServer.options(
        user_config=user_config,
        ray_actor_options=spec["actor"],
        num_replicas=int(opts.get("num_replicas", 1)),
        **bounds,
    )
    router = Router.options(**bounds)
    # A fixed version makes a user_config change an in-place `reconfigure` (no replica restart,
    # no target reload), and leaves the router running through a swap. Ray 2.60 only takes it
    # through the internal flag; without it the swap still works, by restarting the replicas.
    bound = {k: spec[k] for k in ("target", "options", "actor")}
    version = hashlib.sha256(json.dumps(bound, sort_keys=True, default=str).encode()).hexdigest()
    version = version[:16]
    try:
        dep = dep.options(version=version, _internal=True)
        router = router.options(version=version, _internal=True)
    except (TypeError, ValueError):
        log.warning(
            "Serve rejected a fixed deployment version; drafter swaps will restart the replica"
        )
    app = router.bind(dep.bind(spec["target"], spec["options"], spec["actor"]), opts)
    prefix = opts.get("route_prefix") or "/"
    retry(
        lambda: serve.run(app, name=app_name, route_prefix=prefix), f"serve.run of app {app_name!r}"
    )


def swap_drafter(drafter_dir: str | Path, app_name: str = APP_NAME) -> dict[str, Any]:
    """Hot-swap the drafter of a running app. The replica validates the checkpoint first; a bad
    one raises DrafterRejected and the current drafter keeps serving."""
    if app_name not in _APPS:
        raise ValueError(f"app {app_name!r} was not deployed by this process; call deploy() first")
    handle = engine_handle(app_name)
    path = str(drafter_dir)
    problem = handle.validate_drafter.remote(path).result()
    if problem:
        raise DrafterRejected(f"drafter swap refused, the old drafter keeps serving: {problem}")
    _run_app(app_name, path)
    info = handle.drafter_info.remote().result()
    if info["path"] != path:
        # declare the drafter that serves again: a refused path must not stay in the config
        # that a restarted replica starts from
        _run_app(app_name, info["path"])
        raise DrafterRejected(f"drafter swap refused by the replica: {info['error']}")
    _APPS[app_name]["good"] = path
    return info


def set_shape(shape: Shape, app_name: str = APP_NAME) -> dict[str, Any]:
    """Serve `shape` by default (in place: a reconfigure; plain = no drafting) on a running
    app; a restarted replica starts with it too. Returns the replica's drafter_info."""
    if app_name not in _APPS:
        raise ValueError(f"app {app_name!r} was not deployed by this process; call deploy() first")
    _APPS[app_name]["shape"] = shape.request_fields()
    _run_app(app_name, _APPS[app_name].get("good"))
    return engine_handle(app_name).drafter_info.remote().result()


def adopt_app(app_name: str = APP_NAME) -> dict[str, Any]:
    """Make an app another process deployed swappable from this one (`serve.cli swap`): read
    what it was bound with from the replica, so a redeploy keeps its version (in place).
    Returns the replica's drafter_info (its `instance` says which server this handle reached)."""
    handle = engine_handle(app_name)
    spec = handle.spec.remote().result()
    info = handle.drafter_info.remote().result()
    _APPS[app_name] = {**spec, "good": info["path"]}
    return info


def shutdown(app_name: str = APP_NAME) -> None:
    serve.delete(app_name)
    _APPS.pop(app_name, None)


# ----------------------------------------------------------------------------------------------
# One entry point for both engines


class ServingEndpoint(Protocol):
    """A running server the benchmark can score: an `EngineHandle` or `EmbeddedEndpoint`."""

    engine: str  # "embedded" | "sglang" | "vllm"
    url: str  # http://host:port, the OpenAI base without /v1

    @property
    def fixed_steps(self) -> int | None:
        """Draft steps the server uses whatever a request asks (SGLang), or None when requests
        may choose (the embedded engine: the benchmark's steps sweep works)."""
        ...

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Serve another drafter; raises DrafterRejected (the previous one keeps serving)."""
        ...

    def info(self) -> dict[str, Any]: ...

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> tuple[dict[str, Any], bool] | None:
        """Figures of a no-speculation server, when the server cannot run the baseline per
        request (SGLang); None when it can (`speculative: false` on the same replica)."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class EmbeddedEndpoint:
    """The embedded engine's Serve app as a ServingEndpoint."""

    url: str
    app_name: str
    engine: str = "embedded"
    fixed_steps: int | None = None
    shape: Shape | None = None  # the configured shape (serve.steps/topk/num_draft_tokens)

    def set_shape(self, shape: Shape) -> dict[str, Any]:
        """Serve `shape` to requests that name none (the benchmark's choice; plain = none)."""
        set_shape(shape, self.app_name)
        return self.info()

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """In place (`reconfigure`, no target reload), validated by the replica first."""
        swap_drafter(drafter_dir, self.app_name)
        return self.info()

    def info(self) -> dict[str, Any]:
        drafter = engine_handle(self.app_name).drafter_info.remote().result()
        return {"engine": self.engine, "url": self.url, "app": self.app_name, **drafter}

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> None:
        return None  # each request may say `speculative: false`: measured on this replica

    def shutdown(self) -> None:
        shutdown(self.app_name)


def deploy_endpoint(
    serve_cfg: Any,
    target_cfg: Any,
    drafter_dir: str | Path | None,
    log_dir: str | Path,
    *,
    app_name: str | None = None,
    owner: str | None = None,
    launch: Sequence[str] | None = None,
    traffic_dir: str | Path | None = None,
) -> ServingEndpoint:
    """Start the server `serve.engine` names with `drafter_dir` (None = no speculation).

    embedded: the Ray Serve app above, `serve.num_cpus` CPUs and as many torch threads;
    `log_dir` is unused (Serve logs under Ray's session dir). sglang: `sglang.launch_server` in
    an actor that owns max(serve.num_gpus, target.tp_size) GPUs, logging to `log_dir`; `launch`
    replaces `python -m sglang.launch_server` (e.g. another venv's Python). vllm: vLLM's OpenAI
    server in an actor reserving serve.num_cpus / serve.num_gpus (actors/vllm_server.py).
    `app_name` (None: serve.app) and `owner`: the embedded engine's (`deploy`)."""
    if serve_cfg.engine == "sglang":
        return deploy_sglang(serve_cfg, target_cfg, drafter_dir, log_dir, launch=launch)
    if serve_cfg.engine == "vllm":
        from actors.vllm_server import deploy_vllm

        return deploy_vllm(serve_cfg, target_cfg, drafter_dir, log_dir, launch=launch)
    ep = deploy(
        serve_cfg,
        target_cfg,
        drafter_dir,
        app_name=app_name,
        owner=owner,
        num_cpus=serve_cfg.num_cpus,
        torch_threads=int(serve_cfg.num_cpus),
        traffic_dir=traffic_dir,
    )
    configured = Shape(serve_cfg.steps, serve_cfg.topk, serve_cfg.num_draft_tokens)
    return EmbeddedEndpoint(ep.url, ep.app_name, shape=configured)
