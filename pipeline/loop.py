"""The driver: generate -> train -> benchmark, round after round, until a stop rule fires.

Plain Python over a persisted run directory (state.json): every stage's result record is saved
the moment it finishes, so re-running the same command resumes at the first unfinished stage,
reuses the MLflow runs and shards it already made, and never duplicates them. Only paths, counts
and metrics pass through here; tensors stay on disk or inside the stages.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from actors.shards import ShardError
from pipeline.config import Config, dump_config
from pipeline.preflight import preflight
from pipeline.rules import format_table, round_row, stop_reason
from pipeline.state import Clock, RunState, write_json_atomic
from pipeline.tracking import Tracker

log = logging.getLogger("eagle_loop")


def run_loop(cfg: Config, run_dir: Path) -> dict[str, Any]:
    preflight(cfg)  # seconds, before any MLflow run or GPU time (run.py: before Ray starts too)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.yaml").write_text(dump_config(cfg))
    log.info("resolved config:\n%s", dump_config(cfg))
    state = RunState.load_or_new(run_dir, cfg.digest())
    tracker = Tracker(cfg.tracking, run_dir)  # default store: <run_dir>/mlflow.db
    tracker.check_known(state.run_ids(), str(run_dir / "state.json"), state.tracking_uri)
    if not state.parent_run_id:
        state.parent_run_id = tracker.start_run(cfg.name, params=cfg.model_dump(mode="json"))
        state.tracking_uri = tracker.uri
        state.save(run_dir)
    elif not state.stopped_because:
        tracker.reopen(state.parent_run_id)  # a failed earlier attempt resumes
    tracker.log_artifact(state.parent_run_id, run_dir / "config.resolved.yaml")
    if state.stopped_because:
        log.info("run already finished: %s", state.stopped_because)
        return _write_summary(state, run_dir)

    train_prompts, heldout = _prompts(cfg)
    clock, server = Clock(state), None
    try:
        for r in range(cfg.stop.max_rounds):
            rs = state.round(r)
            if not rs.mlflow_run_id:
                rs.mlflow_run_id = tracker.start_run(
                    f"round-{r}", state.parent_run_id, cfg.model_dump(mode="json")
                )
                state.save(run_dir)
            elif not rs.is_done("bench"):
                tracker.reopen(rs.mlflow_run_id)
            child = rs.mlflow_run_id
            if not rs.is_done("generate"):
                t0 = clock.elapsed()
                rs.done["generate"] = _generate(cfg, run_dir, r, train_prompts, tracker, child)
                rs.done["generate"]["wall_s"] = clock.elapsed() - t0
                _commit(state, clock, run_dir)
            if not rs.is_done("train"):
                t0 = clock.elapsed()
                try:
                    rs.done["train"] = _train(cfg, run_dir, state, r, tracker, child)
                except ShardError:  # a finished round's shards were damaged since: heal, retry
                    _heal_data(cfg, run_dir, state, r, train_prompts)
                    rs.done["train"] = _train(cfg, run_dir, state, r, tracker, child)
                rs.done["train"]["wall_s"] = clock.elapsed() - t0
                _commit(state, clock, run_dir)
            if not rs.is_done("bench"):
                t0 = clock.elapsed()
                server = _serve(cfg, run_dir, state, r, server)
                rs.done["bench"] = _bench(cfg, run_dir, r, heldout, server, tracker, child)
                rs.done["bench"]["wall_s"] = clock.elapsed() - t0
                if cfg.serve.num_gpus > 0:  # the next round's stages need those GPUs
                    server = _stop_serving(server)
                tracker.finish(child)
                _commit(state, clock, run_dir)
            reason = stop_reason(cfg.stop, _rows(state)[: r + 1], rs.done["bench"], clock.elapsed())
            _write_summary(state, run_dir)
            if reason:
                state.stopped_because = reason
                break
        state.stopped_because = state.stopped_because or f"budget: {cfg.stop.max_rounds} rounds"
        _finish(cfg, state, run_dir, tracker)
        _commit(state, clock, run_dir)
    except BaseException as e:
        _mark_failed(tracker, state, e)
        raise
    finally:
        _stop_serving(server)
    return _write_summary(state, run_dir)


# ---- stages ------------------------------------------------------------------------------------


def _prompts(cfg: Config) -> tuple[list, list]:
    from actors.prompts import load_prompts, split_prompts

    return split_prompts(load_prompts(cfg.data), cfg.data.heldout_prompts, cfg.data.seed)


def _generate(
    cfg: Config, run_dir: Path, r: int, train_prompts: list, tracker: Tracker, child: str
) -> dict:
    rec = _record(_generate_round(cfg, run_dir, r, train_prompts))
    tracker.log(child, {f"data/{k}": v for k, v in rec.items()})
    return rec


def _generate_round(cfg: Config, run_dir: Path, r: int, train_prompts: list):
    """Round r's shards; batches already on disk and intact are kept, the others (re)made."""
    from actors.generate import run_generate
    from actors.prompts import round_prompts

    prompts = round_prompts(train_prompts, r, cfg.data.prompts_per_round)
    out = run_dir / "data" / f"round-{r:03d}"
    return run_generate(cfg.target, cfg.data, prompts, out, cfg.digest(), round_index=r)


