"""The SGLang target backend: regenerate with `sglang.Engine`, capture with a non-speculative
SGLang `ModelRunner`. For targets too big for transformers (Kimi-K2.5: 1T MoE over 8 GPUs).

Same interface as the HF backend: `generate(prompts, max_new_tokens, temperature, seed)` returns
the new token ids of each prompt; `capture(batch, layer_ids)` returns per sample
(aux [T, 3*H], final [T, H]).

Two phases, never both at once: the Engine holds the weights plus a KV pool sized for serving, the
capture runners hold a second copy of the weights, and for Kimi two copies do not fit in 8 GPUs.
Switching phase shuts one down and loads the other (seconds for 8B, minutes for Kimi; logged), so
callers should generate a whole round, then capture it, not alternate per batch.

Capture follows SpecForge's offline capture (scripts/prepare_hidden_states.py and its SGLang
backend, written against sglang 0.5.14): one process per TP rank builds a `ModelRunner` without any
speculative algorithm, calls the model's own `set_eagle3_layers_to_capture(ids)` -- the very
function the EAGLE-3 server calls with the drafter config's `eagle_aux_hidden_state_layer_ids` --
and runs one EXTEND forward per token-bounded sub-batch with `CaptureHiddenMode.FULL`. Every
`LogitsProcessor` of the model is replaced by `CaptureHead`, which skips the LM head and returns
all tokens' aux states and final (post-norm) states.

Never capture from the speculative server: its returned hidden states are dropped and
misattributed across draft/verify passes (sglang issue #26163).

Layer ids (checked in sglang 0.5.14 models/llama.py and models/deepseek_v2.py):
- SGLang captures at the *input* of decoder layer i (the residual stream `hidden + residual`),
  i.e. the output of layer i-1 = HF `hidden_states[i]`.
- Llama family: `set_eagle3_layers_to_capture(ids)` captures at i = k+1 for id k, so id k = output
  of layer k = HF `hidden_states[k+1]` -- our convention (TargetConfig.aux_layer_ids).
- DeepSeek-V2/V3 family (Kimi-K2.x): i = k+1 only when ids[0] == 1, else i = k. The default ids
  [1, N//2-1, N-4] (Kimi: [1, 29, 57]) start with 1, so they keep our convention; ids that do not
  start with 1 are read one layer earlier. Capture and serving call the same function with the
  same ids, so they always agree with each other; `hf_hidden_state_indices` says which HF index
  SGLang really reads, for the HF backend to mirror.
- Id N-1 would be captured at the input of layer N, which does not exist: SGLang silently
  captures nothing, so ids must lie in [0, N-2].

GPUs: one Ray actor owns all `tp_size` GPUs of a target replica. `reserve_target_gpus` holds a
STRICT_PACK placement group of `tp_size` one-GPU bundles (all on one node) and finds each bundle's
GPU id; `target_actor_options` puts the actor in bundle 0 and passes the ids and `TargetConfig.env`
through the actor's runtime_env `env_vars` (Ray merges those over the job's runtime_env), and
`SGLangTarget` widens CUDA_VISIBLE_DEVICES to all of them before any CUDA call, so the processes
SGLang spawns (schedulers, capture ranks) inherit the GPUs and the environment.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from actors.ports import free_port
from eagle3.fit import resolve_aux_layer_ids
from eagle3.target_weights import TargetInfo, read_target_config, target_info_from_dict

if TYPE_CHECKING:
    from actors.config import TargetConfig

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.14"
"""The sglang release this module was written against (pyproject's `sglang` extra pins it)."""

GPU_IDS_ENV = "EAGLE_LOOP_TARGET_GPUS"
"""Env var carrying the GPU ids of the target's placement-group bundles into the actor."""

# model_type / architecture markers of targets built on SGLang's deepseek_v2.py, whose
# set_eagle3_layers_to_capture adds 1 only when ids[0] == 1.
_DEEPSEEK_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "kimi_k25",
    "kimi_vl",
)
_DEEPSEEK_ARCH_MARKERS = ("Deepseek", "KimiK2", "KimiK25", "KimiVL")


# ---------------------------------------------------------------------------------------------
# Import and layer ids


