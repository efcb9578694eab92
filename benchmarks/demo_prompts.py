"""Write the demo's own prompt split as files the GPU scripts read (they run where the prompt
wheels are not installed): its training prompts, each with its source's reply where the source
has one (ShareGPT), and its simulated users' prompts (disjoint from training and benchmark).

    python benchmarks/demo_prompts.py --config configs/smollm2-cpu.yaml --out /tmp/demo-prompts

Writes `train.jsonl.gz` (`{"messages", "reply", "domain", "source"}`, in the loop's draw order,
per source) and `users.jsonl.gz`. The held-out benchmark prompts are never written.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.prompts import load_source, plan_prompts, prompt_key  # noqa: E402
from benchmarks.harness import Results, parser  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    data = load_config(a.config).data
    plan = plan_prompts(data)
    tagged = {prompt_key(p.messages): p for src in plan.train for p in load_source(src, data)}
    a.out.mkdir(parents=True, exist_ok=True)
    counts = {}
    with gzip.open(a.out / "train.jsonl.gz", "wt", encoding="utf-8") as f:
        for src, convs in plan.train.items():
            counts[src] = len(convs)
            for c in convs:
                p = tagged[prompt_key(c)]
                rec = {"messages": c, "reply": plan.replies.get(prompt_key(c)),
                       "domain": p.domain, "source": src}  # fmt: skip
                f.write(json.dumps(rec) + "\n")
    with gzip.open(a.out / "users.jsonl.gz", "wt", encoding="utf-8") as f:
        for p in plan.users:
            f.write(json.dumps({"messages": p.messages, "domain": p.domain, "source": p.source}) + "\n")  # fmt: skip
    Results("demo_prompts").emit({"train": counts, "with_reply": len(plan.replies),
                                  "users": len(plan.users), "out": str(a.out)})  # fmt: skip


if __name__ == "__main__":
    main()
