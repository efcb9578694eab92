"""Embedded speculative-decoding engine: an HF causal LM target and an EAGLE-3 drafter in one process.

One cycle (chain drafting, `steps` = k, topk 1), for every row of the batch at once:
  1. the drafter proposes d_1..d_k from its last verified slot (k drafter forwards per cycle: the
     extend of the previous cycle plus k-1 single-token steps);
  2. the target scores [x_n, d_1..d_k] in ONE forward over its KV cache; greedy keeps the longest
     prefix of drafts equal to the target's argmax, sampling uses speculative rejection sampling;
     both add one bonus token from the target, so a cycle emits a+1 tokens;
  3. the target cache keeps the a+1 accepted entries per row (rejected ones are masked or cropped)
     and the drafter extends its cache with the target's aux states of exactly those entries.
Temperature 0 reproduces the target's own greedy decoding token for token; temperature > 0
preserves the target's sampling distribution.

Rows of different lengths are left-padded; each row carries its own positions. Rows accept
different counts per cycle, so the target cache may hold rejected entries of some rows: a 4-D
attention mask hides them, the common tail is cropped, and the cache is compacted when holes pile
up. `plain_generate` runs the same target path without speculation (the benchmark baseline).

Accounting follows SGLang: accept_len = completion_tokens / verify passes (the first token comes
from prefill, the bonus token of each cycle is counted).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # the static runner's GPU attention kernel; CPU-only installs have no triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

from eagle3.config import Eagle3Config, default_aux_layer_ids
from eagle3.fit import bad_aux_ids, drafter_fit_problems
from eagle3.model import DrafterCache, Eagle3Drafter, drafter_from_state, rope_cos_sin

TokenCallback = Callable[[int, list[int]], None]  # (request index, new token ids)


# ----------------------------------------------------------------------------------------------
# Requests and their statistics


def _check_aux_ids(ids: list[int], num_layers: int) -> None:
    """Shared by both target runners: each id names a captured layer (eagle3.fit's range; the
    count is the drafter's rule, checked with the drafter)."""
    bad = bad_aux_ids(ids, num_layers)
    if bad:
        raise ValueError(
            f"aux layer ids {bad} out of range for a {num_layers}-layer target "
            "(id k is the output of decoder layer k, captured at the input of layer k+1)"
        )


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    steps: int | None = None  # draft steps per cycle; None = the engine's default
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always produce max_tokens
    topk: int | None = None  # tree branching; None = the engine's default (1 = chain)
    num_draft_tokens: int | None = None  # tokens per tree verify incl. the root; None = steps+1


@dataclass
class RequestStats:
    prompt_tokens: int
    completion_tokens: int = 0
    spec_verify_ct: int = 0  # target verify passes (0 without speculation)
    accepted_drafts: int = 0  # draft tokens accepted over all cycles (before max_tokens truncation)
    accept_hist: list[int] = field(default_factory=list)  # [a] = cycles that accepted a drafts
    steps: int = 0
    draft_ms: float = 0.0  # drafter time per cycle summed: extends after verify + draft steps
    verify_ms: float = 0.0  # target forwards after prefill (verify, or decode steps when plain)
    prefill_ms: float = 0.0  # target prefill + the drafter's extend over the prompt
    total_ms: float = 0.0
    finish_reason: str = "length"

    @property
    def accept_len(self) -> float | None:
        """SGLang's per-request accept length: completion tokens per verify pass."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    @property
    def cycle_accept_len(self) -> float | None:
        """Tokens emitted per cycle, without the prefill token: exactly k+1 when all drafts pass."""
        if not self.spec_verify_ct:
            return None
        return (self.accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct

    def usage(self) -> dict[str, Any]:
        """The OpenAI `usage` object plus the speculative statistics."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": self.spec_verify_ct > 0 or self.steps > 0,
            "spec_accept_len": self.accept_len,
            "spec_cycle_accept_len": self.cycle_accept_len,
            "spec_verify_ct": self.spec_verify_ct,
            "spec_accepted_tokens": self.accepted_drafts,
            "spec_accept_hist": list(self.accept_hist),
            "spec_steps": self.steps,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "total_ms": round(self.total_ms, 3),
        }


@dataclass
class Generation:
    token_ids: list[int]
    stats: RequestStats


# ----------------------------------------------------------------------------------------------
# A faster linear for the few-row matmuls of verify passes

SMALL_ROWS = 8
_PAD_ROWS = {1: 2, 3: 4}  # the 2- and 4-column kernels beat the 1- and 3-column ones


def small_rows_linear(mod: torch.nn.Linear, x: Tensor) -> Tensor:
    """`mod(x)` computed as (W @ x^T)^T when x has at most SMALL_ROWS rows.

    On this CPU (MKL), F.linear of a single row is a GEMV that runs on one thread, and for 2-8
    rows it picks a GEMM kernel that costs ~2x a single-row step. W @ x^T with x^T column-major
    streams W once and uses every thread. With 1 and 3 rows padded to 2 and 4: decoding one token
    is 1.2x (1 thread) to 2x (2 threads) faster, and a 4-token verify costs about one decode
    step (benchmarks/engine_cpu.py). Plain decoding uses the same path, so the baseline is not
    handicapped. Results differ from F.linear only in float rounding; `SpecEngine(fast_linear=False)`
    keeps HF's kernels exactly."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if not 1 <= rows <= SMALL_ROWS:
        return F.linear(x, mod.weight, mod.bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows in _PAD_ROWS:
        x2 = torch.cat([x2, x2.new_zeros(_PAD_ROWS[rows] - rows, x2.shape[1])])
    y = (mod.weight @ x2.contiguous().t()).t()[:rows].contiguous()
    if mod.bias is not None:
        y = y + mod.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def use_small_rows_linear(model: torch.nn.Module) -> int:
    """Route every plain nn.Linear of `model` through `small_rows_linear`; returns how many."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and not hasattr(mod, "_small_rows"):
            mod.forward = functools.partial(small_rows_linear, mod)
            mod._small_rows = True
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# The target: one HF causal LM, its KV cache and the aux hidden states of three layers


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (Llama-like `model.model.layers`)."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(
        f"{type(model).__name__}: no decoder layer list (model.layers); unsupported target"
    )


