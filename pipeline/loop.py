"""The driver: generate -> train -> benchmark, round after round, until a stop rule fires.

Plain Python over a persisted run directory (state.json): every stage's result record is saved
the moment it finishes, so re-running the same command resumes at the first unfinished stage,
reuses the MLflow runs and shards it already made, and never duplicates them. Only paths, counts
and metrics pass through here; tensors stay on disk or inside the stages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from actors.cluster import cluster_gpus
from actors.prompt_keys import KEY_FILE, key_hash, write_key_file
from actors.shards import ShardError
from pipeline.budget import plan_vs_actual
from pipeline.config import Config, dump_config
from pipeline.console import (
    bench_line,
    data_line,
    data_note,
    detail,
    disk_line,
    measured_line,
    plan_line,
    sizing_line,
    stage,
    train_line,
    train_note,
    users_line,
)
from pipeline.continued import continued_from
from pipeline.gate_set import gate_dirs, gate_due, make_gate_set
from pipeline.layout import RunDir, round_tag
from pipeline.measure import machine
from pipeline.preflight import preflight
from pipeline.round_data import fresh_prompts, replied_batches, run_prompts, start_early
from pipeline.round_plan import (
    data_bytes,
    disk_plan,
    first_round_skips,
    measure_once,
    next_round_refusal,
    plan_record,
    size_once,
    sized_config,
    stage_seconds,
    train_overhead_s,
)
from pipeline.rules import (
    AcceptanceCollapsed,
    collapse_problem,
    costs,
    curve,
    format_table,
    promote,
    rows_of,
    sim_vs_bench,
    still_stopped,
    stop_reason,
)
from pipeline.state import Clock, RunState, write_json_atomic, write_text_atomic
from pipeline.tracking import Tracker, runs_page
from pipeline.traffic_round import answered_batches, traffic_for_round, users_left
from pipeline.window import drawn, free_data, window

log = logging.getLogger("eagle_loop")


def run_loop(cfg: Config, run_dir: Path) -> dict[str, Any]:
    preflight(cfg)  # seconds, before any MLflow run or GPU time (run.py: before Ray starts too)
    _claim_serving(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = RunState.load_or_new(run_dir, cfg.digest(), cfg.changes_from)  # before it is rewritten
    write_text_atomic(RunDir(run_dir).config, dump_config(cfg))
    detail.info("resolved config:\n%s", dump_config(cfg))
    tracker = Tracker(cfg.tracking, run_dir)  # default store: <run_dir>/mlflow.db
    if page := runs_page(tracker.uri, tracker.experiment_id):
        log.info("MLflow runs: %s", page)
    tracker.check_known(state.run_ids(), str(RunDir(run_dir).state), state.tracking_uri)
    if not state.parent_run_id:
        state.parent_run_id = tracker.start_run(cfg.name, params=cfg.model_dump(mode="json"))
        state.tracking_uri = tracker.uri  # RunState.save masks a password in it
        state.save(run_dir)
    elif state.stopped_because and not still_stopped(cfg.stop, state.rounds, state.elapsed_s):
        # submitted again with its stop rules raised: on from its last round, same MLflow run
        log.info("run extended (it stopped: %s): on from its last round", state.stopped_because)
        state.stopped_because = None
        tracker.reopen(state.parent_run_id)
    elif not state.stopped_because:
        tracker.reopen(state.parent_run_id)  # a failed earlier attempt resumes
    tracker.log_artifact(state.parent_run_id, RunDir(run_dir).config)
    if state.stopped_because:
        log.info("run already finished: %s", state.stopped_because)
        return _write_summary(state, run_dir)

    plan = run_prompts(cfg, run_dir)
    evalset = _eval_set(cfg, plan)
    clock, server, early = Clock(state), None, None
    try:
        if cfg.stop.planned and not state.round(0).is_done("plan"):
            # measured once; a budget that cannot hold the rounds is refused before round 0
            with stage(
                "start-up measurement", plan="plain decoding, then one drafted request"
            ) as st:
                measure_once(cfg, state, evalset[0][0], tracker)
                st.result = measured_line(state.round(0).done["measure"])
            _commit(state, clock, run_dir)
            size_once(cfg, state, clock)  # the measuring work this machine affords, or refused
            log.info(sizing_line(state.round(0).done["sizing"]))
            _commit(state, clock, run_dir)
        if (sized := sized_config(cfg, state)) is not cfg:  # as measured (a resume: as it began)
            # a gate set cut down is re-carved; the held-out and users' splits come first
            plan = (
                plan
                if sized.data.gate_prompts == cfg.data.gate_prompts
                else run_prompts(sized, run_dir)
            )
            cfg = sized
        if state.champion and cfg.serves_through_rounds(cluster_gpus()):
            # a resumed run serves its champion first, as it did when it stopped: users are
            # answered through the round, whose benchmark swaps the drafter instead of starting
            # the server (a fresh H100: the target's load and graphs, 52 s of a 94 s benchmark)
            with stage("serving the champion again", plan=_serving_drafter(state) or ""):
                server = _serve(cfg, run_dir, _serving_drafter(state), None, _serving_shape(state))
        for r in range(cfg.stop.max_rounds):
            rs = state.round(r)
            if not rs.mlflow_run_id:
                rs.mlflow_run_id = tracker.start_run(
                    f"round-{r}", state.parent_run_id, cfg.model_dump(mode="json")
                )
                state.save(run_dir)
            elif not rs.is_done("gate"):
                tracker.reopen(rs.mlflow_run_id)
            child = rs.mlflow_run_id
            if cfg.stop.planned and not rs.is_done("plan"):
                rs.done["plan"] = plan_record(cfg, state, r, clock, tracker, child)
                log.info(plan_line(r, rs.done["plan"], cfg.stop))
                _commit(state, clock, run_dir)
            if not rs.is_done("generate") and _skips(cfg, r):
                rs.done["generate"] = {"skipped": "train.first_round: skip", "wall_s": 0.0}
                rs.done["train"] = _serve_init(cfg, run_dir, tracker, child)
                _commit(state, clock, run_dir)
            if gate_due(cfg, state, r):  # once per run, in the first round that trains
                rs.done["gate_set"] = make_gate_set(cfg, run_dir, plan, clock)
                _commit(state, clock, run_dir)
            if not rs.is_done("generate"):  # its deadline is what the gate set left of the plan's
                free_data(cfg, run_dir, state, r)  # first: the disk plan counts what it frees
                _commit(state, clock, run_dir)
                rs.done["disk_plan"] = disk_plan(
                    cfg, state, r, run_dir, _fresh(cfg, state, r, plan)
                )
                log.info(disk_line(r, rs.done["disk_plan"]))
                t0, secs = clock.elapsed(), stage_seconds(rs, "data", clock)
                n = f"{cfg.data.prompts_for_round(r)} prompts"
                with stage(f"round {r} data", secs, n, data_note(RunDir(run_dir).data(r))) as st:
                    rs.done["generate"] = _generate(
                        cfg, run_dir, state, r, plan, evalset, tracker, child, secs
                    )
                    rs.done["generate"]["wall_s"] = clock.elapsed() - t0
                    st.result = data_line(rs.done["generate"])
                _commit(state, clock, run_dir)
            if not rs.is_done("train"):
                around = train_overhead_s(state, r, run_dir, cfg.train.use_gpu)
                t0, box = clock.elapsed(), stage_seconds(rs, "train", clock, around)
                what = f"time box {box:.0f} s of steps, {around:.0f} s around them" if box else "no time box"  # fmt: skip
                with stage(f"round {r} train", box and box + around, what,
                           train_note(RunDir(run_dir).train(r))) as st:  # fmt: skip
                    try:
                        rs.done["train"] = _train(cfg, run_dir, state, r, tracker, child, box)
                    except ShardError:  # a finished round's shards were damaged since: heal, retry
                        _heal_data(cfg, run_dir, state, r, plan, evalset)
                        rs.done["train"] = _train(cfg, run_dir, state, r, tracker, child, box)
                    rs.done["train"]["wall_s"] = clock.elapsed() - t0
                    st.result = train_line(rs.done["train"])
                _commit(state, clock, run_dir)
            if early is None:  # the next round's fresh prompts, on the cores the server leaves
                early = start_early(cfg, run_dir, state, r, plan, _early_seconds(rs))
            if not rs.is_done("bench"):
                t0 = clock.elapsed()
                what = f"{len(evalset[0])} held-out prompts"
                what += ", the server's start included" if server is None else ""
                with stage(f"round {r} bench", _planned(rs, "bench_s"), what) as st:
                    starts = server is None
                    server = _serve(cfg, run_dir, rs.done["train"]["drafter_dir"], server)
                    up = clock.elapsed() - t0
                    rs.done["bench"] = _bench(cfg, run_dir, r, evalset, server, tracker, child)
                    rs.done["bench"]["wall_s"] = clock.elapsed() - t0
                    if starts:  # the next round's plan prices its benchmark without it
                        rs.done["bench"]["serve_start_s"] = up
                    st.result = bench_line(rs.done["bench"])
                _commit(state, clock, run_dir)
            if not rs.is_done("gate"):
                server = _serve(cfg, run_dir, rs.done["train"]["drafter_dir"], server)
                rs.done["gate"] = _gate(cfg, state, r, server, tracker, child)
                _commit(state, clock, run_dir)
            reason = stop_reason(
                cfg.stop, rows_of(state.rounds)[: r + 1], rs.done["bench"], clock.elapsed(),
                next_round_refusal(cfg, state, r, clock),
            )  # fmt: skip
            _write_summary(state, run_dir)
            if reason:
                state.stopped_because = reason
                tracker.finish(child)
                break
            if cfg.serve.simulate_users and not rs.is_done("traffic"):
                t0 = clock.elapsed()
                what = f"{cfg.serve.simulate_users} simulated users' requests to the live server"
                with stage(f"round {r} users", _planned(rs, "traffic_s"), what) as st:
                    server = _serve(
                        cfg, run_dir, _serving_drafter(state), server, _serving_shape(state)
                    )
                    # when the users began: a resumed stage asks only those not yet answered
                    begun = rs.done.setdefault("users_begun", {"time": time.time()})["time"]
                    _commit(state, clock, run_dir)
                    rs.done["traffic"] = _simulate(
                        cfg, plan, r, server, tracker, child, run_dir, begun
                    )
                    rs.done["traffic"]["wall_s"] = clock.elapsed() - t0
                    st.result = users_line(rs.done["traffic"])
                _commit(state, clock, run_dir)
            if early is not None:  # the server's core is free again: round r+1's stage takes over
                rs.done["early"], early = early.finish(), None
                _commit(state, clock, run_dir)
            if rs.is_done("plan"):
                tracker.log(child, plan_vs_actual(rs.done["plan"], rs.done))
            if server is not None and not cfg.serves_through_rounds(cluster_gpus()):
                server.shutdown()  # the next round's stages need its GPUs
                server, rs.done["bench"]["server_stopped"] = None, True  # priced in its plan
                _commit(state, clock, run_dir)
            tracker.finish(child)
        state.stopped_because = state.stopped_because or f"budget: {cfg.stop.max_rounds} rounds"
        _finish(cfg, state, run_dir, tracker)
        _commit(state, clock, run_dir)
    except BaseException as e:
        _mark_failed(tracker, state, e)
        raise
    finally:
        if early is not None:
            early.finish()
        if server is not None:
            server.shutdown()
    return _write_summary(state, run_dir)


# ---- stages ------------------------------------------------------------------------------------


def _eval_set(cfg: Config, plan) -> tuple[list, list[str]]:
    """What every round is judged on (the stop rule, the promotion gate): all prompts of
    `bench.eval_files` (one domain per file), else the held-out split of the prompt sources;
    `bench.num_prompts` of them, interleaved across domains."""
    from actors.prompts import interleave, load_jsonl_prompts

    if cfg.bench.eval_files:
        prompts = interleave([load_jsonl_prompts(Path(f)) for f in cfg.bench.eval_files])
    else:
        prompts = plan.heldout
    prompts = prompts[: cfg.bench.num_prompts]
    return [p.messages for p in prompts], [p.domain for p in prompts]


def _skips(cfg: Config, r: int) -> bool:
    return r == 0 and first_round_skips(cfg)


def _serve_init(cfg: Config, run_dir: Path, tracker: Tracker, child: str) -> dict:
    """Round 0's drafter without training: `drafter.init`, copied byte for byte into the run
    directory (train/round-000/drafter), so it is served, recorded and registered like a trained
    round's, and a resumed run does not depend on where the job's working dir was."""
    import shutil

    from eagle3.checkpoint import local_or_download

    src = local_or_download(cfg.drafter.resolved_init(), None, ["config.json", "*.safetensors*"])
    dest = RunDir(run_dir).train(0) / "drafter"
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*"))
    log.info("round 0: serves drafter.init %s as it is (train.first_round: skip)", cfg.drafter.init)
    detail.info("round 0: drafter.init is %s", src)
    tracker.log_artifact(child, dest, "drafter")
    return {"drafter_dir": str(dest), "init": cfg.drafter.init, "train_tokens": 0,
            "skipped": "train.first_round: skip", "wall_s": 0.0}  # fmt: skip


def _generate(
    cfg: Config,
    run_dir: Path,
    state: RunState,
    r: int,
    plan,
    evalset,
    tracker: Tracker,
    child: str,
    seconds: float | None = None,
) -> dict:
    rec = _generate_round(cfg, run_dir, state, r, plan, evalset, seconds)
    if r and (early := state.rounds[r - 1].done.get("early")):  # its batches are among these
        rec["early"] = early
    # the round's peak disk: its data has landed, and no round's is deleted before the next
    rec["disk_bytes"] = data_bytes(RunDir(run_dir).data(r).parent)
    tracker.log(child, {f"data/{k}": v for k, v in rec.items()})
    return rec


def _generate_round(
    cfg: Config,
    run_dir: Path,
    state: RunState,
    r: int,
    plan,
    evalset,
    seconds: float | None = None,
    only: list[int] | None = None,
) -> dict:
    """Round r's data: served requests from the traffic log (their share of the round's prompts;
    capture only), then fresh prompts from the other sources for what the log does not cover
    (generated and captured), within `seconds` when the budget plan gives it. Batches already on
    disk and intact are kept, the others (re)made; healing passes the batches made (`only`)."""
    import time

    from actors.generate import run_generate

    out = RunDir(run_dir).data(r)
    records = traffic_for_round(cfg, run_dir, state, r, out, evalset)
    prompts, replied, slices = fresh_prompts(cfg, state, r, plan, out, len(records))
    write_key_file(
        out / KEY_FILE,
        [key_hash(c) for c in prompts + replied + [x["messages"] for x in records if x.get("messages")]],
    )  # fmt: skip
    counts = {s: b - a for s, (a, b) in slices.items()}
    data = cfg.data.model_copy(update={"states": cfg.states()})  # auto resolved: ids or states
    res = run_generate(
        cfg.target,
        data,
        prompts,
        out,
        cfg.digest(),
        round_index=r,
        answered=answered_batches(records, cfg.data.batch_size),
        replied=replied_batches(replied, plan.replies, cfg.data.batch_size),
        deadline=None if seconds is None else time.monotonic() + seconds,  # in this process
        only=None if only is None else set(only),
    )
    skipped = RunDir(run_dir).traffic_skipped(r)  # what the traffic reader passed over
    # learned tokens are the target's own (data.context_turns); the rest conditions them
    return {**_record(res), "context_tokens": res.num_tokens - res.num_loss_tokens,
            "drawn": counts, "slice": slices, "traffic_records": len(records),
            "traffic_skipped": json.loads(skipped.read_text()) if skipped.exists() else {},
            "fresh_prompts": len(prompts), "replied_prompts": len(replied),
            "traffic_ids": [x["id"] for x in records]}  # fmt: skip


def _fresh(cfg: Config, state: RunState, r: int, plan) -> list:
    """Round r's fresh prompts as if the traffic log gave none: what the disk plan sizes a
    round by before any round measured its tokens."""
    from actors.prompts import round_slices

    return round_slices(plan, cfg.data.prompts_for_round(r), drawn(state, r))[0]


def _heal_data(cfg: Config, run_dir: Path, state: RunState, r: int, plan, evalset) -> list[int]:
    """Check the shards of the rounds round r trains on (pipeline/window.py: rounds outside it are
    deleted, and are never remade); a round with missing, truncated or corrupted shards gets
    those batches regenerated, the intact ones kept. Returns the rounds healed; a shard still
    bad afterwards raises ShardError."""
    from actors.shards import verify_manifest

    if gate_dirs(state, run_dir):  # intact batches are kept
        make_gate_set(cfg, run_dir, plan)
    healed = []
    for i in window(cfg, state, r):
        try:
            verify_manifest(state.rounds[i].done["generate"]["manifest"])
        except ShardError as e:
            log.warning("round %d: damaged shards, regenerating them:\n%s", i, e)
            made = state.rounds[i].done["generate"].get("made")
            rec = _generate_round(cfg, run_dir, state, i, plan, evalset, only=made)
            verify_manifest(rec["manifest"])
            healed.append(i)
    return healed


def _train(
    cfg: Config,
    run_dir: Path,
    state: RunState,
    r: int,
    tracker: Tracker,
    child: str,
    seconds: float | None = None,
) -> dict:
    from pipeline.train import run_train

    data_dirs = [state.rounds[i].manifest.parent for i in window(cfg, state, r)]
    init, cont = cfg.drafter.resolved_init(), None
    if r > 0:  # keep learning from the drafter that serves (the last one the gate promoted)
        init = _serving_drafter(state) or state.rounds[r - 1].drafter_dir
        # and when the round before kept it, on from that round's last trained state (the gate
        # still judges against `init`: pipeline/continued.py)
        cont = continued_from(cfg.train.continue_kept, state.rounds[r - 1].done.get("train"), init)
        if cont:
            log.info("round %d: trains on from round %d's last state %s (that round kept its "
                     "start); judged against the serving drafter %s", r, r - 1, cont, init)  # fmt: skip
    tc = cfg.train.for_round(r, seconds, from_drafter=init != "scratch")  # the recipe it takes
    res = run_train(
        cfg=cfg.model_copy(update={"train": tc}),
        data_dirs=data_dirs,
        init=init,
        out_dir=RunDir(run_dir).train(r),
        run_name=f"{cfg.name}-{round_tag(r)}",
        eval_dirs=gate_dirs(state, run_dir),  # every round alike; none: a hold-out of its data
        continue_from=cont,
    )
    rec = _record(res)
    rec["prompt_keys"] = _write_prompt_keys(Path(rec["drafter_dir"]), init, data_dirs, rec, cont)
    if rec.get("last_dir"):  # what the kept-out state trained on, should a later round export it
        _write_prompt_keys(Path(rec["last_dir"]), init, data_dirs, {}, cont)
    curve = _read_metrics(Path(rec["metrics_file"]))
    tracker.log_steps(child, ((s, {f"train/{k}": v for k, v in m.items()}) for s, m in curve))
    tracker.log(child, {f"train/final_{k}": v for k, v in (rec.get("final_metrics") or {}).items()})
    tracker.log(child, {f"train/eval_{k}": v for k, v in (rec.get("eval_metrics") or {}).items()})
    start = rec.get("start_eval_metrics") or {}
    tracker.log(child, {f"train/start_eval_{k}": v for k, v in start.items()})
    tracker.log(child, {"train/kept_start": float(bool(rec.get("kept_start")))})
    tracker.log(child, {"train/continued": float(cont is not None)})
    gate = {k: v for k, v in (rec.get("gate") or {}).items() if isinstance(v, int | float)}
    tracker.log(child, {f"train/gate_{k}": float(v) for k, v in gate.items()})
    if rec.get("kept_start"):
        log.info("round %d: no trained state beat the drafter it started from (held-out sim "
                 "%.3f); it is exported unchanged", r, start.get("sim_accept_len", 0.0))  # fmt: skip
    tracker.log_artifact(child, Path(rec["drafter_dir"]), "drafter")
    return rec


def _claim_serving(cfg: Config, run_dir: Path) -> None:
    """ServeClaimed, in seconds and before any MLflow run or data, when the Serve app or route
    this run would serve on belongs to another run or server on this cluster (serve/endpoint.py
    `check_claim`; the deploy checks again)."""
    import ray

    if cfg.serve.engine != "embedded" or not ray.is_initialized():
        return
    from serve.endpoint import check_claim

    check_claim(cfg.serve.app, cfg.serve.route_prefix, str(run_dir.resolve()))


def _write_prompt_keys(
    drafter: Path, init: str, data_dirs: list[Path], rec: dict, cont: str | None = None
) -> int:
    """The exported drafter's key file (actors/prompt_keys.py): its start's keys and, unless
    it is its start unchanged (`kept_start`), those of the state it trained on from (`cont`, a
    kept round's last state) and of the rounds it trained on. Returns how many it lists."""
    from actors.prompt_keys import drafter_prompt_hashes, read_key_file

    keys = set(drafter_prompt_hashes(init) or ()) if Path(init).is_dir() else set()
    if not rec.get("kept_start"):
        keys |= (cont and drafter_prompt_hashes(cont)) or set()
        for d in data_dirs:
            if (Path(d) / KEY_FILE).is_file():
                keys |= read_key_file(Path(d) / KEY_FILE)
    return write_key_file(drafter / KEY_FILE, keys)


def _serve(cfg: Config, run_dir: Path, drafter: str | None, server, shape: dict | None = None):
    """The live server, serving `drafter`. Deployed once, then the drafter is swapped (validated
    first: a bad one is refused and the old drafter keeps serving). Embedded engine: a Ray Serve
    hot-swap; SGLang: a restart. `shape`: the serving shape a benchmark chose for `drafter`
    (its BenchResult.shape; plain = no drafting), applied where the server can (embedded)."""
    from serve.endpoint import deploy_endpoint
    from serve.shapes import Shape

    if server is None:
        server = deploy_endpoint(
            cfg.serve,
            cfg.target,
            drafter,
            RunDir(run_dir).serve,
            owner=str(run_dir.resolve()),  # a run never replaces another's app (serve.app)
            traffic_dir=RunDir(run_dir).traffic,
        )
    elif drafter and server.info().get("path") != drafter:
        server.swap_drafter(drafter)
    if shape and hasattr(server, "set_shape"):
        info = server.set_shape(Shape.parse(shape))
        detail.info("serving %s with shape %s: %s", drafter, info["shape"], shape.get("reason"))
    return server


def _early_seconds(rs) -> float | None:
    """How long round r+1's data may run beside round r's server: the rest of round r's plan
    (its benchmark and users), or until its users are done where nothing is planned."""
    left = [_planned(rs, f"{s}_s") for s in ("bench", "traffic") if not rs.is_done(s)]
    return None if None in left else sum(left)  # type: ignore[arg-type]


def _planned(rs, key: str) -> float | None:
    """A stage's seconds in the round's budget plan (None: no plan)."""
    return (rs.done.get("plan") or {}).get(key) or None


def _serving_drafter(state: RunState) -> str | None:
    return (state.champion or {}).get("drafter_dir")


def _serving_shape(state: RunState) -> dict | None:
    """The shape the champion's round's benchmark chose for it (None: no choice made)."""
    champ = state.champion
    return champ and state.rounds[champ["round"]].done["bench"].get("shape") or None


def _bench(
    cfg: Config, run_dir: Path, r: int, evalset, server, tracker: Tracker, child: str
) -> dict:
    from serve.bench import bench_endpoint

    out = RunDir(run_dir).bench(r)
    prompts, domains = evalset
    res = bench_endpoint(
        server,
        prompts,
        cfg.bench,
        out,
        baseline_cache=RunDir(run_dir).baseline,
        tag=round_tag(r),
        domains=domains,
    )
    rec = _record(res)
    tracker.log(child, {f"bench/{k}": v for k, v in rec.items()})
    tracker.log(child, {f"bench/{k}": rec["extra"]["settings"][k] for k in ("temperature", "top_p", "top_k")})  # fmt: skip
    for i, a in enumerate(rec.get("acceptance_per_position") or []):
        tracker.log(child, {"bench/acceptance_per_position": a}, step=i + 1)
    for dom, figs in (rec.get("domains") or {}).items():
        tracker.log(child, {f"bench/{dom}/{k}": v for k, v in figs.items()})
        for i, a in enumerate(figs.get("acceptance_per_position") or []):
            tracker.log(child, {f"bench/{dom}/acceptance_per_position": a}, step=i + 1)
    if shape := rec.get("shape"):
        detail.info("round %d serving shape %s: %s", r, shape["served"], shape["reason"])
        tracker.tag(child, {"bench.served_shape": shape["served"]})
        tracker.log(child, {"bench/served_plain": float(shape["served"] == "plain"),
                            "bench/served_speedup": shape.get("served_speedup"),
                            **{f"bench/shape_speedup/{k}": v
                               for k, v in (shape.get("speedups") or {}).items()}})  # fmt: skip
    for key in ("json_path", "plot_path"):
        if rec.get(key):
            tracker.log_artifact(child, Path(rec[key]), "bench")
    return rec


def _gate(cfg: Config, state: RunState, r: int, server, tracker: Tracker, child: str) -> dict:
    """Promote round r's drafter only when it beats the serving one on the same prompts and
    settings; otherwise put the serving one back. A collapsed drafter (serves at ~1.0 while its
    held-out accuracy predicts more) is an error, after the serving one is back."""
    bench, train = state.rounds[r].done["bench"], state.rounds[r].done["train"]
    champ = state.champion
    ok = promote(bench["accept_len"], champ and champ["accept_len"], cfg.bench.promote_margin)
    predicted = (train.get("eval_metrics") or {}).get("sim_accept_len")
    problem = collapse_problem(train["drafter_dir"], bench["accept_len"], predicted, cfg.bench)
    if problem or not ok:
        if champ is not None:
            server.swap_drafter(champ["drafter_dir"])
        if problem:
            raise AcceptanceCollapsed(problem)
    rec = {
        "promoted": ok,
        "accept_len": bench["accept_len"],
        "champion_accept_len": champ and champ["accept_len"],
        "champion_round": champ and champ["round"],
        "predicted_accept_len": predicted,
    }
    if ok:
        state.champion = {"round": r, "accept_len": bench["accept_len"],
                          "domains": {d: v.get("accept_len") for d, v in (bench.get("domains") or {}).items()},
                          "drafter_dir": train["drafter_dir"]}  # fmt: skip
    log.info(
        "round %d %s: accept_len %.3f vs serving %s",
        r,
        "promoted" if ok else "NOT promoted, the serving drafter stays",
        bench["accept_len"],
        "none" if champ is None else f"{champ['accept_len']:.3f} (round {champ['round']})",
    )
    tracker.log(child, {"gate/promoted": float(ok), "gate/accept_len": bench["accept_len"],
                        "gate/champion_accept_len": (champ or {}).get("accept_len") or 0.0})  # fmt: skip
    return rec


def _simulate(cfg: Config, plan, r: int, server, tracker: Tracker, child: str, run_dir: Path,
              begun: float) -> dict:  # fmt: skip
    """Simulated users answered by the live server: the next round's traffic (bounded); those
    answered since the stage `begun` (a stopped job's) are not asked again."""
    from serve.simulate import simulate_users

    n = cfg.serve.simulate_users
    pool = plan.users
    start = (r * n) % max(1, len(pool))
    prompts = [pool[(start + i) % len(pool)].messages for i in range(min(n, len(pool)))]
    left = users_left(prompts, RunDir(run_dir).traffic, begun)
    b = cfg.bench  # the users sample as the deployment is judged
    res = simulate_users(server.url, left, max_tokens=cfg.data.max_new_tokens,
                         concurrency=cfg.serve.simulate_concurrency, temperature=b.temperature,
                         top_p=b.top_p, top_k=b.top_k)  # fmt: skip
    before = len(prompts) - len(left)
    rec = _record(res) | {"requests": res.requests + before, "answered_before": before}
    detail.info("simulated users: %s", rec)
    tracker.log(child, {f"traffic/{k}": v for k, v in rec.items() if isinstance(v, int | float)})
    return rec


def _finish(cfg: Config, state: RunState, run_dir: Path, tracker: Tracker) -> None:
    rows = rows_of(state.rounds)
    summary = _write_summary(state, run_dir)
    if rows and state.champion:
        rid = state.rounds[state.champion["round"]].mlflow_run_id
        version = tracker.register_champion(rid, cfg.registered_model())
        state.champion = {
            **state.champion,
            "registered_model": cfg.registered_model(),
            "version": version,
        }
        from pipeline.plots import round_plots

        for p in round_plots(state, rows, RunDir(run_dir).plots, summary["curve"]):
            tracker.log_artifact(state.parent_run_id, p, "plots")
        for row in rows:
            tracker.log(
                state.parent_run_id,
                {
                    f"bench/{k}": float(v)
                    for k, v in row.items()
                    if isinstance(v, int | float) and k != "round"
                },
                step=row["round"],
            )
    tracker.log_artifact(state.parent_run_id, RunDir(run_dir).summary)
    tracker.finish(state.parent_run_id)
    if champ := state.champion:
        log.info("registered round %d's drafter as %s v%s", champ["round"],
                 cfg.registered_model(), champ.get("version"))  # fmt: skip
    detail.info("stopped because %s", summary["stopped_because"])
    detail.info("rounds:\n%s", format_table(rows))


def _mark_failed(tracker: Tracker, state: RunState, err: BaseException) -> None:
    """The parent and every unfinished round's run end FAILED (KILLED on Ctrl-C), not RUNNING
    forever; a re-run reopens them and resumes."""
    # Ctrl-C, or a signal Ray's driver turns into sys.exit (seen: SIGINT -> SystemExit(1))
    status = "KILLED" if isinstance(err, KeyboardInterrupt | SystemExit) else "FAILED"
    ids = [state.parent_run_id] + [
        rs.mlflow_run_id for rs in state.rounds if not rs.is_done("gate")
    ]
    for run_id in filter(None, ids):
        try:
            tracker.finish(run_id, status)
        except Exception as e:  # noqa: BLE001 - keep the original error
            log.warning("could not mark MLflow run %s %s: %s", run_id, status, e)
    log.error("run %s: %s: %s", status, type(err).__name__, err)


# ---- helpers -----------------------------------------------------------------------------------


def _record(result: Any) -> dict[str, Any]:
    """A stage's frozen result dataclass as a JSON-safe dict (paths as strings)."""
    d = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else dict(result)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _read_metrics(path: Path):
    from pipeline.train_worker import read_metrics

    for m in read_metrics(path):
        step = int(m.pop("step", 0))
        yield step, {k: v for k, v in m.items() if isinstance(v, int | float)}


def _write_summary(state: RunState, run_dir: Path) -> dict[str, Any]:
    rows, (cpus, gpus) = rows_of(state.rounds), machine()
    summary = {"rounds": rows, "stopped_because": state.stopped_because, "champion": state.champion,
               "elapsed_s": round(state.elapsed_s, 1), "costs": costs(rows, cpus, gpus),
               "sim_vs_bench": sim_vs_bench(rows), "curve": curve(rows, gpus),
               "plans": [rs.done["plan"] for rs in state.rounds if rs.is_done("plan")]}  # fmt: skip
    write_json_atomic(RunDir(run_dir).summary, summary)
    return summary


def _commit(state: RunState, clock: Clock, run_dir: Path) -> None:
    clock.commit()
    state.save(run_dir)
