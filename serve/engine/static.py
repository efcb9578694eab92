"""The static target runner: the target on a GPU over a preallocated KV cache of up to
`max_batch` rows of their own lengths, one CUDA graph per (rows, verify width, span); its step is
pure functions of tensors that torch.compile fuses."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from eagle3.cuda_graph import capture_graph
from serve.engine import prefill
from serve.engine.buckets import (
    compile_static,
    dynamic_dims,
    moved_rows,
    row_bucket,
    span_buckets,
)
from serve.engine.eager import decoder_layers
from serve.engine.kernels import (
    FUSED_ROWS,
    _split_attention,
    few_rows_linear,
    fused_matmuls_problem,
    triton_attention_ok,
)
from serve.engine.runner import _check_aux_ids
from serve.engine.step import (
    _attn_in,
    _attn_out_mlp,
    _gqa_views,
    _head,
    _LayerWeights,
    _merged_heads,
    _probs,
    _rotated,
)

# ----------------------------------------------------------------------------------------------
# The target on a GPU: a preallocated KV cache and one CUDA graph per (rows, width, span)


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


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: Tensor  # static int64 [2q + 1 + q*q]: ids, positions, base slot, tree mask
    staging: Tensor  # pinned host copy of `inputs`
    logits: Tensor
    aux: Tensor | None
    copied: Any  # torch.cuda.Event: the last staging -> inputs copy finished


class StaticTargetRunner:
    """The target over a preallocated KV cache [layers, k/v, max_batch rows, kv heads, capacity,
    head dim], with the forward of each (rows, width q, cache bucket) captured once as a CUDA
    graph and replayed.

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

    Layout: in each row slot i holds position i (no padding: the rows are ragged, each with its
    own committed length). A forward writes each row's q entries at slots base..base+q-1 (base =
    the row's length) and attends to slots < base plus the new entries allowed by `tree` (causal
    for a chain). `commit` keeps each row's accepted entries: a prefix just moves its length; a
    tree path is first gathered to the front. Attention reads a power-of-two bucket of slots
    (>= 256) over the longest row, so short contexts do not read the whole capacity. One row runs
    the split-KV kernel; several run the batched products (the CPU path's).

    Same interface as `TargetRunner` (prefill / forward / commit / select / release), up to
    `max_batch` rows, and the device-side cycle's (`verify`, `keep_path`, `advance`).
    Without CUDA (or with graphs=False) the same code runs eagerly: that is what the CPU tests pin.
    Building one makes the model's q/k/v and gate/up weights views of one fused tensor each
    (same values; see `_fuse_linears`)."""

    MIN_BUCKET = 256
    PREFILL_CHUNK = 512  # the longest prefill in one graph, and the chunk of longer ones

    def __init__(
        self,
        model: torch.nn.Module,
        capacity: int = 4096,
        graphs: bool | None = None,
        compiled: bool | None = None,
        split_attention: bool | None = None,
        max_batch: int = 1,
        compile_backend: str = "inductor",
        compile_mode: str | None = None,
        fused_matmuls: bool = False,
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
        self.capacity, self.max_batch = int(capacity), int(max_batch)
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
        # steps of up to FUSED_ROWS rows: the matmuls in kernels.py's few-rows kernel, norms and
        # SwiGLU inside (opt-in until measured on a GPU; on a CPU only under triton's interpreter)
        if fused_matmuls and (problem := fused_matmuls_problem(self.device)):
            raise ValueError(f"fused_matmuls: {problem}")
        self.fused_matmuls = bool(fused_matmuls)
        self._fns = self._step_functions(self.compiled, compile_backend, compile_mode)
        self.aux_ids: list[int] = []
        self.lengths = [0]  # each row's committed slots (host)
        self.kv: Tensor | None = None  # [L, 2, max_batch, Hkv, capacity, d], made on first use
        self._graphs: dict[tuple, Any] = {}  # (rows, q, span, aux): _Graph; prefill's too
        self.captures = 0  # graphs captured so far (SpecEngine.late_captures reads it)
        self._pool: Any = None
        self._causal: dict[tuple[int, str], Tensor] = {}  # (q, device type) -> the chain's mask
        # With graphs a forward of B rows runs as the next power of two (at most max_batch): a
        # batch that shrinks as its requests finish replays a few graphs (and compiled
        # specialisations), not one per size. The padding rows are free cache rows (a write to
        # their first slots is never read: a prefill writes a row before it is read); their
        # outputs are dropped.
        self.bucket_rows = self.use_graphs
        self.padded_prefill = self.use_graphs  # prompts up to PREFILL_CHUNK: one graph (prefill.py)

    @staticmethod
    def _step_functions(compiled: bool, backend: str, mode: str | None) -> dict[str, Callable]:
        fns = {"attn_in": _attn_in, "probs": _probs, "attn_out_mlp": _attn_out_mlp, "head": _head,
               "rotated": _rotated}  # fmt: skip
        if not compiled:
            return fns
        # `mode` "max-autotune-no-cudagraphs": inductor times triton matmul templates that may
        # fuse norms and SwiGLU into the matmuls (minutes of autotuning per shape at start-up).
        return {k: compile_static(f, backend, mode) for k, f in fns.items()}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """The first row's committed slots (one row's: what a batch of one has)."""
        return self.lengths[0]

    @property
    def valid(self) -> Tensor:
        """[B, S] the cache slots each row attends to (TargetRunner's): its first `length`."""
        return torch.arange(max(self.lengths))[None] < torch.tensor(self.lengths)[:, None]

    def set_aux_layers(self, ids: list[int]) -> None:
        _check_aux_ids(ids, self.num_layers)
        if list(ids) != self.aux_ids:
            self.aux_ids = list(ids)
            self._graphs.clear()  # the aux outputs are part of each captured graph

    # -- the forward ------------------------------------------------------------------------
    def _core(
        self,
        inputs: Tensor,
        q: int,
        span: int,
        aux: bool,
        rows: Tensor | None = None,
        last: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One forward of q entries per row from the packed int64 `inputs` [B, 2q + 1 + q*q]
        (ids, positions, the row's base slot, tree), attending over slots [0, span) of cache
        rows 0..B-1, or of `rows` [B] (a prefill's: it may join a batch, and its padding rows
        repeat a row). `last` [B] (a prefill): the logits of each row's entry there only
        ([B, 1, V]), attention by the batched products (the split kernel is for a few entries).
        Graph-safe: no host reads, fixed shapes for fixed (B, q, span)."""
        m, dev, fns = self.model, self.device, self._fns
        assert self.kv is not None
        B = inputs.shape[0]
        kv = self.kv[:, :, :B] if rows is None else self.kv  # the graphs of every B: one cache
        ids, pos = inputs[:, :q], inputs[:, q : 2 * q]
        base = inputs[:, 2 * q]
        tree = inputs[:, 2 * q + 1 :].view(B, q, q).bool()
        slots = base[:, None] + torch.arange(q, device=dev)  # [B, q]
        rel = torch.arange(span, device=dev)[None] - base[:, None]  # [B, span]: to the first new
        new = (rel >= 0) & (rel < q)
        seen = tree.gather(2, rel.clamp(0, q - 1)[:, None].expand(B, q, span))
        allowed = (rel < 0)[:, None] | (new[:, None] & seen)
        mask = torch.zeros(B, q, span, device=dev).masked_fill_(~allowed, float("-inf"))
        x = m.get_input_embeddings()(ids)
        cos, sin = m.model.rotary_emb(x, pos)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, q, 1, d]
        heads = (self.n_heads, self.n_kv, self.head_dim)
        rep = self.n_heads // self.n_kv
        # each row's cache row; with heads_ix and slots: [B, Hkv, q]
        rows_ix = (torch.arange(B, device=dev) if rows is None else rows)[:, None, None]
        heads_ix = torch.arange(self.n_kv, device=dev)[None, :, None]
        d = torch.zeros_like(x)
        states = []
        # compiled: one code for every row count, verify width and span (`dynamic_dims`)
        dyn = functools.partial(dynamic_dims, B if self.compiled else 1)
        wide = functools.partial(dynamic_dims, q if self.compiled else 1)
        spans = functools.partial(dynamic_dims, span if self.compiled else 1)
        dyn((mask, 0), (cos, 0), (sin, 0))
        wide((mask, 1), (cos, 1), (sin, 1))
        spans((mask, 2))
        fused = self.fused_matmuls and B * q <= FUSED_ROWS
        for i, w in enumerate(self.weights):
            dyn((x, 0), (d, 0))
            wide((x, 1), (d, 1))
            if fused:  # the norm and its residual add inside the matmul's kernel (kernels.py)
                x, qkv = few_rows_linear(x, w.qkv, w.qkv_bias, d, (w.norm_in, self.eps[0]))
                dyn((qkv, 0))
                wide((qkv, 1))
                rot = fns["rotated"](qkv, w, cos, sin, heads, self.eps)
            else:
                x, rot = fns["attn_in"](x, d, w, cos, sin, heads, self.eps)
            queries, new_kv = _gqa_views(rot, heads)
            if self.split_attention and B == 1 and last is None:  # also writes the new keys/values
                o = _split_attention(queries[0], kv[i, 0, 0], kv[i, 1, 0], new_kv[:, 0],
                                     base, mask[0], self.scale)[None]  # fmt: skip
            else:
                kv[i][:, rows_ix, heads_ix, slots[:, None]] = new_kv  # [2, B, Hkv, q, d]
                cache = kv[i][:, :, :, :span] if rows is None else kv[i][:, rows, :, :span]
                queries = queries.reshape(B, self.n_kv, rep * q, self.head_dim)
                scores = torch.matmul(queries, cache[0].transpose(2, 3))
                dyn((scores, 0))
                wide((scores, 2))
                spans((scores, 3))
                p = fns["probs"](scores, mask, self.scale, rep)
                o = torch.matmul(p, cache[1])  # [B, Hkv, rep*q, d] = [B, H, q, d]
            dyn((o, 0), (x, 0))
            wide((o, 2), (x, 1))
            if fused:
                o = few_rows_linear(_merged_heads(o, heads), w.o, w.o_bias)[1]
                x, gu = few_rows_linear(x, w.gate_up, w.gate_up_bias, o, (w.norm_post, self.eps[0]))  # fmt: skip
                d = few_rows_linear(gu, w.down, w.down_bias, swiglu=True)[1]
            else:
                x, d = fns["attn_out_mlp"](o, x, w, heads, self.eps)
            if aux and i in self.aux_ids:
                states.append((i, x + d))
        norm, head = m.model.norm, m.get_output_embeddings()
        if last is not None:  # a prefill: each row's last prompt entry only (not q x vocab)
            at = last[:, None, None].expand(B, 1, x.shape[-1])
            x, d, wide = x.gather(1, at), d.gather(1, at), functools.partial(dynamic_dims, 1)
        dyn((x, 0), (d, 0))
        wide((x, 1), (d, 1))
        logits = fns["head"](
            x, d, norm.weight, float(norm.variance_epsilon), head.weight, head.bias
        )
        if not aux or not self.aux_ids:
            return logits, None
        by_id = dict(states)
        return logits, torch.cat([by_id[k] for k in self.aux_ids], -1)

    def _pack(self, ids: Tensor, positions: Tensor, tree: Tensor | None) -> Tensor:
        """[B, 2q + 1 + q*q] int64 on the host: each row's ids, positions, base slot, tree."""
        B, q = ids.shape
        if tree is None:
            t = self._causal_mask(q, torch.device("cpu")).expand(B, q * q)
        else:
            t = tree.long().cpu().reshape(B, q * q)
        base = torch.tensor(self.lengths, dtype=torch.long)[:, None]
        return torch.cat([ids.long().cpu(), positions.long().cpu(), base, t], 1)

    def _alloc(self) -> None:
        if self.kv is None:
            shape = (self.num_layers, 2, self.max_batch, self.n_kv, self.capacity, self.head_dim)
            self.kv = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def spans(self) -> list[int]:
        """Every span `_span` can give with graphs: the buckets from MIN_BUCKET to capacity."""
        return span_buckets(self.MIN_BUCKET, self.capacity)

    @torch.inference_mode()  # the buffers are made (and used) in inference mode
    def capture(self, widths: list[tuple[int, bool]], rows: tuple[int, ...] = (1,)) -> int:
        """Capture the graph of every (width, with aux) at every span, in the row buckets of
        `rows` (batch sizes), now, so that no request pays a capture (nor torch.compile's
        specialisation) inside a measurement; returns how many were new. Between requests only
        (the warm-ups write cache slots no request holds then). GPU only; without graphs it does
        nothing. Verified by tests/test_engine_static_draft.py's `gpu` test."""
        if not self.use_graphs:
            return 0
        self._alloc()
        saved, n = self.lengths, 0
        try:
            for b in sorted({row_bucket(r, self.max_batch) for r in rows}):
                self.lengths = [0] * b
                for (q, aux), span in itertools.product(widths, self.spans()):
                    aux = aux and bool(self.aux_ids)
                    if span < q or (b, q, span, aux) in self._graphs:
                        continue
                    ids = torch.zeros(b, q, dtype=torch.long)
                    self._graph(q, span, aux, self._pack(ids, torch.arange(q).expand(b, q), None))
                    n += 1
            buckets = sorted({row_bucket(r, self.max_batch) for r in rows})
            n += prefill.capture(self, buckets)
            for b in {min(r, 2) for r in rows}:  # the chunks' codes (longer prompts), 2 tokens
                ids = torch.zeros(b, 2, dtype=torch.long, device=self.device)
                prefill.chunked(self, ids, torch.full((b,), 2, device=self.device), False, 0)
        finally:
            self.lengths = saved
        return n

    def _span(self, q: int) -> int:
        need = max(self.lengths) + q
        if not self.use_graphs:
            return need
        span = self.MIN_BUCKET
        while span < need:
            span *= 2
        return min(span, self.capacity)

    def _graph(self, q: int, span: int, aux: bool, packed: Tensor) -> _Graph:
        key = (packed.shape[0], q, span, aux)
        if key in self._graphs:
            return self._graphs[key]
        inputs = packed.to(self.device, copy=True)  # the graph's own (`verify` packs on device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, (logits, states) = capture_graph(lambda: self._core(inputs, q, span, aux), self._pool)  # fmt: skip
        self.captures += 1
        staging = torch.empty(packed.shape, dtype=packed.dtype).pin_memory()
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
        """q new entries per row (a chain, or a tree given its ancestor mask [B, q, q]); returns
        (float logits [B, q, V], aux [B, q, 3·Ht]) on the target's device. `new_valid` must be
        all True (the rows are ragged, not padded); `logits_to_keep` is ignored (all q kept)."""
        if ids.shape[0] != len(self.lengths) or not bool(new_valid.all()):
            raise ValueError(
                f"StaticTargetRunner holds {len(self.lengths)} row(s), without padding: got "
                f"{ids.shape[0]} row(s), new_valid all True: {bool(new_valid.all())}"
            )
        B, q = ids.shape
        self._check_room(q)
        aux = aux and bool(self.aux_ids)
        packed = self._pad_rows(self._pack(ids, positions, tree), q)
        span = self._span(q)
        if not self.use_graphs:
            logits, states = self._core(packed.to(self.device), q, span, aux)
            return logits[:B], (states[:B] if states is not None else None)
        g = self._graph(q, span, aux, packed)
        g.copied.synchronize()  # the staging buffer may still be in flight
        g.staging.copy_(packed)
        g.inputs.copy_(g.staging, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        # Graphs share one memory pool: hand out copies, not the static outputs.
        return g.logits[:B].clone(), (g.aux[:B].clone() if g.aux is not None else None)

    def _pad_rows(self, packed: Tensor, q: int) -> Tensor:
        """`packed` [B, ...] with padding rows up to its bucket (`bucket_rows`): ids, positions
        and base 0, a causal tree."""
        B = packed.shape[0]
        b = row_bucket(B, self.max_batch) if self.bucket_rows else B
        if b == B:
            return packed
        pad = packed.new_zeros(b - B, packed.shape[1])
        pad[:, 2 * q + 1 :] = self._causal_mask(q, packed.device)
        return torch.cat([packed, pad])

    def _causal_mask(self, q: int, device: torch.device) -> Tensor:
        """A chain's ancestor mask [q * q] (int64), made once per width and device: no kernels
        per call on the device-side cycle."""
        key = (q, device.type)
        if key not in self._causal:
            self._causal[key] = torch.ones(q, q, dtype=torch.long, device=device).tril().reshape(-1)
        return self._causal[key]

    def _check_room(self, q: int) -> None:
        if max(self.lengths) + q > self.capacity:
            raise ValueError(
                f"static KV cache full: {max(self.lengths)} + {q} entries > capacity {self.capacity}; "
                "build the engine with a larger static_capacity"
            )

    def verify(
        self, ids: Tensor, positions: Tensor, tree: Tensor | None, aux: bool
    ) -> tuple[Tensor, Tensor | None]:
        """`forward` with its inputs already on the device, read by no host code: the q ids and
        positions [q] of the one row, or [B, q] of every row (each row's first position is its
        committed length: slot i holds position i), and the tree's ancestor mask [q, q] or
        [B, q, q] (None: a chain). The inputs are packed on the device and copied into the
        graph's own, so the static path's cycle runs without a sync. Returns (logits [q, V] or [B, q, V], aux
        [q, 3·Ht]): on CUDA the graph's static outputs, valid until this runner's next replay
        (the cycle reads them before). Parity with `forward`: tests/test_engine_device_cycle.py
        and tests/test_engine_static_batch.py."""
        one = ids.dim() == 1
        ids, positions = (ids[None], positions[None]) if one else (ids, positions)
        B, q = ids.shape
        self._check_room(q)
        aux = aux and bool(self.aux_ids)
        t = self._causal_mask(q, ids.device) if tree is None else tree.long()
        t = t.reshape(-1, q * q).expand(B, q * q)
        packed = torch.cat([ids.long(), positions.long(), positions[:, :1].long(), t], 1)
        packed = self._pad_rows(packed, q)
        span = self._span(q)
        if not self.use_graphs:
            logits, states = self._core(packed, q, span, aux)
        else:
            g = self._graph(q, span, aux, packed)
            g.inputs.copy_(packed)
            g.graph.replay()
            logits, states = g.logits, g.aux
        if not one:
            return logits[:B], (states[:B] if states is not None else None)
        return logits[0], (states[0] if states is not None else None)

    def keep_path(self, nodes: Tensor, base: Tensor) -> None:
        """Move each row's entries of the last forward at offsets `nodes` [B, n] (device; the
        root's 0 first, then the accepted path, any padding after it) to its first n new slots,
        from `base` [B] (device: each row's committed length, its verify's first position),
        without reading them on the host: the committed lengths move later (`advance`), once
        the host has read how many were accepted. Entries past the accepted ones are left as
        garbage that no query reads (slots >= length are masked)."""
        assert self.kv is not None
        B, n = nodes.shape
        rows = torch.arange(B, device=nodes.device)[:, None].expand(B, n)
        dst = base[:, None] + torch.arange(n, device=nodes.device)
        self.kv[:, :, rows, :, dst] = self.kv[:, :, rows, :, base[:, None] + nodes]

    def advance(self, n: int | list[int]) -> None:
        """Commit n more entries in every row, or n[r] in row r (of a chain, or a path that
        `keep_path` moved to the front)."""
        more = [n] * len(self.lengths) if isinstance(n, int) else n
        self.lengths = [a + m for a, m in zip(self.lengths, more, strict=True)]

    def prefill(
        self, prompts: list[list[int]], aux: bool, join: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Prefill of up to `max_batch` prompts, each in its own row (`serve/engine/prefill.py`:
        one graph replay for prompts up to PREFILL_CHUNK tokens, else chunks); returns
        (last logits [B, V], aux [B, L, 3·Ht], ids [B, L], valid [B, L]) like
        `TargetRunner.prefill`: left-padded to the longest prompt, so each row's last column is
        its last token. `join`: the prompts join the running batch in the rows after its own,
        whose caches stay (a request that joins between cycles); else they start a new batch."""
        first = len(self.lengths) if join else 0
        B = len(prompts)
        if not 1 <= first + B <= self.max_batch or B < 1:
            joining = f" joining {first} rows" if first else ""
            raise ValueError(f"{B} prompts{joining}: StaticTargetRunner(max_batch={self.max_batch}) holds 1 to {self.max_batch}")  # fmt: skip
        lens = torch.tensor([len(p) for p in prompts])
        L = int(lens.max())
        if L > self.capacity:
            raise ValueError(f"prompt of {L} tokens > static KV cache capacity {self.capacity}")
        self._alloc()
        aux = aux and bool(self.aux_ids)
        right = torch.zeros(B, L, dtype=torch.long)  # slot i of each row holds its position i
        for r, p in enumerate(prompts):
            right[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        run = prefill.padded if prefill.fits(self, L) else prefill.chunked
        logits, states = run(self, right.to(self.device), lens.to(self.device), aux, first)
        # right-padded -> left-padded: column j of row r is its token j - (L - len_r)
        src = (torch.arange(L)[None] - (L - lens)[:, None]).clamp(min=0)
        valid = torch.arange(L)[None] >= (L - lens)[:, None]
        ids = right.gather(1, src) * valid
        if states is not None:
            at = src.to(self.device)[..., None].expand(B, L, states.shape[-1])
            states = states.gather(1, at) * valid.to(self.device)[..., None]
        self.lengths = self.lengths[:first] + lens.tolist()
        return logits, states, ids, valid

    def commit(self, keep: Tensor) -> None:
        """Keep each row's accepted entries of the last forward ([B, q] bool, the root first): a
        prefix only moves the row's length; a tree path is gathered to the front of its new
        slots first."""
        keep = keep.cpu()
        n = keep.sum(1)
        moved = (keep != (torch.arange(keep.shape[1])[None] < n[:, None])).any(1)
        for r in moved.nonzero().squeeze(1).tolist():  # not a prefix: move the kept together
            assert self.kv is not None
            at, k = self.lengths[r], int(n[r])
            src = (at + keep[r].nonzero().squeeze(1)).to(self.device)
            self.kv[:, :, r, :, at : at + k] = self.kv[:, :, r, :, src]
        self.lengths = [a + k for a, k in zip(self.lengths, n.tolist(), strict=True)]

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (ascending), moved to the first rows of the cache: the graphs of
        the smaller batch read them there. Only the rows that move are copied, and only their
        committed slots."""
        keep = rows.tolist()
        if (move := moved_rows(rows)) is not None:
            assert self.kv is not None
            dst, src = (t.to(self.device) for t in move)
            top = max(self.lengths[r] for r in keep)
            self.kv[:, :, dst, :, :top] = self.kv[:, :, src, :, :top]
        self.lengths = [self.lengths[r] for r in keep]

    def release(self) -> None:
        self.lengths = [0]
