"""The prompt pool: every real prompt the installed sources give that a run never benchmarks nor
gives its simulated users; `data.source: pool` trains on it (actors/prompts.py decides the keys
left out) and benchmarks/base_pool.py writes it for the base drafter's build.

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
from dataclasses import dataclass
from pathlib import Path

from actors.prompt_record import Conversation, Prompt, prompt_key
from actors.sources import (
    bounded_turns,
    humaneval_prompts,
    lm_eval_prompts,
    parse_conversation,
    sharegpt_records,
)

TURN_CHARS = 2000  # the user turn to answer
CONTEXT_CHARS = 6000  # the whole prompt: that turn and the earlier turns kept as its context


@dataclass(frozen=True)
class Pool:
    prompts: list[Prompt]  # distinct by prompt key, in a seeded order
    counts: dict[str, int]  # per source, in the pool
    left_out: dict[str, int]  # per source, prompts left out because the demo uses them
    duplicates: int  # prompts dropped as repeats of an earlier one


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
