"""The static path's greedy loops with their glue on the device (issue 50): speculative cycles
(`device_cycles`) and plain decoding (`device_plain`) of a batch on the static runner (and the
static drafter), where acceptance, the cache update and the next input are tensor ops between
the graphs and the host reads each cycle's outcome once. The host-side loops in
serve/engine/loop.py are their reference (`SpecEngine(device_glue=False)`): same tokens, drafts
and statistics (tests/test_engine_device_cycle.py, tests/test_engine_static_batch.py)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from serve.engine.acceptance import greedy_accept, tree_greedy_accept_on_device
from serve.engine.buckets import compile_static, dynamic_dims, span_arg
from serve.engine.drafting import DraftSource, DraftTree
from serve.engine.joining import Joins, admit
from serve.engine.requests import Rows
from serve.engine.runner import Runner
from serve.engine.static import StaticTargetRunner
from serve.engine.static_draft import StaticEagleDraft
from serve.engine.timing import _mark, _marks_ms, ms_since

# Plain decoding's steps between host reads (as `BatchDecoder` does): a stop token is seen at
# the next read, and the steps after it are wasted, not emitted.
PLAIN_STEPS_PER_READ = 8


def drop_finished(
    done: list[bool],
    rows: Rows,
    runner: Runner,
    drafter: DraftSource | None,
    *tensors: Tensor,
) -> tuple[Tensor, ...]:
    """Remove finished requests from the batch: target cache, drafter state and per-row tensors."""
    if not any(done):
        return tensors
    for req in [r for r, d in zip(rows.active, done, strict=True) if d]:
        rows.finish(req)
    keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long)
    rows.active = [rows.active[i] for i in keep.tolist()]
    if rows.active:
        runner.select(keep)
        if drafter is not None:
            drafter.select(keep)
    return tuple(t[keep] for t in tensors)


Outcome = tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor]


def chain_outcome(drafts: Tensor, logits: Tensor, aux: Tensor) -> Outcome:
    """A greedy chain's cycle after its verify: (a [B] accepted, bonus [B], None, the kept
    entries' aux [B, k+1, A], the drafter's extension [B, k+1] and its mask, and what the host
    reads [B, k+2]: a, the k tokens, the bonus)."""
    a, bonus = greedy_accept(drafts, logits)
    return (a, bonus, None, aux, *extension(a, drafts, bonus), _packed(a, drafts, bonus))


def tree_outcome(
    tokens: Tensor,
    parents: Tensor,
    depths: Tensor,
    ancestors: Tensor,
    x: Tensor,
    logits: Tensor,
    aux: Tensor,
    levels: Tensor,
) -> Outcome:
    """A greedy tree's cycle after its verify (`chain_outcome`'s, the third the offsets of the
    root and the accepted path [B, k+1] that the target's cache keeps, `keep_path`), within
    k = `levels.shape[0]` levels (`span_arg`: a size, so that it can be dynamic)."""
    steps = levels.shape[0]
    t = DraftTree(tokens, parents, depths, ancestors)
    a, path, bonus = tree_greedy_accept_on_device(t, logits, steps)
    nodes = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
    toks = torch.cat([x[:, None], tokens], 1).gather(1, path)
    kept = aux.gather(1, nodes[..., None].expand(*nodes.shape, aux.shape[-1]))
    return (a, bonus, nodes, kept, *extension(a, toks, bonus), _packed(a, toks, bonus))


def extension(a: Tensor, toks: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor]:
    """The drafter's extension after a cycle that accepted a [B] of the k drafted `toks`
    [B, k] and then `bonus` [B]: slot pos + i gets the token after it, the i-th accepted draft,
    then the bonus ([B, k+1]); and which of those k + 1 entries it keeps (i <= a)."""
    j = torch.arange(toks.shape[1] + 1, device=a.device)
    ext = torch.where(j[None, :-1] < a[:, None], toks, bonus[:, None])
    return torch.cat([ext, bonus[:, None]], 1), j[None] <= a[:, None]


def _packed(a: Tensor, toks: Tensor, bonus: Tensor) -> Tensor:
    """What the host reads of a cycle [B, k+2]: a, the k tokens, the bonus."""
    return torch.cat([a[:, None], toks, bonus[:, None]], 1)


class CycleGlue:
    """`chain_outcome` and `tree_outcome`, compiled by `backend` (`compile_static`: a few fused
    kernels where eager ran about 60 small ones a tree cycle, 0.15 ms of an H100's 1.8 ms) or
    eager (None). A batch's rows, a chain's length and a tree's nodes and levels are dynamic
    where they are more than one, so every chain of 2 or more drafts runs one code, every tree
    another, each for one row and for several (SpecEngine.capture runs a request of each
    shape first, so none compiles in a request)."""

    def __init__(self, backend: str | None):
        self.backend = backend
        self._chain = chain_outcome if backend is None else compile_static(chain_outcome, backend)
        self._tree = tree_outcome if backend is None else compile_static(tree_outcome, backend)

    def chain(self, drafts: Tensor, logits: Tensor, aux: Tensor) -> Outcome:
        dynamic_dims(drafts.shape[0], (drafts, 0), (logits, 0), (aux, 0))
        dynamic_dims(drafts.shape[1], (drafts, 1), (logits, 1), (aux, 1))
        return self._chain(drafts, logits, aux)

    def tree(self, t: DraftTree, x: Tensor, logits: Tensor, aux: Tensor, steps: int) -> Outcome:
        assert t.ancestors is not None  # the static drafter's tree carries its mask
        args = (t.tokens, t.parents, t.depths, t.ancestors, x, logits, aux)
        dynamic_dims(x.shape[0], *((v, 0) for v in args))
        nodes = (t.tokens, 1), (t.parents, 1), (t.depths, 1), (t.ancestors, 1, 2), (logits, 1), (aux, 1)  # fmt: skip
        dynamic_dims(t.tokens.shape[1], *nodes)
        return self._tree(*args, span_arg(steps, x.device))


def device_cycles(
    runner: StaticTargetRunner,
    drafter: StaticEagleDraft,
    rows: Rows,
    x_next: Tensor,
    pos_next: Tensor,
    k: int,
    topk: int,
    n_tokens: int,
    tree: bool,
    glue: CycleGlue,
    joins: Joins | None = None,
) -> None:
    """The cycles of a batch of greedy requests on the static runner and drafter, with the
    glue on the device (issue 50): acceptance, the cache update and the next draft's input
    are tensor ops between the graphs, and the host reads the cycle's outcome (each row's
    accepted count, the path's tokens, the bonus) once, from a pinned buffer, after the
    drafter's extension is queued behind it. The host keeps what sizes the graphs (the
    committed lengths, an upper bound of the drafter's top position) from those reads alone.
    The drafter's extension is always k + 1 wide (rejected entries masked), so its width
    needs no device value; a finished row leaves the batch after the read. Same tokens,
    drafts and statistics as the host-side cycles (the reference, `device_glue=False`):
    tests/test_engine_device_cycle.py, tests/test_engine_static_batch.py."""
    dev = runner.device
    cuda = dev.type == "cuda"
    j = torch.arange(k + 1, device=dev)
    x, pos = (
        x_next.to(dev),
        pos_next.to(dev),
    )  # [B] each: the token after the cache, its position
    tops = pos_next.tolist()  # host: each row's pos, as known after the last read
    host = torch.empty(runner.max_batch * (k + 2), dtype=torch.long, pin_memory=cuda)
    copied = torch.cuda.Event() if cuda else None
    timed: list[tuple[tuple[Any, ...], list[int]]] = []  # each cycle's marks, its requests
    while rows.active:
        if joins is not None:  # between cycles: requests that arrived join the batch
            x, pos, done, new_tops = admit(joins, rows, runner, drafter, x, pos, k)
            tops += new_tops
            if any(done):
                tops = [tops[r] for r, d in enumerate(done) if not d]
                x, pos = drop_finished(done, rows, runner, drafter, x, pos)
            if not rows.active:
                break
        B = len(rows.active)
        marks = [_mark(cuda)]  # start, drafted, verified, accepted, extended
        if tree:
            t = drafter.propose_tree(k, topk, n_tokens - 1)
            marks.append(_mark(cuda))
            ids = torch.cat([x[:, None], t.tokens], 1)
            vpos = pos[:, None] + torch.cat([torch.zeros_like(t.depths[:, :1]), t.depths], 1)
            logits, aux = runner.verify(ids, vpos, t.ancestors, aux=True)
            marks.append(_mark(cuda))
            a, bonus, nodes, aux, ext, keep, packed = glue.tree(t, x, logits, aux, k)
            assert nodes is not None
            runner.keep_path(nodes, pos)
        else:
            drafts, _ = drafter.propose(k, 0.0, None)
            marks.append(_mark(cuda))
            ids = torch.cat([x[:, None], drafts], 1)
            logits, aux = runner.verify(ids, pos[:, None] + j, None, aux=True)
            marks.append(_mark(cuda))
            a, bonus, _, aux, ext, keep, packed = glue.chain(drafts, logits, aux)
        out = host[: B * (k + 2)].view(B, k + 2)
        out.copy_(packed, non_blocking=True)
        if copied is not None:
            copied.record()  # the one host read
        marks.append(_mark(cuda))
        drafter.extend_on_device(ext, aux, pos[:, None] + j, keep, max(tops) + k)
        marks.append(_mark(cuda))
        x, pos = bonus, pos + a + 1
        if copied is not None:
            copied.synchronize()
        got = out.tolist()
        runner.advance([r[0] + 1 for r in got])
        timed.append((tuple(marks), list(rows.active)))
        done = []
        for r, (n, *rest) in enumerate(got):
            st = rows.stats[rows.active[r]]
            st.spec_verify_ct += 1
            st.accepted_drafts += n
            st.accept_hist[n] += 1
            tops[r] += n + 1
            done.append(rows.append(r, rest[:n] + [rest[k]]))
        if any(done):
            tops = [tops[r] for r, d in enumerate(done) if not d]
            x, pos = drop_finished(done, rows, runner, drafter, x, pos)
    for marks, reqs in timed:  # read once the cycles ran: no sync inside them
        ms = _marks_ms([marks], cuda)
        for req in reqs:
            st = rows.stats[req]
            st.draft_ms, st.verify_ms, st.accept_ms = (a + b for a, b in zip((st.draft_ms, st.verify_ms, st.accept_ms), ms, strict=True))  # fmt: skip


def device_plain(
    runner: StaticTargetRunner, rows: Rows, x: Tensor, pos: Tensor, joins: Joins | None = None
) -> None:
    """Greedy plain decoding of the batch on the static runner with the argmax fed back on
    the device and the host reading the tokens once per `PLAIN_STEPS_PER_READ` steps (as
    `BatchDecoder` does): never past a request's token limit, and a stop token ends its
    request at the next read (the steps after it are wasted, not emitted), where its row
    leaves the batch. Same tokens as the host loop (`device_glue=False`):
    tests/test_engine_device_cycle.py and tests/test_engine_static_batch.py."""
    dev = runner.device
    cuda = dev.type == "cuda"
    x, p = x.to(dev), pos.to(dev)  # [B] each
    host = torch.empty(PLAIN_STEPS_PER_READ * runner.max_batch, dtype=torch.long, pin_memory=cuda)  # fmt: skip
    copied = torch.cuda.Event() if cuda else None
    while rows.active:
        if joins is not None:  # between reads: requests that arrived join the batch
            x, p, done, _ = admit(joins, rows, runner, None, x, p)
            x, p = drop_finished(done, rows, runner, None, x, p)
            if not rows.active:
                break
        t, B = time.perf_counter(), len(rows.active)
        n = min(PLAIN_STEPS_PER_READ, *(rows.limits[r] - len(rows.out[r]) for r in rows.active))  # fmt: skip
        toks = []
        for _ in range(n):
            logits, _ = runner.verify(x[:, None], p[:, None], None, aux=False)
            runner.advance(1)
            x, p = logits[:, -1].argmax(-1), p + 1
            toks.append(x)
        got = host[: n * B].view(B, n)
        got.copy_(torch.stack(toks, 1), non_blocking=True)
        if copied is not None:
            copied.record()
            copied.synchronize()
        rows.charge("verify_ms", ms_since(t))
        done = [rows.append(r, toks_r) for r, toks_r in enumerate(got.tolist())]
        x, p = drop_finished(done, rows, runner, None, x, p)