def _heal_data(
    cfg: Config, run_dir: Path, state: RunState, r: int, train_prompts: list
) -> list[int]:
    """Check the shards of rounds 0..r (what round r trains on); a round with missing, truncated
    or corrupted shards gets those batches regenerated, the intact ones kept. Returns the rounds
    healed; a shard still bad afterwards raises ShardError."""
    from actors.shards import verify_manifest

    healed = []
    for i in range(r + 1):
        try:
            verify_manifest(state.rounds[i].done["generate"]["manifest"])
        except ShardError as e:
            log.warning("round %d: damaged shards, regenerating them:\n%s", i, e)
            verify_manifest(_generate_round(cfg, run_dir, i, train_prompts).manifest)
            healed.append(i)
    return healed


def _train(
    cfg: Config, run_dir: Path, state: RunState, r: int, tracker: Tracker, child: str
) -> dict:
    from pipeline.train import run_train

    data_dirs = [Path(state.rounds[i].done["generate"]["manifest"]).parent for i in range(r + 1)]
    init = cfg.drafter.init
    if r > 0:
        init = state.rounds[r - 1].done["train"]["drafter_dir"]  # keep learning from the last round
    res = run_train(
        cfg=cfg,
        data_dirs=data_dirs,
        init=init,
        out_dir=run_dir / "train" / f"round-{r:03d}",
        run_name=f"{cfg.name}-round-{r:03d}",
    )
    rec = _record(res)
    for step, metrics in _read_metrics(Path(rec["metrics_file"])):
        tracker.log(child, {f"train/{k}": v for k, v in metrics.items()}, step=step)
    tracker.log(child, {f"train/final_{k}": v for k, v in (rec.get("final_metrics") or {}).items()})
    tracker.log(child, {f"train/eval_{k}": v for k, v in (rec.get("eval_metrics") or {}).items()})
    tracker.log_artifact(child, Path(rec["drafter_dir"]), "drafter")
    return rec


def _serve(cfg: Config, run_dir: Path, state: RunState, r: int, server):
    """Deploy once, then swap the drafter each round (validated first: a bad one is refused and
    the old drafter keeps serving). Embedded engine: a Ray Serve hot-swap; SGLang: a restart."""
    from serve.deployment import deploy_endpoint

    drafter = state.rounds[r].done["train"]["drafter_dir"]
    if server is None:
        return deploy_endpoint(cfg.serve, cfg.target, drafter, run_dir / "serve")
    server.swap_drafter(drafter)
    return server


def _stop_serving(server) -> None:
    if server is not None:
        server.shutdown()


