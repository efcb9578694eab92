"""What a round's data stage is given, and the next round's data begun early.

`fresh_prompts` is the one rule for a round's fresh prompts: which slice of each source, kept in
the round's `slice.json` the first time, so a resumed round, or one begun early, takes the same.

`start_early` (`data.early_start`) begins round r+1's fresh prompts while round r's server is
benchmarked and talked to: one target actor on the cores that server leaves free, stopped when
round r's users are done (`EarlyData.finish`). Round r+1's data stage then finds those batches
on disk with their keys and goes on from them (actors/generate.py keeps finished batches)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.layout import RunDir
from pipeline.state import RunState, write_json_atomic
from pipeline.window import drawn

log = logging.getLogger("eagle_loop")

SLICE = "slice.json"


def run_prompts(cfg: Config, run_dir: Path | None = None):
    """The run's prompt plan (actors/prompts.py `plan_prompts`): held-out, users', gate and
    training prompts; a pool without what the starting drafter was trained on, as its key file
    was when the run began (`RunDir.start_keys`, pinned then)."""
    from actors.prompt_keys import read_key_file, write_key_file
    from actors.prompts import init_trained_hashes, plan_prompts

    # the pool leaves out what the starting drafter learned (its key file); later rounds take
    # slices after round 0's, so they never repeat one either
    trained = frozenset()
    if "pool" in cfg.data.sources():
        pin = RunDir(run_dir).start_keys if run_dir else None
        if pin and pin.is_file():
            trained = read_key_file(pin)
        else:
            trained = init_trained_hashes(cfg.drafter.resolved_init())
            if pin:
                # pinned: each round's slice is recorded as offsets into this pool, and the
                # start's own key file grows when a climb's champion is shipped in its place
                # (the base climb's resume on a second machine found 16,384 more keys there)
                pin.parent.mkdir(parents=True, exist_ok=True)
                write_key_file(
                    pin, trained, "the run's starting drafter's prompt keys, at its start"
                )
    return plan_prompts(cfg.data, eval_files=cfg.bench.eval_files or [], trained=trained)


def fresh_prompts(
    cfg: Config, state: RunState, r: int, plan, out: Path, traffic: int
) -> tuple[list, list, dict[str, list[int]]]:
    """Round r's fresh prompts: (to regenerate, to train on their source's reply, the slice of
    each source they are). Their count is what `prompts_for_round` leaves beside the round's
    `traffic` records, or, once the round began (its slice.json), the count it began with."""
    from actors.prompts import round_slices

    began = out / SLICE
    n = cfg.data.prompts_for_round(r) - traffic
    if began.exists():
        n = sum(json.loads(began.read_text())["counts"].values())
    prompts, slices = round_slices(plan, n, drawn(state, r))
    keep_slice(began, r, slices)
    regen, replied = with_replies(prompts, plan.replies, cfg.data.dataset_replies)
    return regen, replied, slices


def keep_slice(path: Path, r: int, slices: dict[str, list[int]]) -> None:
    """Record which slice of each source's training order round r takes (`{source: [start,
    end)}`, and `counts`, how many from each: for the pool its domains), or, when the round is
    resumed, check it takes the one it began: a changed slice would train on prompts beside the
    shards already made (a changed config or state)."""
    if path.exists():
        had = json.loads(path.read_text())["slices"]
        if had != slices:
            raise RuntimeError(
                f"{path}: round {r} began on prompt slices {had}, its resume would take {slices} "
                "(the config or state.json changed since); resume with the config it began "
                "with, or start a new run directory"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {s: b - a for s, (a, b) in slices.items()}
    write_json_atomic(path, {"round": r, "slices": slices, "counts": counts})


def with_replies(prompts: list, replies: dict[str, str], share: float) -> tuple[list, list]:
    """(prompts to regenerate, prompts trained on their source's reply): `share` of all of them,
    spread evenly through the round's order, among those that have a reply."""
    from actors.prompts import prompt_key

    regen, replied = [], []
    for i, p in enumerate(prompts):
        if len(replied) < share * (i + 1) and prompt_key(p) in replies:
            replied.append(p)
        else:
            regen.append(p)
    return regen, replied


def replied_batches(prompts: list, replies: dict[str, str], batch_size: int) -> list:
    from actors.prompts import Replied, prompt_key

    return [
        Replied(tuple(b), tuple(replies[prompt_key(p)] for p in b))
        for b in (prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size))
    ]


# ---- the next round's data, begun early --------------------------------------------------------


@dataclass
class EarlyData:
    """Round `round`'s fresh batches being made in a thread of the driver (Ray calls)."""

    round: int
    stop: threading.Event
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.monotonic)
    result: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None

    def finish(self) -> dict[str, Any] | None:
        """Stop it (the batches decoding end at the token they have and are written) and wait:
        the record of what it made, or None where it failed (the data stage then makes those
        batches itself, so a failure here loses only the time)."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            log.warning("round %d data, begun early: failed (%s: %s); the round's data stage "
                        "makes its batches", self.round, type(self.error).__name__, self.error)  # fmt: skip
            return None
        return self.result


def free_cores(cfg: Config) -> int:
    """The cores of this machine the embedded CPU server (all its replicas) leaves free."""
    return (os.cpu_count() or 1) - math.ceil(cfg.serve.num_cpus * cfg.serve.num_replicas)


def start_early(
    cfg: Config, run_dir: Path, state: RunState, r: int, plan, seconds: float | None
) -> EarlyData | None:
    """Begin round r+1's fresh prompts (one actor, the free cores' threads) until `seconds` from
    now or `EarlyData.finish`, whichever comes first; None where `data.early_start` is off, round
    r is the last, its plan has no time left to overlap, round r+1's data is made, or no core is
    free."""
    nxt = r + 1
    if not cfg.data.early_start or nxt >= cfg.stop.max_rounds:
        return None
    if seconds is not None and seconds <= 0:  # a resumed round r: nothing of it left to overlap
        return None
    if len(state.rounds) > nxt and state.rounds[nxt].is_done("generate"):
        return None
    if (threads := free_cores(cfg)) < 1:
        log.info("data.early_start: no core beside the server's %s; round %d's data waits for "
                 "its stage", cfg.serve.num_cpus, nxt)  # fmt: skip
        return None
    out = RunDir(run_dir).data(nxt)
    # before round r's users have asked anything: the fresh count leaves no room for them
    regen, _, _ = fresh_prompts(cfg, state, nxt, plan, out, traffic=0)
    early = EarlyData(nxt, threading.Event())
    data = cfg.data.model_copy(update={"states": cfg.states(), "num_actors": 1})
    deadline = time.monotonic() + (seconds if seconds is not None else 24 * 3600.0)

    def run() -> None:
        from actors.generate import run_generate

        try:
            # in the background: beside it, round r's server answers the benchmark's timed
            # requests one at a time (docs/data.md, "The early actor runs in the background")
            res = run_generate(cfg.target, data, regen, out, cfg.digest(), round_index=nxt,
                               deadline=deadline, stop=early.stop, threads=threads,
                               background=True)  # fmt: skip
            early.result = {
                "made": list(res.made),
                "samples": res.num_samples,
                "loss_tokens": res.num_loss_tokens,
                "cut": res.cut,
                "wall_s": time.monotonic() - early.started,
            }
        except BaseException as e:  # reported by finish(); the data stage redoes its batches
            early.error = e

    early.thread = threading.Thread(target=run, name=f"early-data-{nxt}", daemon=True)
    early.thread.start()
    log.info("round %d data: begun early, 1 actor of %d thread(s) beside round %d's server, "
             "until its users are done", nxt, threads, r)  # fmt: skip
    return early
