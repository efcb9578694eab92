"""One external engine server (SGLang's or vLLM's OpenAI server) as a child process: launch it,
wait until it is healthy, keep its log, stop it; and the Ray actor that owns one for the driver.
The engines are adapters (actors/sglang_server.py, actors/vllm_server.py): their arguments, their
counters, their drafter format notes. Both floors use this module: serve/ deploys endpoints
through it, actors/vllm_backend.py regenerates the data stage's answers through it.

- The log: `<log_dir>/<engine>-<n>.log`, one file per start (failed ones included); its first
  line is the command line, redacted (actors/redact.py).
- Secrets: a secret flag of the command line (`serve.extra_args: [--api-key, K]`; actors/redact.py
  says which flags are secret) is not passed there, where `ps` shows it to every user of the
  machine, but in a YAML file only this user can read, named by `--config` and deleted once the
  server is up (or has failed). Both engines read `--config FILE` as the flags it holds (sglang
  server_args_config_parser.py `ConfigArgumentMerger`, vllm utils/argparse_utils.py
  `load_config_file`); SGLang has no environment variable for its key, vLLM's `VLLM_API_KEY`
  would cover `--api-key` only.
- A drafter swap is a restart on both engines (their adapters say why); a drafter the checks
  refuse, or with which the server does not come up, leaves the previous one serving.
- The benchmark's one interface to an engine's figures: `ResponseSpec` (what one response says of
  its speculation: each adapter's `response_spec`) and `SpecCounters` (server-wide counters:
  `EngineServer.spec_counters`, None where the engine keeps none).
- `BaselineCache`: neither engine honours a request's `speculative: false`, so the no-speculation
  figures come from a server without a drafter, measured once per (target, engine version, bench
  settings) and kept in a small JSON file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from actors.files import atomic_write
from actors.ports import port_problem
from actors.redact import is_secret, redact

if TYPE_CHECKING:
    from actors.config import TargetConfig

log = logging.getLogger(__name__)

PORT_RELEASE_S = 10.0  # how long a (re)start waits for serve.port to be free before refusing


class DrafterRejected(ValueError):
    """A drafter checkpoint that does not load, does not fit the target, or with which the server
    does not start; the previous drafter keeps serving."""


class ServerSettings(Protocol):
    """What a launcher reads of its settings: serve.config.ServeConfig has these fields, and so
    has `LocalSettings` (tests/test_engine_server.py checks both)."""

    host: str
    port: int
    steps: int
    topk: int
    num_draft_tokens: int | None
    num_gpus: float
    num_cpus: float
    extra_args: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class LocalSettings:
    """A server without a drafter that only its owner talks to (the data stage's vLLM): actors/
    cannot build a ServeConfig, which is serve/'s section."""

    port: int
    num_gpus: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    steps: int = 1
    topk: int = 1
    num_draft_tokens: int | None = None
    num_cpus: float = 1.0


def server_env(settings: ServerSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this process's (the job's runtime_env) with `serve.env` over it."""
    return {**(os.environ if base is None else base), **settings.env}


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """GET (payload None) or POST JSON; returns the decoded JSON body."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def validate_drafter(drafter_dir: str | Path, target_cfg: TargetConfig) -> str | None:
    """Every reason an engine would not serve this drafter well with this target, or None: the
    strict checkpoint checks (names, shapes, vocab map) plus vocab size, target hidden size and
    aux layer ids against the target's config.json. Catches before a restart what an engine
    would otherwise load silently (unknown names dropped, a missing d2t)."""
    from eagle3.checkpoint import CheckpointError, load_drafter
    from eagle3.fit import drafter_fit_problems
    from eagle3.target_weights import read_target_config, target_info_from_dict

    try:
        cfg, _ = load_drafter(drafter_dir)
    except (CheckpointError, OSError, ValueError) as e:
        return f"{drafter_dir}: {e}"
    info = target_info_from_dict(read_target_config(target_cfg.model, target_cfg.revision))
    problems = drafter_fit_problems(
        cfg, vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers
    )
    if problems:
        return f"{drafter_dir} does not fit {target_cfg.model}: " + "; ".join(problems)
    return None


# ---------------------------------------------------------------------------------------------
# The benchmark's one interface to an engine's figures


@dataclass(frozen=True)
class ResponseSpec:
    """What one engine response says of its speculation (each adapter's `response_spec`)."""

    completion_tokens: int
    verify_ct: int  # verify passes with drafts; 0 = the request did not speculate
    accepted: int | None  # draft tokens accepted
    hist: tuple[int, ...] | None  # [a] = verify passes that accepted a drafts


@dataclass(frozen=True)
class SpecCounters:
    """Server-wide speculative counters summed over engines: drafts (= verify passes with
    drafts), draft tokens, accepted tokens, and accepted tokens per draft position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + (0.0,) * (n - len(self.per_pos))
        b = other.per_pos + (0.0,) * (n - len(other.per_pos))
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            tuple(x - y for x, y in zip(a, b, strict=True)),
        )

    @property
    def accept_len(self) -> float | None:
        """Tokens per verify pass, bonus token included (SGLang's and this project's unit)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """[i] = fraction of drafts whose position i was accepted (= accepted >= i+1 drafts)."""
        return tuple(p / self.drafts for p in self.per_pos) if self.drafts else ()

    def accept_hist(self) -> tuple[int, ...]:
        """[a] = drafts that accepted exactly a tokens: acceptance is a prefix, so it is the
        difference of neighbouring positions' counts."""
        if not self.drafts:
            return ()
        reach = (self.drafts, *self.per_pos, 0.0)
        return tuple(int(round(reach[a] - reach[a + 1])) for a in range(len(self.per_pos) + 1))


# ---------------------------------------------------------------------------------------------
# Secrets off the command line


def split_secret_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """`argv` without its secret flags, and those as {name: value} (`--api-key K` and
    `--api-key=K` give {"api-key": "K"}; a secret flag followed by another flag, or last, is a
    switch: True)."""
    public: list[str] = []
    secrets: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        i += 1
        if not (arg.startswith("--") and is_secret(name)):
            public.append(arg)
        elif eq:
            secrets[name[2:]] = value
        elif i < len(argv) and not argv[i].startswith("--"):
            secrets[name[2:]] = argv[i]
            i += 1
        else:
            secrets[name[2:]] = True
    return public, secrets


def secret_config(secrets: dict[str, Any], engine: str) -> Path:
    """A YAML file of `secrets` that only this user can read (mkstemp: mode 0600)."""
    import yaml

    fd, path = tempfile.mkstemp(prefix=f"{engine}-flags-", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(secrets, fh)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# The server process


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the process that started it dies
    (Linux prctl PR_SET_PDEATHSIG), so a server never outlives a killed actor holding GPUs.
    (Its own session keeps it out of the actor's process group.)"""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class EngineServer:
    """One engine server process: start, health-check, restart on drafter swap, stop. An adapter
    subclasses it with the engine's name and version, its settings check, its launch command and
    arguments, and what it reads once healthy; where its resources need more than Ray's CPU and
    GPU counts, its `reserve`."""

    engine = ""  # names the log files and the messages
    version = ""  # `<engine>-<release>`: part of the baseline cache's key
    info_path = ""  # read once /health answers 200: the server's model info
    default_timeout_s = 1800.0

    def __init__(
        self,
        serve_cfg: ServerSettings,
        target_cfg: TargetConfig,
        log_dir: str | Path,
        *,
        launch: Sequence[str] | None = None,
        start_timeout_s: float | None = None,
    ):
        self.check(serve_cfg)
        self.serve_cfg = serve_cfg
        self.target_cfg = target_cfg
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s or self.default_timeout_s
        self.launch = list(launch) if launch else self.default_launch()
        self.proc: subprocess.Popen | None = None
        self.drafter_dir: str | None = None
        self.log_file: Path | None = None
        self.model_info: dict[str, Any] | None = None
        self.starts: list[dict[str, Any]] = []  # one record per (re)start: drafter, seconds
        self.attempts = 0  # starts tried, failed ones included: each has its own log file

    @staticmethod
    def check(serve_cfg: ServerSettings) -> None:
        """Raise ValueError, naming the field, for settings the engine cannot serve."""

    @staticmethod
    def default_launch() -> list[str]:
        """The command before the engine's arguments (`launch` replaces it)."""
        raise NotImplementedError

    @staticmethod
    def reserve(serve_cfg: ServerSettings, target_cfg: TargetConfig) -> tuple[dict[str, Any], Any]:
        """(Ray options of the actor that owns the server, placement group to give back at
        shutdown or None): here serve.num_cpus CPUs and serve.num_gpus GPUs."""
        return {"num_cpus": serve_cfg.num_cpus, "num_gpus": serve_cfg.num_gpus}, None

    def server_args(self, drafter_dir: str | None) -> list[str]:
        """The engine's arguments after `launch`; `drafter_dir=None` = the baseline server."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return server_env(self.serve_cfg)

    def spec_counters(self) -> SpecCounters | None:
        """The engine's server-wide speculative counters; None where it keeps none."""
        return None

    def engine_status(self) -> dict[str, Any]:
        """What the engine adds to `status`."""
        return {}

    @property
    def url(self) -> str:
        return f"http://{self.serve_cfg.host}:{self.serve_cfg.port}"

    def command(self) -> tuple[list[str], Path | None]:
        """The command line to run, its secret flags moved to a `--config` file (returned, for
        deletion once the server has read it; None without secrets)."""
        argv, secrets = split_secret_flags(self.launch + self.server_args(self.drafter_dir))
        if not secrets:
            return argv, None
        if "--config" in argv:
            raise ValueError(
                f"serve.extra_args: secret flags ({', '.join(secrets)}) and --config together; "
                "put the secrets in that config file (the engine reads one --config)"
            )
        path = secret_config(secrets, self.engine)
        return [*argv, "--config", str(path)], path

    def start(self, drafter_dir: str | Path | None) -> float:
        """Start with this drafter (None = baseline); returns seconds until healthy."""
        self.stop()
        # A port another process holds would answer the health probe for a server that never
        # bound it (or garble the probe): refused before anything is launched. A restart waits
        # a little for the stopped server's processes to let go of it.
        deadline = time.monotonic() + PORT_RELEASE_S
        while problem := port_problem(self.serve_cfg.host, self.serve_cfg.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.engine} server was not started: {problem}")
            time.sleep(0.5)
        self.drafter_dir = None if drafter_dir is None else str(drafter_dir)
        self.log_file = self.log_dir / f"{self.engine}-{self.attempts:03d}.log"
        self.attempts += 1
        argv, secrets_file = self.command()
        t0 = time.monotonic()
        try:
            with open(self.log_file, "w") as fh:
                fh.write("# " + " ".join(redact(argv)) + "\n")
                fh.flush()
                self.proc = subprocess.Popen(
                    argv,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    start_new_session=True,  # stop() can kill the whole tree by its group
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            self.model_info = self._wait_healthy(self.proc, self.log_file)
        finally:
            if secrets_file is not None:
                secrets_file.unlink(missing_ok=True)  # read at start-up, never again
        took = time.monotonic() - t0
        self.starts.append(
            {"drafter": self.drafter_dir, "seconds": round(took, 2), "log": str(self.log_file)}
        )
        log.info(
            "%s server up in %.1fs (drafter %s) at %s",
            self.engine,
            took,
            self.drafter_dir,
            self.url,
        )
        return took

    def _wait_healthy(self, proc: subprocess.Popen, log_file: Path) -> dict[str, Any]:
        """Poll `/health` until it answers 200, then read `info_path`."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {self.engine} server exited with {proc.returncode}; see {log_file}:\n"
                    f"{_tail(log_file)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                    if r.status == 200:
                        return http_json(f"{self.url}{self.info_path}", timeout=30)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.engine} server at {self.url} not healthy after "
                    f"{self.start_timeout_s:.0f}s; see {log_file}"
                )
            time.sleep(2.0)

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Serve another drafter by a restart. Returns {"drafter", "seconds", "error"}: with an
        error (drafter refused, or the server did not come up with it) the previous drafter is
        serving again and "seconds" includes that restart."""
        new, old = str(drafter_dir), self.drafter_dir
        problem = validate_drafter(new, self.target_cfg)
        if problem:
            log.error("drafter swap refused, still serving %s: %s", old, problem)
            return {"drafter": old, "seconds": 0.0, "error": problem}
        t0 = time.monotonic()
        try:
            took = self.start(new)
        except (RuntimeError, TimeoutError) as e:
            log.error("%s did not start with drafter %s; restarting with %s", self.engine, new, old)
            self.start(old)
            error = f"{new}: the server did not come up with this drafter ({e})"
            return {"drafter": old, "seconds": time.monotonic() - t0, "error": error}
        log.info("drafter swap by restart took %.1fs", took)
        return {"drafter": new, "seconds": took, "error": None}

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # the engine drains, then stops its own process tree
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: children too
                self.proc.wait()
        self.proc = None

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "drafter": self.drafter_dir,
            "running": self.proc is not None and self.proc.poll() is None,
            "starts": list(self.starts),
            **self.engine_status(),
        }

    def post(self, path: str, payload: dict[str, Any], timeout: float = 600.0) -> Any:
        """POST from the server's own node (for clients that cannot reach its loopback address)."""
        return http_json(f"{self.url}{path}", payload, timeout)


# ---------------------------------------------------------------------------------------------
# Ray: the actor that owns the server's CPUs and GPUs


@dataclass
class EngineHandle:
    """What the driver holds: a Ray actor running an `EngineServer` on what it reserved. A
    `serve.endpoint.ServingEndpoint` (url, swap_drafter, info, baseline, shutdown)."""

    engine: str
    actor: Any
    serve_cfg: Any
    target_cfg: Any
    baseline_key: str  # the target and engine version part of the baseline cache's key
    placement_group: Any = None  # given back at shutdown; None when the actor's options reserve
    url: str = ""

    @property
    def fixed_steps(self) -> int:
        """Both engines draft `serve.steps` per cycle whatever a request asks (set at launch)."""
        return self.serve_cfg.steps

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Restart with this drafter; raises DrafterRejected (previous drafter serving again)."""
        import ray

        out = ray.get(self.actor.swap_drafter.remote(str(drafter_dir)))
        if out["error"]:
            raise DrafterRejected(
                f"drafter swap refused, {out['drafter']} keeps serving: {out['error']}"
            )
        return {**self.info(), "swap_seconds": out["seconds"]}

    def spec_counters(self) -> SpecCounters | None:
        """Read on the server's node (its address is loopback there)."""
        import ray

        return ray.get(self.actor.spec_counters.remote())

    def status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.status.remote())

    def info(self) -> dict[str, Any]:
        """Engine, url, drafter, running, every (re)start's seconds and the engine's own fields."""
        return {"engine": self.engine, **self.status()}

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> tuple[dict[str, Any], bool]:
        """(no-speculation figures, was_cached) for this target and `settings_key` (the bench
        settings): from the cache, or `measure(url)` run after restarting this server without a
        drafter on the same resources; the drafter is restarted afterwards (two restarts, once)."""
        import ray

        def run() -> dict[str, Any]:
            drafter = self.status()["drafter"]
            ray.get(self.actor.start.remote(None))
            try:
                return {**measure(self.url), "server": self.status()}
            finally:
                ray.get(self.actor.start.remote(drafter))

        key = f"{self.baseline_key}|{settings_key}"
        return cached_baseline(BaselineCache(Path(cache_path)), key, run)

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote())
        finally:
            ray.kill(self.actor)
            if self.placement_group is not None:
                ray.util.remove_placement_group(self.placement_group)


def deploy(
    server_cls: type[EngineServer],
    serve_cfg: ServerSettings,
    target_cfg: TargetConfig,
    drafter_dir: str | Path | None,
    log_dir: str | Path,
    *,
    launch: Sequence[str] | None = None,
    start_timeout_s: float | None = None,
) -> EngineHandle:
    """Start `server_cls` with `drafter_dir` (None = no speculation) in a Ray actor that owns
    what `server_cls.reserve` reserves. The settings and the drafter are checked first, before
    anything is reserved. `launch` replaces the engine's command (e.g. another venv's Python)."""
    import ray

    server_cls.check(serve_cfg)
    if drafter_dir is not None and (problem := validate_drafter(drafter_dir, target_cfg)):
        raise DrafterRejected(problem)
    launch = list(launch) if launch else server_cls.default_launch()  # an error here, not in Ray
    options, group = server_cls.reserve(serve_cfg, target_cfg)
    actor = (
        ray.remote(server_cls)
        .options(**options)
        .remote(serve_cfg, target_cfg, str(log_dir), launch=launch, start_timeout_s=start_timeout_s)
    )
    key = baseline_key(target_cfg, server_cls.version)
    handle = EngineHandle(server_cls.engine, actor, serve_cfg, target_cfg, key, group)
    try:
        ray.get(actor.start.remote(None if drafter_dir is None else str(drafter_dir)))
        handle.url = handle.status()["url"]
    except BaseException:
        handle.shutdown()  # give the resources back
        raise
    return handle


# ---------------------------------------------------------------------------------------------
# Baseline cache


def baseline_key(target_cfg: TargetConfig, engine_version: str) -> str:
    """The target and engine part of a baseline's cache key (`engine_version`: `sglang-0.5.14`)."""
    t = target_cfg
    return f"{t.model}@{t.revision or 'main'}|tp{t.tp_size}|{t.dtype}|{engine_version}"


@dataclass
class BaselineCache:
    """{key: measurement} in one JSON file; a key is measured once."""

    path: Path

    def get(self, key: str) -> dict[str, Any] | None:
        return self._read().get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        data = self._read()
        data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(data, indent=2, sort_keys=True), fsync=False)

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            return json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{self.path}: not valid JSON ({e}); delete it to re-measure the baseline"
            ) from None


def cached_baseline(
    cache: BaselineCache,
    key: str,
    measure: Callable[[], dict[str, Any]],
) -> tuple[dict[str, Any], bool]:
    """(measurement, was_cached): `measure()` runs only when `key` is not in the cache."""
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    value = {**measure(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    cache.put(key, value)
    return value, False
