"""The record of `make demo` runs (benchmarks/results/*.json) from what the runs wrote: each run
directory's summary.json and state.json, and the console log `make demo` printed (its regime,
sizing and wall time). The README's demo table is then generated from it
(`python -m pipeline.results_docs`), never pasted.

    RUN_DIR=/tmp/d1 make demo >/tmp/d1.log; ... three runs ...
    python scripts/demo_record.py --run /tmp/d1 /tmp/d1.log --run /tmp/d2 /tmp/d2.log \
        --hardware "2-core x86 VM (Intel Xeon, AMX-BF16), quiet" --commit abc1234 \
        --scenario "make demo: ..." --out benchmarks/results/2026-12-05-cpu-demo-offpolicy.json

The first run's rounds make the record's `rounds` (the README row) and its console table; every
run's rounds per domain, stage seconds and round-1 target tokens go to `runs`.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.console import measured_line, sizing_line  # noqa: E402
from pipeline.rules import format_table  # noqa: E402

ROUND_KEYS = ("round", "accept_len", "domains", "shape", "served_speedup", "train_tokens",
              "promoted", "kept_start")  # fmt: skip


def one_run(run_dir: Path, log: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    state = json.loads((run_dir / "state.json").read_text())
    text = log.read_text(errors="replace")
    wall = re.search(r"demo wall time: (\d+) s", text)
    regime = re.search(r"regime: ([^\n]*)", text)
    rounds = []
    for row, rs in zip(summary["rounds"], state["rounds"], strict=False):
        gen = rs["done"].get("generate") or {}
        rounds.append({
            **{k: _round3(row.get(k)) for k in ROUND_KEYS},
            "domains": {d: round(v, 3) for d, v in (row.get("domains") or {}).items() if v},
            "stage_s": row.get("stage_s", {}),
            "target_tokens": gen.get("num_loss_tokens", 0),  # what the target wrote (learned)
            "samples": gen.get("num_samples", 0),
            "train_steps": (rs["done"].get("train") or {}).get("steps"),
        })  # fmt: skip
    plan0 = (summary.get("plans") or [{}])[0]
    return {"run_dir": str(run_dir), "wall_s": int(wall.group(1)) if wall else None,
            "regime": regime.group(1).strip() if regime else None,
            "measured": plan0.get("measured"), "sizing": plan0.get("sizing"),
            "stopped_because": summary.get("stopped_because"), "rounds": rounds,
            "summary": summary}  # fmt: skip


def bench_line(run_dir: Path) -> str:
    """What the run's benchmark measured, from its resolved config and its first round."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    b, s = cfg["bench"], cfg["serve"]
    first = json.loads((run_dir / "summary.json").read_text())["rounds"][0]
    doms = list(first.get("domains") or {})
    n = b["num_prompts"]
    each = f" ({n // len(doms)} a domain: {', '.join(doms)})" if doms else ""
    how = "greedy" if not b.get("temperature") else f"temperature {b['temperature']:g}, top_p {b['top_p']:g}"  # fmt: skip
    shape = f"{s['steps']} levels, top-{s['topk']}, {s['num_draft_tokens']} tokens"
    line = f"{n} held-out real prompts{each}, {b['max_tokens']} tokens, {how}; accept_len is the configured tree's ({shape})"  # fmt: skip
    if b.get("accept_concurrency"):
        line += f", scored {b['accept_concurrency']} in flight in the server's batches"
    timed = b.get("baseline_prompts") if b.get("accept_concurrency") else None
    return line + (f"; speed against plain decoding on {timed} of them alone" if timed else "; speed against plain decoding")  # fmt: skip


def _round3(v):
    return round(v, 3) if isinstance(v, float) else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    ap.add_argument("--run", nargs=2, action="append", required=True, metavar=("RUN_DIR", "LOG"))
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--drafter-init", default="drafters/smollm2-135m-offpolicy")
    ap.add_argument("--command", default="make demo")
    ap.add_argument("--note", default=None, help="how the runs differ from a plain `make demo`")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--readme", action="store_true", help="the record the README's demo shows")
    a = ap.parse_args()
    runs = [one_run(Path(d), Path(log)) for d, log in a.run]
    first = runs[0]
    console = []
    if first["regime"]:
        console.append(f"regime: {first['regime']}")
    if first["measured"]:
        console.append(f"measured at start-up ({first['measured']['wall_s']:.0f} s): "
                       f"{measured_line(first['measured'])}")  # fmt: skip
    if first["sizing"]:
        console.append(sizing_line(first["sizing"]))
    console += format_table(first["summary"]["rounds"]).splitlines()
    import ray
    import torch
    import transformers

    rec = {
        "scenario": a.scenario, "kind": "loop", "status": "current", "date": a.date,
        "hardware": a.hardware, "commit": a.commit, "command": a.command, "config": a.config,
        "target": "SmolLM2-135M-Instruct (GGUF Q4_1), embedded engine",
        "drafter_init": a.drafter_init,
        "bench": bench_line(Path(a.run[0][0])),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "ray": ray.__version__},
        "rounds": [{k: r[k] for k in ROUND_KEYS} for r in first["rounds"]],
        "wall_s": first["wall_s"],
        "console": console,
        "runs": [{k: v for k, v in r.items() if k != "summary"} for r in runs],
        "source": "scripts/demo_record.py over each run's summary.json, state.json and "
                  "`make demo` log",
    }  # fmt: skip
    if a.note:
        rec["note"] = a.note
    if a.readme:
        rec["readme_demo"] = True
    a.out.write_text(json.dumps(rec, indent=2) + "\n")
    print(a.out)


if __name__ == "__main__":
    main()
