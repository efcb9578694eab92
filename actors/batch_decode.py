"""Batched generation and capture on one GPU for HF Llama-family targets: the data stage's
generator for `target.backend: hf` when the target runs on a GPU.

Why not HF's decode loop: at batch 256 it ran at 1.6k generated tok/s for SmolLM2-135M on an
H200, where the card's bandwidth allows some hundred thousand: every step is a few hundred small
kernel launches from Python and a DynamicCache that grows by concatenation. Here:

- a static KV cache [layers, rows, kv heads, capacity, head dim], written in place;
- the decode step as pure tensor code over fixed-shape buffers (token, position, count, done,
  output ids per row), captured once in a CUDA graph and replayed; nothing in it reads the host;
- continuous batching: every `sync_every` steps the host reads which rows finished, takes their
  replies, and prefills queued prompts into the freed rows (eagerly, right-padded, causal);
- capture of the aux hidden states with one batched forward over finished samples (`capture`),
  the same layer code as prefill.

The decoder re-implements the layer math of transformers' Llama (RMSNorm in fp32, rotary from the
model's own rotary module, GQA, SwiGLU; optional q/k/v biases and Qwen3-style q/k norms) over the
model's own weight tensors; tests/test_batch_decode.py checks it token for token against HF's
greedy `generate` and state for state against HF's hidden states. On a CPU it runs the same code
without graphs (slowly); tests use that.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.cuda_graph import capture_graph


class _Layer(NamedTuple):
    norm_in: Tensor
    qkv: Tensor  # [(H + 2 Hkv) d, hidden]: q, k and v in one matmul
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: Tensor
    norm_post: Tensor
    gate_up: Tensor  # [2 I, hidden]
    down: Tensor


def decoder_problem(model: torch.nn.Module) -> str | None:
    """Why `BatchDecoder` cannot run `model`, or None."""
    base = getattr(model, "model", None)
    cfg = model.config.get_text_config(decoder=True)
    if base is None or not all(hasattr(base, n) for n in ("layers", "norm", "rotary_emb")):
        return f"{type(model).__name__}: not Llama-like (model.layers, .norm, .rotary_emb)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"{type(model).__name__}: sliding-window attention"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return f"{type(model).__name__}: layers other than full attention"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"{type(model).__name__}: MLP activation {cfg.hidden_act!r} is not SiLU"
    for la in base.layers:
        at, mlp = getattr(la, "self_attn", None), getattr(la, "mlp", None)
        if at is None or mlp is None or not hasattr(mlp, "gate_proj"):
            return f"{type(model).__name__}: a layer that is not attention + SwiGLU MLP"
        if getattr(at.o_proj, "bias", None) is not None or mlp.down_proj.bias is not None:
            return f"{type(model).__name__}: biased o_proj/down_proj"
    return None


def _fuse(mods: list[torch.nn.Module]) -> Tensor:
    """One weight for linears that read the same input (one matmul instead of three), with the
    modules' own weights made views of it: the model computes as before and no memory is added
    (a copy of gate/up would cost an 8B target 7.5 GB)."""
    ws = [m.weight for m in mods]
    same = all(w.untyped_storage().data_ptr() == ws[0].untyped_storage().data_ptr() for w in ws)
    if same and all(w.data_ptr() == ws[0].data_ptr() + sum(x.numel() for x in ws[:i]) * ws[0].element_size() for i, w in enumerate(ws)):  # fmt: skip
        return (
            ws[0].detach().as_strided((sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].stride())
        )
    with torch.no_grad():
        fused = torch.cat([w.detach() for w in ws])
        for m, part in zip(mods, fused.split([w.shape[0] for w in ws]), strict=True):
            m.weight = torch.nn.Parameter(part, requires_grad=False)
    return fused


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """transformers' Llama RMSNorm: fp32 statistics, cast back, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _swiglu(gu: Tensor) -> Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


