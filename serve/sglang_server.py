"""Serving through SGLang: one process of `python -m sglang.launch_server` with the EAGLE-3 drafter,
owned by a Ray actor that holds the GPUs, plus the pure pieces around it.

- `build_server_args` turns the config into the launch_server command line (tested against
  SGLang's own parser where sglang is installed).
- `spec_stats_from_sglang` reads per-request accept length from `meta_info` (completion_tokens /
  spec_verify_ct), in native `/generate` responses and in `/v1/chat/completions` responses sent
  with `"return_meta_info": true` (SGLang's OpenAI adapter then puts the whole meta_info under
  `choices[i].meta_info`; `/v1/completions` and streamed chat carry none). Never from
  `/get_server_info`'s `avg_spec_accept_length`: it accumulates since boot, warm-up included.
- `parse_decode_log` reads the scheduler's "Decode batch, ... cuda graph: True, ..." lines: decode
  without CUDA graphs is several times slower and would make every speed figure wrong.
- Drafter swap is a restart. sglang 0.5.14's `/update_weights_from_disk` takes one `model_path` and
  loads it into the target first and then into the draft worker (scheduler_components/
  weight_updater.py): there is no way to address only the drafter, so the restart's cost is
  measured and logged instead. The drafter is checked against the target first
  (`validate_drafter`); one that is refused, or with which the server does not come up, leaves
  the previous drafter serving and raises `DrafterRejected`.
- `BaselineCache`: the no-speculation server is measured once per (target, revision, tp, sglang
  version, benchmark settings) and kept in a small JSON file. SGLang ignores the benchmark's
  per-request `speculative: false`, so the baseline needs a server without a drafter.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.files import atomic_write
from actors.redact import redact
from actors.sglang_backend import SGLANG_VERSION

if TYPE_CHECKING:
    from actors.config import TargetConfig
    from serve.config import ServeConfig

log = logging.getLogger(__name__)

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]
GRPC_PORT_OFFSET = (
    10000  # sglang 0.5.14 server_args: grpc_port = port + 10000 unless SGLANG_GRPC_PORT
)


class DrafterRejected(ValueError):
    """A drafter checkpoint that does not load, does not fit the target, or with which the server
    does not start; the previous drafter keeps serving."""


# ---------------------------------------------------------------------------------------------
# Command line


def num_draft_tokens(serve_cfg: ServeConfig) -> int | None:
    """Tokens verified per cycle: the configured value, steps+1 for chains, None (SGLang's own
    choice) for trees without a value."""
    if serve_cfg.num_draft_tokens is not None:
        return serve_cfg.num_draft_tokens
    return serve_cfg.steps + 1 if serve_cfg.topk == 1 else None


def build_server_args(
    serve_cfg: ServeConfig, target_cfg: TargetConfig, drafter_dir: str | Path | None, port: int
) -> list[str]:
    """Arguments for `python -m sglang.launch_server`; `drafter_dir=None` = the baseline server
    without speculation."""
    args = [
        "--model-path", target_cfg.model,
        "--tp-size", str(target_cfg.tp_size),
        "--dtype", target_cfg.dtype,
        "--host", serve_cfg.host,
        "--port", str(port),
    ]  # fmt: skip
    if target_cfg.revision:
        args += ["--revision", target_cfg.revision]
    if target_cfg.trust_remote_code:
        args.append("--trust-remote-code")
    if drafter_dir is not None:
        args += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(drafter_dir),
            "--speculative-num-steps", str(serve_cfg.steps),
            "--speculative-eagle-topk", str(serve_cfg.topk),
        ]  # fmt: skip
        n = num_draft_tokens(serve_cfg)
        if n is not None:
            args += ["--speculative-num-draft-tokens", str(n)]
    return args + list(serve_cfg.extra_args)


def check_port(serve_cfg: ServeConfig) -> None:
    """sglang 0.5.14 refuses to start when port + 10000 (its gRPC port) exceeds 65535."""
    if serve_cfg.port + GRPC_PORT_OFFSET > 65535 and not server_env(serve_cfg).get(
        "SGLANG_GRPC_PORT"
    ):
        raise ValueError(
            f"serve.port: {serve_cfg.port} -- sglang {SGLANG_VERSION} takes port + "
            f"{GRPC_PORT_OFFSET} for its gRPC port, which must stay <= 65535; use a port <= "
            f"{65535 - GRPC_PORT_OFFSET} or set SGLANG_GRPC_PORT in serve.env"
        )


def server_env(serve_cfg: ServeConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this process's (the job's runtime_env) with `serve.env` over it."""
    return {**(os.environ if base is None else base), **serve_cfg.env}


# ---------------------------------------------------------------------------------------------
# Per-request speculative statistics