def require_sglang() -> Any:
    """Import sglang or say how to get it."""
    try:
        import sglang
    except ImportError as e:
        raise RuntimeError(
            f"target.backend: 'sglang' needs the SGLang package on the GPU nodes ({e}); install it with "
            f"`pip install '.[sglang]'` (pins sglang=={SGLANG_VERSION}) or set target.backend: hf"
        ) from None
    version = getattr(sglang, "__version__", "?")
    if version != SGLANG_VERSION:
        log.warning(
            "sglang %s is installed; this backend was written against %s", version, SGLANG_VERSION
        )
    return sglang


def is_deepseek_family(info: TargetInfo) -> bool:
    """True for targets SGLang runs with models/deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2.x)."""
    if info.model_type in _DEEPSEEK_MODEL_TYPES:
        return True
    return any(m in a for a in info.architectures for m in _DEEPSEEK_ARCH_MARKERS)


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The aux layer ids to capture (SGLang's default when None): eagle3.fit's one rule."""
    return resolve_aux_layer_ids(layer_ids, num_layers)


def hf_hidden_state_indices(info: TargetInfo, layer_ids: Sequence[int]) -> list[int]:
    """Index into HF `output_hidden_states` of what SGLang's `set_eagle3_layers_to_capture(ids)`
    really captures for this target (see the module docstring for the DeepSeek quirk)."""
    ids = list(layer_ids)
    if is_deepseek_family(info) and not (ids and ids[0] == 1):
        return ids
    return [k + 1 for k in ids]


# ---------------------------------------------------------------------------------------------
# GPUs: one actor owns the placement group's GPUs


@dataclass(frozen=True)
class GpuReservation:
    """A STRICT_PACK placement group of `len(gpu_ids)` one-GPU bundles and their GPU ids."""

    placement_group: Any
    gpu_ids: tuple[str, ...]


def reserve_target_gpus(
    tp_size: int, cpus_per_gpu: float = 1.0, timeout_s: float = 600.0
) -> GpuReservation:
    """Reserve `tp_size` GPUs on one node and find which GPU each bundle holds."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"GPU": 1, "CPU": cpus_per_gpu}] * tp_size, strategy="STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            f"target.tp_size: {tp_size} GPUs on one node were not free within {timeout_s:.0f}s; "
            "check `ray status` for a node with that many idle GPUs or lower target.tp_size"
        )

    @ray.remote(num_gpus=1, num_cpus=0)
    def _bundle_gpu() -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    probes = [
        _bundle_gpu.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(tp_size)
    ]
    ids = tuple(g for got in ray.get(probes) for g in got)
    if len(set(ids)) != tp_size:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"placement group bundles reported GPU ids {ids}; expected {tp_size} distinct"
        )
    return GpuReservation(pg, ids)


def gpu_actor_options(reservation: GpuReservation, env: dict[str, str]) -> dict[str, Any]:
    """`.options(...)` for the actor that owns a reservation: bundle 0, the GPU ids and `env` in
    its runtime_env env_vars (Ray merges those over the job's runtime_env env_vars)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_gpus": 1,
        "num_cpus": 1,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            reservation.placement_group,
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        ),
        "runtime_env": {"env_vars": {**env, GPU_IDS_ENV: ",".join(reservation.gpu_ids)}},
    }


def target_actor_options(cfg: TargetConfig, reservation: GpuReservation) -> dict[str, Any]:
    """`.options(...)` for the actor that wraps `SGLangTarget` (with `target.env`)."""
    return gpu_actor_options(reservation, cfg.env)


def claim_gpus(gpu_ids: Sequence[str] | None, env: dict[str, str]) -> None:
    """Make this process (and everything it spawns) see all the target's GPUs and its env."""
    os.environ.update(env)
    ids = list(gpu_ids) if gpu_ids else [g for g in os.environ.get(GPU_IDS_ENV, "").split(",") if g]
    if ids:
        if torch.cuda.is_initialized():
            raise RuntimeError("claim_gpus must run before CUDA is initialized in this process")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)


# ---------------------------------------------------------------------------------------------
# Capture head: replaces SGLang's LogitsProcessor during capture


@dataclass
class Captured:
    """What the model's forward returns during capture (no logits are computed)."""

    aux: torch.Tensor  # [tokens, 3*H]: the three captured layers, concatenated in id order
    final: torch.Tensor  # [tokens, H]: last hidden state after the final norm


