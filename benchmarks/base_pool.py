"""Write the prompt pool benchmarks/base_drafter.py trains on: real prompts from the demo's
sources that the demo never holds out nor gives its simulated users.

    python benchmarks/base_pool.py --config configs/smollm2-cpu.yaml --n 12288 --out pool.jsonl

The demo's own split (its `data` section and seed) names the prompts to leave out. The pool is
drawn from a wider load of the same sources (prompts up to `--max-prompt-chars`), every coding
and math prompt first, then chat turns, in a seeded order; one `{"messages": [...]}` per line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.prompts import plan_prompts, prompt_key  # noqa: E402
from pipeline.config import load_config  # noqa: E402

CHAT = "sharegpt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--max-prompt-chars", type=int, default=2000)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    data = load_config(a.config).data
    demo = plan_prompts(data)
    taken = {prompt_key(p.messages) for p in demo.heldout + demo.users}
    wide = data.model_copy(
        update={"max_prompt_chars": a.max_prompt_chars, "heldout_prompts": 1, "user_prompts": 0}
    )
    plan = plan_prompts(wide, seed=data.seed + 1)
    kept = {src: [c for c in ps if prompt_key(c) not in taken] for src, ps in plan.train.items()}
    pool = [c for src, ps in kept.items() if src != CHAT for c in ps]
    pool += kept.get(CHAT, [])[: max(0, a.n - len(pool))]
    random.Random(7).shuffle(pool)
    a.out.write_text("".join(json.dumps({"messages": c}) + "\n" for c in pool))
    counts = {src: len(ps) for src, ps in kept.items()}
    print(json.dumps({"written": len(pool), "available": counts, "left_out": len(taken)}))


if __name__ == "__main__":
    main()