def spec_stats_from_sglang(response: dict[str, Any]) -> dict[str, Any]:
    """Per-request speculative stats from one SGLang response.

    Accepts a native `/generate` response (`{"text", "output_ids", "meta_info": {...}}`) or an
    OpenAI chat completion sent with `"return_meta_info": true` (`choices[0].meta_info`). Returns
    `completion_tokens`, `spec_verify_ct`, `spec_accept_len` (= completion_tokens / verify passes,
    bonus token included, as SGLang counts), `spec_accepted_tokens` (draft tokens accepted),
    `spec_accept_hist` ([a] = verify passes that accepted a drafts) and `speculative`.
    Without speculation, or without meta_info, the spec fields are None / 0.
    """
    meta = _meta_info(response)
    usage = response.get("usage") or {}
    completion = meta.get("completion_tokens", usage.get("completion_tokens"))
    verify = int(meta.get("spec_verify_ct") or 0)
    accepted = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    hist = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    return {
        "completion_tokens": int(completion) if completion is not None else None,
        "spec_verify_ct": verify,
        "spec_accept_len": (completion / verify) if verify and completion is not None else None,
        "spec_accepted_tokens": int(accepted) if accepted is not None else None,
        "spec_accept_hist": list(hist) if hist is not None else None,
        "speculative": verify > 0,
        "has_meta_info": bool(meta),
    }


def _meta_info(response: dict[str, Any]) -> dict[str, Any]:
    """The top-level meta_info (native /generate) or the first choice's (OpenAI chat)."""
    if isinstance(response.get("meta_info"), dict):
        return response["meta_info"]
    for choice in response.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("meta_info"), dict):
            return choice["meta_info"]
    return {}


def has_meta_info(response: dict[str, Any]) -> bool:
    return bool(_meta_info(response))


# ---------------------------------------------------------------------------------------------
# Drafter check before a (re)start


def validate_drafter(drafter_dir: str | Path, target_cfg: TargetConfig) -> str | None:
    """Every reason SGLang would not serve this drafter well with this target, or None: the
    strict checkpoint checks (names, shapes, vocab map) plus vocab size, target hidden size and
    aux layer ids against the target's config.json. Catches before a restart what SGLang would
    otherwise load silently (unknown names dropped, a missing d2t)."""
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
# Scheduler log

# "[2026-06-26 10:00:00 TP0] Decode batch, #running-req: 8, #token: 5120, token usage: 0.02,
#  accept len: 3.12, accept rate: 0.71, cuda graph: True, gen throughput (token/s): 812.44, #queue-req: 0"
_DECODE = re.compile(r"Decode batch\b")
_GRAPH = re.compile(r"\b(?:cuda|cpu|npu|musa) graph: (True|False)")
_ACCEPT = re.compile(r"accept len: ([0-9.]+)")
_THROUGHPUT = re.compile(r"gen throughput \(token/s\): ([0-9.]+)")


@dataclass
class DecodeLogStats:
    decode_lines: int = 0
    graph_true: int = 0
    graph_false: int = 0
    accept_lens: list[float] = field(default_factory=list)
    gen_throughputs: list[float] = field(default_factory=list)

    @property
    def cuda_graph(self) -> bool | None:
        """True when every decode line ran a graph, False when any did not, None without lines."""
        if not self.decode_lines:
            return None
        return self.graph_false == 0 and self.graph_true > 0


def parse_decode_log(lines: Sequence[str]) -> DecodeLogStats:
    """Collect the scheduler's decode lines (prefill lines also print "cuda graph:" and are skipped)."""
    st = DecodeLogStats()
    for line in lines:
        if not _DECODE.search(line):
            continue
        st.decode_lines += 1
        if m := _GRAPH.search(line):
            if m.group(1) == "True":
                st.graph_true += 1
            else:
                st.graph_false += 1
        if m := _ACCEPT.search(line):
            st.accept_lens.append(float(m.group(1)))
        if m := _THROUGHPUT.search(line):
            st.gen_throughputs.append(float(m.group(1)))
    return st


# ---------------------------------------------------------------------------------------------
# The server process


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """GET (payload None) or POST JSON; returns the decoded JSON body."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def wait_healthy(
    base_url: str, proc: subprocess.Popen, timeout_s: float, log_file: Path
) -> dict[str, Any]:
    """Poll `/health` (200 once a one-token generation works) then read `/get_model_info`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sglang.launch_server exited with {proc.returncode}; see {log_file}:\n{_tail(log_file)}"
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as r:
                if r.status == 200:
                    return http_json(f"{base_url}/get_model_info", timeout=30)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"sglang server at {base_url} not healthy after {timeout_s:.0f}s; see {log_file}"
            )
        time.sleep(2.0)


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


