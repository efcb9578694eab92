"""The SGLang adapter of actors/engine_server.py: `python -m sglang.launch_server` with the EAGLE-3
drafter (docs/sglang.md). Its arguments, its per-request figures, its decode log, its Ray
reservation; the launcher does the rest (start, health, log, secrets, restart, stop).

- `build_server_args` turns the config into the launch_server command line (tested against
  SGLang's own parser where sglang is installed).
- Drafter format: SGLang reads the drafter folder's `config.json` (`LlamaForCausalLMEagle3`,
  `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's ids, which are this project's) and
  `model.safetensors` (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`); `engine_server.
  validate_drafter` checks it against the target before any (re)start.
- `spec_stats_from_sglang` reads per-request accept length from `meta_info` (completion_tokens /
  spec_verify_ct), in native `/generate` responses and in `/v1/chat/completions` responses sent
  with `"return_meta_info": true` (SGLang's OpenAI adapter then puts the whole meta_info under
  `choices[i].meta_info`; `/v1/completions` and streamed chat carry none). Never from
  `/get_server_info`'s `avg_spec_accept_length`: it accumulates since boot, warm-up included.
  SGLang keeps no server-wide counters the benchmark reads (`spec_counters` is None).
- `parse_decode_log` reads the scheduler's "Decode batch, ... cuda graph: True, ..." lines: decode
  without CUDA graphs is several times slower and would make every speed figure wrong.
- Drafter swap is a restart. sglang 0.5.14's `/update_weights_from_disk` takes one `model_path` and
  loads it into the target first and then into the draft worker (scheduler_components/
  weight_updater.py): there is no way to address only the drafter, so the restart's cost is
  measured and logged instead.
- The baseline (a server without a drafter: SGLang ignores a request's `speculative: false`) is
  cached per (target, revision, tp, dtype, sglang version, bench settings): `baseline_key`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors import engine_server
from actors.engine_server import (
    EngineHandle,
    EngineServer,
    ResponseSpec,
    ServerSettings,
    server_env,
)
from actors.sglang_backend import (
    SGLANG_VERSION,
    claim_gpus,
    gpu_actor_options,
    reserve_target_gpus,
)

if TYPE_CHECKING:
    from actors.config import TargetConfig

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]
GRPC_PORT_OFFSET = (
    10000  # sglang 0.5.14 server_args: grpc_port = port + 10000 unless SGLANG_GRPC_PORT
)
MAX_PORT = 65535 - GRPC_PORT_OFFSET  # the highest serve.port whose gRPC port exists


# ---------------------------------------------------------------------------------------------
# Command line


def num_draft_tokens(serve_cfg: ServerSettings) -> int | None:
    """Tokens verified per cycle: the configured value, steps+1 for chains, None (SGLang's own
    choice) for trees without a value."""
    if serve_cfg.num_draft_tokens is not None:
        return serve_cfg.num_draft_tokens
    return serve_cfg.steps + 1 if serve_cfg.topk == 1 else None


def build_server_args(
    serve_cfg: ServerSettings, target_cfg: TargetConfig, drafter_dir: str | Path | None, port: int
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


def check_port(serve_cfg: ServerSettings) -> None:
    """sglang 0.5.14 refuses to start when port + 10000 (its gRPC port) exceeds 65535."""
    if serve_cfg.port > MAX_PORT and not server_env(serve_cfg).get("SGLANG_GRPC_PORT"):
        raise ValueError(
            f"serve.port: {serve_cfg.port} -- sglang {SGLANG_VERSION} takes port + "
            f"{GRPC_PORT_OFFSET} for its gRPC port, which must stay <= 65535; use a port <= "
            f"{MAX_PORT} or set SGLANG_GRPC_PORT in serve.env"
        )


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


def response_spec(response: dict[str, Any]) -> ResponseSpec | None:
    """The benchmark's form of `spec_stats_from_sglang`; None for a response without meta_info
    (another engine's)."""
    if not has_meta_info(response):
        return None
    st = spec_stats_from_sglang(response)
    if st["completion_tokens"] is None:
        raise ValueError(f"meta_info without completion_tokens: keys {sorted(response)}")
    hist = st["spec_accept_hist"]
    accepted, verify = st["spec_accepted_tokens"], st["spec_verify_ct"]
    return ResponseSpec(st["completion_tokens"], verify, accepted, tuple(map(int, hist or ())))


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
# The server process and the actor that owns its GPUs


class SGLangServer(EngineServer):
    """One `sglang.launch_server` process (actors/engine_server.py's `EngineServer`). Its
    stdout/stderr go to `<log_dir>/sglang-<n>.log`; `status()` adds the decode log's CUDA-graph
    verdict."""

    engine = "sglang"
    version = f"sglang-{SGLANG_VERSION}"
    info_path = "/get_model_info"
    default_timeout_s = 3600.0
    check = staticmethod(check_port)

    @staticmethod
    def default_launch() -> list[str]:
        return list(LAUNCH)

    @staticmethod
    def reserve(serve_cfg: ServerSettings, target_cfg: TargetConfig) -> tuple[dict[str, Any], Any]:
        """max(serve.num_gpus, target.tp_size) GPUs of one node, in a placement group."""
        reservation = reserve_target_gpus(max(int(serve_cfg.num_gpus), target_cfg.tp_size))
        return gpu_actor_options(reservation, serve_cfg.env), reservation.placement_group

    def server_args(self, drafter_dir: str | None) -> list[str]:
        return build_server_args(self.serve_cfg, self.target_cfg, drafter_dir, self.serve_cfg.port)

    def decode_log(self) -> DecodeLogStats:
        if self.log_file is None or not self.log_file.exists():
            return DecodeLogStats()
        return parse_decode_log(self.log_file.read_text(errors="replace").splitlines())

    def engine_status(self) -> dict[str, Any]:
        graph = self.decode_log()
        return {"cuda_graph": graph.cuda_graph, "decode_lines": graph.decode_lines}


class _ServerActor(SGLangServer):
    """SGLangServer inside the actor: widens CUDA_VISIBLE_DEVICES to the reserved GPUs first."""

    def __init__(self, serve_cfg: ServerSettings, *args: Any, **kw: Any):
        claim_gpus(None, serve_cfg.env)
        super().__init__(serve_cfg, *args, **kw)


def deploy_sglang(*args: Any, **kw: Any) -> EngineHandle:
    """`engine_server.deploy(SGLang, serve_cfg, target_cfg, drafter_dir, log_dir, launch=,
    start_timeout_s=)`: the server on max(serve.num_gpus, target.tp_size) GPUs of one node.
    `launch` replaces this Python's `-m sglang.launch_server` (another venv's Python where SGLang
    pins another torch)."""
    return engine_server.deploy(_ServerActor, *args, **kw)


def baseline_key(target_cfg: TargetConfig, sglang_version: str = SGLANG_VERSION) -> str:
    return engine_server.baseline_key(target_cfg, f"sglang-{sglang_version}")


__all__ = [
    "DecodeLogStats",
    "SGLangServer",
    "baseline_key",
    "build_server_args",
    "deploy_sglang",
    "has_meta_info",
    "parse_decode_log",
    "response_spec",
    "spec_stats_from_sglang",
]
