"""Write the prompt pool benchmarks/base_drafter.py trains on: every real prompt of the installed
sources that the demo of `--config` never benchmarks nor gives its simulated users.

    python benchmarks/base_pool.py --config configs/smollm2-cpu.yaml --out /work/notes/pool.jsonl.gz

    python benchmarks/base_pool.py --config configs/smollm2-1gpu-climb.yaml --ab /tmp/p

ShareGPT user turns up to `--turn-chars` characters, each with the turns before it as context
(at most `--context-chars` in all, oldest dropped first), HumanEval and the lm_eval exemplars;
deduplicated, in a seeded order (so any prefix is a fair sample). actors/pool.py says what is
left out and why. One `{"messages": [...], "domain": ..., "source": ...}` per line; gzipped when
`--out` ends in .gz. Prints the counts per source, the total and the number left out.

`--ab DIR`: the files of scripts/gpu_data_ab.sh instead: the config's round-0 pool slice as the
loop draws it (`multi.jsonl.gz`, with context) and the same prompts cut to their user turn
(`last.jsonl.gz`), 256 of its simulated users' prompts (`users.jsonl.gz`) and its held-out
prompts per domain (`heldout-<domain>.jsonl`).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.pool import CONTEXT_CHARS, TURN_CHARS, build_pool, domain_of  # noqa: E402
from actors.prompts import demo_prompt_keys  # noqa: E402
from benchmarks.harness import Results, parser  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ab", type=Path, help="write scripts/gpu_data_ab.sh's files here instead")
    ap.add_argument("--turn-chars", type=int, default=TURN_CHARS)
    ap.add_argument("--context-chars", type=int, default=CONTEXT_CHARS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = load_config(a.config)
    if a.ab:
        return ab_files(cfg, a.ab)
    if a.out is None:
        ap.error("--out (or --ab) is required")
    excluded = demo_prompt_keys(cfg.data, cfg.bench.eval_files or [])
    pool = build_pool(excluded, a.seed, a.turn_chars, a.context_chars)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    _write(a.out, [{"messages": p.messages, "domain": p.domain, "source": p.source} for p in pool.prompts])  # fmt: skip
    chars = sorted(sum(len(m["content"]) for m in p.messages) for p in pool.prompts)
    Results("base_pool").emit({
        "out": str(a.out), "total": len(pool.prompts), "sources": pool.counts, "domains": pool.domains,
        "left_out": sum(pool.left_out.values()), "left_out_by_source": pool.left_out,
        "excluded_keys": len(excluded), "duplicates_dropped": pool.duplicates,
        "prompt_chars_p50": chars[len(chars) // 2], "prompt_chars_p99": chars[int(len(chars) * 0.99)],
    })  # fmt: skip


def _write(path: Path, rows: list[dict]) -> None:
    """One JSON object a line; gzipped when `path` ends in .gz."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _convs(convs: list) -> list[dict]:
    return [{"messages": c, "domain": domain_of(c)} for c in convs]


def ab_files(cfg, out: Path) -> None:
    """The data-shape A/B's prompt files (see the module docstring)."""
    from actors.prompts import init_trained_hashes, plan_prompts, round_slices

    trained = init_trained_hashes(cfg.drafter.init)
    data = cfg.data.model_copy(update={"pool_turns": "context"})  # whatever the config draws
    plan = plan_prompts(data, eval_files=cfg.bench.eval_files or [], trained=trained)
    convs, slices = round_slices(plan, data.prompts_per_round, [])
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "multi.jsonl.gz", _convs(convs))
    _write(out / "last.jsonl.gz", _convs([c[-1:] for c in convs]))
    _write(out / "users.jsonl.gz", _convs([p.messages for p in plan.users[:256]]))
    for d in sorted({p.domain for p in plan.heldout}):
        _write(out / f"heldout-{d}.jsonl", [{"messages": p.messages} for p in plan.heldout if p.domain == d])  # fmt: skip
    Results("base_pool").emit({"ab": str(out), "slice": slices, "prompts": len(convs),
                               "multi_turn": sum(len(c) > 1 for c in convs)})  # fmt: skip


if __name__ == "__main__":
    main()
