"""The generate stage: target actors regenerate responses for a round's prompts and write shards.

    python -m actors.generate --config configs/smollm2-cpu.yaml --out runs/x/data/round-000 [--round 0]

Prompt batches (``data.batch_size`` prompts each) are numbered in order; batch b writes shards
``b{b:05d}-{part:02d}.safetensors`` and then a sidecar ``b{b:05d}.json`` with their sha256 and a key
of the prompts and settings. A rerun skips every batch whose sidecar matches and whose shards are
intact, so a killed stage resumes where it stopped; ``manifest.json`` is written last.

With ``target.backend: sglang`` (or ``two_phase=True``) the round runs in two phases: every batch
is generated first (ids kept in ``b{b:05d}.gen.jsonl``), then every batch is captured, because
SGLang's serving engine and its capture runners cannot hold the weights at the same time. A rerun
skips finished batches and does not regenerate batches whose ``.gen.jsonl`` matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from actors.config import DataConfig, TargetConfig
from actors.prompt_record import conversation_chars
from actors.prompts import (
    Answered,
    Batch,
    Conversation,
    Replied,
    SelfWritten,
    prompt_key,
    self_written_batches,
)
from actors.shards import MANIFEST, bytes_per_token, finished_batch, write_manifest

if TYPE_CHECKING:
    from actors.batch_records import BatchResult
    from actors.sglang_backend import SGLangOptions

STORAGE_MARGIN = 1.1  # headroom over the estimate (headers, sidecars, temp files)


@dataclass(frozen=True)
class DataResult:
    """What the generate stage hands the driver. Throughputs are aggregate over actors and count
    only batches computed in this run (0 when everything was already on disk)."""

    manifest: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    gen_tok_per_s: float
    capture_tok_per_s: float
    seconds: float
    switch_seconds: float = 0.0  # loading / switching SGLang's engine and capture runners
    actors_ready_s: float = 0.0  # from asking Ray for the actors to their target loaded
    gen_tokens: int = 0  # generated in this run (the rates' numerators)
    capture_tokens: int = 0
    made: tuple[int, ...] = ()  # batch indices on disk for this round
    left_out: int = 0  # batches a deadline left out
    cut: int = 0  # batches whose decoding the deadline stopped (their replies so far kept)


def run_generate(
    target: TargetConfig,
    data: DataConfig,
    prompts: list[Conversation],
    out_dir: Path,
    config_hash: str,
    *,
    round_index: int = 0,
    two_phase: bool | None = None,
    sglang_options: SGLangOptions | None = None,
    answered: list[Answered] | None = None,
    replied: list[Replied] | None = None,
    deadline: float | None = None,
    only: set[int] | None = None,
    stop: threading.Event | None = None,
    threads: int | None = None,
    background: bool = False,
) -> DataResult:
    """Generate, capture and write shards for ``prompts`` into ``out_dir``, then for
    ``data.self_prompts_per_round`` conversations whose user turns the target writes (drawn fresh
    for ``round_index``); Ray must be initialised.

    ``two_phase``: generate the whole round, then capture it (None = only for the SGLang backend).
    ``sglang_options``: knobs of the SGLang backend the config does not carry (tests, tuning).
    ``answered``: batches of served requests (the traffic log): captured, not generated; they
    run first (the cheapest data, and the most telling).
    ``replied``: batches of prompts with their source's own replies: captured, not generated.
    ``deadline`` (a ``time.monotonic()`` of this process). Where the actors cut decoding (the HF
    decode loop), batches are handed out until it, and each stops decoding there with the replies
    so far written (``DataResult.cut``): the stage ends on time with no core idle. Elsewhere no
    batch starts that would end after it, by the time the batches so far took. ``DataResult.made``
    lists what was made; the rest is left out. Actors get it as a wall-clock time, taken once
    here (another host's monotonic clock counts from its own boot).
    ``only``: make just these batch indices (what a cut stage made, when it is healed).
    ``stop``: once set, the actors stop decoding at the token they have (the replies so far
    written, as at a deadline) and no batch is handed out (pipeline/round_data.py); it takes
    effect where they cut decoding at a ``deadline``.
    ``threads``: torch threads (and Ray CPUs) per actor, where the node's cores are not all this
    stage's (the default: its cores shared by ``data.num_actors``).
    ``background``: the actors take only the CPU time other processes leave
    (eagle3/cpu.py `run_in_background`): data made beside a server that is being timed."""
    start = time.perf_counter()
    two_phase = target.backend == "sglang" if two_phase is None else two_phase
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    batches: list[Batch] = list(prompt_batches(prompts, data.batch_size))
    batches += self_written_batches(
        data.self_prompts_per_round, data.batch_size, data.seed, round_index
    )
    batches += replied or []
    batches += answered or []
    keys = [batch_key(b, target, data) for b in batches]
    records: dict[int, dict[str, Any]] = {}
    for i, k in enumerate(keys):
        if (rec := finished_batch(out_dir, i, k)) is not None:
            records[i] = rec
    wanted = set(range(len(batches))) if only is None else set(only)
    todo = deque(i for i in range(len(batches)) if i not in records and i in wanted)
    records = {i: rec for i, rec in records.items() if i in wanted}
    print(
        f"[generate] {out_dir}: {len(batches)} batches, {len(records)} already done, {len(todo)} to do",
        flush=True,
    )

    done, generated, info, n_actors, switch_s, ready_s = [], [], {}, 0, 0.0, 0.0
    if todo:
        t0 = time.perf_counter()
        actors, reservations = _start_actors(
            target, data, min(data.num_actors, len(todo)), sglang_options, threads, background
        )
        n_actors = len(actors)
        try:
            done, generated, info, switch_s, ready_at = _run_batches(
                actors, batches, keys, list(todo), out_dir, data, two_phase, deadline, stop
            )
            ready_s = ready_at - t0
        finally:
            _stop_actors(actors, reservations)
    for r in done:
        records[r.batch_index] = {**info, "shards": list(r.shards)}
    cut = sum(r.cut for r in done)
    if cut:
        print(
            f"[generate] deadline: {cut} batch(es) stopped decoding, replies so far kept",
            flush=True,
        )

    first = records[min(records)] if records else {}
    manifest = write_manifest(
        out_dir,
        first.get("target", {}),
        first.get("aux_layer_ids", []),
        config_hash,
        [s for i in sorted(records) for s in records[i]["shards"]],
        online=first.get("online", False),
    )
    gen_s = sum(r.gen_seconds for r in generated) / max(1, n_actors)
    cap_s = sum(r.capture_seconds for r in done) / max(1, n_actors)
    return DataResult(
        manifest=str(out_dir / MANIFEST),
        num_samples=manifest.num_samples,
        num_tokens=manifest.num_tokens,
        num_loss_tokens=manifest.num_loss_tokens,
        gen_tok_per_s=sum(r.gen_tokens for r in generated) / gen_s if gen_s else 0.0,
        capture_tok_per_s=sum(r.capture_tokens for r in done) / cap_s if cap_s else 0.0,
        seconds=time.perf_counter() - start,
        switch_seconds=switch_s,
        actors_ready_s=ready_s,
        gen_tokens=sum(r.gen_tokens for r in generated),
        capture_tokens=sum(r.capture_tokens for r in done),
        made=tuple(sorted(records)),
        left_out=len(wanted) - len(records),
        cut=cut,
    )


LENGTH_WINDOW = 4  # batches whose prompts are sorted by length together


def prompt_batches(prompts: list[Conversation], batch_size: int) -> list[list[Conversation]]:
    """The prompts in batches of ``batch_size``, each run of `LENGTH_WINDOW` batches sorted by
    length first (characters, a stable sort). The HF decode loop pads a batch to its longest
    prompt, and every row prefills and attends over that width: on 2 CPU cores, 4 batches of 64
    from a sorted 256 generated 255 tok/s against 203 as drawn (2026-12-05). A window, not the
    whole round, so a stage cut at its deadline keeps short and long prompts alike."""
    out: list[list[Conversation]] = []
    for i in range(0, len(prompts), batch_size * LENGTH_WINDOW):
        window = sorted(prompts[i : i + batch_size * LENGTH_WINDOW], key=conversation_chars)
        out += [window[j : j + batch_size] for j in range(0, len(window), batch_size)]
    return out


def remove_stale_temp_files(out_dir: Path) -> int:
    """Delete the partial `.<name>.tmp-*` files a killed writer left; only this stage writes
    `out_dir`, and no writer of it runs yet. Returns how many were removed."""
    stale = [p for p in out_dir.glob(".*.tmp-*") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        print(f"[generate] {out_dir}: removed {len(stale)} stale temp file(s)", flush=True)
    return len(stale)


def _run_batches(
    actors: list[Any],
    batches: list[Batch],
    keys: list[str],
    todo: list[int],
    out_dir: Path,
    data: DataConfig,
    two_phase: bool,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[BatchResult], list[BatchResult], dict[str, Any], float, float]:
    """Run the unfinished batches: (results with shards, results with generate figures, target
    info, seconds spent loading/switching backend phases, when the actors were ready)."""
    import ray

    from actors.batch_records import has_generated

    t0 = time.perf_counter()
    _wait_placed(actors, deadline)
    info = ray.get(actors[0].info.remote())
    ready_at = time.perf_counter()
    print(f"[generate] {len(actors)} actor(s) ready in {ready_at - t0:.1f}s", flush=True)
    given = [p for i in todo if isinstance(b := batches[i], list) for p in b]
    # a source's reply is at most max_new_tokens, as the estimate assumes for generated ones
    given += [c for i in todo if isinstance(b := batches[i], Replied) for c in b.conversations]
    lengths = ray.get(actors[0].prompt_lengths.remote(given))
    # an answered request's length is known; the estimate adds max_new_tokens to it
    lengths += [
        len(p) + len(c) - data.max_new_tokens
        for i in todo
        if isinstance(b := batches[i], Answered)
        for p, c in zip(b.prompt_ids, b.completion_ids, strict=True)
    ]
    # a self-written prompt: the template's header (~40 tokens) and a turn of at most the budget
    lengths += [40 + data.self_prompt_max_tokens] * sum(
        b.count for i in todo if isinstance(b := batches[i], SelfWritten)
    )
    _check_storage(out_dir, info, lengths, data)
    out, sizes = str(out_dir), [b.count if isinstance(b, SelfWritten) else len(b) for b in batches]
    todo = _dispatch_order(batches, todo)
    if not two_phase:
        cuts = deadline is not None and ray.get(actors[0].cuts_decoding.remote())
        stop_at = (time.time() + deadline - time.monotonic(),) if cuts else ()
        jobs = {i: (batches[i], out, i, keys[i], *stop_at) for i in todo}
        done = _dispatch(actors, "process", jobs, sizes, deadline, cuts, stop if cuts else None)
        done = generated = [r for r in done if not r.left_out]
    else:
        gen_todo = [i for i in todo if not has_generated(out_dir, i, keys[i])]
        print(
            f"[generate] phase 1 (generate): {len(gen_todo)} batch(es), "
            f"{len(todo) - len(gen_todo)} already generated",
            flush=True,
        )
        # the deadline cuts generation only; capture is the cheap phase that makes the shards
        generated = _dispatch(
            actors,
            "generate_batch",
            {i: (batches[i], out, i, keys[i]) for i in gen_todo},
            sizes,
            deadline,
        )
        todo = [i for i in todo if has_generated(out_dir, i, keys[i])]
        print(f"[generate] phase 2 (capture): {len(todo)} batch(es)", flush=True)
        done = _dispatch(actors, "capture_batch", {i: (out, i, keys[i]) for i in todo}, sizes)
    skipped = sum(r.skipped_prompts for r in done)
    if skipped:
        print(
            f"[generate] skipped {skipped} prompt(s): longer than data.max_length, or a "
            "self-written turn that did not end, was too short or repeated",
            flush=True,
        )
    calls = done if generated is done else generated + done
    return done, generated, info, sum(r.switch_seconds for r in calls), ready_at


def _dispatch_order(batches: list[Batch], todo: list[int]) -> list[int]:
    """Served requests first (capture only, and what users asked), then the other kinds
    interleaved by how far into their kind each batch is, so a stage cut at its deadline keeps
    the round's mix of regenerated prompts and sources' replies."""
    kinds: dict[type, list[int]] = {}
    for i in todo:
        kinds.setdefault(type(batches[i]), []).append(i)
    place = {i: k / len(mine) for mine in kinds.values() for k, i in enumerate(mine)}
    return sorted(todo, key=lambda i: (not isinstance(batches[i], Answered), place[i], i))


def batch_key(batch: Batch, target: TargetConfig, data: DataConfig) -> str:
    """Identity of a batch's output: its prompts and every setting that changes the shards."""
    settings: dict[str, Any] = {
        "target": target.model_dump(mode="json", exclude={"env", "num_gpus_per_actor"}),
        "data": data.model_dump(mode="json", include={"max_new_tokens", "max_length", "temperature", "seed", "shard_max_bytes", "context_turns"}),
    }  # fmt: skip
    if data.states == "online":  # ids-only shards; offline keys stay what they were
        settings["online"] = True
    if isinstance(batch, Answered):
        settings["answered"] = [list(p) + [-1] + list(c) for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]  # fmt: skip
    elif isinstance(batch, Replied):
        settings["replied"] = [[prompt_key(c), r] for c, r in zip(batch.conversations, batch.replies, strict=True)]  # fmt: skip
    elif isinstance(batch, SelfWritten):
        settings["self_written"] = {
            "count": batch.count,
            "seed": batch.seed,
            "temperature": data.self_prompt_temperature,
            "max_tokens": data.self_prompt_max_tokens,
        }
    else:
        settings["prompts"] = [prompt_key(c) for c in batch]
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def _start_actors(
    target: TargetConfig,
    data: DataConfig,
    n: int,
    sglang_options: SGLangOptions | None,
    threads: int | None = None,
    background: bool = False,
) -> tuple[list[Any], list[Any]]:
    """`n` target actors and the GPU reservations they hold (SGLang: one STRICT_PACK placement
    group of `target.tp_size` GPUs per actor, released by `_stop_actors`)."""
    import ray

    from actors.target import TargetActor

    if target.backend == "sglang":
        from actors.sglang_backend import reserve_target_gpus, target_actor_options

        actors, reservations = [], []
        try:
            for _ in range(n):
                reservations.append(reserve_target_gpus(target.tp_size))
                opts = target_actor_options(target, reservations[-1])
                actors.append(
                    TargetActor.options(**opts, max_concurrency=2).remote(
                        target, data, None, sglang_options
                    )
                )
        except BaseException:
            _stop_actors(actors, reservations)
            raise
        return actors, reservations

    # Torch threads per actor: this node's cores shared by data.num_actors actors (not by the
    # batches left, so a resumed run computes with the same kernels and byte-identical shards).
    # On a small CPU, single-threaded actors beat one multi-threaded one.
    cores = min(int(ray.cluster_resources().get("CPU", 1)), os.cpu_count() or 1)
    threads = threads or max(1, cores // data.num_actors)
    # Ray's CPUs are bookkeeping: each actor reserves at most its share of what is free now, so
    # a server that stays up through rounds (its `serve.num_cpus`) cannot leave a reservation of
    # every core pending forever (an H100 climb's round 1, 2026-12-07); it still runs `threads`.
    free = int(ray.available_resources().get("CPU", 0))
    opts: dict[str, Any] = {
        "num_cpus": max(1, min(threads, free // n)),
        "num_gpus": target.num_gpus_per_actor,
        "max_concurrency": 3,  # two batches in flight (`_dispatch`), and `stop_now` beside them
    }
    if target.env:
        opts["runtime_env"] = {"env_vars": dict(target.env)}
    actors = [TargetActor.options(**opts).remote(target, data, threads) for _ in range(n)]
    if background:
        ray.get([a.run_in_background.remote() for a in actors])
    return actors, []


PLACE_WARN_S = 60.0  # how often a stage whose actors Ray has not placed says so


def _wait_placed(actors: list[Any], deadline: float | None) -> None:
    """Until Ray has placed every actor, a line every `PLACE_WARN_S` names what they wait for: an
    actor Ray cannot place waits without a word (an H100 climb's round 1 waited 7 minutes for
    CPUs its server held, 2026-12-07), where a cluster may yet free or add them. Past the
    stage's `deadline` with none placed: RuntimeError, since none of its data can be made."""
    import ray

    refs = {a.__ray_ready__.remote(): a for a in actors}
    pending, waited = list(refs), 0.0
    while True:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=PLACE_WARN_S)
        if not pending:
            return
        waited += PLACE_WARN_S
        free = ray.available_resources()
        line = (
            f"{len(pending)} of {len(actors)} target actor(s) not placed after {waited:.0f} s: "
            f"Ray has CPU {free.get('CPU', 0.0):g} and GPU {free.get('GPU', 0.0):g} free "
            "(what holds the rest: `ray status`, the dashboard's Actors page); an actor asks "
            "target.num_gpus_per_actor GPUs and its share of the free CPUs"
        )
        if deadline is not None and time.monotonic() > deadline and len(pending) == len(actors):
            for ref in pending:  # unplaced: nothing to close, and `_stop_actors` need not wait
                ray.kill(refs[ref])
            raise RuntimeError(f"data stage past its deadline: {line}")
        print(f"[generate] {line}", flush=True)


def _stop_actors(actors: list[Any], reservations: list[Any]) -> None:
    """Close each backend (SGLang's processes would outlive a killed actor), kill the actors,
    release their GPUs."""
    import ray

    closing = [a.close.remote() for a in actors]
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=300)
    for a in actors:
        ray.kill(a)
    for r in reservations:
        ray.util.remove_placement_group(r.placement_group)


def _dispatch(
    actors: list[Any],
    method: str,
    jobs: dict[int, tuple],
    sizes: list[int],
    deadline: float | None = None,
    cuts: bool = False,
    stop: threading.Event | None = None,
) -> list[BatchResult]:
    """Call `method(*jobs[i])` for every batch i (in the order of `jobs`), two in flight per
    actor (one computing, one writing), until all are done, or until `deadline`: where the
    actors `cuts` decoding there, batches are handed out until it passes; elsewhere until the
    next batch would end after it (by the mean wall time of an actor's batches so far). The rest
    is left out. Once `stop` is set no batch is handed out and each actor is told to stop
    decoding (`TargetWorker.stop_now`)."""
    import ray

    todo = deque(jobs)
    pending: dict[Any, Any] = {}
    results: list[BatchResult] = []
    per_actor: list[float] = []  # seconds between an actor's finished batches

    def fits() -> bool:
        if stop is not None and stop.is_set():
            return False
        if deadline is None or not per_actor:
            return True
        if cuts:  # the actor stops decoding at the deadline, or does not start (too late)
            return time.monotonic() < deadline
        # a batch handed out now queues behind the one its actor computes: it ends two means on
        return time.monotonic() + 2 * sum(per_actor) / len(per_actor) <= deadline

    def submit(actor: Any) -> None:
        if todo and fits():
            i = todo.popleft()
            pending[getattr(actor, method).remote(*jobs[i])] = actor
        elif todo and (deadline is not None or stop is not None):
            print(f"[generate] deadline: {len(todo)} batch(es) left out", flush=True)
            todo.clear()

    for a in actors:
        submit(a)
        submit(a)
    t0 = time.perf_counter()
    last_done = {id(a): t0 for a in actors}
    total = sum(sizes[i] for i in jobs)
    with tqdm(total=total, unit="prompt", desc=method, file=sys.stdout, mininterval=2.0) as bar:
        stopping = False
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=None if stop is None else 1.0)
            if not ready:
                if stop is not None and stop.is_set() and not stopping:
                    stopping = True
                    for a in actors:  # a third call slot: two batches may hold the others
                        a.stop_now.remote()
                continue
            [ref] = ready
            actor = pending.pop(ref)
            r = ray.get(ref)
            results.append(r)
            now = time.perf_counter()
            per_actor.append(now - last_done[id(actor)])
            last_done[id(actor)] = now
            submit(actor)
            dt = time.perf_counter() - t0
            bar.set_postfix(
                gen_tok_s=f"{sum(x.gen_tokens for x in results) / dt:.0f}",
                cap_tok_s=f"{sum(x.capture_tokens for x in results) / dt:.0f}",
                shards=sum(len(x.shards) for x in results),
            )
            bar.update(r.num_prompts)
    return results


def _check_storage(
    out_dir: Path, info: dict[str, Any], lengths: list[int], data: DataConfig
) -> None:
    """Print the storage estimate and refuse to start when the disk cannot hold it."""
    per_tok = bytes_per_token(
        info["target"]["hidden_size"], len(info["aux_layer_ids"]), info.get("online", False)
    )
    tokens = sum(min(n + data.max_new_tokens, data.max_length) for n in lengths)
    need = int(per_tok * tokens * STORAGE_MARGIN)
    free = shutil.disk_usage(out_dir).free
    print(
        f"[generate] storage estimate: {per_tok} B/token x {tokens} planned tokens "
        f"({len(lengths)} prompts x (prompt + {data.max_new_tokens} new)) = {need / 2**30:.2f} GiB; "
        f"{free / 2**30:.1f} GiB free in {out_dir}",
        flush=True,
    )
    if need > free:
        raise OSError(
            f"{out_dir}: the shards need about {need} bytes but only {free} are free; free space, point "
            "--out elsewhere, or lower data.prompts_per_round / data.max_new_tokens"
        )


def main(argv: list[str] | None = None, prog: str = "python -m actors.generate") -> None:
    from actors.config import add_set_argument, load_data_stage_config
    from actors.prompts import plan_prompts, round_slices

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Run the generate stage alone (one round).",
        epilog=f"example:\n  {prog} --config configs/smollm2-cpu.yaml --out runs/x/data/round-000 "
        "--set data.prompts_per_round=64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True, help="YAML config (target: and data: are used)")
    ap.add_argument("--out", required=True, type=Path, help="data directory of the round")
    ap.add_argument(
        "--round", type=int, default=0, help="round index: picks that round's fresh prompts"
    )
    add_set_argument(ap)
    ap.add_argument("overrides", nargs="*", help="(older spelling of --set) dotted.path=value")
    args = ap.parse_args(argv)
    cfg = load_data_stage_config(args.config, args.set + args.overrides)

    from actors.cluster import start_ray

    start_ray(runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    # the loop's split and draw (without earlier rounds' traffic: this CLI generates fresh prompts)
    # (the pool is not deduplicated against a starting drafter here: the data stage's config
    # has no drafter section)
    plan = plan_prompts(cfg.data)
    earlier: list[dict[str, int]] = []
    for r in range(args.round + 1):  # the draws of the rounds before, as the loop makes them
        prompts, slices = round_slices(plan, cfg.data.prompts_for_round(r), earlier)
        earlier.append({s: b - a for s, (a, b) in slices.items()})
    result = run_generate(
        cfg.target, cfg.data, prompts, args.out, cfg.digest(), round_index=args.round
    )
    print(json.dumps(asdict(result), indent=1))


if __name__ == "__main__":
    main()