class TargetRunner:
    """Runs the target over a batch with a KV cache whose slots may hold masked (rejected) entries.

    `valid` [B, S] marks the cache slots each row attends to. Aux states come from forward hooks on
    the chosen decoder layers (SGLang id k = output of layer k), only while `capture` is set."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.layers = decoder_layers(model)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.hidden_size = int(model.get_input_embeddings().weight.shape[1])
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.aux_ids: list[int] = []
        self._hooks: list[Any] = []
        self._captured: dict[int, Tensor] = {}
        self.capture = False
        self.cache: Any = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_aux_layers(self, ids: list[int]) -> None:
        _check_aux_ids(ids, self.num_layers)
        if ids == self.aux_ids:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = [self.layers[k].register_forward_hook(self._hook(k)) for k in ids]
        self.aux_ids = list(ids)

    def _hook(self, k: int):
        def hook(_module, _args, output):
            if self.capture:
                self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    # -- cache bookkeeping ------------------------------------------------------------------
    def _kv_layers(self) -> list[Any]:
        return list(self.cache.layers)

    def _slice_slots(self, start: int, end: int) -> None:
        for layer in self._kv_layers():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., start:end, :]
                layer.values = layer.values[..., start:end, :]
        self.valid = self.valid[:, start:end]

    def commit(self, keep: Tensor) -> None:
        """Mark which of the last forward's entries stay ([B, q] bool), then drop slots no row uses
        at the tail and compact when masked holes exceed the live length."""
        self.valid = torch.cat([self.valid, keep], dim=1)
        used = self.valid.any(0).nonzero()
        end = int(used.max()) + 1 if used.numel() else 0
        if end < self.valid.shape[1]:
            self._slice_slots(0, end)
        live = int(self.valid.sum(1).max())
        if (
            self.valid.shape[1] > live + live // 2 + 32
        ):  # attention over holes costs more than a gather
            self._compact(live)

    def _compact(self, live: int) -> None:
        """Gather each row's valid slots to the right (left padding); order inside a row is kept,
        and RoPE is already in the keys, so attention results do not change."""
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, -live:]  # [B, L]
        for layer in self._kv_layers():
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            B, H, _, D = layer.keys.shape
            idx = order[:, None, :, None].expand(B, H, live, D)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.valid = self.valid.gather(1, order)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch; drop leading and trailing slots no remaining row uses."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        used = self.valid.any(0).nonzero()
        if used.numel():
            self._slice_slots(int(used.min()), int(used.max()) + 1)

    # -- forwards ---------------------------------------------------------------------------
    def _mask(
        self, new_valid: Tensor, dtype: torch.dtype, tree: Tensor | None = None
    ) -> Tensor | None:
        """Float 4-D mask [B, 1, q, S+q]: valid cache slots plus causal new entries (or `tree`
        [B, q, q]: each entry sees its ancestors and itself). None when HF's own causal mask is
        the same thing (no padding, no holes, no tree): batch-1 numerics stay those of `generate`."""
        B, q = new_valid.shape
        if tree is None and bool(self.valid.all()) and bool(new_valid.all()):
            return None
        causal = torch.ones(q, q, dtype=torch.bool).tril()[None] if tree is None else tree
        new = causal & new_valid[:, None, :]
        new = new | torch.eye(q, dtype=torch.bool)[None]  # a padding query sees itself: no NaN row
        old = self.valid[:, None, :].expand(B, q, self.valid.shape[1])
        allowed = torch.cat([old, new], dim=2)[:, None]
        zero = torch.zeros((), dtype=dtype)
        return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        new_valid: Tensor,
        logits_to_keep: int = 0,
        aux: bool = False,
        tree: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run q new entries per row (a chain, or a tree given its ancestor mask [B, q, q]);
        returns (float logits [B, q or keep, V], aux [B, q, 3·Ht])."""
        dtype = self.model.get_input_embeddings().weight.dtype
        self.capture = aux and bool(self.aux_ids)
        self._captured.clear()
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self._mask(new_valid, dtype, tree),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self.cache_kw: self.cache},
            )
        finally:
            self.capture = False
        states = (
            torch.cat([self._captured[k] for k in self.aux_ids], -1)
            if aux and self.aux_ids
            else None
        )
        self._captured.clear()
        return out.logits.float(), states

    def prefill(
        self, prompts: list[list[int]], aux: bool
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Left-padded prefill of fresh prompts; returns (last logits [B, V], aux [B, L, 3·Ht],
        padded ids [B, L], valid [B, L])."""
        from transformers import DynamicCache

        L = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        valid = torch.zeros(len(prompts), L, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, L - len(p) :] = True
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        self.valid = torch.zeros(len(prompts), 0, dtype=torch.bool)
        logits, states = self.forward(ids, positions, valid, logits_to_keep=1, aux=aux)
        self.valid = valid
        return logits[:, -1], states, ids, valid

    def release(self) -> None:
        self.cache = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# The target on a GPU at batch 1: a preallocated KV cache and one CUDA graph per verify width


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


# HF's Llama-family RMSNorm classes: one code (fp32 statistics, cast back, then the weight), which
# `_rms` reproduces; the static runner reads their weights instead of calling them.
_PLAIN_RMSNORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _plain_rmsnorm(mod: Any) -> bool:
    return type(mod).__name__ in _PLAIN_RMSNORMS and hasattr(mod, "variance_epsilon")


def static_runner_problem(model: torch.nn.Module) -> str | None:
    """Why `StaticTargetRunner` cannot run `model`, or None. It re-implements the decoder of a
    Llama-like model (rotary, GQA, optional q/k norms, no sliding window, plain RMSNorm, SwiGLU
    MLP); only the embedding and rotary tables are the model's own modules."""
    cfg = model.config.get_text_config(decoder=True)
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "norm"):
        return f"{type(model).__name__}: no Llama-like .model.rotary_emb/.model.norm"
    types = getattr(cfg, "layer_types", None) or []
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if windowed or any(t != "full_attention" for t in types):
        return f"{type(model).__name__}: sliding-window or non-attention layers"
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        return str(e)
    need = ("q_proj", "k_proj", "v_proj", "o_proj")
    for la in layers:
        attn = getattr(la, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in need):
            return f"{type(model).__name__}: a decoder layer without self_attn.q/k/v/o_proj"
        if not all(hasattr(la, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"{type(model).__name__}: a decoder layer that is not pre-norm attention + MLP"
        norms = [la.input_layernorm, la.post_attention_layernorm]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not all(_plain_rmsnorm(n) for n in [*norms, base.norm]):
            return f"{type(model).__name__}: a norm that is not the Llama-family RMSNorm"
        mlp = la.mlp
        silu = getattr(cfg, "hidden_act", None) in ("silu", "swish")
        if not silu or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"{type(model).__name__}: an MLP that is not SwiGLU (gate/up/down, SiLU)"
    return None


def _fuse_linears(owner: torch.nn.Module, name: str, mods: list[torch.nn.Linear]) -> Tensor:
    """One [sum of outputs, in] weight for linears that read the same input (q/k/v, gate/up), so
    a step runs one matmul instead of three or two. The modules' own weights become views of it:
    the model computes exactly as before and no memory is added. Cached on `owner` (a second
    runner on the same model reuses it). Biases stay with the modules (see `_fused_bias`)."""
    cached = owner.__dict__.get(name)
    if cached is not None:
        offs, o = [], 0
        for m in mods:
            offs.append(o)
            o += m.weight.shape[0]
        if all(
            m.weight.data_ptr() == cached[o].data_ptr() for m, o in zip(mods, offs, strict=True)
        ):
            return cached
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat([m.weight for m in mods])
        for m, part in zip(mods, fused.split([m.weight.shape[0] for m in mods]), strict=True):
            m.weight = torch.nn.Parameter(part, requires_grad=m.weight.requires_grad)
    owner.__dict__[name] = fused
    return fused


def _fused_bias(mods: list[torch.nn.Linear]) -> Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
    )


class _LayerWeights(NamedTuple):
    """One decoder layer's tensors as the static runner's pure functions take them (a tuple, so
    torch.compile treats its tensors as inputs: one compiled code for every layer)."""

    norm_in: Tensor
    qkv: Tensor  # [(H + 2 Hkv) d, hidden]
    qkv_bias: Tensor | None
    q_norm: Tensor | None  # Qwen3-style per-head norms
    k_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    norm_post: Tensor
    gate_up: Tensor  # [2 I, hidden]
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerWeights:
        at, mlp = layer.self_attn, layer.mlp
        qkv = [at.q_proj, at.k_proj, at.v_proj]
        gu = [mlp.gate_proj, mlp.up_proj]
        return cls(
            norm_in=layer.input_layernorm.weight,
            qkv=_fuse_linears(at, "_static_qkv", qkv),
            qkv_bias=_fused_bias(qkv),
            q_norm=at.q_norm.weight if hasattr(at, "q_norm") else None,
            k_norm=at.k_norm.weight if hasattr(at, "k_norm") else None,
            o=at.o_proj.weight,
            o_bias=at.o_proj.bias,
            norm_post=layer.post_attention_layernorm.weight,
            gate_up=_fuse_linears(mlp, "_static_gate_up", gu),
            gate_up_bias=_fused_bias(gu),
            down=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
        )


# The static runner's step, as pure functions of tensors (no modules, no host reads), so that
# torch.compile can fuse each one's elementwise work (norms, residual adds, RoPE, the masked
# softmax, SwiGLU) into a few kernels, and one compiled code serves all layers. The matmuls stay
# cuBLAS calls. `heads` = (H, Hkv, head dim); `eps` = (norm eps, q/k norm eps).


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF's Llama RMSNorm: fp32 statistics, cast back to x's dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _attn_in(
    x: Tensor,
    d: Tensor,
    w: _LayerWeights,
    cos: Tensor,
    sin: Tensor,
    heads: tuple[int, int, int],
    eps: tuple[float, float],
) -> tuple[Tensor, Tensor]:
    """Add the previous layer's MLP output `d` to the residual `x`, norm, q/k/v in one matmul,
    q/k norms, RoPE. Returns (x, the rotated queries, rotated keys and values [q, H + 2 Hkv, d]
    in one tensor, so one kernel writes them; `_gqa_views` splits it)."""
    H, Hkv, dh = heads
    q = x.shape[1]
    x = x + d
    qkv = F.linear(_rms(x, w.norm_in, eps[0]), w.qkv, w.qkv_bias)[0]
    qs, ks, vs = qkv.split([H * dh, Hkv * dh, Hkv * dh], -1)
    qs, ks, vs = qs.view(q, H, dh), ks.view(q, Hkv, dh), vs.view(q, Hkv, dh)
    if w.q_norm is not None and w.k_norm is not None:
        qs, ks = _rms(qs, w.q_norm, eps[1]), _rms(ks, w.k_norm, eps[1])
    qs = qs * cos + _rotate_half(qs) * sin  # cos, sin: [q, 1, d]
    ks = ks * cos + _rotate_half(ks) * sin
    return x, torch.cat([qs, ks, vs], dim=1)


def _gqa_views(rot: Tensor, heads: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """Views of `_attn_in`'s [q, H + 2 Hkv, d]: queries [Hkv, rep, q, d] (the rep query heads of
    a KV head; flattened, rep x q rows) and the new keys/values [2, Hkv, q, d]."""
    H, Hkv, dh = heads
    q = rot.shape[0]
    queries = rot[:, :H].view(q, Hkv, H // Hkv, dh).permute(1, 2, 0, 3)
    return queries, rot[:, H:].view(q, 2, Hkv, dh).permute(1, 2, 0, 3)


def _probs(scores: Tensor, mask: Tensor, scale: float, rep: int) -> Tensor:
    """Softmax over key slots in fp32 with the additive mask [q, span] (GQA rows: rep x q)."""
    Hkv, rows, span = scores.shape
    s = scores.float().view(Hkv, rep, rows // rep, span) * scale + mask
    return torch.softmax(s, dim=-1).to(scores.dtype).view(Hkv, rows, span)


def _attn_out_mlp(
    o: Tensor, x: Tensor, w: _LayerWeights, heads: tuple[int, int, int], eps: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """o_proj and its residual add, the post-attention norm, gate/up in one matmul, SwiGLU and
    down_proj. Returns (x, the MLP output): the next layer's `_attn_in` adds it to x."""
    H, _, dh = heads
    q = x.shape[1]
    o = o.view(H, q, dh).transpose(0, 1).reshape(1, q, H * dh)
    x = x + F.linear(o, w.o, w.o_bias)
    g, u = F.linear(_rms(x, w.norm_post, eps[0]), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return x, F.linear(F.silu(g) * u, w.down, w.down_bias)


def _head(
    x: Tensor, d: Tensor, norm: Tensor, eps: float, head: Tensor, head_bias: Tensor | None
) -> Tensor:
    """Last residual add, final norm, lm_head; float logits."""
    return F.linear(_rms(x + d, norm, eps), head, head_bias).float()


# Attention of q new entries over the cache at batch 1, split over the key slots (flash
# decoding). cuBLAS's batched products give only Hkv blocks of work for [rep*q, span] scores and
# take three kernels (scores, softmax, products) plus an index copy for the new keys/values; here
# Hkv x SPLITS programs each take a slice of the slots with an online softmax in fp32, the program
# whose slice holds the new slots writes the new keys/values into the cache (and uses them), and
# a second kernel merges the slices, one program per row. Rows are the GQA rows of `_attn_in`
# (row r is new entry r % q); `mask` [q, span] is additive (0 or -inf).
ATTN_SPLITS = 16
ATTN_BLOCK_N = 64

if triton is not None:

    @triton.jit
    def _attn_split_kernel(
        Q,
        K,
        V,
        New,
        Base,
        Mask,
        Part,
        Stats,
        stride_qh,
        stride_qr,
        stride_qt,
        stride_kh,
        stride_kn,
        stride_vh,
        stride_vn,
        stride_nc,
        stride_nh,
        stride_nq,
        R,
        q,
        span,
        chunk,
        scale,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        rows = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, D)
        live = rows < R
        at_q = Q + h * stride_qh + (rows // q) * stride_qr + (rows % q) * stride_qt
        qv = tl.load(at_q[:, None] + dims[None, :], mask=live[:, None])
        base = tl.load(Base)
        m_i = tl.full([BLOCK_R], -1e30, tl.float32)  # finite: a slice may be fully masked
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        start = sp * chunk
        for j in range(0, chunk, BLOCK_N):
            cols = start + j + tl.arange(0, BLOCK_N)
            ok = (cols < start + chunk) & (cols < span)
            rel = cols - base
            new = ok & (rel >= 0) & (rel < q)
            old = ok & ~new
            at_k = K + h * stride_kh + cols[:, None] * stride_kn + dims[None, :]
            at_v = V + h * stride_vh + cols[:, None] * stride_vn + dims[None, :]
            at_n = New + h * stride_nh + rel[:, None] * stride_nq + dims[None, :]
            k_new = tl.load(at_n, mask=new[:, None], other=0.0)
            v_new = tl.load(at_n + stride_nc, mask=new[:, None], other=0.0)
            tl.store(at_k, k_new, mask=new[:, None])
            tl.store(at_v, v_new, mask=new[:, None])
            k = tl.load(at_k, mask=old[:, None], other=0.0) + k_new
            sc = tl.dot(qv, tl.trans(k), input_precision=PREC) * scale
            add = tl.load(
                Mask + (rows % q)[:, None] * span + cols[None, :],
                mask=live[:, None] & ok[None, :],
                other=float("-inf"),
            )
            sc = sc + add
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(at_v, mask=old[:, None], other=0.0) + v_new
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        at = h * SPLITS + sp
        tl.store(Part + (at * BLOCK_R + rows[:, None]) * D + dims[None, :], acc)
        tl.store(Stats + (at * 2) * BLOCK_R + rows, m_i)
        tl.store(Stats + (at * 2 + 1) * BLOCK_R + rows, l_i)

    @triton.jit
    def _attn_merge_kernel(
        Part,
        Stats,
        Out,
        R,
        BLOCK_R: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        h = tl.program_id(0)
        r = tl.program_id(1)
        dims = tl.arange(0, D)
        at = h * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(Stats + (at * 2) * BLOCK_R + r)
        w = tl.exp(m - tl.max(m, 0))
        total = tl.sum(w * tl.load(Stats + (at * 2 + 1) * BLOCK_R + r), 0)
        part = tl.load(Part + (at[:, None] * BLOCK_R + r) * D + dims[None, :])
        out = tl.sum(part * w[:, None], 0) / total
        tl.store(Out + (h * R + r) * D + dims, out)


def triton_attention_ok(device: torch.device, head_dim: int) -> bool:
    """Whether `_split_attention` can run: triton present, CUDA, a power-of-two head dim."""
    pow2 = head_dim >= 16 and not (head_dim & (head_dim - 1))
    return triton is not None and device.type == "cuda" and pow2


def _split_attention(
    queries: Tensor,
    k: Tensor,
    v: Tensor,
    new_kv: Tensor,
    base: Tensor,
    mask: Tensor,
    scale: float,
) -> Tensor:
    """softmax(queries k^T * scale + mask) v over the first `span` = mask.shape[1] slots of the
    cache views k, v [Hkv, capacity, d], after writing the q new keys/values `new_kv`
    [2, Hkv, q, d] at slots base..base+q-1 (`base`: a one-element int64 device tensor). queries
    [Hkv, rep, q, d] (views of `_gqa_views`; each row's last dim contiguous). Returns
    [Hkv, rep * q, d]: what `_core`'s CPU path computes (index copy, batched products, softmax),
    with fp32 scores."""
    Hkv, rep, q, D = queries.shape
    R = rep * q
    span = mask.shape[1]
    block_r = max(16, triton.next_power_of_2(R))
    chunk = max(ATTN_BLOCK_N, triton.cdiv(span, ATTN_SPLITS))
    part = torch.empty(Hkv, ATTN_SPLITS, block_r, D, device=queries.device, dtype=torch.float32)
    stats = torch.empty(Hkv, ATTN_SPLITS, 2, block_r, device=queries.device, dtype=torch.float32)
    out = torch.empty(Hkv, R, D, device=queries.device, dtype=queries.dtype)
    _attn_split_kernel[(Hkv, ATTN_SPLITS)](
        queries,
        k,
        v,
        new_kv,
        base,
        mask,
        part,
        stats,
        queries.stride(0),
        queries.stride(1),
        queries.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        new_kv.stride(0),
        new_kv.stride(1),
        new_kv.stride(2),
        R,
        q,
        span,
        chunk,
        scale,
        BLOCK_R=block_r,
        BLOCK_N=ATTN_BLOCK_N,
        D=D,
        SPLITS=ATTN_SPLITS,
        PREC="ieee" if queries.dtype == torch.float32 else "tf32",
    )
    _attn_merge_kernel[(Hkv, R)](part, stats, out, R, BLOCK_R=block_r, D=D, SPLITS=ATTN_SPLITS)
    return out


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: Tensor  # static int64 [2q + 1 + q*q]: ids, positions, base slot, tree mask
    staging: Tensor  # pinned host copy of `inputs`
    logits: Tensor
    aux: Tensor | None
    copied: Any  # torch.cuda.Event: the last staging -> inputs copy finished


class StaticTargetRunner:
    """The target at batch 1 over a preallocated KV cache [layers, k/v, kv heads, capacity,
    head dim], with the forward of each (width q, cache bucket) captured once as a CUDA graph and
    replayed.

    Why: at batch 1 an 8B target's HF eager forward is launch-bound (about 22 ms a token on an
    H200, against a 3.4 ms HBM floor), and a verify of q tokens costs 1.3x a decode. A graph
    replays all kernels of a step with one launch, and the static cache needs no concatenation.
    Inside the graph the kernels still run one by one, so the step is written as a few pure
    functions (`_attn_in`, `_probs`, `_attn_out_mlp`, `_head`) over fused q/k/v and gate/up
    weights, compiled with torch.compile on CUDA (`compiled`), and attention is one split-KV
    triton kernel plus a merge (`split_attention`, CUDA): about 14 kernels a layer instead of
    about 50. The matmuls read the weights once per step either way. Without `compiled` the same
    functions run eagerly; without `split_attention` attention is two batched products and a
    softmax (the CPU path).

    Layout: slot i holds position i (batch 1 has no padding). A forward writes its q entries at
    slots base..base+q-1 (base = committed length) and attends to slots < base plus the new entries
    allowed by `tree` (causal for a chain). `commit` keeps the accepted entries: a prefix just moves
    the length; a tree path is first gathered to the front. Attention reads a power-of-two bucket
    of slots (>= 256) so short contexts do not read the whole capacity.

    Same interface as `TargetRunner` (prefill / forward / commit / select / release), batch 1 only.
    Without CUDA (or with graphs=False) the same code runs eagerly: that is what the CPU tests pin.
    Building one makes the model's q/k/v and gate/up weights views of one fused tensor each
    (same values; see `_fuse_linears`)."""

    MIN_BUCKET = 256

    def __init__(
        self,
        model: torch.nn.Module,
        capacity: int = 4096,
        graphs: bool | None = None,
        compiled: bool | None = None,
        split_attention: bool | None = None,
    ):
        if (problem := static_runner_problem(model)) is not None:
            raise ValueError(f"StaticTargetRunner: {problem}; use TargetRunner")
        self.model = model.eval()
        self.layers = decoder_layers(model)
        emb = model.get_input_embeddings()
        self.vocab_size, self.hidden_size = int(emb.weight.shape[0]), int(emb.weight.shape[1])
        self.device, self.dtype = emb.weight.device, emb.weight.dtype
        cfg = model.config.get_text_config(decoder=True)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.n_heads)
        self.capacity = int(capacity)
        self.use_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        self.weights = [_LayerWeights.of(la) for la in self.layers]
        at0 = self.layers[0].self_attn
        self.scale = float(getattr(at0, "scaling", self.head_dim**-0.5))
        qk_eps = float(at0.q_norm.variance_epsilon) if hasattr(at0, "q_norm") else 0.0
        self.eps = (float(self.layers[0].input_layernorm.variance_epsilon), qk_eps)
        self.compiled = self.use_graphs if compiled is None else bool(compiled)
        can_split = triton_attention_ok(self.device, self.head_dim)
        if split_attention and not can_split:
            raise ValueError("split_attention needs triton, CUDA and a power-of-two head dim")
        self.split_attention = can_split if split_attention is None else bool(split_attention)
        self._fns = self._step_functions(self.compiled)
        self.aux_ids: list[int] = []
        self.length = 0  # committed slots
        self.kv: Tensor | None = None  # [L, 2, Hkv, capacity, d], made on first prefill
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}
        self._pool: Any = None
        self._causal: dict[int, Tensor] = {}
        self.valid = torch.zeros(1, 0, dtype=torch.bool)  # TargetRunner compatibility

    @staticmethod
    def _step_functions(compiled: bool) -> dict[str, Callable[..., Any]]:
        fns = {"attn_in": _attn_in, "probs": _probs, "attn_out_mlp": _attn_out_mlp, "head": _head}
        if not compiled:
            return fns
        # Static shapes give the best kernels; each (width, bucket) is one more specialisation
        # (compiled once, during the graph's warm-up), more than dynamo's default limit of 8.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        return {k: torch.compile(f, dynamic=False, fullgraph=True) for k, f in fns.items()}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_aux_layers(self, ids: list[int]) -> None:
        _check_aux_ids(ids, self.num_layers)
        if list(ids) != self.aux_ids:
            self.aux_ids = list(ids)
            self._graphs.clear()  # the aux outputs are part of each captured graph

    # -- the forward ------------------------------------------------------------------------
    def _core(self, inputs: Tensor, q: int, span: int, aux: bool) -> tuple[Tensor, Tensor | None]:
        """One forward of q entries from the packed int64 `inputs` (ids, positions, base, tree),
        attending over slots [0, span). Graph-safe: no host reads, fixed shapes for fixed (q, span)."""
        m, dev, fns, kv = self.model, self.device, self._fns, self.kv
        assert kv is not None
        ids, pos = inputs[:q][None], inputs[q : 2 * q][None]
        base = inputs[2 * q : 2 * q + 1]
        tree = inputs[2 * q + 1 :].view(q, q).bool()
        slots = base + torch.arange(q, device=dev)
        rel = torch.arange(span, device=dev) - base  # key slot relative to the first new entry
        new = (rel >= 0) & (rel < q)
        allowed = (rel < 0)[None, :] | (new[None, :] & tree[:, rel.clamp(0, q - 1)])
        mask = torch.zeros(q, span, device=dev).masked_fill_(~allowed, float("-inf"))
        x = m.get_input_embeddings()(ids)
        cos, sin = m.model.rotary_emb(x, pos)
        cos, sin = cos[0, :, None], sin[0, :, None]  # [q, 1, d]
        heads = (self.n_heads, self.n_kv, self.head_dim)
        rep = self.n_heads // self.n_kv
        d = torch.zeros_like(x)
        states = []
        for i, w in enumerate(self.weights):
            x, rot = fns["attn_in"](x, d, w, cos, sin, heads, self.eps)
            queries, new_kv = _gqa_views(rot, heads)
            if self.split_attention:  # also writes the new keys/values
                o = _split_attention(queries, kv[i, 0], kv[i, 1], new_kv, base, mask, self.scale)
            else:
                kv[i].index_copy_(2, slots, new_kv)
                queries = queries.reshape(self.n_kv, rep * q, self.head_dim)
                scores = torch.matmul(queries, kv[i, 0, :, :span].transpose(1, 2))
                p = fns["probs"](scores, mask, self.scale, rep)
                o = torch.matmul(p, kv[i, 1, :, :span])  # [Hkv, rep*q, d] = [H, q, d]
            x, d = fns["attn_out_mlp"](o, x, w, heads, self.eps)
            if aux and i in self.aux_ids:
                states.append((i, x + d))
        norm, head = m.model.norm, m.get_output_embeddings()
        logits = fns["head"](
            x, d, norm.weight, float(norm.variance_epsilon), head.weight, head.bias
        )
        if not aux or not self.aux_ids:
            return logits, None
        by_id = dict(states)
        return logits, torch.cat([by_id[k] for k in self.aux_ids], -1)

    def _pack(self, ids: Tensor, positions: Tensor, tree: Tensor | None) -> Tensor:
        q = ids.shape[1]
        if tree is None:
            if q not in self._causal:
                self._causal[q] = torch.ones(q, q, dtype=torch.long).tril().reshape(-1)
            t = self._causal[q]
        else:
            t = tree[0].long().cpu().reshape(-1)
        return torch.cat(
            [ids[0].long().cpu(), positions[0].long().cpu(), torch.tensor([self.length]), t]
        )

    def _span(self, q: int) -> int:
        if not self.use_graphs:
            return self.length + q
        need = self.length + q
        span = self.MIN_BUCKET
        while span < need:
            span *= 2
        return min(span, self.capacity)

    def _graph(self, q: int, span: int, aux: bool, packed: Tensor) -> _Graph:
        key = (q, span, aux)
        if key in self._graphs:
            return self._graphs[key]
        inputs = packed.to(self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compiled, kernels chosen, workspaces made)
            for _ in range(2):
                self._core(inputs, q, span, aux)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, states = self._core(inputs, q, span, aux)
        staging = torch.empty_like(packed).pin_memory()
        g = _Graph(graph, inputs, staging, logits, states, torch.cuda.Event())
        self._graphs[key] = g
        return g

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        new_valid: Tensor,
        logits_to_keep: int = 0,
        aux: bool = False,
        tree: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """q new entries of the one row (a chain, or a tree given its ancestor mask [1, q, q]);
        returns (float logits [1, q, V], aux [1, q, 3·Ht]) on the target's device. `new_valid`
        must be all True (batch 1 has no padding); `logits_to_keep` is ignored (all q kept)."""
        if ids.shape[0] != 1 or not bool(new_valid.all()):
            raise ValueError("StaticTargetRunner runs one row without padding")
        q = ids.shape[1]
        if self.length + q > self.capacity:
            raise ValueError(
                f"static KV cache full: {self.length} + {q} entries > capacity {self.capacity}; "
                "build the engine with a larger static_capacity"
            )
        aux = aux and bool(self.aux_ids)
        packed = self._pack(ids, positions, tree)
        span = self._span(q)
        if not self.use_graphs:
            return self._core(packed.to(self.device), q, span, aux)
        g = self._graph(q, span, aux, packed)
        g.copied.synchronize()  # the staging buffer may still be in flight
        g.staging.copy_(packed)
        g.inputs.copy_(g.staging, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        # Graphs share one memory pool: hand out copies, not the static outputs.
        return g.logits.clone(), (g.aux.clone() if g.aux is not None else None)

    def prefill(
        self, prompts: list[list[int]], aux: bool
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Prefill of one prompt (eager, causal SDPA); returns (last logits [1, V],
        aux [1, L, 3·Ht], ids [1, L], valid [1, L]) like `TargetRunner.prefill`."""
        if len(prompts) != 1:
            raise ValueError("StaticTargetRunner runs one prompt at a time")
        L = len(prompts[0])
        if L > self.capacity:
            raise ValueError(f"prompt of {L} tokens > static KV cache capacity {self.capacity}")
        if self.kv is None:
            shape = (self.num_layers, 2, self.n_kv, self.capacity, self.head_dim)
            self.kv = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.length = 0
        ids = torch.tensor([prompts[0]], dtype=torch.long)
        logits, states = self._prefill(ids.to(self.device), aux and bool(self.aux_ids))
        self.length = L
        self.valid = torch.ones(1, L, dtype=torch.bool)
        return logits[:, -1], states, ids, torch.ones(1, L, dtype=torch.bool)

    def _prefill(self, ids: Tensor, aux: bool) -> tuple[Tensor, Tensor | None]:
        """The prompt in one eager pass: the model's own modules (their q/k/v and gate/up weights
        are views of the fused ones) and causal SDPA; the keys and values go to the cache."""
        m, L, kv = self.model, ids.shape[1], self.kv
        assert kv is not None
        pos = torch.arange(L, device=self.device)[None]
        x = m.get_input_embeddings()(ids)
        cos, sin = m.model.rotary_emb(x, pos)
        cos, sin = cos[:, None], sin[:, None]
        H, Hkv, d = self.n_heads, self.n_kv, self.head_dim
        states = {}
        for i, layer in enumerate(self.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            qs = at.q_proj(h).view(1, L, H, d).transpose(1, 2)
            ks = at.k_proj(h).view(1, L, Hkv, d).transpose(1, 2)
            vs = at.v_proj(h).view(1, L, Hkv, d).transpose(1, 2)
            if hasattr(at, "q_norm"):
                qs, ks = at.q_norm(qs), at.k_norm(ks)
            qs = qs * cos + _rotate_half(qs) * sin
            ks = ks * cos + _rotate_half(ks) * sin
            kv[i, 0, :, :L] = ks[0]
            kv[i, 1, :, :L] = vs[0]
            o = F.scaled_dot_product_attention(
                qs,
                ks.repeat_interleave(H // Hkv, 1),
                vs.repeat_interleave(H // Hkv, 1),
                is_causal=True,
                scale=self.scale,
            )
            x = x + at.o_proj(o.transpose(1, 2).reshape(1, L, H * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if aux and i in self.aux_ids:
                states[i] = x
        logits = m.get_output_embeddings()(m.model.norm(x[:, -1:])).float()
        return logits, (torch.cat([states[k] for k in self.aux_ids], -1) if aux else None)

    def commit(self, keep: Tensor) -> None:
        """Keep the accepted entries of the last forward ([1, q] bool, the root first): a prefix
        only moves the length; a tree path is gathered to the front of the new slots first."""
        idx = keep[0].nonzero().squeeze(1)
        n = int(idx.numel())
        if n and int(idx[-1]) != n - 1:  # not a prefix: move the kept entries together
            assert self.kv is not None
            src = (self.length + idx).to(self.device)
            self.kv[:, :, :, self.length : self.length + n] = self.kv[:, :, :, src]
        self.length += n
        self.valid = torch.ones(1, self.length, dtype=torch.bool)

    def select(self, rows: Tensor) -> None:
        if rows.numel() != 1:
            raise ValueError("StaticTargetRunner runs one row")

    def release(self) -> None:
        self.length = 0
        self.valid = torch.zeros(1, 0, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# Draft sources: the EAGLE-3 drafter, or (in tests) stubs with the same four methods


class DraftSource(Protocol):
    aux_layer_ids: list[int]  # target layers whose outputs `extend` receives (SGLang ids)

    def start(self, batch: int, capacity: int) -> None:
        """Fresh state for a batch whose positions stay below `capacity`."""

    def extend(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        """Verified entries: slot `positions[b, j]` gets token x_{t+1} = ids[b, j] and the target's
        aux state h_t; only entries with `write` are real. Drafting continues from each row's last
        real entry."""

    def propose(
        self, steps: int, temperature: float, gen: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None]:
        """Draft `steps` tokens per row: (target ids [B, steps], q [B, steps, V] over the target
        vocab when temperature > 0, else None)."""

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch."""

    # Tree drafting (optional): propose_tree(steps, topk, num_nodes) -> DraftTree


@dataclass
class DraftTree:
    """Draft nodes per row, parents before children: tokens [B, M] (target ids), parents [B, M]
    (index of the parent node, -1 = the root x_n), depths [B, M] (1 = child of the root)."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor


def tree_problem(steps: int, topk: int, num_draft_tokens: int | None) -> str | None:
    """Why (steps, topk, num_draft_tokens) cannot be drafted, or None. A tree of `steps` levels
    holds at most topk + (steps-1)·topk² nodes; num_draft_tokens counts them plus the root."""
    if steps < 1 or topk < 1:
        return f"steps={steps}, topk={topk}: both must be >= 1"
    if topk == 1:
        return None  # a chain always verifies steps+1 tokens; num_draft_tokens is for trees
    most = topk + (steps - 1) * topk * topk + 1
    if num_draft_tokens is not None and not 2 <= num_draft_tokens <= most:
        return f"num_draft_tokens={num_draft_tokens}: steps={steps}, topk={topk} allow 2..{most}"
    return None


def tree_ancestors(parents: Tensor) -> Tensor:
    """[B, M] parents -> [B, M+1, M+1] bool 'column is an ancestor of row, or the row itself',
    index 0 being the root."""
    B, M = parents.shape
    anc = torch.zeros(B, M + 1, M + 1, dtype=torch.bool)
    anc[:, 0, 0] = True
    b = torch.arange(B)
    for i in range(1, M + 1):
        anc[:, i] = anc[b, parents[:, i - 1] + 1]
        anc[:, i, i] = True
    return anc


def _last_true(mask: Tensor) -> Tensor:
    """Index of the last True per row of a [B, n] mask (every row has one)."""
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, idx, -1).max(1).values


class EagleDraft:
    """The EAGLE-3 chain drafter over a `DrafterCache`; state = the cache plus each row's last
    pre-norm output, draft logits and position."""

    def __init__(self, model: Eagle3Drafter, source: str = ""):
        self.model = model.eval()
        self.cfg = model.cfg
        self.source = source
        self.aux_layer_ids = list(model.cfg.aux_layer_ids)
        self.cache: DrafterCache | None = None
        self.h = self.logits = self.pos = None

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def start(self, batch: int, capacity: int) -> None:
        w = self.model.fc.weight
        self.cache = DrafterCache(self.cfg, batch, capacity, device=w.device, dtype=w.dtype)

    def _prenorm(
        self, ids: Tensor, hidden: Tensor, positions: Tensor, write: Tensor | None
    ) -> Tensor:
        """`Eagle3Drafter.forward_step` without the LM head: only each row's last entry needs
        logits, and the head (draft vocab x H) is most of a draft step's cost. Parity with
        forward_step: tests/test_engine.py::test_drafter_protocol_matches_fresh_recomputation."""
        m, dev = self.model, self.device
        ids, positions = ids.to(dev), positions.to(dev)
        write = write.to(dev) if write is not None else None
        hidden = m.project(hidden.to(dev))
        x = m.midlayer.attn_input(m.embed(ids), hidden)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, positions)
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)
        self.cache.write(k, v, positions, write)
        return m.midlayer.finish(hidden, self.cache.attend(q, positions))

    def extend(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        assert self.cache is not None, "start() first"
        out = self._prenorm(ids, aux.to(self.model.fc.weight.dtype), positions, write)
        b = torch.arange(ids.shape[0], device=self.device)
        last = _last_true(write.to(self.device))
        self.h, self.pos = out[b, last], positions.to(self.device)[b, last]
        self.logits = self.model.logits(self.h)

    def _pick(
        self, logits: Tensor, temperature: float, gen: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None]:
        """Draft ids and (when sampling) the draft distribution they were drawn from."""
        if temperature <= 0:
            return logits.argmax(-1), None
        q = torch.softmax(logits.float().cpu() / temperature, -1)  # the generator is a CPU one
        return torch.multinomial(q, 1, generator=gen).squeeze(-1).to(logits.device), q

    def propose(
        self, steps: int, temperature: float, gen: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None]:
        assert self.cache is not None and self.logits is not None, "extend() first"
        B = self.logits.shape[0]
        h, logits, drafts, qs = self.h[:, None], self.logits, [], []
        for j in range(steps):
            d, q = self._pick(logits, temperature, gen)
            tok = self.model.draft_to_target(d)
            drafts.append(tok)
            if q is not None:
                qt = torch.zeros(B, self.cfg.vocab_size)
                d_all = torch.arange(q.shape[-1], device=self.device)
                qt[:, self.model.draft_to_target(d_all).cpu()] = q  # onto target ids
                qs.append(qt)
            if j + 1 < steps:
                h = self._prenorm(tok[:, None], h, (self.pos + 1 + j)[:, None], None)
                logits = self.model.logits(h[:, 0])
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def select(self, rows: Tensor) -> None:
        assert self.cache is not None
        self.cache.k, self.cache.v = self.cache.k[rows], self.cache.v[rows]
        self.h, self.logits, self.pos = self.h[rows], self.logits[rows], self.pos[rows]

    def _tree_step(
        self, tok: Tensor, h: Tensor, anc: Tensor, ek: Tensor, ev: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Expand the K frontier nodes of every row at once ([B, K] tokens, [B, K, H] input
        states). Each attends to its row's verified slots, its expanded ancestors (`anc` [B, K, E]
        over the entries `ek`/`ev` [B, Hkv, E, d]) and itself; the tree never touches the cache.
        Returns (pre-norm out [B, K, H], new keys, new values [B, Hkv, K, d])."""
        m, (B, K) = self.model, tok.shape
        depth = ek.shape[2] // K + 1  # the frontier's depth: one expansion per earlier depth
        x = m.midlayer.attn_input(m.embed(tok), h)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, (self.pos + depth)[:, None].expand(B, K))
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)
        top, dev = int(self.pos.max()) + 1, self.device
        prefix = torch.arange(top, device=dev)[None, :] <= self.pos[:, None]
        prefix = prefix[:, None, :].expand(B, K, top)
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        mask = torch.cat([prefix, anc, eye], -1)[:, None]
        keys = torch.cat([self.cache.k[:, :, :top], ek, k], 2)
        vals = torch.cat([self.cache.v[:, :, :top], ev, v], 2)
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return m.midlayer.finish(h, attn.transpose(1, 2).reshape(B, K, -1)), k, v

    def propose_tree(self, steps: int, topk: int, num_nodes: int) -> DraftTree:
        """EAGLE tree drafting (greedy): the root's top-k children, then `steps`-1 times expand
        the k best frontier nodes into k children each, scoring a node by its path's summed draft
        log-probability; keep the `num_nodes` best nodes (a child never outscores its parent, so
        the kept set is a tree)."""
        assert self.cache is not None and self.logits is not None, "extend() first"
        m, K, B, dev = self.model, topk, self.h.shape[0], self.device
        score, d = torch.log_softmax(self.logits.float(), -1).topk(K)  # [B, K]
        toks, scores, parents, depths = (
            [m.draft_to_target(d)],
            [score],
            [torch.full((B, K), -1, device=dev)],
            [torch.ones(B, K, dtype=torch.long, device=dev)],
        )
        f_id, f_tok, f_score = torch.arange(K, device=dev).expand(B, K), toks[0], score
        f_h = self.h[:, None].expand(B, K, self.h.shape[-1])
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)
        ek = self.cache.k.new_zeros(B, self.cache.k.shape[1], 0, self.cache.k.shape[-1])
        ev = ek.clone()
        n_nodes = K
        for j in range(1, steps):
            out, k, v = self._tree_step(f_tok, f_h, anc, ek, ev)
            c_score, c_d = torch.log_softmax(m.logits(out).float(), -1).topk(K)  # [B, K, K]
            c_score = (f_score[..., None] + c_score).reshape(B, K * K)
            toks.append(m.draft_to_target(c_d).reshape(B, K * K))
            scores.append(c_score)
            parents.append(f_id[..., None].expand(B, K, K).reshape(B, K * K))
            depths.append(torch.full((B, K * K), j + 1, device=dev))
            best = c_score.topk(K).indices  # the next frontier
            par = best // K  # which old frontier node each new one hangs from
            e_old = ek.shape[2]
            ek, ev = torch.cat([ek, k], 2), torch.cat([ev, v], 2)
            own = F.one_hot(e_old + par, e_old + K).bool()
            anc = (
                torch.cat(
                    [
                        anc.gather(1, par[..., None].expand(B, K, e_old)),
                        torch.zeros(B, K, K, dtype=torch.bool, device=dev),
                    ],
                    2,
                )
                | own
            )
            f_id, f_tok = n_nodes + best, toks[-1].gather(1, best)
            f_score, f_h = (
                c_score.gather(1, best),
                out.gather(1, par[..., None].expand(B, K, out.shape[-1])),
            )
            n_nodes += K * K
        tok, sc, par_id, dep = (torch.cat(x, 1) for x in (toks, scores, parents, depths))
        if not 1 <= num_nodes <= n_nodes:
            raise ValueError(
                f"num_draft_tokens - 1 = {num_nodes} draft nodes; steps={steps}, topk={K} make 1..{n_nodes}"
            )
        keep = torch.sort(torch.argsort(-sc, dim=1, stable=True)[:, :num_nodes], dim=1).values
        where = torch.full((B, n_nodes + 1), -1, device=dev)  # node id -> kept index (last: root)
        where.scatter_(1, keep, torch.arange(num_nodes, device=dev).expand(B, num_nodes))
        kept_par = par_id.gather(1, keep)
        return DraftTree(
            tok.gather(1, keep), where.gather(1, kept_par % (n_nodes + 1)), dep.gather(1, keep)
        )


# ----------------------------------------------------------------------------------------------
# Acceptance rules


def greedy_accept(drafts: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """drafts [B, k], target logits [B, k+1, V] -> (accepted count a [B], bonus token [B]):
    the longest prefix of drafts equal to the target's argmax, then the target's own next token."""
    top = logits.argmax(-1)  # [B, k+1]
    a = (drafts == top[:, :-1]).long().cumprod(1).sum(1)
    return a, top.gather(1, a[:, None]).squeeze(1)


def rejection_accept(
    drafts: Tensor, q: Tensor, logits: Tensor, temperature: float, gen: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling. Draft d_j (drawn from q_j) is accepted with probability
    min(1, p_j(d)/q_j(d)) while all earlier ones were; at the first rejection the token is drawn
    from norm(max(p_j - q_j, 0)); after k acceptances the bonus is drawn from p_k. The emitted
    tokens are distributed exactly as the target samples them."""
    B, k = drafts.shape
    p = torch.softmax(logits / temperature, -1)  # [B, k+1, V]
    pd = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=gen)
    a = (u * qd < pd).long().cumprod(1).sum(1)  # u < p/q without dividing by q
    b = torch.arange(B)
    pa = p[b, a]
    qa = torch.where((a < k)[:, None], q[b, a.clamp(max=k - 1)], torch.zeros_like(pa))
    resid = (pa - qa).clamp(min=0)
    mass = resid.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, resid / mass.clamp(min=1e-30), pa)  # p == q: rejection had prob 0
    return a, torch.multinomial(dist, 1, generator=gen).squeeze(1)


def tree_greedy_accept(
    tree: DraftTree, logits: Tensor, steps: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk each row's tree from the root, always into the child carrying the target's argmax.
    logits [B, M+1, V] over [root, nodes...] -> (accepted count a [B], path node indices [B, steps]
    (1-based, 0-padded), bonus token [B])."""
    top = logits.argmax(-1).cpu()  # the walk below reads it element by element
    B = top.shape[0]
    a, path = torch.zeros(B, dtype=torch.long), torch.zeros(B, steps, dtype=torch.long)
    bonus = torch.empty(B, dtype=torch.long)
    for b in range(B):
        children: dict[int, dict[int, int]] = {}
        for i, (p, t) in enumerate(
            zip(tree.parents[b].tolist(), tree.tokens[b].tolist(), strict=True)
        ):
            children.setdefault(p + 1, {}).setdefault(t, i + 1)
        cur = 0
        while (nxt := children.get(cur, {}).get(int(top[b, cur]))) is not None:
            path[b, a[b]] = nxt
            a[b] += 1
            cur = nxt
        bonus[b] = top[b, cur]
    return a, path, bonus


def sample_token(logits: Tensor, temperature: float, gen: torch.Generator | None) -> Tensor:
    """[B, V] -> [B]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# The engine


class _Rows:
    """Per-request outputs and stats while a batch runs; `active` maps batch rows to requests."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: GenParams,
        stop_ids: set[int],
        on_tokens: TokenCallback | None,
        limits: list[int] | None,
    ):
        self.limits = list(limits) if limits is not None else [params.max_tokens] * len(prompts)
        if len(self.limits) != len(prompts) or min(self.limits, default=1) < 1:
            raise ValueError(f"max_tokens_each: need one limit >= 1 per prompt, got {limits}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: every prompt needs at least one token")
        self.out: list[list[int]] = [[] for _ in prompts]
        self.stats = [RequestStats(prompt_tokens=len(p)) for p in prompts]
        self.active = list(range(len(prompts)))
        self.params, self.stop_ids, self.on_tokens = params, stop_ids, on_tokens

    def append(self, row: int, tokens: list[int]) -> bool:
        """Add tokens to batch row `row`; True when its request is finished."""
        req = self.active[row]
        room = self.limits[req] - len(self.out[req])
        new = tokens[:room]
        if not self.params.ignore_eos:
            for i, t in enumerate(new):
                if t in self.stop_ids:
                    new = new[: i + 1]
                    self.stats[req].finish_reason = "stop"
                    break
        self.out[req].extend(new)
        self.stats[req].completion_tokens = len(self.out[req])
        if self.on_tokens is not None and new:
            self.on_tokens(req, new)
        return self.stats[req].finish_reason == "stop" or len(self.out[req]) >= self.limits[req]

    def charge(self, field_name: str, ms: float) -> None:
        for req in self.active:
            setattr(self.stats[req], field_name, getattr(self.stats[req], field_name) + ms)

    def results(self, t0: float) -> list[Generation]:
        total = (time.perf_counter() - t0) * 1000
        for s in self.stats:
            s.total_ms = total
        return [Generation(o, s) for o, s in zip(self.out, self.stats, strict=True)]


def _drop_finished(
    done: list[bool],
    rows: _Rows,
    runner: TargetRunner,
    drafter: DraftSource | None,
    *tensors: Tensor,
) -> tuple[Tensor, ...]:
    """Remove finished requests from the batch: target cache, drafter state and per-row tensors."""
    if not any(done):
        return tensors
    keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long)
    rows.active = [rows.active[i] for i in keep.tolist()]
    if rows.active:
        runner.select(keep)
        if drafter is not None:
            drafter.select(keep)
    return tuple(t[keep] for t in tensors)


def _ms(t: float) -> float:
    return (time.perf_counter() - t) * 1000


@dataclass
class _Cycle:
    """One draft + verify cycle of every active row."""

    a: Tensor  # [B] accepted drafts
    path: Tensor  # [B, k] drafted tokens along the accepted path (the first a are emitted)
    bonus: Tensor  # [B] the target's token after the accepted path
    aux: Tensor  # [B, k+1, 3·Ht] target aux states of x_n and the path nodes
    draft_ms: float
    verify_ms: float


class SpecEngine:
    """Target + optional drafter. Not thread-safe: callers serialize `generate` calls."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: DraftSource | None = None,
        steps: int = 3,
        stop_ids: set[int] | None = None,
        fast_linear: bool = True,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        runner: str = "auto",
        static_capacity: int = 4096,
    ):
        """`runner`: "auto" = the static-cache, CUDA-graph runner when the target is on a GPU
        and Llama-like (requests then run one at a time), else the eager batched `TargetRunner`;
        "eager" or "static" force one (static on CPU runs the same code without graphs).
        `static_capacity`: KV slots of the static runner (prompt + max_tokens + steps + 2 must fit)."""
        self.device = next(target.parameters()).device
        # An MKL trick for fp32 on CPU only. In bf16 (oneDNN) F.linear is already fast for few
        # rows and W @ x^T is not: SmolLM2 decode 20.7 vs 31.1 ms, 10-token verify 23.5 vs 24.0.
        self._cpu_fast = fast_linear and self.device.type == "cpu"
        dtype = target.get_input_embeddings().weight.dtype
        self.fast_linear = self._cpu_fast and dtype == torch.float32
        self.topk, self.num_draft_tokens = topk, num_draft_tokens
        if self.fast_linear:
            use_small_rows_linear(target)
        self.target = TargetRunner(target)
        if runner not in ("auto", "eager", "static"):
            raise ValueError(f"runner={runner!r}: use auto, eager or static")
        use_static = runner == "static" or (
            runner == "auto"
            and self.device.type == "cuda"
            and static_runner_problem(target) is None
        )
        self.static = StaticTargetRunner(target, static_capacity) if use_static else None
        self._runner: TargetRunner | StaticTargetRunner = self.static or self.target
        self.drafter: DraftSource | None = None
        self.steps = steps
        self.stop_ids = set(stop_ids) if stop_ids is not None else eos_ids(target)
        if drafter is not None:
            self.set_drafter(drafter)

    def set_drafter(self, drafter: DraftSource | None) -> None:
        if drafter is not None:
            self.target.set_aux_layers(drafter.aux_layer_ids)
            if self.static is not None:
                self.static.set_aux_layers(drafter.aux_layer_ids)
            model = getattr(drafter, "model", None)
            if self._cpu_fast and isinstance(model, torch.nn.Module):
                if next(model.parameters()).dtype == torch.float32:  # the drafter stays fp32
                    use_small_rows_linear(model)
        self.drafter = drafter

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: GenParams,
        on_tokens: TokenCallback | None = None,
        speculative: bool = True,
        max_tokens_each: list[int] | None = None,
    ) -> list[Generation]:
        """Speculative decoding of a batch (plain decoding without a drafter or when not
        `speculative`). `max_tokens_each` overrides `params.max_tokens` per prompt; `on_tokens` is
        called after every cycle with each request's new tokens."""
        if not speculative or self.drafter is None:
            return self.plain_generate(prompts, params, on_tokens, max_tokens_each)
        if self.static is not None and len(prompts) > 1:
            return self._one_by_one(
                lambda p, cb, lim: self.generate(p, params, cb, True, lim),
                prompts,
                on_tokens,
                max_tokens_each,
            )
        drafter, runner = self.drafter, self._runner
        k = params.steps or self.steps
        topk = params.topk or self.topk
        tree = topk > 1 and params.temperature <= 0  # sampling always drafts chains
        n_tokens = params.num_draft_tokens or self.num_draft_tokens or k + 1
        if tree and (problem := tree_problem(k, topk, n_tokens)):
            raise ValueError(problem)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        rows = _Rows(prompts, params, self.stop_ids, on_tokens, max_tokens_each)
        self._check_fits(prompts, rows.limits, n_tokens if tree else k + 1)
        t0 = time.perf_counter()
        for s in rows.stats:
            s.steps, s.accept_hist = k, [0] * (k + 1)

        t = time.perf_counter()
        logits, aux, ids, valid = runner.prefill(prompts, aux=True)
        x_next = _host_sample(logits, params.temperature, gen)
        rows.charge("prefill_ms", _ms(t))
        t = time.perf_counter()
        drafter.start(len(prompts), max(map(len, prompts)) + max(rows.limits) + k + 2)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        drafter.extend(torch.cat([ids[:, 1:], x_next[:, None]], 1), aux, positions, valid)
        rows.charge("prefill_ms", _ms(t))  # the drafter's prompt extend is prefill work
        pos_next = valid.sum(1)  # position of x_next, not yet in the target cache
        done = [rows.append(r, [int(x_next[r])]) for r in range(len(prompts))]
        x_next, pos_next = _drop_finished(done, rows, runner, drafter, x_next, pos_next)

        j = torch.arange(k + 1)
        while rows.active:
            if tree:
                cyc = self._tree_cycle(x_next, pos_next, k, topk, n_tokens)
            else:
                cyc = self._chain_cycle(x_next, pos_next, k, params, gen)
            rows.charge("draft_ms", cyc.draft_ms)
            rows.charge("verify_ms", cyc.verify_ms)
            done = []
            for r, req in enumerate(rows.active):
                st, ar = rows.stats[req], int(cyc.a[r])
                st.spec_verify_ct += 1
                st.accepted_drafts += ar
                st.accept_hist[ar] += 1
                done.append(rows.append(r, cyc.path[r, :ar].tolist() + [int(cyc.bonus[r])]))
            # slot n+j gets the token after it: the j-th accepted draft, then the bonus
            keep = j[None] <= cyc.a[:, None]
            ext_ids = torch.cat(
                [
                    torch.where(j[None, :k] < cyc.a[:, None], cyc.path, cyc.bonus[:, None]),
                    cyc.bonus[:, None],
                ],
                1,
            )
            ext_pos = pos_next[:, None] + j
            x_next, pos_next = cyc.bonus, pos_next + cyc.a + 1
            keep_rows = torch.tensor([not d for d in done])
            x_next, pos_next = _drop_finished(done, rows, runner, drafter, x_next, pos_next)
            if rows.active:
                t = time.perf_counter()
                drafter.extend(
                    ext_ids[keep_rows],
                    cyc.aux[keep_rows.to(cyc.aux.device)],
                    ext_pos[keep_rows],
                    keep[keep_rows],
                )
                rows.charge("draft_ms", _ms(t))
        runner.release()
        return rows.results(t0)

    def _chain_cycle(
        self,
        x_next: Tensor,
        pos_next: Tensor,
        k: int,
        params: GenParams,
        gen: torch.Generator | None,
    ) -> _Cycle:
        t = time.perf_counter()
        drafts, q = self.drafter.propose(k, params.temperature, gen)
        drafts, q = drafts.cpu(), (q.cpu() if q is not None else None)  # bookkeeping on the host
        draft_ms, t = _ms(t), time.perf_counter()
        vpos = pos_next[:, None] + torch.arange(k + 1)
        ones = torch.ones_like(vpos, dtype=torch.bool)
        logits, aux = self._runner.forward(
            torch.cat([x_next[:, None], drafts], 1), vpos, ones, aux=True
        )
        if params.temperature <= 0:  # on the logits' device; only a and the bonus come back
            a, bonus = greedy_accept(drafts.to(logits.device), logits)
            a, bonus = a.cpu(), bonus.cpu()
        else:
            a, bonus = rejection_accept(drafts, q, logits.cpu(), params.temperature, gen)
        self._runner.commit(torch.arange(k + 1)[None] <= a[:, None])
        return _Cycle(a, drafts, bonus, aux, draft_ms, _ms(t))

    def _tree_cycle(
        self, x_next: Tensor, pos_next: Tensor, k: int, topk: int, n_tokens: int
    ) -> _Cycle:
        """Greedy tree cycle: all n_tokens (root + nodes) verified in one pass under an ancestor
        mask; the accepted path's entries stay in the target cache, the rest are masked out."""
        t = time.perf_counter()
        tree = self.drafter.propose_tree(k, topk, n_tokens - 1)
        tree = DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu())
        draft_ms, t = _ms(t), time.perf_counter()
        B = x_next.shape[0]
        ids = torch.cat([x_next[:, None], tree.tokens], 1)
        vpos = pos_next[:, None] + torch.cat([torch.zeros(B, 1, dtype=torch.long), tree.depths], 1)
        logits, aux = self._runner.forward(
            ids,
            vpos,
            torch.ones_like(ids, dtype=torch.bool),
            aux=True,
            tree=tree_ancestors(tree.parents),
        )
        a, path, bonus = tree_greedy_accept(tree, logits, k)
        keep = torch.zeros_like(ids, dtype=torch.bool)
        keep.scatter_(1, path, torch.arange(k)[None] < a[:, None])
        keep[:, 0] = True  # scatter of padded (index 0) entries may have cleared the root
        self._runner.commit(keep)
        nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), path], 1).to(aux.device)
        path_aux = aux.gather(1, nodes[..., None].expand(B, k + 1, aux.shape[-1]))
        return _Cycle(a, ids.gather(1, path), bonus, path_aux, draft_ms, _ms(t))

    @torch.inference_mode()
    def plain_generate(
        self,
        prompts: list[list[int]],
        params: GenParams,
        on_tokens: TokenCallback | None = None,
        max_tokens_each: list[int] | None = None,
    ) -> list[Generation]:
        """The target alone, one token per forward (the no-speculation baseline)."""
        if self.static is not None and len(prompts) > 1:
            return self._one_by_one(
                lambda p, cb, lim: self.plain_generate(p, params, cb, lim),
                prompts,
                on_tokens,
                max_tokens_each,
            )
        runner = self._runner
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        rows = _Rows(prompts, params, self.stop_ids, on_tokens, max_tokens_each)
        self._check_fits(prompts, rows.limits, 1)
        t0 = time.perf_counter()
        t = time.perf_counter()
        logits, _, _, valid = runner.prefill(prompts, aux=False)
        x = _host_sample(logits, params.temperature, gen)
        rows.charge("prefill_ms", _ms(t))
        pos = valid.sum(1)
        done = [rows.append(r, [int(x[r])]) for r in range(len(prompts))]
        x, pos = _drop_finished(done, rows, runner, None, x, pos)
        while rows.active:
            t = time.perf_counter()
            ones = torch.ones(len(rows.active), 1, dtype=torch.bool)
            logits, _ = runner.forward(x[:, None], pos[:, None], ones)
            runner.commit(ones)
            x = _host_sample(logits[:, -1], params.temperature, gen)
            pos = pos + 1
            rows.charge("verify_ms", _ms(t))
            done = [rows.append(r, [int(x[r])]) for r in range(len(rows.active))]
            x, pos = _drop_finished(done, rows, runner, None, x, pos)
        runner.release()
        return rows.results(t0)

    def _check_fits(self, prompts: list[list[int]], limits: list[int], width: int) -> None:
        """The static cache must hold prompt + completion + one verify's spare entries."""
        if self.static is None:
            return
        need = max(len(p) + n for p, n in zip(prompts, limits, strict=True)) + width + 1
        if need > self.static.capacity:
            raise ValueError(
                f"prompt + max_tokens + {width} verify slots = {need} > static KV cache capacity "
                f"{self.static.capacity}; build SpecEngine(static_capacity=...) larger"
            )

    def _one_by_one(
        self,
        run: Callable[[list[list[int]], TokenCallback | None, list[int] | None], list[Generation]],
        prompts: list[list[int]],
        on_tokens: TokenCallback | None,
        max_tokens_each: list[int] | None,
    ) -> list[Generation]:
        """The static runner holds one sequence: run a batch's requests in turn."""
        out: list[Generation] = []
        for i, p in enumerate(prompts):
            cb = None if on_tokens is None else (lambda _r, toks, i=i: on_tokens(i, toks))
            out += run([p], cb, None if max_tokens_each is None else [max_tokens_each[i]])
        return out