class SGLangServer:
    """One `sglang.launch_server` process: start, health-check, restart on drafter swap, stop.
    Its stdout/stderr go to `<log_dir>/sglang-<n>.log`."""

    def __init__(
        self,
        serve_cfg: ServeConfig,
        target_cfg: TargetConfig,
        log_dir: str | Path,
        *,
        start_timeout_s: float = 3600.0,
        launch: Sequence[str] = tuple(LAUNCH),
    ):
        check_port(serve_cfg)
        self.serve_cfg = serve_cfg
        self.target_cfg = target_cfg
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.launch = list(launch)
        self.proc: subprocess.Popen | None = None
        self.drafter_dir: str | None = None
        self.log_file: Path | None = None
        self.model_info: dict[str, Any] | None = None
        self.starts: list[dict[str, Any]] = []  # one record per (re)start: drafter, seconds
        self.attempts = 0  # starts tried, failed ones included: each has its own log file

    @property
    def url(self) -> str:
        return f"http://{self.serve_cfg.host}:{self.serve_cfg.port}"

    def start(self, drafter_dir: str | Path | None) -> float:
        """Start with this drafter (None = baseline); returns seconds until healthy."""
        self.stop()
        self.drafter_dir = None if drafter_dir is None else str(drafter_dir)
        self.log_file = self.log_dir / f"sglang-{self.attempts:03d}.log"
        self.attempts += 1
        argv = self.launch + build_server_args(
            self.serve_cfg, self.target_cfg, self.drafter_dir, self.serve_cfg.port
        )
        t0 = time.monotonic()
        with open(self.log_file, "w") as fh:
            fh.write("# " + " ".join(redact(argv)) + "\n")  # --api-key K -> ***
            fh.flush()
            self.proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=server_env(self.serve_cfg),
                start_new_session=True,  # stop() can kill the whole tree by its process group
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.model_info = wait_healthy(self.url, self.proc, self.start_timeout_s, self.log_file)
        took = time.monotonic() - t0
        self.starts.append(
            {"drafter": self.drafter_dir, "seconds": round(took, 2), "log": str(self.log_file)}
        )
        log.info("sglang server up in %.1fs (drafter %s) at %s", took, self.drafter_dir, self.url)
        return took

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Serve another drafter by a restart (see the module docstring). Returns {"drafter",
        "seconds", "error"}: with an error (drafter refused, or the server did not come up with
        it) the previous drafter is serving again and "seconds" includes that restart."""
        new, old = str(drafter_dir), self.drafter_dir
        problem = validate_drafter(new, self.target_cfg)
        if problem:
            log.error("drafter swap refused, still serving %s: %s", old, problem)
            return {"drafter": old, "seconds": 0.0, "error": problem}
        t0 = time.monotonic()
        try:
            took = self.start(new)
        except (RuntimeError, TimeoutError) as e:
            log.error("sglang did not start with drafter %s; restarting with %s", new, old)
            self.start(old)
            error = f"{new}: the server did not come up with this drafter ({e})"
            return {"drafter": old, "seconds": time.monotonic() - t0, "error": error}
        log.info("drafter swap by restart took %.1fs", took)
        return {"drafter": new, "seconds": took, "error": None}

    def decode_log(self) -> DecodeLogStats:
        if self.log_file is None or not self.log_file.exists():
            return DecodeLogStats()
        return parse_decode_log(self.log_file.read_text(errors="replace").splitlines())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # SGLang drains, then stops its scheduler/detokenizer tree
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: children too
                self.proc.wait()
        self.proc = None

    def status(self) -> dict[str, Any]:
        graph = self.decode_log()
        return {
            "url": self.url,
            "drafter": self.drafter_dir,
            "running": self.proc is not None and self.proc.poll() is None,
            "cuda_graph": graph.cuda_graph,
            "decode_lines": graph.decode_lines,
            "starts": list(self.starts),
        }

    def post(self, path: str, payload: dict[str, Any], timeout: float = 600.0) -> Any:
        """POST from the server's own node (for clients that cannot reach its loopback address)."""
        return http_json(f"{self.url}{path}", payload, timeout)


# ---------------------------------------------------------------------------------------------
# Ray: the actor that owns the GPUs