@dataclass(frozen=True)
class DecodeStats:
    """What one `generate` call did: generated tokens (EOS included), decode steps replayed,
    prefill calls, and seconds on the host clock around the whole call."""

    tokens: int
    steps: int
    prefills: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class BatchDecoder:
    """`rows` sequences decoding at once over a static cache of `capacity` positions each.

    `generate(prompts, ...)` takes any number of prompts; they queue and refill rows as others
    finish. `graphs` (default: on CUDA) captures the decode step in a CUDA graph; `compiled`
    fuses its elementwise work with torch.compile first (slower to start, fewer kernels)."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        capacity: int,
        eos_ids: Sequence[int],
        *,
        graphs: bool | None = None,
        compiled: bool = False,
        sync_every: int = 8,
        prefill_tokens: int = 65536,
    ):
        problem = decoder_problem(model)
        if problem:
            raise ValueError(f"target.model: the batched GPU decoder cannot run it: {problem}")
        cfg = model.config.get_text_config(decoder=True)
        base = model.model
        self.model, self.rows, self.capacity = model, rows, capacity
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.qk_eps = self.eps
        self.scale = getattr(base.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.layers = [self._layer(la) for la in base.layers]
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        with torch.no_grad():  # rotary tables from the model's own module (its scaling included)
            pos = torch.arange(capacity, device=self.device)[None]
            cos, sin = base.rotary_emb(self.embed[:1][None], pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [capacity, d]
        n, kv, d = len(self.layers), self.kv_heads, self.head_dim
        self.k = torch.zeros(n, rows, kv, capacity, d, device=self.device, dtype=self.dtype)
        self.v = torch.zeros_like(self.k)
        z = dict(device=self.device, dtype=torch.long)
        self.tok, self.pos = torch.zeros(rows, **z), torch.zeros(rows, **z)
        self.count, self.limit = torch.zeros(rows, **z), torch.zeros(rows, **z)
        self.done = torch.ones(rows, device=self.device, dtype=torch.bool)
        self.out = torch.zeros(rows, capacity, **z)
        self.temperature = torch.ones((), device=self.device, dtype=torch.float32)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], **z)
        self._arange = torch.arange(rows, **z)
        self._slots = torch.arange(capacity, **z)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._step_fn = self._step
        if compiled:
            self._step_fn = torch.compile(self._step, fullgraph=True, dynamic=False)
        self._graph: dict[bool, Any] = {}
        self._gen: torch.Generator | None = None

    def _layer(self, la: torch.nn.Module) -> _Layer:
        at, mlp = la.self_attn, la.mlp
        qkv = [at.q_proj, at.k_proj, at.v_proj]
        bias = None
        if any(m.bias is not None for m in qkv):
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in qkv])  # fmt: skip
        qn, kn = getattr(at, "q_norm", None), getattr(at, "k_norm", None)
        if qn is not None:
            self.qk_eps = getattr(qn, "variance_epsilon", self.eps)
        return _Layer(
            norm_in=la.input_layernorm.weight,
            qkv=_fuse(qkv),
            qkv_bias=bias,
            q_norm=qn.weight if qn is not None else None,
            k_norm=kn.weight if kn is not None else None,
            o=at.o_proj.weight,
            norm_post=la.post_attention_layernorm.weight,
            gate_up=_fuse([mlp.gate_proj, mlp.up_proj]),
            down=mlp.down_proj.weight,
        )

    # ------------------------------------------------------------------------------------------
    # The layer math, shared by prefill, capture and the decode step

    def _qkv(self, w: _Layer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """x [B, T, hidden] -> rotated q [B, H, T, d], k and v [B, Hkv, T, d]."""
        B, T, _ = x.shape
        H, Hkv, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_rms(x, w.norm_in, self.eps), w.qkv, w.qkv_bias)
        q, k, v = qkv.split([H * d, Hkv * d, Hkv * d], dim=-1)
        q, k, v = q.view(B, T, H, d), k.view(B, T, Hkv, d), v.view(B, T, Hkv, d)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = _rms(q, w.q_norm, self.qk_eps), _rms(k, w.k_norm, self.qk_eps)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, d]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _mlp(self, w: _Layer, x: Tensor, attn: Tensor) -> Tensor:
        x = x + F.linear(attn, w.o)
        return x + F.linear(_swiglu(F.linear(_rms(x, w.norm_post, self.eps), w.gate_up)), w.down)

    def _forward(
        self, ids: Tensor, aux: Sequence[int] = (), slots: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Causal forward of right-padded sequences [B, T] from position 0: the final-norm states
        [B, T, hidden] and the outputs of the layers in `aux`. With `slots`, each row's keys and
        values are written to those cache rows (prefill)."""
        T = ids.shape[1]
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[:T][None], self.sin[:T][None]
        kept = []
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)
            if slots is not None:
                self.k[i, slots, :, :T] = k
                self.v[i, slots, :, :T] = v
            a = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.heads != self.kv_heads
            )
            x = self._mlp(w, x, a.transpose(1, 2).reshape(*x.shape[:2], -1))
            if i in aux:
                kept.append(x)
        return _rms(x, self.norm, self.eps), kept

    def _pick(self, logits: Tensor, sampled: bool) -> Tensor:
        if not sampled:
            return logits.argmax(-1)
        # Gumbel-max: argmax(l/T + g) is a draw from softmax(l/T), and needs no host sync.
        u = torch.rand(logits.shape, device=logits.device, generator=self._gen)
        g = -torch.log(-torch.log(u.clamp_(1e-10, 1.0)))
        return (logits.float() / self.temperature + g).argmax(-1)

    def _is_eos(self, t: Tensor) -> Tensor:
        return (t[:, None] == self.eos[None]).any(-1)  # a compare, not isin: graph-safe

    def _step(self, sampled: bool) -> None:
        """One decode step of every row over the buffers (graph-safe: no host reads)."""
        B, H, Hkv, d = self.rows, self.heads, self.kv_heads, self.head_dim
        live = ~self.done
        x = F.embedding(self.tok[:, None], self.embed)  # [B, 1, hidden]
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]
        mask = self._slots[None] <= self.pos[:, None]  # [B, capacity]: filled positions
        bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -math.inf)
        bias = bias[:, None, None]  # [B, 1, 1, capacity]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)
            self.k[i, self._arange, :, self.pos] = k[:, :, 0]
            self.v[i, self._arange, :, self.pos] = v[:, :, 0]
            # GQA without copying the cache: the H/Hkv query heads of a kv head are its rows.
            qg = q.reshape(B, Hkv, H // Hkv, d)
            s = torch.matmul(qg, self.k[i].transpose(-1, -2)).float() * self.scale + bias
            p = torch.softmax(s, dim=-1).to(self.dtype)
            a = torch.matmul(p, self.v[i]).reshape(B, 1, H * d)
            x = self._mlp(w, x, a)
        logits = F.linear(_rms(x[:, 0], self.norm, self.eps), self.lm_head)
        nxt = self._pick(logits, sampled)
        at = self.count.clamp(max=self.capacity - 1)
        self.out[self._arange, at] = torch.where(live, nxt, self.out[self._arange, at])
        self.count.add_(live.long())
        self.done.logical_or_(self._is_eos(nxt) | (self.count >= self.limit))
        self.tok.copy_(torch.where(live, nxt, self.tok))
        self.pos.copy_((self.pos + live.long()).clamp(max=self.capacity - 1))

    def _replay(self, sampled: bool) -> None:
        if not self.graphs:
            self._step_fn(sampled)
            return
        g = self._graph.get(sampled)
        if g is None:  # warm up on a side stream (allocator, compile), then capture
            snap = [t.clone() for t in (self.tok, self.pos, self.count, self.done, self.out)]
            g, _ = capture_graph(lambda: self._step_fn(sampled), warmups=3, device=self.device)
            for t, old in zip((self.tok, self.pos, self.count, self.done, self.out), snap, strict=True):  # fmt: skip
                t.copy_(old)  # warm-up and capture stepped the rows: put them back
            self._graph[sampled] = g
        g.replay()

    # ------------------------------------------------------------------------------------------
    # The host loop

    def _prefill(self, slots: list[int], prompts: list[list[int]], limits: list[int], sampled: bool) -> None:  # fmt: skip
        """Prompts into free rows: their keys/values into the cache and their first new token."""
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device, non_blocking=True)
        s = torch.tensor(slots, device=self.device)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        h, _ = self._forward(ids, slots=s)
        last = h[torch.arange(len(prompts), device=self.device), lens - 1]
        first = self._pick(F.linear(last, self.lm_head), sampled)
        lim = torch.tensor(limits, device=self.device)
        self.tok[s], self.pos[s], self.limit[s] = first, lens, lim
        self.out[s, 0] = first
        self.count[s] = 1
        self.done[s] = self._is_eos(first) | (lim <= 1)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        on_done: Callable[[int, list[int]], None] | None = None,
    ) -> tuple[list[list[int]], DecodeStats]:
        """New tokens of each prompt (ending with EOS unless `max_new_tokens` or the row's
        capacity ran out), in prompt order. `on_done(i, tokens)` is called as each finishes."""
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if not 0 < len(p) < self.capacity:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens, the decoder holds 1..{self.capacity - 1}; "
                    "shorten it (data.max_prompt_chars) or build the decoder with more capacity"
                )
        sampled = temperature > 0
        self.temperature.fill_(max(temperature, 1e-6))
        if sampled and self.device.type != "cuda":
            self._gen = torch.Generator(device=self.device).manual_seed(seed)
        elif sampled:
            torch.cuda.manual_seed(seed)
        queue = deque(range(len(prompts)))
        result: list[list[int]] = [[] for _ in prompts]
        held: dict[int, int] = {}  # row -> prompt index
        free = list(range(self.rows))
        self.done.fill_(True)
        steps = prefills = tokens = 0
        refill_at = max(1, self.rows // 8)  # refill in groups: a prefill per freed row is slow
        while queue or held:
            if queue and (len(free) >= min(refill_at, len(queue)) or not held):
                take = []
                while queue and free:
                    take.append((free.pop(), queue.popleft()))
                for group in self._groups(take, prompts):
                    rows, idx = [r for r, _ in group], [i for _, i in group]
                    ps = [list(prompts[i]) for i in idx]
                    lims = [min(max_new_tokens, self.capacity - len(p)) for p in ps]
                    self._prefill(rows, ps, lims, sampled)
                    held.update(zip(rows, idx, strict=True))
                    prefills += 1
            for _ in range(self.sync_every):
                self._replay(sampled)
            steps += self.sync_every
            done = self.done.cpu()
            finished = [r for r in held if bool(done[r])]
            if not finished:
                continue
            rows_t = torch.tensor(finished, device=self.device)
            counts = self.count[rows_t].cpu().tolist()
            outs = self.out[rows_t, : max(counts)].cpu().tolist()
            for r, n, o in zip(finished, counts, outs, strict=True):
                i = held.pop(r)
                result[i] = o[:n]
                tokens += n
                free.append(r)
                if on_done is not None:
                    on_done(i, result[i])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result, DecodeStats(tokens, steps, prefills, time.perf_counter() - t0)

    def _groups(self, take: list[tuple[int, int]], prompts: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:  # fmt: skip
        """Split a refill into prefill calls of at most `prefill_tokens` padded tokens, similar
        lengths together (less padding)."""
        take = sorted(take, key=lambda t: len(prompts[t[1]]))
        groups: list[list[tuple[int, int]]] = [[]]
        for t in take:  # ascending: the newest member is the group's widest
            if groups[-1] and len(prompts[t[1]]) * (len(groups[-1]) + 1) > self.prefill_tokens:
                groups.append([])
            groups[-1].append(t)
        return [g for g in groups if g]

    @torch.inference_mode()
    def capture(
        self, sequences: Sequence[Sequence[int]], aux_layers: Sequence[int], max_tokens: int = 65536
    ) -> list[tuple[Tensor, Tensor]]:
        """Per sequence: (aux [T, len(aux_layers)·hidden], final [T, hidden]) on the device, from
        batched right-padded forwards (each row sees only its own tokens: causal attention, the
        padding comes after). `aux_layers`: decoder layer indices (SGLang id k = layer k's output)."""
        longest = max((len(s) for s in sequences), default=0)
        if longest > self.capacity:  # the rotary tables end there (a GPU build once hit this)
            raise ValueError(
                f"capture: a sequence of {longest} tokens, the decoder holds {self.capacity}; "
                "build it with capacity >= the longest sequence"
            )
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out: list[tuple[Tensor, Tensor]] = [None] * len(sequences)  # type: ignore[list-item]
        at = 0
        while at < len(order):
            group = [order[at]]
            while at + len(group) < len(order):
                nxt = order[at + len(group)]
                if len(sequences[nxt]) * (len(group) + 1) > max_tokens:
                    break
                group.append(nxt)
            at += len(group)
            T = max(len(sequences[i]) for i in group)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            for r, i in enumerate(group):
                ids[r, : len(sequences[i])] = torch.tensor(list(sequences[i]))
            final, kept = self._forward(ids.to(self.device), aux=set(aux_layers))
            by_layer = dict(zip(sorted(set(aux_layers)), kept, strict=True))
            aux = torch.cat([by_layer[k] for k in aux_layers], dim=-1)
            for r, i in enumerate(group):
                n = len(sequences[i])
                out[i] = (aux[r, :n], final[r, :n])
        return out
