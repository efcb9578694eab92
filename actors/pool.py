"""The base drafter's prompt pool: every real prompt the installed sources give that the demo
never benchmarks nor gives its simulated users (issue 23; benchmarks/base_pool.py writes it).

- ShareGPT: each user turn of at most `TURN_CHARS` characters is a prompt, with the turns before
  it (user and assistant, as the dataset has them) as context, at most `CONTEXT_CHARS`
  characters in all: the oldest turns are dropped first. The target regenerates the last reply.
- HumanEval and the lm_eval exemplars, as the demo reads them.

Left out: every prompt the demo holds out (its benchmark), gives its simulated users, or
benchmarks from a file (`bench.eval_files`, `benchmarks/prompts/*.jsonl`), by prompt key; and
every prompt that starts with one of them (its first messages, up to a user turn), so none is
the context of a training prompt either (a prompt whose context was cut can start with a turn
another chat held out). Duplicates (by prompt key) are kept once.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from actors.config import DataConfig
from actors.prompts import (
    Conversation,
    Prompt,
    PromptPlan,
    load_jsonl_prompts,
    plan_prompts,
    prompt_key,
)
from actors.sources import (
    bounded_turns,
    humaneval_prompts,
    lm_eval_prompts,
    parse_conversation,
    sharegpt_records,
)

TURN_CHARS = 2000  # the user turn to answer
CONTEXT_CHARS = 6000  # the whole prompt: that turn and the earlier turns kept as its context
BENCH_FILES = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"


@dataclass(frozen=True)
class Pool:
    prompts: list[Prompt]  # distinct by prompt key, in a seeded order
    counts: dict[str, int]  # per source, in the pool
    left_out: dict[str, int]  # per source, prompts left out because the demo uses them
    duplicates: int  # prompts dropped as repeats of an earlier one


def demo_prompt_keys(data: DataConfig, eval_files: Sequence[str] = ()) -> set[str]:
    """The prompt keys of everything a demo with this `data` section and `bench.eval_files`
    benchmarks or gives its simulated users: its held-out split (all of it, not only
    `bench.num_prompts`), its users' pool, those files and the repository's benchmark sets."""
    return _held_keys(plan_prompts(_as_real(data)), eval_files)


def pool_plan(data: DataConfig, seed: int, eval_files: Sequence[str] = ()) -> PromptPlan:
    """`data.source: pool`'s split: the held-out and user prompts `real` would give (so a pool
    run is judged on the demo's benchmark), and the pool without them as the training order."""
    real = plan_prompts(_as_real(data), seed)
    pool = build_pool(_held_keys(real, eval_files), seed)
    return PromptPlan({"pool": [p.messages for p in pool.prompts]}, real.heldout, real.users, {"pool": 1.0})


def _as_real(data: DataConfig) -> DataConfig:
    """`pool` as `real` (whose prompts it holds): the held-out and user split is per source, and
    traffic's weight does not change it."""
    return data.model_copy(update={"source": "real"}) if "pool" in data.sources() else data


def _held_keys(plan: PromptPlan, eval_files: Sequence[str]) -> set[str]:
    prompts = plan.heldout + plan.users
    files = [Path(f) for f in eval_files] + sorted(BENCH_FILES.glob("*.jsonl"))
    prompts += [p for f in files for p in load_jsonl_prompts(f)]
    return {prompt_key(p.messages) for p in prompts}


def build_pool(
    excluded: set[str],
    seed: int = 0,
    turn_chars: int = TURN_CHARS,
    context_chars: int = CONTEXT_CHARS,
) -> Pool:
    """The pool without the prompts whose keys are `excluded` (see the module docstring)."""
    left_out: Counter[str] = Counter()
    candidates: list[Prompt] = []
    for rec in sharegpt_records():
        conv = parse_conversation(rec.get("conversations") or [])
        candidates += [
            Prompt(c, "chat", "sharegpt") for c in bounded_turns(conv, turn_chars, context_chars)
        ]
    candidates += humaneval_prompts() + lm_eval_prompts()
    unique: dict[str, Prompt] = {}
    lengths = {len(k) for k in excluded}
    for p in candidates:
        if _starts_with_any(p.messages, excluded, lengths):
            left_out[p.source] += 1
        else:
            unique.setdefault(prompt_key(p.messages), p)
    keys = sorted(unique)  # the order depends on the seed only, not on the sources' order
    random.Random(seed).shuffle(keys)
    kept = [unique[k] for k in keys]
    return Pool(
        kept,
        dict(Counter(p.source for p in kept)),
        {s: left_out.get(s, 0) for s in ("sharegpt", "humaneval", "lm_eval")},
        len(candidates) - sum(left_out.values()) - len(kept),
    )


def _starts_with_any(conv: Conversation, excluded: set[str], lengths: set[int]) -> bool:
    """Whether the conversation, or its first messages up to one of its user turns, is an
    excluded prompt. Only beginnings as long as an excluded key (`lengths`) are joined: no
    other can match, and joining every one would cost seconds."""
    size = -1  # prompt_key's length: "role: content" lines joined by newlines
    for end, m in enumerate(conv):
        size += len(m["role"]) + 2 + len(m["content"]) + 1
        if m["role"] == "user" and size in lengths and prompt_key(conv[: end + 1]) in excluded:
            return True
    return False


def read_pool(path: str | Path) -> list[dict]:
    """The records benchmarks/base_pool.py writes (`{"messages", "domain", "source"}` per line),
    from a .jsonl or .jsonl.gz file."""
    op = gzip.open if str(path).endswith(".gz") else open
    with op(path, "rt", encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]