class CaptureHead(nn.Module):
    """Stands where the model's LogitsProcessor stood: SGLang models call it with
    (input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states) after the final norm.
    Returns every token's states, skips the LM head."""

    def __init__(self, replaced: nn.Module):
        super().__init__()
        self.replaced = replaced  # kept so the module tree (and weight names) stay intact

    def forward(
        self,
        input_ids,
        hidden_states,
        lm_head,
        logits_metadata,
        aux_hidden_states=None,
        *args,
        **kwargs,
    ):
        if aux_hidden_states is None or len(aux_hidden_states) == 0:
            raise RuntimeError(
                "SGLang returned no aux hidden states: set_eagle3_layers_to_capture had no effect on "
                "this model (pipeline-parallel rank, or an architecture without EAGLE-3 capture)"
            )
        aux = (
            aux_hidden_states
            if torch.is_tensor(aux_hidden_states)
            else torch.cat(list(aux_hidden_states), dim=-1)
        )
        return Captured(aux=aux, final=hidden_states)


def install_capture_heads(model: nn.Module) -> int:
    """Replace every SGLang LogitsProcessor inside `model` with a CaptureHead; returns the count."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, LogitsProcessor) and n]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent_name) if parent_name else model, child, CaptureHead(module)
        )
    if not found:
        raise RuntimeError(
            f"{type(model).__name__}: no LogitsProcessor found to replace for capture"
        )
    return len(found)


def token_bounded_batches(
    lengths: Sequence[int], max_tokens: int, max_requests: int
) -> list[list[int]]:
    """Split sample indices, in order, into groups of at most `max_tokens` tokens and
    `max_requests` samples (one forward each)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"capture: sample {i} has {n} tokens > max_capture_tokens {max_tokens}; raise it or truncate"
            )
        if cur and (used + n > max_tokens or len(cur) >= max_requests):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


# ---------------------------------------------------------------------------------------------
# Capture ranks (one spawned process per GPU)


