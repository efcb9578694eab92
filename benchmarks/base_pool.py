"""Write the prompt pool benchmarks/base_drafter.py trains on: every real prompt of the installed
sources that the demo of `--config` never benchmarks nor gives its simulated users.

    python benchmarks/base_pool.py --config configs/smollm2-cpu.yaml --out /work/notes/pool.jsonl.gz

ShareGPT user turns up to `--turn-chars` characters, each with the turns before it as context
(at most `--context-chars` in all, oldest dropped first), HumanEval and the lm_eval exemplars;
deduplicated, in a seeded order (so any prefix is a fair sample). actors/pool.py says what is
left out and why. One `{"messages": [...], "domain": ..., "source": ...}` per line; gzipped when
`--out` ends in .gz. Prints the counts per source, the total and the number left out.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.pool import CONTEXT_CHARS, TURN_CHARS, build_pool  # noqa: E402
from actors.prompts import demo_prompt_keys  # noqa: E402
from benchmarks.harness import Results, parser  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--turn-chars", type=int, default=TURN_CHARS)
    ap.add_argument("--context-chars", type=int, default=CONTEXT_CHARS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = load_config(a.config)
    excluded = demo_prompt_keys(cfg.data, cfg.bench.eval_files or [])
    pool = build_pool(excluded, a.seed, a.turn_chars, a.context_chars)
    lines = "".join(
        json.dumps({"messages": p.messages, "domain": p.domain, "source": p.source}) + "\n"
        for p in pool.prompts
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if a.out.suffix == ".gz" else open)(a.out, "wt", encoding="utf-8") as f:
        f.write(lines)
    chars = sorted(sum(len(m["content"]) for m in p.messages) for p in pool.prompts)
    Results("base_pool").emit({
        "out": str(a.out), "total": len(pool.prompts), "sources": pool.counts, "domains": pool.domains,
        "left_out": sum(pool.left_out.values()), "left_out_by_source": pool.left_out,
        "excluded_keys": len(excluded), "duplicates_dropped": pool.duplicates,
        "prompt_chars_p50": chars[len(chars) // 2], "prompt_chars_p99": chars[int(len(chars) * 0.99)],
    })  # fmt: skip


if __name__ == "__main__":
    main()
