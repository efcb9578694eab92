"""Write the key file (actors/prompt_keys.py) of each shipped drafter: the prompts it was trained on,
rebuilt from the config and the code that built it (both deterministic for the installed wheels).

    python benchmarks/drafter_prompt_keys.py            # writes drafters/*/prompt_keys.txt.gz
    python benchmarks/drafter_prompt_keys.py --check    # fails when a shipped file differs

- `smollm2-135m-base`: its previous build, round 0 of configs/smollm2-base-1gpu.yaml (f9be60e),
  then the three rounds of the base climb that fine-tuned it (configs/smollm2-1gpu-climb.yaml,
  2026-12-06, two machine runs, DATA_CARD.md). The build drew its 13,197 prompts by the `real`
  mix's weights: the first 11,217 of the 12,749 ShareGPT training prompts, and HumanEval's 135
  and lm_eval's 313 over and over (660 and 1,320 draws): 11,665 distinct prompts. The climb's
  pool left those out and its rounds drew the first 18,695 chat, 5,294 coding and 587 math
  prompts of the pool's seeded orders (the run's data/round-N/slice.json): 24,576 more, 36,241
  in all. (Round 1's data stage regenerated 5,120 of its 8,192 before its deadline; the key file
  lists all it drew.)
- `smollm2-135m-offpolicy`: the training split of configs/smollm2-cpu.yaml that has a ShareGPT
  reply (benchmarks/demo_prompts.py, then `base_drafter.py gen --replies dataset`): 12,733
  prompts, its 256 evaluation samples included. A prompt whose reply the chat template renders
  differently was skipped at build time (not counted there); listing it too only leaves out one
  more pool prompt.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.prompt_keys import KEY_FILE, key_hash, read_key_file, write_key_file  # noqa: E402
from actors.prompt_record import Conversation  # noqa: E402
from actors.prompts import plan_prompts, prompt_key, round_slices  # noqa: E402
from benchmarks.harness import Results, parser  # noqa: E402
from pipeline.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


BUILT_WITH = ["data.gate_prompts=0"]
# the demo's split when the off-policy drafter was built: the `real` mix and 256 users' prompts
# (the demo draws by domain and keeps 24 since; its held-out prompts are the same either way)
OFFPOLICY_SPLIT = [*BUILT_WITH, "data.source={real: 0.75, traffic: 0.25}", "data.user_prompts=256"]


# where the base climb's three rounds' slices of the pool's per-domain orders ended
CLIMB_DRAWN = {"chat": 18_695, "coding": 5_294, "math": 587}


def base_prompts() -> list[Conversation]:
    """The on-policy base's prompts: its build's, then the climb's rounds' slices of the pool,
    which left the build's out (as the loop's plan does with drafter.init's key file)."""
    build = base_build_prompts()
    data = load_config(REPO / "configs" / "smollm2-1gpu-climb.yaml").data
    plan = plan_prompts(data, eval_files=[], trained=frozenset(key_hash(c) for c in build))
    return build + [c for d, end in CLIMB_DRAWN.items() for c in plan.train[d][:end]]


def base_build_prompts() -> list[Conversation]:
    """The prompts the on-policy base's first build (one round from scratch) regenerated and
    trained on (with repeats)."""
    # both shipped drafters predate the gate set: their splits carved none (data.gate_prompts 0)
    data = load_config(REPO / "configs" / "smollm2-base-1gpu.yaml", BUILT_WITH).data
    with warnings.catch_warnings():  # HumanEval and lm_eval wrapped then, as the card says
        warnings.simplefilter("ignore")
        prompts, _ = round_slices(plan_prompts(data), data.prompts_for_round(0), [])
    return prompts


def offpolicy_prompts() -> list[Conversation]:
    """The demo's training prompts that carry ShareGPT's reply, which the off-policy drafter
    was trained on."""
    plan = plan_prompts(load_config(REPO / "configs" / "smollm2-cpu.yaml", OFFPOLICY_SPLIT).data)
    return [c for convs in plan.train.values() for c in convs if prompt_key(c) in plan.replies]


SHIPPED = {"smollm2-135m-base": base_prompts, "smollm2-135m-offpolicy": offpolicy_prompts}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    a = ap.parse_args()
    out, stale = {}, []
    for name, prompts in SHIPPED.items():
        path = REPO / "drafters" / name / KEY_FILE
        hashes = {key_hash(c) for c in prompts()}
        if a.check:
            if not path.is_file() or read_key_file(path) != hashes:
                stale.append(str(path))
        else:
            write_key_file(path, hashes, f"{name}: prompts trained on ({__file__.split('/')[-1]})")
        out[name] = {"prompts": len(hashes), "bytes": path.stat().st_size if path.is_file() else 0}
    Results("drafter_prompt_keys").emit({"drafters": out, "stale": stale})
    if stale:
        sys.exit(f"stale key files (rerun without --check): {stale}")


if __name__ == "__main__":
    main()
