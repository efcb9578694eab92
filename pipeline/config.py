"""The one configuration tree of the loop, composed from the sections each component owns.

Each component declares its sections (torchtitan's pattern): `target:` and `data:` live in
actors/config.py, `serve:` and `bench:` in serve/config.py, and the driver's own (drafter, train,
stop, tracking) here. Every field's docstring is its documentation. `load_config` validates a YAML
file against the tree and reports every problem at once, each naming its dotted path and the fix.
Stages receive the sub-tree they need (``cfg.data``, ``cfg.train`` ...), never the whole tree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from actors.config import (  # noqa: F401  (re-exported: the tree's sections, one import path)
    ConfigError,
    DataConfig,
    Strict,
    TargetConfig,
    data_stage_problems,
    format_errors,
    read_yaml,
)
from serve.config import BenchConfig, ServeConfig  # noqa: F401  (re-exported)

_Strict = Strict


class DrafterConfig(_Strict):
    init: str = "scratch"
    """`scratch`, `previous` (the last round's drafter), or a local folder / HF repo id of an
    existing EAGLE-3 drafter (checked for compatibility before any GPU time). A relative folder
    is found from the working directory, else from this checkout's root (`drafters/...`, the
    drafters shipped with the repository): see `resolved_init`. Fine-tuning keeps the drafter's
    own draft vocabulary (d2t/t2d); `draft_vocab_size` applies to `scratch` only."""
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

    def resolved_init(self) -> str:
        """`init` as every stage reads it: a relative folder resolved against the working
        directory (under `ray job submit --working-dir .`, the uploaded repository), else
        against this checkout's root, so `python /elsewhere/pipeline/run.py` finds the shipped
        drafters too; an absolute path. `scratch`, `previous`, a Hub repo id and a missing path
        stay as given (preflight names a missing one)."""
        if self.init in ("scratch", "previous"):
            return self.init
        p = Path(self.init).expanduser()
        for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
            if (base / p).is_dir():
                return str((base / p).resolve())
        return self.init


class FinetuneConfig(_Strict):
    """The recipe of a round that starts from a trained drafter (`drafter.init` names one, or any
    round after the first): gentle and anchored to where it started, so a few thousand samples
    fit the drafter to its target without erasing what it knew. Chosen from a measured sweep
    (docs/training.md, "Fine-tuning a trained drafter"). Training from scratch uses the
    section's top-level settings."""

    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (the scratch rate is several times this)."""
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    """Linear warmup fraction: a trained drafter's first steps with fresh AdamW moments are the
    ones that knock it furthest."""
    anchor: float = Field(1e-2, ge=0)
    """L2-SP weight, per weight: the loss adds anchor x Σ(θ−θ₀)² over the drafter's weights, so
    each weight's gradient gains 2·anchor·(θ−θ₀) whatever the model's size (DDP only; 0 = off).
    Logged per step as `train/anchor_loss`, with `train/drift_rms`, the weights' RMS distance
    from the start."""
    gate_z: float = Field(2.0, ge=0)
    """A trained state replaces the starting drafter only when its gain over the start is
    this many standard errors above 0: the mean over eval batches of the paired difference in
    simulated acceptance (the same batches scored at step 0 and now) against that mean's
    standard error. The margin follows the eval set's own noise, where a fixed one (0.01 before
    2026-12-05) was inside the noise of a few thousand tokens and far above it on many
    (docs/training.md, "The gate"). 0 = any gain on average replaces the start."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the data; None = `train.epochs`."""
    ttt_length: int | None = Field(None, ge=1)
    """TTT steps; None = `train.ttt_length`."""