def _bench(
    cfg: Config, run_dir: Path, r: int, heldout: list, server, tracker: Tracker, child: str
) -> dict:
    from serve.bench import bench_endpoint

    out = run_dir / "bench" / f"round-{r:03d}"
    res = bench_endpoint(
        server,
        heldout,
        cfg.bench,
        out,
        baseline_cache=run_dir / "baseline.json",
        tag=f"round-{r:03d}",
    )
    rec = _record(res)
    tracker.log(child, {f"bench/{k}": v for k, v in rec.items()})
    for i, a in enumerate(rec.get("acceptance_per_position") or []):
        tracker.log(child, {"bench/acceptance_per_position": a}, step=i + 1)
    for key in ("json_path", "plot_path"):
        if rec.get(key):
            tracker.log_artifact(child, Path(rec[key]), "bench")
    return rec


def _finish(cfg: Config, state: RunState, run_dir: Path, tracker: Tracker) -> None:
    rows = _rows(state)
    summary = _write_summary(state, run_dir)
    if rows:
        best = max(rows, key=lambda x: x["accept_len"])
        rid = state.rounds[best["round"]].mlflow_run_id
        version = tracker.register_champion(rid, "drafter")
        state.champion = {
            "round": best["round"],
            "accept_len": best["accept_len"],
            "drafter_dir": state.rounds[best["round"]].done["train"]["drafter_dir"],
            "registered_model": cfg.tracking.registered_model,
            "version": version,
        }
        for p in _plots(state, run_dir):
            tracker.log_artifact(state.parent_run_id, p, "plots")
        for row in rows:
            tracker.log(
                state.parent_run_id,
                {f"bench/{k}": v for k, v in row.items() if k != "round"},
                step=row["round"],
            )
    tracker.log_artifact(state.parent_run_id, run_dir / "summary.json")
    tracker.finish(state.parent_run_id)
    log.info("stopped because %s\n%s", summary["stopped_because"], format_table(rows))


def _mark_failed(tracker: Tracker, state: RunState, err: BaseException) -> None:
    """The parent and every unfinished round's run end FAILED (KILLED on Ctrl-C), not RUNNING
    forever; a re-run reopens them and resumes."""
    # Ctrl-C, or a signal Ray's driver turns into sys.exit (seen: SIGINT -> SystemExit(1))
    status = "KILLED" if isinstance(err, KeyboardInterrupt | SystemExit) else "FAILED"
    ids = [state.parent_run_id] + [
        rs.mlflow_run_id for rs in state.rounds if not rs.is_done("bench")
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
    import json

    if not path.exists():
        return
    for line in path.read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            step = int(m.pop("step", 0))
            yield step, {k: v for k, v in m.items() if isinstance(v, int | float)}


def _rows(state: RunState) -> list[dict[str, Any]]:
    return [round_row(rs.index, rs.done) for rs in state.rounds if rs.is_done("bench")]


def _write_summary(state: RunState, run_dir: Path) -> dict[str, Any]:
    summary = {"rounds": _rows(state), "stopped_because": state.stopped_because, "champion": state.champion,
               "elapsed_s": round(state.elapsed_s, 1)}  # fmt: skip
    write_json_atomic(run_dir / "summary.json", summary)
    return summary


def _commit(state: RunState, clock: Clock, run_dir: Path) -> None:
    clock.commit()
    state.save(run_dir)


def _plots(state: RunState, run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(state)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["round"] for r in rows], [r["accept_len"] for r in rows], "o-")
    ax.set(xlabel="round", ylabel="accept_len", title="accept_len per round")
    paths.append(out / "accept_len_per_round.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for rs in state.rounds:
        acc = (rs.done.get("bench") or {}).get("acceptance_per_position") or []
        ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"round {rs.index}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance per position")
    ax.legend()
    paths.append(out / "acceptance_per_position.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["round"] for r in rows], [r["tok_per_s"] for r in rows], "o-", label="speculative")
    ax.plot(
        [r["round"] for r in rows], [r["baseline_tok_per_s"] for r in rows], "s--", label="baseline"
    )
    ax.set(xlabel="round", ylabel="output tok/s", title="tok/s vs baseline")
    ax.legend()
    paths.append(out / "tok_per_s.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)
    return paths