def _host_sample(logits: Tensor, temperature: float, gen: torch.Generator | None) -> Tensor:
    """`sample_token` whose result is on the host: argmax on the logits' device, sampling on the
    CPU (the engine's generator is a CPU one)."""
    if temperature > 0:
        logits = logits.cpu()
    return sample_token(logits, temperature, gen).cpu()


def eos_ids(model: torch.nn.Module) -> set[int]:
    """Stop tokens from the model's generation config (int or list)."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# ----------------------------------------------------------------------------------------------
# Loading


def load_target(
    model: str,
    gguf_file: str | None = None,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: str | None = None,
):
    """(model, tokenizer) of an HF causal LM; `smollm2` resolves to the bundled GGUF. `device`
    ("cuda", "cpu"; None = cpu) is where the weights go: on CUDA `SpecEngine` uses its
    static-cache, CUDA-graph runner."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.target_weights import resolve_target

    path, gguf = resolve_target(model, gguf_file)
    kw: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if gguf:
        kw["gguf_file"] = gguf
    tok = AutoTokenizer.from_pretrained(path, **kw)
    from eagle3.train_step import target_dtype

    dt = target_dtype(dtype, torch.device(device).type if device else "cpu")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dt, **kw).eval()
    return (lm.to(device) if device else lm), tok