class TrainConfig(_Strict):
    def data_window(self, made: list[Any]) -> list[Any]:
        """Of the rounds that made data, oldest first, those a round trains on (`data_rounds`)."""
        return made if self.data_rounds is None else made[-self.data_rounds :]

    def for_round(
        self, r: int, seconds: float | None = None, from_drafter: bool = False
    ) -> TrainConfig:
        """This section as round r's workers run it: the fine-tuning recipe when the round
        starts from a trained drafter (`from_drafter`), round 0's epochs, the budget plan's time
        box. The one place that decides which recipe a round trains with."""
        update: dict[str, Any] = {}
        ft = self.finetune
        if from_drafter and ft is not None:
            update.update(
                lr=ft.lr, warmup_ratio=ft.warmup_ratio, anchor=ft.anchor, gate_z=ft.gate_z
            )
            update.update({k: v for k in ("epochs", "ttt_length") if (v := getattr(ft, k))})
        elif r == 0 and self.first_round_epochs is not None:
            update["epochs"] = self.first_round_epochs
        if seconds is not None:
            update["max_seconds"] = seconds
        return self.model_copy(update=update) if update else self

    first_round: Literal["train", "skip"] = "train"
    """`skip`: round 0 trains nothing and makes no data. It serves `drafter.init` as it is,
    benchmarks it, and the simulated users talk to it; round 1 fine-tunes it on their traffic
    plus fresh prompts, behind the promotion gate. For a base drafter that already fits the
    target (the demo's `drafters/smollm2-135m-base`); needs `drafter.init` to be one. `train`:
    round 0 trains from `drafter.init` like every round."""
    num_workers: int = Field(2, ge=1)
    """Ray Train workers (DDP)."""
    use_gpu: bool = False
    """One GPU per worker (`gpus_per_worker`); NCCL when true, gloo on CPU."""
    gpus_per_worker: float = Field(1.0, gt=0)
    """With `use_gpu`: the share of a GPU each worker reserves from Ray. Below 1, training
    shares its GPU, with the embedded server among others, which can then stay up between rounds
    (`Config.serves_through_rounds`)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype of the training step; master weights and optimizer state stay fp32. `auto` =
    bf16 on GPUs and on CPUs with native bf16 matmul (AVX512-BF16 or AMX, ~2.3x faster there), fp32
    on other CPUs."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each worker reserves."""
    fsdp: bool = False
    """Shard the drafter with FSDP2 instead of DDP (large drafters)."""
    epochs: int = Field(6, ge=1)
    """Passes over the round's training data (`data_rounds`) per round (rounds after the first
    fine-tune the serving drafter)."""
    data_rounds: int | None = Field(None, ge=1)
    """Rounds of data a round trains on: its own and the `data_rounds - 1` before it; None = all
    accumulated data. A loop of many large rounds (the pool climb) fine-tunes each round's
    drafter on its fresh slice (1) or a short window, so a round costs the same in round 9 as
    in round 1; the fine-tuning anchor keeps what earlier data taught."""
    first_round_epochs: int | None = Field(None, ge=1)
    """Epochs of round 0, which trains from `drafter.init` (often from scratch) and so usually
    needs more; None = `epochs`."""
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
    """Fraction of a round's samples held out for evaluation, when the run has no gate set
    (`data.gate_prompts` 0); with one, every round evaluates on it and trains on all its
    samples."""
    max_failures: int = Field(2, ge=0)
    """Worker-group restarts Ray Train may do (resume from the last checkpoint)."""
    seed: int = 0
    """Seed of init and data order."""
    eval_every: int | None = Field(None, ge=1)
    """Optimizer steps between held-out evaluations, besides the one at each epoch's end and at
    the last step; None = only those."""
    patience: int | None = Field(None, ge=1)
    """Stop a round's training after this many held-out evaluations in a row without a new best
    simulated acceptance (loss keeps falling after acceptance peaks); None = never early."""
    continue_kept: bool = True
    """When a round keeps its start (no trained state cleared the gate: `kept_start`), the next
    round trains on from that round's last trained state (written to `train/round-N/last/`
    only then) instead of from the serving drafter again, so a fine-tune's steps add up across
    short rounds through the dip it starts with. The gate, the step-0 evaluation, a kept
    start's export and the anchor stay on the serving drafter: the kept-out state is a training
    init only, never served, benchmarked or promoted. false = every round trains from the
    serving drafter (docs/training.md, "Rounds that keep their start")."""
    finetune: FinetuneConfig | None = FinetuneConfig()
    """The recipe of rounds that start from a trained drafter (`for_round`); None = every
    round trains with the settings above."""
    anchor: float = Field(0.0, ge=0)
    """L2-SP weight toward the starting weights, as the workers run it: `finetune.anchor` when
    the round fine-tunes (set by `for_round`); from scratch there is no start to keep."""
    gate_z: float = Field(0.0, ge=0)
    """How many paired standard errors a trained state's gain over the starting drafter must
    reach to be exported instead of it, as the workers run it: `finetune.gate_z` (set by
    `for_round`); from scratch there is no start to beat."""
    max_seconds: float | None = Field(None, gt=0)
    """Time box of a round's training: after its first steps the workers fix the step count
    that fits (at most `epochs`), and the LR schedule decays over it. None = `epochs` decide.
    `stop.max_wall_minutes` sets it per round from the budget plan (pipeline/budget.py)."""


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
    """Budget: wall time of the loop, as a plan (pipeline/budget.py): each round's data stage
    and training are time-boxed to fit it, sized from what this machine measures at start-up
    (pipeline/measure.py, the embedded engine: `serve.engine: embedded` only). On a machine too
    slow for the configured measuring work, `bench.max_tokens`, `bench.shape_chains`,
    `serve.simulate_users` and `data.gate_prompts` are cut (at most to a quarter) so data and
    training keep their share (pipeline/round_plan.py `size_work`, recorded in summary.json's
    first plan); only a budget that even the smallest cannot fit is refused before round 0,
    naming the minutes that would."""
    round_minutes: float | None = Field(None, gt=0)
    """Budget: wall time of each round (data, training, the gate, the benchmark and the
    simulated users), as the same plan: the round's data stage and training are time-boxed so
    that it ends within this, however long the run has been going (a resumed one too). With
    `max_wall_minutes` a round gets the smaller of the two plans. For machines held by the hour
    or taken back: each round is a piece that fits (docs/training.md)."""

    @property
    def planned(self) -> bool:
        """Rounds are planned in seconds: a time budget is set."""
        return bool(self.max_wall_minutes or self.round_minutes)


