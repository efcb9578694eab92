"""The static drafter: EAGLE-3 drafting at static shapes, so that on a GPU a cycle's drafting is
two CUDA graph replays (the cache extension, then the whole multi-step propose) instead of about
ten eager launches of a one-layer model and a host sync per step.

Why (issue 42): on an H200 the target's decode step is one graph of about 1.0 ms, while the eager
drafter costs about 0.9 ms a forward plus `int(positions.max())` syncs, so an EAGLE-3 tree ran at
0.24x plain decoding. SGLang captures the whole draft as one graph per batch size over static
buffers (`eagle_draft_cuda_graph_runner.py`); this is the same idea at the engine's scale.

What makes it static, against `drafting.EagleDraft` (the plain reference it must equal):
- the drafter KV cache is allocated once for `capacity` slots (+1 spare slot that padding entries
  are written to) and kept across requests; a query at position p attends to the slots <= p of a
  power-of-two span of slots (>= `min_bucket`) under a mask, instead of slicing `[:top]`;
- the state (last pre-norm output `h`, position `pos`) lives in device buffers that the
  extension writes in place, so a replay leaves the next one's input where it reads it;
- the host knows the highest position from the engine's own host-side positions, so capacity and
  span are checked once per call on the host, and no step reads a device value back.

A cycle extension of width w, a chain of `steps` and a tree of (steps, topk, nodes) are each one
graph per (batch, shape, span), captured on first use (or ahead, through `capture`) and replayed.
The prompt's extension runs eagerly (its width is the prompt's length), as the target's prefill
does. Sampling (temperature > 0) runs the same chain code eagerly: its draws come from the
engine's CPU generator. Without CUDA, or with graphs=False, the same functions run eagerly: that
is what the CPU tests pin against `EagleDraft` (tests/test_engine_static_draft.py). The graph
capture itself (`_graphed`) only runs on CUDA and is verified by the `gpu` test there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.cuda_graph import capture_graph
from eagle3.model import Eagle3Drafter, rope_cos_sin
from serve.engine.buckets import (
    compile_static,
    dynamic_dims,
    moved_rows,
    row_bucket,
    span_arg,
    span_buckets,
)
from serve.engine.drafting import (
    DraftTree,
    _last_true,
    pick_draft,
    target_q,
    tree_ancestors_by_depth,
)
from serve.engine.law import Draws

Pick = Callable[[Tensor], tuple[Tensor, Tensor | None]]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static device copies of the call's inputs
    outputs: Any  # what the captured function returned (static; copied out after a replay)


def _greedy(logits: Tensor) -> tuple[Tensor, Tensor | None]:
    return logits.argmax(-1), None


def serving_drafter_compile(backend: str | None, device: str) -> str | None:
    """The torch.compile backend the serving engine gives its static drafter on `device`
    (serve.drafter_compile): on CUDA the configured one; on CPUs none, where the drafter runs
    without graphs, inductor's C++ build takes minutes and the step's cost is its matmuls."""
    return backend if str(device).startswith("cuda") else None


class StaticEagleDraft:
    """A `DraftSource` over an `Eagle3Drafter` at static shapes (module doc); same methods and
    results as `EagleDraft`. `positions`/`write` given to `extend` must be host tensors (the
    engine's bookkeeping): reading their maximum is then no device sync."""

    def __init__(
        self,
        model: Eagle3Drafter,
        capacity: int,
        graphs: bool | None = None,
        source: str = "",
        min_bucket: int = 256,
        compile_backend: str | None = None,
    ):
        self.model = model.eval()
        self.cfg = model.cfg
        self.source = source
        self.aux_layer_ids = list(model.cfg.aux_layer_ids)
        self.capacity = int(capacity)
        self.min_bucket = int(min_bucket)
        self.use_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        # torch.compile of each graphed function (its extension, chain or tree at one span): the
        # step's norms, rotary, attention mask and its glue fuse into fewer kernels, and a
        # captured step's cost is its launches (0.2-0.29 ms a step on an H100, 2026-12-07).
        # "inductor" on a GPU (the server's default, serve.drafter_compile); None = eager.
        self.compile_backend = compile_backend
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("StaticEagleDraft(graphs=True) needs the drafter on a CUDA device")
        self.batch = 0  # rows of the buffers: a power of two
        self.rows = 0  # the batch's rows in them (the first ones)
        self.k: Tensor | None = None  # [B, Hkv, capacity + 1, d]; the last slot takes padding
        self.v: Tensor | None = None
        self.h: Tensor | None = None  # [B, H] each row's last pre-norm output
        self.pos: Tensor | None = None  # [B] its position (device)
        self.top = -1  # host: the highest position any row's state holds
        self._prompt = True  # the next extend is a prompt's (eager; any width)
        self._graphs: dict[tuple, _Graph] = {}  # the current bucket's (they read its buffers)
        # each bucket's buffers and graphs, made once: a batch that moves between buckets (one
        # that grows as requests join, or the next batch) replays what it captured there
        self._buckets: dict[int, tuple[Tensor, Tensor, Tensor, Tensor, dict[tuple, _Graph]]] = {}
        self._compiled_fns: dict[tuple, Callable[..., Any]] = {}
        self.captures = 0  # graphs captured so far, recaptures included (SpecEngine.late_captures)
        self._pool: Any = None

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def adopt(self, model: Eagle3Drafter, source: str = "") -> bool:
        """Take `model`'s weights into this drafter's own tensors, in place, where it is the
        same architecture (config, every parameter and buffer of equal name, shape, dtype and
        device); False, changing nothing, where it is not. In place keeps the captured CUDA
        graphs valid (they read these tensors' memory), so a swap between rounds' drafters skips
        the recapture that took 27.8 s on an H100 (the climb's server, 2026-12-06). Between
        requests only, as a swap is."""
        if model.cfg != self.cfg:
            return False
        mine = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        new = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        same = mine.keys() == new.keys() and all(
            (a.shape, a.dtype, a.device) == (new[n].shape, new[n].dtype, new[n].device)
            for n, a in mine.items()
        )
        if not same:
            return False
        with torch.no_grad():
            for n, a in mine.items():
                a.copy_(new[n])
        self.source = source
        return True

    # -- state ------------------------------------------------------------------------------
    def start(self, batch: int, capacity: int) -> None:
        """Fresh state for `batch` rows, in buffers of the next power of two rows (`self.batch`;
        the rows past `self.rows` are padding, free rows whose results are dropped). The buffers
        (and the graphs over them) are made once per bucket and reused: stale slots are never
        read, a query only sees slots <= its position, and every one of those was written for the
        current request first."""
        if capacity > self.capacity:
            raise ValueError(
                f"drafter needs {capacity} positions > static drafter capacity {self.capacity}; "
                "build SpecEngine(static_capacity=...) larger"
            )
        bucket = row_bucket(batch)
        if bucket != self.batch or self.k is None:
            if bucket not in self._buckets:
                w, cfg = self.model.fc.weight, self.cfg
                shape = (bucket, cfg.num_key_value_heads, self.capacity + 1, cfg.head_dim)
                k = torch.zeros(shape, device=w.device, dtype=w.dtype)
                pos = torch.zeros(bucket, dtype=torch.long, device=w.device)
                self._buckets[bucket] = (k, torch.zeros_like(k), w.new_zeros(bucket, cfg.hidden_size), pos, {})  # fmt: skip
                # rows dynamic: one compiled code for every bucket of several rows (`_compiled`)
                dynamic_dims(bucket, *((t, 0) for t in self._buckets[bucket][:4]))
            self.k, self.v, self.h, self.pos, self._graphs = self._buckets[bucket]
            self.batch = bucket
        self.rows = batch
        self.top, self._prompt = -1, True

    def join(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        """Requests joining the running batch between cycles: their prompts' extension (as
        `extend`'s first, eager) into the rows after the batch's own, whose state stays. A batch
        that outgrows its buffers moves to the next bucket's (and its graphs)."""
        assert self.k is not None and self.v is not None and self.h is not None
        assert self.pos is not None
        first, n, held = self.rows, ids.shape[0], self.top
        if row_bucket(first + n) > self.batch:  # the bigger bucket's buffers and graphs
            old = (self.k, self.v, self.h, self.pos)
            self.start(first + n, self.capacity)
            for dst, src in zip((self.k, self.v, self.h, self.pos), old, strict=True):
                dst[:first] = src[:first]
        top = int(torch.where(write, positions, -1).max())
        self._check(top, "join")
        self.rows, self.top, self._prompt = first + n, max(held, top), False
        dev, dtype = self.device, self.model.fc.weight.dtype
        args = (ids.to(dev), aux.to(dev, dtype), positions.to(dev), write.to(dev))
        self._extend_core(*args, self._span(top + 1), first)

    def select(self, rows: Tensor) -> None:
        """Keep `rows`, moved to the first rows of the same buffers: the graphs stay (the rows
        after them are padding now), so a batch that shrinks as its requests finish captures
        nothing new."""
        assert self.k is not None and self.v is not None and self.h is not None
        assert self.pos is not None
        if (move := moved_rows(rows)) is not None:
            dst, src = (t.to(self.device) for t in move)
            for buf in (self.k, self.v, self.h, self.pos):
                buf[dst] = buf[src]
        self.rows = int(rows.numel())

    def _padded(self, t: Tensor, fill: int | float | bool = 0) -> Tensor:
        """`t` [rows, ...] with padding rows up to the buffers' (their writes go to the spare
        slot or to free rows)."""
        if t.shape[0] == self.batch:
            return t
        pad = t.new_full((self.batch - t.shape[0], *t.shape[1:]), fill)
        return torch.cat([t, pad])

    def _span(self, need: int) -> int:
        """Slots attention reads: the smallest of `span_buckets` >= need."""
        return next(s for s in span_buckets(self.min_bucket, self.capacity) if s >= need)

    def _check(self, top: int, what: str) -> None:
        if top >= self.capacity:
            raise ValueError(
                f"static drafter cache full: {what} reaches position {top} >= capacity "
                f"{self.capacity}; build SpecEngine(static_capacity=...) larger"
            )

    # -- the pure step functions (no host reads; shapes fixed by the arguments' shapes) -----
    def _forward(
        self,
        ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        write: Tensor | None,
        span: int,
        first: int = 0,
    ) -> Tensor:
        """One drafter layer over n entries per row ([B, n]) of rows first..first+B-1; writes
        their keys/values at their positions (entries not in `write`: the spare slot) and
        attends over slots [0, span) with the mask 'slot <= position'. Returns the pre-norm
        outputs [B, n, H]."""
        m = self.model
        assert self.k is not None and self.v is not None
        hidden = m.project(hidden)
        x = m.midlayer.attn_input(m.embed(ids), hidden)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, positions)
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)  # [B, Hq or Hkv, n, d]
        slots = positions if write is None else torch.where(write, positions, self.capacity)
        b = torch.arange(first, first + ids.shape[0], device=ids.device)[:, None].expand_as(slots)
        self.k[b, :, slots] = k.transpose(1, 2).to(self.k.dtype)
        self.v[b, :, slots] = v.transpose(1, 2).to(self.v.dtype)
        B, H, n, d = q.shape
        rep = H // self.k.shape[1]
        keys = self.k[first : first + B, :, :span].repeat_interleave(rep, 1).to(q.dtype)
        vals = self.v[first : first + B, :, :span].repeat_interleave(rep, 1).to(q.dtype)
        visible = torch.arange(span, device=q.device)[None, None, :] <= positions[:, :, None]
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible[:, None])
        return m.midlayer.finish(hidden, attn.transpose(1, 2).reshape(B, n, H * d))

    def _extend_core(
        self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor, span: int, first: int = 0
    ) -> None:
        out = self._forward(ids, aux, positions, write, span, first)
        assert self.h is not None and self.pos is not None
        b = torch.arange(ids.shape[0], device=ids.device)
        last = _last_true(write)
        rows = slice(first, first + len(b))  # in place: the captured propose reads these buffers
        self.h[rows].copy_(out[b, last])
        self.pos[rows].copy_(positions[b, last])

    def _chain_core(
        self, steps: int, span: int, pick: Pick, rows: int | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """`steps` chain drafts from the state of the first `rows` rows (None: every row of the
        buffers): (target ids [B, steps], the draft distributions when `pick` samples). Draft
        j's entry is written at slot pos + 1 + j (as EagleDraft)."""
        m = self.model
        assert self.h is not None and self.pos is not None
        state, at = self.h[:rows], self.pos[:rows]
        h, logits = state[:, None], m.logits(state)
        drafts, qs = [], []
        for j in range(steps):
            d, q = pick(logits)
            tok = m.draft_to_target(d)
            drafts.append(tok)
            if q is not None:
                qs.append(q)
            if j + 1 < steps:
                h = self._forward(tok[:, None], h, (at + 1 + j)[:, None], None, span)
                logits = m.logits(h[:, 0])
        return torch.stack(drafts, 1), qs

    def _tree_step(
        self, tok: Tensor, h: Tensor, anc: Tensor, ek: Tensor, ev: Tensor, span: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """EagleDraft._tree_step over a fixed span of verified slots (mask 'slot <= pos')."""
        m, (B, K) = self.model, tok.shape
        assert self.k is not None and self.v is not None and self.pos is not None
        depth = ek.shape[2] // K + 1
        x = m.midlayer.attn_input(m.embed(tok), h)
        cos, sin = rope_cos_sin(m.inv_freq, m.rope_factor, (self.pos + depth)[:, None].expand(B, K))
        q, k, v = m.midlayer.self_attn.qkv(x, cos, sin)
        dev = tok.device
        prefix = torch.arange(span, device=dev)[None, :] <= self.pos[:, None]
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        mask = torch.cat([prefix[:, None, :].expand(B, K, span), anc, eye], -1)[:, None]
        keys = torch.cat([self.k[:, :, :span].to(k.dtype), ek, k], 2)
        vals = torch.cat([self.v[:, :, :span].to(v.dtype), ev, v], 2)
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return m.midlayer.finish(h, attn.transpose(1, 2).reshape(B, K, -1)), k, v

    def _tree_core(
        self, steps: int, topk: int, num_nodes: int, span: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """EagleDraft.propose_tree without host reads: (tokens, parents, depths) [B, num_nodes]
        and the verify's ancestor mask [B, num_nodes + 1, num_nodes + 1], made here so that it is
        part of the graph. The ancestor bookkeeping compares against an arange instead of
        F.one_hot (whose bounds check reads the device)."""
        m, K = self.model, topk
        assert self.h is not None and self.k is not None
        B, dev = self.h.shape[0], self.h.device
        score, d = torch.log_softmax(m.logits(self.h).float(), -1).topk(K)  # [B, K]
        toks, scores = [m.draft_to_target(d)], [score]
        parents = [torch.full((B, K), -1, device=dev)]
        depths = [torch.ones(B, K, dtype=torch.long, device=dev)]
        f_id, f_tok, f_score = torch.arange(K, device=dev).expand(B, K), toks[0], score
        f_h = self.h[:, None].expand(B, K, self.h.shape[-1])
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)
        ek = self.k.new_zeros(B, self.k.shape[1], 0, self.k.shape[-1])
        ev = ek.clone()
        n_nodes = K
        for j in range(1, steps):
            out, k, v = self._tree_step(f_tok, f_h, anc, ek, ev, span)
            c_score, c_d = torch.log_softmax(m.logits(out).float(), -1).topk(K)  # [B, K, K]
            c_score = (f_score[..., None] + c_score).reshape(B, K * K)
            toks.append(m.draft_to_target(c_d).reshape(B, K * K))
            scores.append(c_score)
            parents.append(f_id[..., None].expand(B, K, K).reshape(B, K * K))
            depths.append(torch.full((B, K * K), j + 1, device=dev))
            best = c_score.topk(K).indices  # the next frontier
            par = best // K
            e_old = ek.shape[2]
            ek, ev = torch.cat([ek, k], 2), torch.cat([ev, v], 2)
            own = torch.arange(e_old + K, device=dev) == (e_old + par)[..., None]
            old = anc.gather(1, par[..., None].expand(B, K, e_old))
            anc = torch.cat([old, torch.zeros(B, K, K, dtype=torch.bool, device=dev)], 2) | own
            f_id, f_tok = n_nodes + best, toks[-1].gather(1, best)
            f_score = c_score.gather(1, best)
            f_h = out.gather(1, par[..., None].expand(B, K, out.shape[-1]))
            n_nodes += K * K
        tok, sc, par_id, dep = (torch.cat(x, 1) for x in (toks, scores, parents, depths))
        keep = torch.sort(torch.argsort(-sc, dim=1, stable=True)[:, :num_nodes], dim=1).values
        where = torch.full((B, n_nodes + 1), -1, device=dev)  # node id -> kept index
        where.scatter_(1, keep, torch.arange(num_nodes, device=dev).expand(B, num_nodes))
        kept_par = where.gather(1, par_id.gather(1, keep) % (n_nodes + 1))
        anc = tree_ancestors_by_depth(kept_par, steps)
        return tok.gather(1, keep), kept_par, dep.gather(1, keep), anc

    # -- the DraftSource methods --------------------------------------------------------------
    def extend(self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor) -> None:
        top = int(torch.where(write, positions, -1).max())  # host tensors: no device sync
        dev, dtype = self.device, self.model.fc.weight.dtype
        self.extend_on_device(ids.to(dev), aux.to(dev, dtype), positions.to(dev), write.to(dev), top)  # fmt: skip

    def extend_on_device(
        self, ids: Tensor, aux: Tensor, positions: Tensor, write: Tensor, top: int
    ) -> None:
        """`extend` with its inputs on the device and `top`, the highest position written, from
        the caller: exact, or any bound above it (attention then reads a larger span of slots
        under the same mask 'slot <= position'), so that no device value is read."""
        assert self.k is not None, "start() first"
        self._check(top, "extend")
        self.top = top  # every row's last written entry is its new state (engine: keep[:, 0])
        span = self._span(top + 1)
        aux = aux.to(self.model.fc.weight.dtype)
        args = (self._padded(ids), self._padded(aux), self._padded(positions), self._padded(write, False))  # fmt: skip
        if self._prompt:  # the prompt: any width, once per request -> eager, like prefill
            self._prompt = False
            self._extend_core(*args, span)
            return
        self._graphed(("extend", ids.shape[1]), self._extend_core, args, span)

    def propose(
        self,
        steps: int,
        temperature: float,
        gen: Draws,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        assert self.top >= 0, "extend() first"
        self._check(self.top + steps - 1, f"a chain of {steps}")
        span = self._span(self.top + steps)  # step j reads up to slot pos + j
        if temperature > 0:  # eager: the draws come from the engine's CPU generator

            def sample(logits: Tensor) -> tuple[Tensor, Tensor | None]:
                return pick_draft(logits, temperature, gen, top_p, top_k)

            drafts, qs = self._chain_core(steps, span, sample, self.rows)
            return drafts, torch.stack([target_q(self.model, q) for q in qs], 1)
        key = ("chain", steps)
        drafts = self._graphed(key, self._drafting(key), (), span)
        return drafts[: self.rows], None

    def propose_tree(self, steps: int, topk: int, num_nodes: int) -> DraftTree:
        assert self.top >= 0, "extend() first"
        most = topk + (steps - 1) * topk * topk
        if not 1 <= num_nodes <= most:
            raise ValueError(
                f"num_draft_tokens - 1 = {num_nodes} draft nodes; steps={steps}, topk={topk} make 1..{most}"
            )
        span = self._span(self.top + 1)  # tree nodes attend to verified slots only
        key = ("tree", steps, topk, num_nodes)
        out = self._graphed(key, self._drafting(key), (), span)
        return DraftTree(*(t[: self.rows] for t in out))

    # -- CUDA graphs (GPU only; on CPU `_graphed` calls `fn` directly) -------------------------
    @torch.inference_mode()  # the buffers are made (and used) in inference mode
    def capture(self, shapes: list[tuple[int, int, int]], rows: tuple[int, ...] = (1,)) -> int:
        """Capture every graph requests of these (steps, topk, tokens per verify) shapes can
        replay, at every span and in the buckets of `rows` (batch sizes): the extensions of
        1..steps+1 slots and each greedy chain or tree; returns how many were new. Between
        requests only (the state is reset). GPU only; without graphs it does nothing. Verified
        by the `gpu` test tests/test_engine_static_draft.py::test_capture_at_start_up_covers_the_requests."""
        if not self.use_graphs or not shapes:
            return 0
        before, dev = self.captures, self.device
        dtype, width = self.model.fc.weight.dtype, self.model.fc.in_features
        widest = max(steps for steps, _, _ in shapes) + 1
        for b in sorted({row_bucket(r) for r in rows}):
            self.start(b, self.capacity)
            for span in span_buckets(self.min_bucket, self.capacity):
                for w in range(1, widest + 1):
                    args = (torch.zeros(b, w, dtype=torch.long, device=dev),
                            torch.zeros(b, w, width, dtype=dtype, device=dev),
                            torch.arange(w, device=dev)[None].expand(b, w).contiguous(),
                            torch.ones(b, w, dtype=torch.bool, device=dev))  # fmt: skip
                    self._graphed(("extend", w), self._extend_core, args, span)
                for steps, topk, tokens in shapes:
                    key = ("chain", steps) if topk == 1 else ("tree", steps, topk, tokens - 1)
                    self._graphed(key, self._drafting(key), (), span)
        self.start(1, self.capacity)  # what the warm-ups left in the state is no request's
        return self.captures - before

    def _drafting(self, key: tuple) -> Callable[[int], Any]:
        """The greedy chain's or tree's function of `key` (its span the argument), its shape in
        closure cells: torch.compile guards those, while torch 2.11 does not guard a function's
        constant defaults (`skip_guards_on_constant_func_defaults`), so functions told apart by
        a default argument shared the first one's compiled code (an H100's trees of 6, 8 and 12
        tokens all drafted the first captured tree's 6)."""
        if key[0] == "chain":
            steps = key[1]
            return lambda s: self._chain_core(steps, s, _greedy)[0]
        steps, topk, nodes = key[1:]
        return lambda s: self._tree_core(steps, topk, nodes, s)

    def _graphed(
        self, key: tuple, fn: Callable[..., Any], args: tuple[Tensor, ...], span: int
    ) -> Any:
        """fn(*args, span), on CUDA through one graph per (key, span): captured on first use
        over static copies of `args` (after two warm-up runs on a side stream; every function
        here is idempotent for the same state, so the warm-ups change nothing the replay does
        not), then the arguments are copied in and the graph replayed. Outputs are copied out:
        the graphs share one memory pool. Only runs on a GPU (tests/test_engine_static_draft.py's
        `gpu` test)."""
        if not self.use_graphs:
            return self._compiled(key, fn)(*self._rows_dynamic(args), span)
        g = self._graphs.get((*key, span))
        if g is None:  # compiled (when it is) only here: a replay needs no lookup
            g = self._capture(self._compiled(key, fn), args, span)
            self._graphs[(*key, span)] = g
            self.captures += 1
        for dst, src in zip(g.inputs, args, strict=True):
            dst.copy_(src, non_blocking=True)
        g.graph.replay()
        if g.outputs is None:
            return None
        if isinstance(g.outputs, tuple):
            return tuple(t.clone() for t in g.outputs)
        return g.outputs.clone()

    def _compiled(self, key: tuple, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(*args, span)` compiled (`compile_static`) once per key for one row and once for
        several (a batch's buffers and arguments mark their rows dynamic), and once for every
        span (`span_arg`: the span reaches the code as a dynamic size), so start-up compiles a
        code per shape, not one per (shape, rows bucket, span). `fn` itself without
        `compile_backend`. It reads the buffers of the bucket in use."""
        if self.compile_backend is None:
            return fn
        full = (self.batch > 1, *key)
        if full not in self._compiled_fns:
            code = compile_static(lambda *a: fn(*a[:-1], a[-1].shape[0]), self.compile_backend)
            dev = self.device
            self._compiled_fns[full] = lambda *a: code(*a[:-1], span_arg(a[-1], dev))
        return self._compiled_fns[full]

    def _rows_dynamic(self, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """`args` with their rows marked dynamic in a batch of several rows, as the buffers'
        (`start`), so that one compiled code serves every bucket (`_compiled`)."""
        dynamic_dims(self.batch, *((t, 0) for t in args))
        return args

    def _capture(self, fn: Callable[..., Any], args: tuple[Tensor, ...], span: int) -> _Graph:
        inputs = self._rows_dynamic(tuple(a.clone() for a in args))  # a clone drops the marks
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, outputs = capture_graph(lambda: fn(*inputs, span), self._pool)
        return _Graph(graph, inputs, outputs)

    def graph_keys(self) -> list[tuple]:
        """The captured shapes (for tests and the benchmark)."""
        return sorted(self._graphs, key=str)
