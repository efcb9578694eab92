"""The loop's rounds against one big training job: train a drafter from scratch, in one round, on
all the data a finished run made, benchmark it as the loop benchmarks its rounds, and draw it
beside the run's curve (summary.json `curve`).

    python benchmarks/climb_vs_scratch.py --config configs/smollm2-1gpu-climb.yaml --run RUN_DIR

The same data (every round's shards), the same held-out prompts, bench settings and serving
engine; the scratch drafter's cost is the run's data stages plus its own training and benchmark,
in GPU minutes on a GPU cluster (wall minutes otherwise), as the curve counts them. Writes
RUN_DIR/scratch/ (train/, bench/, result.json) and RUN_DIR/plots/climb_vs_scratch.png, and
prints one JSON line: the scratch point, the run's last and best round.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.layout import RunDir  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", required=True, help="the config the run was made with")
    ap.add_argument("--run", required=True, type=Path, help="the finished run's directory")
    ap.add_argument("--epochs", type=int, default=4, help="passes over all the run's data")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr (the shipped drafters' build)")
    a = ap.parse_args()

    from actors.cluster import start_ray
    from pipeline.loop import _eval_set, _machine, _prompts, _serve
    from pipeline.plots import curve_plot
    from pipeline.train import run_train
    from serve.bench import bench_endpoint

    cfg, run = load_config(a.config), RunDir(a.run.resolve())
    state = json.loads(run.state.read_text())
    made = [rd["done"]["generate"] for rd in state["rounds"] if "manifest" in rd["done"].get("generate", {})]  # fmt: skip
    if not made:
        raise SystemExit(f"{run.state}: no round made data; run the loop first")
    if gone := [i for i, g in enumerate(made) if "freed_bytes" in g]:
        raise SystemExit(
            f"{run.state}: the shards of the data rounds {gone} were deleted once outside the "
            "train.data_rounds window; a run with data.states: online keeps every round's ids"
        )
    out = run.root / "scratch"
    tc = cfg.train.model_copy(update={"epochs": a.epochs, "lr": a.lr, "data_rounds": None})
    start_ray(runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    t0 = time.perf_counter()
    res = run_train(
        cfg=cfg.model_copy(update={"train": tc.for_round(0)}),
        data_dirs=[Path(g["manifest"]).parent for g in made],
        init="scratch",
        out_dir=out / "train",
        run_name=f"{cfg.name}-scratch",
    )
    prompts, domains = _eval_set(cfg, _prompts(cfg))
    server = _serve(cfg, run.root, str(res.drafter_dir), None)
    try:
        bench = bench_endpoint(server, prompts, cfg.bench, out / "bench",
                               baseline_cache=run.baseline, tag="scratch", domains=domains)  # fmt: skip
    finally:
        server.shutdown()
    own_s = time.perf_counter() - t0
    data_s = sum(g.get("wall_s", 0.0) for g in made)
    gpus = _machine()[1]
    point = {
        "train_tokens": res.train_tokens,
        "minutes": round((data_s + own_s) / 60 * (gpus or 1), 2),
        "accept_len": bench.accept_len,
        "domains": {d: v.get("accept_len") for d, v in (bench.domains or {}).items()},
        "epochs": a.epochs, "lr": a.lr, "drafter_dir": str(res.drafter_dir),
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(point, indent=1))
    curve = json.loads(run.summary.read_text())["curve"]
    run.plots.mkdir(exist_ok=True)
    plot = curve_plot(curve, run.plots / "climb_vs_scratch.png", {"one round from scratch": point})
    pts = curve["points"]
    Results("climb_vs_scratch").emit({
        "scratch": point, "plot": str(plot), "minutes_unit": curve["minutes"],
        "loop_last": pts[-1], "loop_best": max(pts, key=lambda p: p["accept_len"]),
    })  # fmt: skip


if __name__ == "__main__":
    main()