class TrackingConfig(_Strict):
    tracking_uri: str | None = None
    """MLflow tracking URI (sqlite or http://127.0.0.1:5000); None = the run directory's own
    store, sqlite:///<run-dir>/mlflow.db with artifacts in <run-dir>/mlartifacts."""
    experiment: str = "eagle-loop"
    """MLflow experiment name."""
    registered_model: str | None = None
    """Registered model name; the best round gets alias `champion`. None: `<name>-drafter`
    (the run's `name`), so runs that share a tracking server keep their own `champion`."""


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
    ray_host: str = "127.0.0.1"
    """The address every listener of a Ray that `pipeline/run.py` starts itself binds (GCS,
    raylet, workers, metrics agent): loopback keeps it off the network. Another address exposes
    it to whoever reaches that one. Unused when joining a cluster (RAY_ADDRESS)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        errs = data_stage_problems(self.target, self.data)
        sources = self.data.sources()
        if sources == {"traffic": 1.0} and not self.bench.eval_files:
            errs.append(
                "data.source: traffic alone leaves no held-out prompts to judge rounds on; add "
                "bench.eval_files or mix traffic with another source"
            )
        if self.serve.engine == "vllm" and self.serve.topk != 1:
            errs.append(
                f"serve.topk: {self.serve.topk} -- serve.engine=vllm drafts chains; set "
                "serve.topk=1 and serve.num_draft_tokens=null"
            )
        where = ("app", "route_prefix")  # a Serve app's, left at their defaults elsewhere
        if self.serve.engine != "embedded" and any(getattr(self.serve, k) != ServeConfig.model_fields[k].default for k in where):  # fmt: skip
            errs.append(
                f"serve.app/serve.route_prefix: a Ray Serve application's, the embedded engine's; "
                f"{self.serve.engine}'s server answers on serve.port alone: remove them"
            )
        if self.serve.record_traffic and self.serve.engine != "embedded":
            errs.append(
                f"serve.record_traffic: only the embedded engine records requests (clients reach "
                f"{self.serve.engine}'s server directly); set serve.engine: embedded or turn it off"
            )
        if "traffic" in sources and not self.serve.record_traffic:
            errs.append("data.source: traffic needs serve.record_traffic: true")
        if self.serve.simulate_users and not self.data.user_prompts:
            errs.append(
                "serve.simulate_users: needs a simulated users' pool; set data.user_prompts"
            )
        if self.serve.topk == 1 and self.serve.num_draft_tokens not in (None, self.serve.steps + 1):
            errs.append(
                f"serve.num_draft_tokens: {self.serve.num_draft_tokens} with topk 1 must be "
                f"steps+1 = {self.serve.steps + 1}; remove it or set topk > 1"
            )
        for field in ("max_wall_minutes", "round_minutes"):
            if getattr(self.stop, field) and self.serve.engine != "embedded":
                errs.append(
                    f"stop.{field}: the budget plan is sized from a start-up measurement of the "
                    f"embedded engine, which serve.engine={self.serve.engine} does not run; "
                    f"unset stop.{field} (stop.max_rounds bounds the run) or use "
                    "serve.engine: embedded"
                )
        if self.train.first_round == "skip" and self.drafter.init in ("scratch", "previous"):
            errs.append(
                f"train.first_round: skip serves drafter.init in round 0, but drafter.init is "
                f"{self.drafter.init!r}; point drafter.init at a drafter folder or Hub id, or set "
                "train.first_round: train"
            )
        gpus = self.target.num_gpus_per_actor or self.serve.num_gpus
        if self.data.early_start and (self.target.backend != "hf" or gpus):
            errs.append(
                "data.early_start: generates on the CPU cores a CPU server leaves free; this "
                f"target ({self.target.backend}, {self.target.num_gpus_per_actor} GPU(s) an actor) "
                f"and server ({self.serve.num_gpus} GPU(s)) share GPUs: set it false"
            )
        if self.data.early_start and self.bench.reuse_baseline:
            errs.append(
                "bench.reuse_baseline: the first round's baseline is measured beside the next "
                "round's data (data.early_start), on a busier machine than later rounds run on, "
                "so reused it would flatter their speedups; set one of them false"
            )
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def serves_through_rounds(self, cluster_gpus: float) -> bool:
        """Whether a GPU server stays up from one round's benchmark to the next: only when the
        next round's data stage and training each fit on the cluster's GPUs beside it (Ray's
        fractional GPUs: `serve.num_gpus`, `target.num_gpus_per_actor`,
        `train.gpus_per_worker`), and only the embedded engine with the HF backend, whose memory
        is the model's and its caches' (SGLang and vLLM take a fraction of the whole card). Else
        it stops, and the next benchmark starts it again: on one H100 about 65 s a round."""
        served = self.serve.num_gpus * self.serve.num_replicas
        if served <= 0:
            return True  # a CPU server holds no GPU
        if self.serve.engine != "embedded" or self.target.backend != "hf":
            return False
        data = self.data.num_actors * self.target.num_gpus_per_actor
        train = self.train.num_workers * self.train.gpus_per_worker if self.train.use_gpu else 0.0
        return served + max(data, train) <= cluster_gpus + 1e-9

    def states(self) -> Literal["online", "offline"]:
        """`data.states` resolved: `auto` is online for an HF target trained on GPUs (each
        worker holds the target beside the drafter on its GPU), offline otherwise."""
        if self.data.states != "auto":
            return self.data.states
        return "online" if self.target.backend == "hf" and self.train.use_gpu else "offline"

    def registered_model(self) -> str:
        """The MLflow registered model the run's champion is a version of."""
        return self.tracking.registered_model or f"{self.name}-drafter"

    def digest(self) -> str:
        """Stable hash of the resolved config (recorded in manifests). `tracking`, `ray_host`
        and where the server answers (serve.app, serve.route_prefix) are left out: they do not
        change results, and a run may move to another store, host or route. So is `stop`: it
        decides when a run ends, not what its rounds make, and a finished climb goes on where a
        later submit raises it (pipeline/loop.py `run_loop`)."""
        kept = self.model_dump(mode="json", exclude=DIGEST_LEAVES_OUT)
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]

    def changes_from(self, stored: dict[str, Any]) -> list[str]:
        """Where this config differs from a run's stored resolved config (its
        config.resolved.yaml, as `dump_config` wrote it), as `field: was -> now`, over what the
        digest covers. A field the stored one lacks and this one holds at its default is no
        change (a newer release added it), nor is a secret the stored one masks: a run made by an
        earlier release resumes under this one where it set nothing new (RunState.load_or_new)."""
        from pipeline.redact import MASK

        now = _flat(self.model_dump(mode="json", exclude=DIGEST_LEAVES_OUT))
        default = _flat(Config().model_dump(mode="json", exclude=DIGEST_LEAVES_OUT))
        was = _flat(stored)
        return [
            f"{k}: {was.get(k, '(absent)')!r} -> {v!r}"
            for k, v in sorted(now.items())
            if (k in was and was[k] != v and was[k] != MASK)
            or (k not in was and v != default.get(k))
        ]


# what neither the digest nor a resume compares: where a run logs, runs and answers, when it
# stops (`stop`: a finished climb goes on where a later submit raises it), and the share of a
# machine each process reserves (a climb moves to a machine of another size and goes on: the
# shares decide where a stage runs, not what it makes)
DIGEST_LEAVES_OUT = {
    "tracking": True,
    "ray_host": True,
    "stop": True,
    "serve": {"app", "route_prefix", "num_gpus", "num_cpus"},
    "target": {"num_gpus_per_actor"},
    "train": {"gpus_per_worker", "cpus_per_worker"},
}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (lists and other values stay whole)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load YAML, apply `a.b=value` overrides (YAML-parsed values), validate once."""
    return parse_config(read_yaml(path, overrides), str(Path(path)))


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML with secrets masked: what is written and logged, never read
    back (pipeline/redact.py)."""
    from pipeline.redact import redact

    return yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False)
