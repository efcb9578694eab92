"""The training window (`train.data_rounds`): which rounds' data a round trains on, and so which
rounds' shards the loop checks and heals for it, and which it deletes before a round generates.
One rule for the three, so a round never trains on, heals or keeps data outside its window."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.budget import size
from pipeline.config import Config
from pipeline.state import RunState

log = logging.getLogger("eagle_loop")


def drawn(state: RunState, r: int) -> list[dict[str, int]]:
    """What each round before r drew from each prompt source (`{source: count}`)."""
    return [(state.rounds[i].done.get("generate") or {}).get("drawn") or {} for i in range(r)]


def window(cfg: Config, state: RunState, r: int) -> list[int]:
    """The rounds whose data round r trains on: the last `train.data_rounds` of those up to r
    that made data. The one rule behind training, healing and freeing."""
    made = [rs.index for rs in state.rounds[: r + 1] if "manifest" in (rs.done.get("generate") or {})]  # fmt: skip
    return cfg.train.data_window(made)


def free_data(cfg: Config, run_dir: Path, state: RunState, r: int) -> None:
    """Before round r generates: delete the shards of every earlier round outside its window
    (no round from r on trains on them), so the disk holds at most `train.data_rounds` rounds of
    states. Their manifests and records stay, saying what was made; `freed_bytes` marks them
    done. Ids-only shards (`data.states: online`, 5 B a token) stay: they hold no states, and
    benchmarks/climb_vs_scratch.py trains on every round's data."""
    from actors.shards import load_manifest

    made = [rs.index for rs in state.rounds[:r] if "manifest" in (rs.done.get("generate") or {})]
    keep = set(cfg.train.data_window([*made, r]))
    for i in made:
        rec = state.rounds[i].done["generate"]
        if i in keep or "freed_bytes" in rec or load_manifest(state.rounds[i].manifest).online:
            continue
        folder, freed = state.rounds[i].manifest.parent, 0
        for f in [*folder.glob("*.safetensors"), *folder.glob("*.gen.jsonl")]:
            freed += f.stat().st_size
            f.unlink()
        rec["freed_bytes"] = freed
        log.info("round %d: deleted round %d's shards (%s): outside train.data_rounds=%s",
                 r, i, size(freed), cfg.train.data_rounds)  # fmt: skip