def check_drafter_for_target(
    cfg: Eagle3Config, vocab_size: int, hidden_size: int, num_layers: int, source: str
) -> list[str]:
    """Every way a drafter config does not fit the target, one line each (eagle3.fit)."""
    return drafter_fit_problems(
        cfg, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, source=source
    )


def load_eagle(path: str | Path, target: torch.nn.Module) -> EagleDraft:
    """Load an EAGLE-3 checkpoint (strict) and check it against the loaded target; raises
    ValueError listing every mismatch."""
    from eagle3.checkpoint import load_drafter

    cfg, state = load_drafter(path)
    emb = target.get_input_embeddings().weight
    n_layers = len(decoder_layers(target))
    problems = check_drafter_for_target(cfg, emb.shape[0], emb.shape[1], n_layers, str(path))
    if problems:
        raise ValueError("drafter does not fit the target:\n  " + "\n  ".join(problems))
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = default_aux_layer_ids(n_layers)
    model = drafter_from_state(cfg, state, emb.detach().float()).to(emb.device)
    return EagleDraft(model, str(path))


def random_drafter(
    target: torch.nn.Module,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    aux_layer_ids: list[int] | None = None,
) -> EagleDraft:
    """An untrained drafter shaped like the target (accept_len ~1): measures cycle overhead."""
    c = target.config
    n_layers = len(decoder_layers(target))
    emb = target.get_input_embeddings().weight.detach().float()
    vocab = emb.shape[0]
    heads = c.num_attention_heads
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size or vocab, vocab),
        target_hidden_size=c.hidden_size,
        aux_layer_ids=aux_layer_ids or default_aux_layer_ids(n_layers),
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(
            getattr(c, "rope_theta", None)
            or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        ),
        max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
    )
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, emb)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(vocab, generator=g)[: cfg.draft_vocab_size]).values
    model.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
    model.t2d.zero_()
    model.t2d[used] = True
    return EagleDraft(model.to(emb.device), "random")


__all__ = [
    "DraftSource",
    "DraftTree",
    "EagleDraft",
    "GenParams",
    "Generation",
    "RequestStats",
    "SpecEngine",
    "TargetRunner",
    "check_drafter_for_target",
    "eos_ids",
    "greedy_accept",
    "load_eagle",
    "load_target",
    "random_drafter",
    "rejection_accept",
    "sample_token",
    "small_rows_linear",
    "tree_ancestors",
    "tree_greedy_accept",
    "tree_problem",
    "use_small_rows_linear",
]
