"""Embedded speculative-decoding engine: an HF causal LM target and an EAGLE-3 drafter in one process.

One cycle (chain drafting, `steps` = k, topk 1), for every row of the batch at once:
  1. the drafter proposes d_1..d_k from its last verified slot (k drafter forwards per cycle: the
     extend of the previous cycle plus k-1 single-token steps);
  2. the target scores [x_n, d_1..d_k] in ONE forward over its KV cache; greedy keeps the longest
     prefix of drafts equal to the target's argmax, sampling uses speculative rejection sampling
     (a tree: `tree_sample_accept`); both add one bonus token from the target, so a cycle emits
     a+1 tokens;
  3. the target cache keeps the a+1 accepted entries per row (rejected ones are masked or cropped)
     and the drafter extends its cache with the target's aux states of exactly those entries.
Temperature 0 reproduces the target's own greedy decoding token for token; temperature > 0
preserves the target's sampling distribution.

Rows of different lengths are left-padded; each row carries its own positions. Rows accept
different counts per cycle, so the target cache may hold rejected entries of some rows: a 4-D
attention mask hides them, the common tail is cropped, and the cache is compacted when holes pile
up. `plain_generate` runs the same target path without speculation (the benchmark baseline).

On the static runner with the static drafter (the GPU path), a greedy batch keeps the cycle's
glue on the device (serve/engine/device.py: acceptance, the cache update and the drafter's next input
are tensor ops between the graphs, one host read a cycle; plain decoding reads once per 8 steps,
`device_plain`). The host-side cycle is the reference (`device_glue=False`) and runs sampling
and the eager runner.

Accounting follows SGLang: accept_len = completion_tokens / verify passes (the first token comes
from prefill, the bonus token of each cycle is counted).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from serve.engine.acceptance import (
    greedy_accept,
    rejection_accept,
    tree_greedy_accept,
    tree_sample_accept,
)
from serve.engine.device import CycleGlue, device_cycles, device_plain, drop_finished, extension
from serve.engine.drafting import (
    DraftSource,
    DraftTree,
    EagleDraft,
    tree_ancestors,
    tree_problem,
)
from serve.engine.eager import TargetRunner
from serve.engine.joining import Joins, admit
from serve.engine.law import Draws
from serve.engine.linear import use_small_rows_linear
from serve.engine.requests import (
    DoneCallback,
    Generation,
    GenParams,
    Rows,
    TokenCallback,
    host_sample,
)
from serve.engine.runner import Runner
from serve.engine.static import StaticTargetRunner, static_runner_problem
from serve.engine.static_draft import StaticEagleDraft
from serve.engine.timing import ms_since

# ----------------------------------------------------------------------------------------------
# The engine


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
        static_batch: int = 1,
        static_draft: bool | None = None,
        capture_chains: tuple[int, ...] = (1, 2, 3, 4, 5),
        capture_trees: tuple[tuple[int, int, int], ...] = (),
        device_glue: bool = True,
        drafter_dtype: str = "serving",
        drafter_compile: str | None = None,
        target_compile_mode: str | None = None,
        target_fused_matmuls: bool = False,
    ):
        """`runner`: "auto" = the static-cache, CUDA-graph runner when the target is on a GPU
        and Llama-like, else the eager batched `TargetRunner`; "eager" or "static" force one
        (static on CPU runs the same code without graphs). `static_capacity`: KV slots of the
        static runner (prompt + max_tokens + steps + 2 must fit) and of the static drafter;
        `static_batch`: its rows (more requests run in groups of as many). `static_draft`: an
        `EagleDraft` given to `set_drafter` runs as a `StaticEagleDraft` (static shapes; CUDA
        graphs on a GPU); None = wherever the static runner runs, False = never (the eager
        reference), True = also with the eager runner.
        `capture_chains`, `capture_trees`: with CUDA graphs, `set_drafter` captures the graphs of
        the configured shape, these chains (bench.shape_chains' default) and these (steps, topk,
        tokens per verify) trees up front (`capture`), at one row.
        `device_glue`: greedy requests on the static runner and drafter run `device_cycles`
        (the cycle's glue on the device, one host read a cycle); False = the host-side cycles,
        the reference. `drafter_dtype`: "serving" = on a GPU a static drafter runs in the
        target's dtype (its rotary frequencies stay fp32); "float32" = as loaded.
        `drafter_compile`: a torch.compile backend ("inductor") for the static drafter's graphed
        functions (StaticEagleDraft.compile_backend); None = eager. `target_compile_mode`: the
        static runner's torch.compile mode (StaticTargetRunner's `compile_mode`);
        `target_fused_matmuls`: its `fused_matmuls` (the few-rows matmul kernel; opt-in)."""
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
        self.static = StaticTargetRunner(target, static_capacity, max_batch=static_batch, compile_mode=target_compile_mode, fused_matmuls=target_fused_matmuls) if use_static else None  # fmt: skip
        self.static_draft = use_static if static_draft is None else static_draft
        self.static_capacity = static_capacity
        self.capture_chains, self.capture_trees = tuple(capture_chains), tuple(capture_trees)
        if bad := [f"{t}: {p}" for t in self.capture_trees if (p := tree_problem(*t))]:
            raise ValueError(f"capture_trees (steps, topk, tokens per verify) {'; '.join(bad)}")
        self.device_glue = device_glue
        if drafter_dtype not in ("serving", "float32"):
            raise ValueError(f"drafter_dtype={drafter_dtype!r}: use serving or float32")
        self.drafter_dtype, self.drafter_compile = drafter_dtype, drafter_compile
        self.glue = CycleGlue(drafter_compile)  # the device cycle's acceptance, compiled with it
        self._runner: Runner = self.static or self.target
        self.drafter: DraftSource | None = None
        self._captures_at_start = 0  # graph_captures() when `capture` last finished
        self.steps = steps
        self.stop_ids = set(stop_ids) if stop_ids is not None else eos_ids(target)
        if drafter is not None:
            self.set_drafter(drafter)

    def set_drafter(self, drafter: DraftSource | None) -> None:
        if self.static_draft and isinstance(drafter, EagleDraft):
            if self.drafter_dtype == "serving" and self.device.type == "cuda":
                _to_dtype(drafter.model, self.target.model.get_input_embeddings().weight.dtype)
            current = self.drafter
            if isinstance(current, StaticEagleDraft) and current.adopt(
                drafter.model, drafter.source
            ):
                drafter = current  # the same architecture: its graphs replay the new weights
            else:
                drafter = StaticEagleDraft(drafter.model, self.static_capacity, source=drafter.source,
                                           compile_backend=self.drafter_compile)  # fmt: skip
        if drafter is not None:
            self.target.set_aux_layers(drafter.aux_layer_ids)
            if self.static is not None:
                self.static.set_aux_layers(drafter.aux_layer_ids)
            model = getattr(drafter, "model", None)
            if self._cpu_fast and isinstance(model, torch.nn.Module):
                if next(model.parameters()).dtype == torch.float32:  # the drafter stays fp32
                    use_small_rows_linear(model)
        self.drafter = drafter
        self.capture()

    def capture_shapes(self) -> list[tuple[int, int, int]]:
        """(steps, topk, tokens per verify) of the configured shape and `capture_chains`/`_trees`."""
        chains = {(c, 1, c + 1) for c in self.capture_chains}
        return sorted(chains | set(self.capture_trees) | {self.configured_shape()})

    def configured_shape(self) -> tuple[int, int, int]:
        k, topk = self.steps, self.topk
        return k, topk, (self.num_draft_tokens or k + 1) if topk > 1 else k + 1

    @torch.inference_mode()  # the buffers are made (and used) in inference mode
    def capture(self) -> dict[str, int]:
        """Capture now every CUDA graph the default shapes replay (`capture_shapes`, and plain
        decoding): the target's verify of each width and the static drafter's extensions,
        chains and trees, at every attention span, in every row bucket of the static runner's
        batch (`static_batch`; 1, 2, 4, ...). Called by `set_drafter` (start-up and each
        swap: the drafter's graphs are its own), so no request, and no shape probe of the
        benchmark, pays a capture inside its timing. Returns the new graphs per part; empty
        without graphs (CPU). GPU only: verified by tests/test_engine_static_draft.py's `gpu`
        test test_capture_at_start_up_covers_the_requests."""
        shapes = self.capture_shapes() if self.drafter is not None else []
        out: dict[str, int] = {}
        # One row: every shape (the benchmark's shape probe runs them one request at a time).
        # The other batch sizes the runner holds: plain and the configured shape (each row
        # bucket's graphs, so a batch that shrinks as requests end or grows as they join
        # replays them; a graph and a compile per bucket, width and span).
        plan = [((1,), shapes)]
        if self.static is not None and self.static.max_batch > 1:
            more = tuple(range(2, self.static.max_batch + 1))
            plan.append((more, [self.configured_shape()] if shapes else []))
        for rows, these in plan:
            if self.static is not None and self.static.use_graphs:
                widths = [(1, False)] + [(w, True) for w in sorted({n for _, _, n in these})]
                out["target"] = out.get("target", 0) + self.static.capture(widths, rows)
            if isinstance(self.drafter, StaticEagleDraft) and self.drafter.use_graphs:
                out["drafter"] = out.get("drafter", 0) + self.drafter.capture(these, rows)
                self._warm_glue(these, rows)
        self._captures_at_start = self.graph_captures()
        return out

    def _warm_glue(self, shapes: list[tuple[int, int, int]], rows: tuple[int, ...]) -> None:
        """A request of each shape, one row and (where the batch holds more) two, so that the
        device cycle's compiled acceptance (`CycleGlue`) compiles here, not in a request."""
        if self.glue.backend is None or self.static is None:
            return
        for (k, topk, n), b in itertools.product(shapes, sorted({min(r, 2) for r in rows})):
            params = GenParams(max_tokens=2, ignore_eos=True, steps=k, topk=topk, num_draft_tokens=n)  # fmt: skip
            self.generate([[0, 1]] * b, params)

    def graph_captures(self) -> int:
        """CUDA graphs the target runner and the drafter have captured so far."""
        n = self.static.captures if self.static is not None else 0
        return n + (self.drafter.captures if isinstance(self.drafter, StaticEagleDraft) else 0)

    def late_captures(self) -> int:
        """Graphs captured since start-up (`capture`): each one is a capture (and compile)
        inside some request's time, so the benchmark prints this and expects 0."""
        return self.graph_captures() - self._captures_at_start

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: GenParams,
        on_tokens: TokenCallback | None = None,
        speculative: bool = True,
        max_tokens_each: list[int] | None = None,
        joins: Joins | None = None,
        on_done: DoneCallback | None = None,
    ) -> list[Generation]:
        """Speculative decoding of a batch (plain decoding without a drafter or when not
        `speculative`). `max_tokens_each` overrides `params.max_tokens` per prompt; `on_tokens` is
        called after every cycle with each request's new tokens; when it returns True that
        request ends there (finish_reason "cancelled") and its row and cache leave the batch.
        `joins` (serve/engine/joining.py): asked between cycles for requests that join the
        running batch (on the static runner: `takes_joins`); their results follow the prompts'
        in the order they joined. `on_done(request, generation)` as each request leaves the
        batch, so its caller can answer it before the batch ends."""
        if not speculative or self.drafter is None:
            return self.plain_generate(prompts, params, on_tokens, max_tokens_each, joins, on_done)
        if self.static is not None and len(prompts) > self.static.max_batch:
            return self._in_groups(
                lambda p, cb, lim, done: self.generate(p, params, cb, True, lim, None, done),
                prompts,
                on_tokens,
                max_tokens_each,
                on_done,
            )
        drafter, runner = self.drafter, self._runner
        k = params.steps or self.steps
        topk = params.topk or self.topk
        tree = topk > 1
        n_tokens = params.num_draft_tokens or self.num_draft_tokens or k + 1
        if tree and (problem := tree_problem(k, topk, n_tokens)):
            raise ValueError(problem)
        rows = Rows(prompts, params, self.stop_ids, on_tokens, max_tokens_each, on_done)
        # the drafter's chain writes up to k slots past the last verified one, even for a tree
        self._check_fits(prompts, rows.limits, max(n_tokens, k + 1) if tree else k + 1)
        for s in rows.stats:
            s.steps, s.accept_hist = k, [0] * (k + 1)

        t = time.perf_counter()
        logits, aux, ids, valid = runner.prefill(prompts, aux=True)
        x_next = host_sample(logits, params, rows.draws())
        rows.charge("prefill_ms", ms_since(t))
        t = time.perf_counter()
        drafter.start(len(prompts), max(map(len, prompts)) + max(rows.limits) + k + 2)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        drafter.extend(torch.cat([ids[:, 1:], x_next[:, None]], 1), aux, positions, valid)
        rows.charge("prefill_ms", ms_since(t))  # the drafter's prompt extend is prefill work
        pos_next = valid.sum(1)  # position of x_next, not yet in the target cache
        done = [rows.append(r, [int(x_next[r])]) for r in range(len(prompts))]
        x_next, pos_next = drop_finished(done, rows, runner, drafter, x_next, pos_next)
        if rows.active and self._on_device(params):
            assert self.static is not None and isinstance(drafter, StaticEagleDraft)
            device_cycles(self.static, drafter, rows, x_next, pos_next, k, topk, n_tokens, tree, self.glue, joins)  # fmt: skip
            runner.release()
            return rows.results()

        j = torch.arange(k + 1)
        takes = joins is not None and self.takes_joins(params)
        while rows.active:
            if takes:  # between cycles: requests that arrived join the batch (sampled ones)
                assert joins is not None and self.static is not None
                x_next, pos_next, done, _ = admit(joins, rows, self.static, drafter, x_next, pos_next, k)  # fmt: skip
                x_next, pos_next = drop_finished(done, rows, runner, drafter, x_next, pos_next)
                if not rows.active:
                    break
            if tree:
                cyc = self._tree_cycle(x_next, pos_next, k, topk, n_tokens, params, rows.draws())
            else:
                cyc = self._chain_cycle(x_next, pos_next, k, params, rows.draws())
            rows.charge("draft_ms", cyc.draft_ms)
            rows.charge("verify_ms", cyc.verify_ms)
            done = []
            for r, req in enumerate(rows.active):
                st, ar = rows.stats[req], int(cyc.a[r])
                st.spec_verify_ct += 1
                st.accepted_drafts += ar
                st.accept_hist[ar] += 1
                done.append(rows.append(r, cyc.path[r, :ar].tolist() + [int(cyc.bonus[r])]))
            ext_ids, keep = extension(cyc.a, cyc.path, cyc.bonus)
            ext_pos = pos_next[:, None] + j
            x_next, pos_next = cyc.bonus, pos_next + cyc.a + 1
            keep_rows = torch.tensor([not d for d in done])
            x_next, pos_next = drop_finished(done, rows, runner, drafter, x_next, pos_next)
            if rows.active:
                t = time.perf_counter()
                # only the slots some row keeps: the drafter's extend is a forward over every
                # slot it is given, and the rejected tail (k - a of k + 1) is never written
                w = int(cyc.a[keep_rows].max()) + 1
                drafter.extend(
                    ext_ids[keep_rows, :w],
                    cyc.aux[keep_rows.to(cyc.aux.device), :w],
                    ext_pos[keep_rows, :w],
                    keep[keep_rows, :w],
                )
                rows.charge("draft_ms", ms_since(t))
        runner.release()
        return rows.results()

    def takes_joins(self, params: GenParams, speculative: bool = True) -> bool:
        """Whether a batch of these settings takes requests that join it between cycles: on the
        static runner, with the static drafter when it drafts (serve/engine/joining.py)."""
        drafts = speculative and self.drafter is not None
        return self.static is not None and (
            not drafts or isinstance(self.drafter, StaticEagleDraft)
        )

    def _on_device(self, params: GenParams) -> bool:
        """Whether a batch runs `device_cycles`: the static runner and drafter, greedy."""
        return (
            self.device_glue
            and self.static is not None
            and isinstance(self.drafter, StaticEagleDraft)
            and params.temperature <= 0
        )

    def _chain_cycle(
        self,
        x_next: Tensor,
        pos_next: Tensor,
        k: int,
        params: GenParams,
        gen: Draws,
    ) -> _Cycle:
        t = time.perf_counter()
        drafts, q = self.drafter.propose(k, params.temperature, gen, params.top_p, params.top_k)
        drafts, q = drafts.cpu(), (q.cpu() if q is not None else None)  # bookkeeping on the host
        draft_ms, t = ms_since(t), time.perf_counter()
        vpos = pos_next[:, None] + torch.arange(k + 1)
        ones = torch.ones_like(vpos, dtype=torch.bool)
        logits, aux = self._runner.forward(
            torch.cat([x_next[:, None], drafts], 1), vpos, ones, aux=True
        )
        if params.temperature <= 0:  # on the logits' device; only a and the bonus come back
            a, bonus = greedy_accept(drafts.to(logits.device), logits)
            a, bonus = a.cpu(), bonus.cpu()
        else:
            a, bonus = rejection_accept(
                drafts, q, logits.cpu(), params.temperature, gen, params.top_p, top_k=params.top_k
            )
        self._runner.commit(torch.arange(k + 1)[None] <= a[:, None])
        return _Cycle(a, drafts, bonus, aux, draft_ms, ms_since(t))

    def _tree_cycle(
        self,
        x_next: Tensor,
        pos_next: Tensor,
        k: int,
        topk: int,
        n_tokens: int,
        params: GenParams,
        gen: Draws,
    ) -> _Cycle:
        """Tree cycle: all n_tokens (root + nodes) verified in one pass under an ancestor mask;
        greedy walks the target's argmax, sampling `tree_sample_accept`; the accepted path's
        entries stay in the target cache, the rest are masked out."""
        t = time.perf_counter()
        tree = self.drafter.propose_tree(k, topk, n_tokens - 1)
        tree = DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu())
        draft_ms, t = ms_since(t), time.perf_counter()
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
        if params.temperature <= 0:
            a, path, bonus = tree_greedy_accept(tree, logits, k)
        else:
            a, path, bonus = tree_sample_accept(
                tree, logits, k, params.temperature, gen, params.top_p, top_k=params.top_k
            )
        keep = torch.zeros_like(ids, dtype=torch.bool)
        keep.scatter_(1, path, torch.arange(k)[None] < a[:, None])
        keep[:, 0] = True  # scatter of padded (index 0) entries may have cleared the root
        self._runner.commit(keep)
        nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), path], 1).to(aux.device)
        path_aux = aux.gather(1, nodes[..., None].expand(B, k + 1, aux.shape[-1]))
        return _Cycle(a, ids.gather(1, path), bonus, path_aux, draft_ms, ms_since(t))

    @torch.inference_mode()
    def plain_generate(
        self,
        prompts: list[list[int]],
        params: GenParams,
        on_tokens: TokenCallback | None = None,
        max_tokens_each: list[int] | None = None,
        joins: Joins | None = None,
        on_done: DoneCallback | None = None,
    ) -> list[Generation]:
        """The target alone, one token per forward (the no-speculation baseline); `joins` and
        `on_done` as in `generate`."""
        if self.static is not None and len(prompts) > self.static.max_batch:
            return self._in_groups(
                lambda p, cb, lim, done: self.plain_generate(p, params, cb, lim, None, done),
                prompts,
                on_tokens,
                max_tokens_each,
                on_done,
            )
        runner = self._runner
        rows = Rows(prompts, params, self.stop_ids, on_tokens, max_tokens_each, on_done)
        self._check_fits(prompts, rows.limits, 1)
        t = time.perf_counter()
        logits, _, _, valid = runner.prefill(prompts, aux=False)
        x = host_sample(logits, params, rows.draws())
        rows.charge("prefill_ms", ms_since(t))
        pos = valid.sum(1)
        done = [rows.append(r, [int(x[r])]) for r in range(len(prompts))]
        x, pos = drop_finished(done, rows, runner, None, x, pos)
        if rows.active and self.device_glue and self.static is not None and params.temperature <= 0:
            device_plain(self.static, rows, x, pos, joins)
        while rows.active:
            if joins is not None and self.takes_joins(params, False):  # sampled: between steps
                assert self.static is not None
                x, pos, done, _ = admit(joins, rows, self.static, None, x, pos)
                x, pos = drop_finished(done, rows, runner, None, x, pos)
                if not rows.active:
                    break
            t = time.perf_counter()
            ones = torch.ones(len(rows.active), 1, dtype=torch.bool)
            logits, _ = runner.forward(x[:, None], pos[:, None], ones)
            runner.commit(ones)
            x = host_sample(logits[:, -1], params, rows.draws())
            pos = pos + 1
            rows.charge("verify_ms", ms_since(t))
            done = [rows.append(r, [int(x[r])]) for r in range(len(rows.active))]
            x, pos = drop_finished(done, rows, runner, None, x, pos)
        runner.release()
        return rows.results()

    def _need(self, prompt: list[int], max_tokens: int, width: int) -> int:
        """Static cache slots a request takes: prompt + completion + one verify's spare entries."""
        return len(prompt) + max_tokens + width + 1

    def fits(self, prompt: list[int], max_tokens: int) -> bool:
        """Whether a request fits the static cache beside any shape of this engine (what a
        request that joins a running batch must, as `_check_fits` checks a batch's)."""
        if self.static is None:
            return True
        width = max(max(n, k + 1) for k, _, n in self.capture_shapes())  # a tree drafts k too
        return self._need(prompt, max_tokens, width) <= self.static.capacity

    def _check_fits(self, prompts: list[list[int]], limits: list[int], width: int) -> None:
        """The static cache must hold every request (`_need`)."""
        if self.static is None:
            return
        need = max(self._need(p, n, width) for p, n in zip(prompts, limits, strict=True))
        if need > self.static.capacity:
            raise ValueError(
                f"prompt + max_tokens + {width} verify slots = {need} > static KV cache capacity "
                f"{self.static.capacity}; build SpecEngine(static_capacity=...) larger"
            )

    def _in_groups(
        self,
        run: Callable[..., list[Generation]],
        prompts: list[list[int]],
        on_tokens: TokenCallback | None,
        max_tokens_each: list[int] | None,
        on_done: DoneCallback | None = None,
    ) -> list[Generation]:
        """The static runner holds `max_batch` rows: a batch's requests in groups of as many
        (`run(prompts, on_tokens, limits, on_done)`, the callbacks' indices the batch's)."""
        n, out = self.static.max_batch if self.static is not None else 1, []
        for a in range(0, len(prompts), n):
            cb = None if on_tokens is None else (lambda r, toks, a=a: on_tokens(a + r, toks))
            done = None if on_done is None else (lambda r, g, a=a: on_done(a + r, g))
            lim = None if max_tokens_each is None else max_tokens_each[a : a + n]
            out += run(prompts[a : a + n], cb, lim, done)
        return out


def _to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The drafter's weights in `dtype`, its rotary frequencies left fp32: in bf16 they would
    shift the angle of position p by about p / 256 radians."""
    inv_freq = getattr(model, "inv_freq", None)
    model.to(dtype)
    if isinstance(inv_freq, Tensor):
        model.inv_freq = inv_freq


def eos_ids(model: torch.nn.Module) -> set[int]:
    """Stop tokens from the model's generation config (int or list)."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