class SGLangServerHandle:
    """What the driver holds: a Ray actor running `SGLangServer` on GPUs it reserved. It is a
    `serve.deployment.ServingEndpoint` (url, swap_drafter, shutdown, info)."""

    engine = "sglang"

    def __init__(
        self,
        actor: Any,
        reservation: Any,
        url: str,
        serve_cfg: ServeConfig,
        target_cfg: TargetConfig,
    ):
        self.actor = actor
        self.reservation = reservation
        self.url = url
        self.serve_cfg = serve_cfg
        self.target_cfg = target_cfg

    @property
    def fixed_steps(self) -> int:
        """SGLang drafts `serve.steps` per cycle whatever a request asks (set at launch)."""
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

    def status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.status.remote())

    def info(self) -> dict[str, Any]:
        """Engine, url, drafter, running, cuda_graph (decode log), and every (re)start's seconds."""
        return {"engine": self.engine, **self.status()}

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> tuple[dict[str, Any], bool]:
        """(no-speculation figures, was_cached) for this target and `settings_key` (the bench
        settings): from the cache, or `measure(url)` run after restarting this server without a
        drafter on the same GPUs; the drafter is restarted afterwards (two restarts, once)."""
        import ray

        def run() -> dict[str, Any]:
            drafter = self.status()["drafter"]
            ray.get(self.actor.start.remote(None))
            try:
                return {**measure(self.url), "server": self.status()}
            finally:
                ray.get(self.actor.start.remote(drafter))

        key = f"{baseline_key(self.target_cfg)}|{settings_key}"
        return cached_baseline(BaselineCache(Path(cache_path)), key, run)

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote())
        finally:
            ray.kill(self.actor)
            ray.util.remove_placement_group(self.reservation.placement_group)


class _ServerActor(SGLangServer):
    """SGLangServer inside the actor: widens CUDA_VISIBLE_DEVICES to the reserved GPUs first."""

    def __init__(self, serve_cfg: ServeConfig, target_cfg: TargetConfig, log_dir: str, **kw: Any):
        from actors.sglang_backend import claim_gpus

        claim_gpus(None, serve_cfg.env)
        super().__init__(serve_cfg, target_cfg, log_dir, **kw)


def deploy_sglang(
    serve_cfg: ServeConfig,
    target_cfg: TargetConfig,
    drafter_dir: str | Path | None,
    log_dir: str | Path,
    *,
    launch: Sequence[str] | None = None,
    start_timeout_s: float = 3600.0,
) -> SGLangServerHandle:
    """Reserve `serve.num_gpus` GPUs (at least target.tp_size) on one node, start the server there.

    `launch`: the command before the server arguments (default: this Python's
    `-m sglang.launch_server`; another venv's Python where SGLang pins another torch)."""
    import ray

    from actors.sglang_backend import gpu_actor_options, reserve_target_gpus

    check_port(serve_cfg)
    if drafter_dir is not None and (problem := validate_drafter(drafter_dir, target_cfg)):
        raise DrafterRejected(problem)
    gpus = max(int(serve_cfg.num_gpus), target_cfg.tp_size)
    reservation = reserve_target_gpus(gpus)
    kw: dict[str, Any] = {"start_timeout_s": start_timeout_s}
    if launch is not None:
        kw["launch"] = list(launch)
    actor = (
        ray.remote(_ServerActor)
        .options(**gpu_actor_options(reservation, serve_cfg.env))
        .remote(serve_cfg, target_cfg, str(log_dir), **kw)
    )
    handle = SGLangServerHandle(actor, reservation, "", serve_cfg, target_cfg)
    try:
        ray.get(actor.start.remote(None if drafter_dir is None else str(drafter_dir)))
        handle.url = handle.status()["url"]
    except BaseException:
        handle.shutdown()  # give the GPUs back
        raise
    return handle


# ---------------------------------------------------------------------------------------------
# Baseline cache


def baseline_key(target_cfg: TargetConfig, sglang_version: str = SGLANG_VERSION) -> str:
    return f"{target_cfg.model}@{target_cfg.revision or 'main'}|tp{target_cfg.tp_size}|{target_cfg.dtype}|sglang-{sglang_version}"


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


def measure_baseline(
    serve_cfg: ServeConfig,
    target_cfg: TargetConfig,
    log_dir: str | Path,
    bench: Callable[[str], dict[str, Any]],
    cache_path: str | Path,
    settings_key: str = "",
    *,
    launch: Sequence[str] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Baseline (no speculation) numbers for this target, from the cache or from a server started
    for it: `bench(url)` runs the benchmark against that server and returns its figures. Needs
    the GPUs free: with a speculative server running, use `SGLangServerHandle.baseline`."""

    def run() -> dict[str, Any]:
        handle = deploy_sglang(serve_cfg, target_cfg, None, log_dir, launch=launch)
        try:
            return {**bench(handle.url), "server": handle.status()}
        finally:
            handle.shutdown()

    key = f"{baseline_key(target_cfg)}|{settings_key}" if settings_key else baseline_key(target_cfg)
    return cached_baseline(BaselineCache(Path(cache_path)), key, run)


__all__ = [
    "BaselineCache",
    "DrafterRejected",
    "DecodeLogStats",
    "SGLangServer",
    "SGLangServerHandle",
    "baseline_key",
    "build_server_args",
    "cached_baseline",
    "deploy_sglang",
    "has_meta_info",
    "measure_baseline",
    "parse_decode_log",
    "spec_stats_from_sglang",
    "validate_drafter",
]
