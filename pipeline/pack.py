"""`eagle-loop pack`: what a run directory carries to another machine, with sizes, as one tar.

A climb on rented or spot GPUs moves between machines. What cannot be rebuilt is small: the
run's state, summary and config, its MLflow store, every round's exported drafter, training
records and benchmark records, the traffic log, ids-only data (`data.states: online`) and the
gate set (every round judges on it). What is big is rebuilt or no longer needed, and stays
behind: the rounds' captured states (offline shards: a later round that trains on a round
whose shards are missing has the data stage remake them) and, for a round whose training
finished, Ray Train's checkpoints, its starting copy and its best state (its drafter/ holds the
export). A round still in training keeps them all, so it resumes mid-round. On the new machine
the same command with `--run-dir` there resumes it: state.json re-roots its paths and the
MLflow store its artifacts (pipeline/state.py, pipeline/tracking.py `rehome_artifacts`).

  eagle-loop pack --run-dir runs/climb --out climb.tar
"""

from __future__ import annotations

import argparse
import json
import tarfile
from collections import defaultdict
from pathlib import Path

from pipeline.budget import size
from pipeline.layout import RunDir

# in train/round-NNN/ once its train is done: Ray Train's storage, the starting copy, the best state
FINISHED_TRAIN_LEAVES = ("ray", "init", "best")


def plan_pack(run_dir: Path) -> tuple[list[Path], dict[str, int], dict[str, int]]:
    """(the files to carry, bytes carried per part, bytes left behind per reason)."""
    state = json.loads((run_dir / "state.json").read_text())
    trained = {f"round-{r['index']:03d}" for r in state["rounds"] if "train" in r["done"]}
    online = {m.parent for m in run_dir.glob("data/*/manifest.json") if _ids_only(m)}
    lock = RunDir(run_dir).lock.relative_to(run_dir)
    carry, parts, left = [], defaultdict(int), defaultdict(int)
    for f in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel, n = f.relative_to(run_dir), f.stat().st_size
        if rel == lock:
            continue
        if (
            rel.parts[0] == "data"
            and rel.parts[1].startswith("round-")  # the gate set is every round's: it travels
            and f.suffix == ".safetensors"
            and f.parent not in online
        ):
            left["captured states (remade when a later round trains on them)"] += n
            continue
        train = rel.parts[0] == "train" and len(rel.parts) > 2 and rel.parts[1] in trained
        if train and rel.parts[2] in FINISHED_TRAIN_LEAVES:
            left["finished rounds' training checkpoints and copies"] += n
            continue
        carry.append(rel)
        part = rel.parts[0] if len(rel.parts) > 1 else "top level: state, summary, config, MLflow store"  # fmt: skip
        parts[part] += n
    return carry, dict(parts), dict(left)


def _ids_only(manifest: Path) -> bool:
    from actors.shards import load_manifest

    return load_manifest(manifest).online


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.pack") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"example:\n  {prog} --run-dir runs/climb --out climb.tar\n\n"
        "then, on the new machine: tar -xf climb.tar -C /shared/runs, and the same submit with "
        "--run-dir /shared/runs/climb",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--out", type=Path, help="the tar to write (default: only list the sizes)")
    a = ap.parse_args(argv)
    run_dir = a.run_dir.resolve()
    if not (run_dir / "state.json").is_file():
        raise SystemExit(f"--run-dir {a.run_dir}: no state.json there; pass a run directory")
    carry, parts, left = plan_pack(run_dir)
    for what, n in sorted(parts.items(), key=lambda x: -x[1]):
        print(f"carry  {size(n):>11}  {what}")
    for what, n in left.items():
        print(f"leave  {size(n):>11}  {what}")
    print(f"a move carries {size(sum(parts.values()))} in {len(carry)} files")
    if a.out:
        with tarfile.open(a.out, "w") as tar:
            for rel in carry:
                tar.add(run_dir / rel, arcname=str(Path(run_dir.name) / rel))
        print(f"wrote {a.out}: tar -xf {a.out.name} -C <folder>, then the same submit with "
              f"--run-dir <folder>/{run_dir.name}")  # fmt: skip
    return 0