def _build_capture_runner(
    server_kwargs: dict[str, Any], rank: int, tp_size: int, nccl_port: int
) -> Any:
    """A non-speculative ModelRunner for TP rank `rank` (sglang 0.5.14 constructor)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**server_kwargs)
    runner = ModelRunner(
        model_config=ModelConfig.from_server_args(server_args),
        mem_fraction_static=server_args.mem_fraction_static,
        gpu_id=rank,
        tp_rank=rank,
        tp_size=tp_size,
        moe_ep_rank=rank // (tp_size // server_args.ep_size),
        moe_ep_size=server_args.ep_size,
        pp_rank=0,
        pp_size=1,
        nccl_port=nccl_port,
        server_args=server_args,
    )
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # no-op: CUDA graphs are disabled for capture
    install_capture_heads(runner.model)
    return runner


def _extend_forward(runner: Any, samples: list[list[int]]) -> Captured:
    """One EXTEND forward over `samples` (token id lists) with every token's states kept."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    params = SamplingParams(temperature=0, max_new_tokens=1)
    reqs = []
    for i, ids in enumerate(samples):
        req = Req(
            rid=f"capture-{i}",
            origin_input_text="",
            origin_input_ids=array("q", ids),
            sampling_params=params,
        )
        req.full_untruncated_fill_ids = array("q", ids)
        req.fill_len = len(ids)
        req.extend_input_len = len(ids)  # no prefix reuse: every token is computed
        req.logprob_start_len = len(ids) - 1
        reqs.append(req)
    cache = RadixCache(
        CacheInitParams(
            disable=False,  # as SpecForge's offline capture; nothing is inserted (no request finishes)
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            page_size=runner.server_args.page_size,
        )
    )
    try:
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        if getattr(batch, "prefill_input_ids_cpu", None) is not None:  # 0.5.14 defers the H2D copy
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        batch.capture_hidden_mode = CaptureHiddenMode.FULL
        forward_batch = ForwardBatch.init_new(batch, runner)
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        out = runner.forward(forward_batch)
        captured = getattr(out, "logits_output", out)
        if not isinstance(captured, Captured):
            raise RuntimeError(f"capture forward returned {type(captured).__name__}, not Captured")
        return captured
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def capture_rank_main(
    rank: int,
    tp_size: int,
    nccl_port: int,
    server_kwargs: dict[str, Any],
    commands: Any,
    results: Any,
) -> None:
    """Entry of one capture rank: build the runner, then serve ("layers", ids) /
    ("capture", groups) / ("stop",) commands. Rank 0 sends the tensors back."""
    try:
        runner = _build_capture_runner(server_kwargs, rank, tp_size, nccl_port)
        results.put(("ready", rank, None))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "layers":
                runner.model.set_eagle3_layers_to_capture(list(cmd[1]))
                results.put(("ok", rank, None))
            elif cmd[0] == "capture":
                out: list[tuple[torch.Tensor, torch.Tensor]] = []
                for group in cmd[1]:
                    got = _extend_forward(runner, group)
                    if rank == 0:
                        lens = [len(s) for s in group]
                        aux = got.aux.split(lens)
                        fin = got.final.split(lens)
                        out.extend(
                            (a.cpu().clone(), f.cpu().clone())
                            for a, f in zip(aux, fin, strict=True)
                        )
                results.put(("ok", rank, out if rank == 0 else None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


class CaptureRanks:
    """`tp_size` spawned processes, each owning one GPU's ModelRunner."""

    def __init__(self, server_kwargs: dict[str, Any], tp_size: int, start_timeout_s: float):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.tp_size = tp_size
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(tp_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=capture_rank_main,
                args=(r, tp_size, port, server_kwargs, self.commands[r], self.results),
                daemon=True,
                name=f"sglang-capture-tp{r}",
            )
            for r in range(tp_size)
        ]
        for p in self.procs:
            p.start()
        self._collect("ready", start_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> Any:
        """Wait for one reply per rank; return rank 0's payload; raise on any rank's error."""
        deadline = time.monotonic() + timeout_s
        payload, seen = None, set()
        while len(seen) < self.tp_size:
            try:
                status, rank, data = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(
                        f"SGLang capture ranks died without a message: {dead}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SGLang capture: no '{what}' from all ranks in {timeout_s:.0f}s"
                    ) from None
                continue
            if status == "error":
                self.close()
                raise RuntimeError(f"SGLang capture rank {rank} failed:\n{data}")
            seen.add(rank)
            if rank == 0:
                payload = data
        return payload

    def call(self, cmd: tuple, timeout_s: float) -> Any:
        for q in self.commands:
            q.put(cmd)
        return self._collect(cmd[0], timeout_s)

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs, strict=True):
            if p.is_alive():
                q.put(("stop",))
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------------------------
# The backend


@dataclass(frozen=True)
class SGLangOptions:
    """Knobs of the SGLang backend that the config tree does not carry."""

    mem_fraction_static: float | None = None  # None = SGLang's own choice
    max_capture_tokens: int = 32768  # tokens per capture forward (bounds activations and KV pool)
    max_capture_requests: int = 256  # samples per capture forward
    start_timeout_s: float = 3600.0  # loading Kimi-K2.5 from cold disk takes a while
    call_timeout_s: float = 3600.0
    log_level: str = "warning"
    # Extra ServerArgs fields for Engine and runners, e.g. (("enable_deterministic_inference", True),).
    server_overrides: tuple[tuple[str, Any], ...] = ()


class SGLangTarget:
    """The target under SGLang. Construct inside the actor that owns the GPUs (see
    `target_actor_options`); nothing touches CUDA or imports sglang until the first call."""

    def __init__(
        self,
        cfg: TargetConfig,
        *,
        gpu_ids: Sequence[str] | None = None,
        options: SGLangOptions = SGLangOptions(),
    ):
        claim_gpus(gpu_ids, cfg.env)
        self.cfg = cfg
        self.options = options
        config = read_target_config(cfg.model, cfg.revision)
        if config.get("auto_map") and not cfg.trust_remote_code:
            raise ValueError(
                f"target.trust_remote_code: {cfg.model} ships its own code (auto_map in config.json); "
                "set target.trust_remote_code: true after reviewing that code"
            )
        self.info: TargetInfo = target_info_from_dict(config, source=cfg.model)
        self._engine: Any = None
        self._ranks: CaptureRanks | None = None
        self._layers: list[int] | None = None
        self._tokenizer_hash: str | None = None
        self.phase_switch_s: list[tuple[str, float]] = []  # (phase, seconds) of every switch

    # --- properties of the backend interface ---
    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def model_id(self) -> str:
        return self.cfg.model

    @property
    def revision(self) -> str | None:
        return self.cfg.revision

    @property
    def tokenizer_hash(self) -> str:
        if self._tokenizer_hash is None:
            from transformers import AutoTokenizer

            from actors.hf_backend import tokenizer_hash  # one definition for both backends

            tok = AutoTokenizer.from_pretrained(
                self.cfg.model,
                revision=self.cfg.revision,
                trust_remote_code=self.cfg.trust_remote_code,
            )
            self._tokenizer_hash = tokenizer_hash(tok)
        return self._tokenizer_hash

    # --- SGLang arguments ---
    def server_kwargs(self, **extra: Any) -> dict[str, Any]:
        """ServerArgs fields shared by the Engine and the capture runners."""
        kw: dict[str, Any] = {
            "model_path": self.cfg.model,
            "revision": self.cfg.revision,
            "tp_size": self.cfg.tp_size,
            "trust_remote_code": self.cfg.trust_remote_code,
            "dtype": self.cfg.dtype,
            "log_level": self.options.log_level,
        }
        if self.options.mem_fraction_static is not None:
            kw["mem_fraction_static"] = self.options.mem_fraction_static
        kw.update(extra)
        kw.update(dict(self.options.server_overrides))
        return kw

    def capture_server_kwargs(self) -> dict[str, Any]:
        o = self.options
        return self.server_kwargs(
            disable_cuda_graph=True,  # variable-length EXTEND forwards; graphs would not apply
            chunked_prefill_size=-1,  # we split batches ourselves (token_bounded_batches)
            disable_radix_cache=True,
            max_running_requests=o.max_capture_requests,
            max_total_tokens=o.max_capture_tokens,
            skip_tokenizer_init=True,
        )

    # --- phases ---
    def _switch(self, phase: str) -> None:
        t0 = time.monotonic()
        if phase == "generate" and self._engine is None:
            self._stop_capture()
            sglang = require_sglang()
            self._engine = sglang.Engine(**self.server_kwargs(random_seed=0))
        elif phase == "capture" and self._ranks is None:
            self._stop_engine()
            require_sglang()
            self._ranks = CaptureRanks(
                self.capture_server_kwargs(), self.cfg.tp_size, self.options.start_timeout_s
            )
            self._layers = None
        else:
            return
        took = time.monotonic() - t0
        self.phase_switch_s.append((phase, took))
        log.info(
            "sglang backend: %s phase ready in %.1fs (%s, tp %d)",
            phase,
            took,
            self.cfg.model,
            self.cfg.tp_size,
        )

    def _stop_engine(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def _stop_capture(self) -> None:
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    def close(self) -> None:
        self._stop_engine()
        self._stop_capture()

    # --- the backend interface ---
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[int]]:
        """New token ids per prompt (the stop token included when one ended the response).
        Sampled runs seed each request with seed + its index, so results do not depend on batching."""
        self._switch("generate")
        params = []
        for i in range(len(prompts)):
            p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
            if temperature > 0:
                p["sampling_seed"] = seed + i
            params.append(p)
        outs = self._engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
        return [list(o["output_ids"]) for o in outs]

    def capture(
        self, batch: list[list[int]], layer_ids: Sequence[int] | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample (aux [T, 3*H], final [T, H]) on CPU in the model dtype."""
        ids = resolve_layer_ids(layer_ids, self.num_layers)
        self._switch("capture")
        assert self._ranks is not None
        if ids != self._layers:
            self._ranks.call(("layers", ids), self.options.call_timeout_s)
            self._layers = ids
        groups = token_bounded_batches(
            [len(s) for s in batch],
            self.options.max_capture_tokens,
            self.options.max_capture_requests,
        )
        out = self._ranks.call(
            ("capture", [[list(batch[i]) for i in g] for g in groups]), self.options.call_timeout_s
        )
        return list(out)


def drafter_layout_for(info: TargetInfo) -> str:
    """Which SGLang EAGLE-3 drafter class serves this target best: "mla" (Eagle3DeepseekV2ForCausalLM,
    models/kimi_k25_eagle3.py, MLA attention whose small KV cache matches the target's) for the
    DeepSeek-V3/Kimi-K2.x family, "llama" (LlamaForCausalLMEagle3) otherwise. Both serve Kimi;
    our exporter writes "llama"."""
    return "mla" if is_deepseek_family(info) else "llama"
