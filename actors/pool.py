"""The prompt pool: every real prompt the installed sources give that a run never benchmarks nor
gives its simulated users; `data.source: pool` trains on it (actors/prompts.py decides the keys
left out) and benchmarks/base_pool.py writes it for the base drafter's build.

- ShareGPT: each user turn of at most `TURN_CHARS` characters is a prompt, with the turns before
  it (user and assistant, as the dataset has them) as context, at most `CONTEXT_CHARS`
  characters in all: the oldest turns are dropped first. The target regenerates the last reply.
- HumanEval and the lm_eval exemplars, as the demo reads them.

Domains (what the benchmark reports: chat, coding, math): HumanEval is coding, lm_eval math, and a
ShareGPT prompt is coding or math when its last user turn reads so (`domain_of`), else chat. The
wheels hold no more coding or math text under a usable licence (docs/data.md), so ShareGPT's own
coding and math turns are what lets a round draw those domains at chat's scale: about 7k coding
and 1k math prompts of the 52k; `actors.prompts` draws each round's domains by weight until a
domain runs out.

Left out: every prompt the demo holds out (its benchmark), gives its simulated users, or
benchmarks from a file (`bench.eval_files`, `benchmarks/prompts/*.jsonl`), by prompt key; and
every prompt that starts with one of them (its first messages, up to a user turn), so none is
the context of a training prompt either (a prompt whose context was cut can start with a turn
another chat held out). Duplicates (by prompt key) are kept once. And every prompt the starting
drafter was trained on (`trained`, the hashes of its key file, actors/prompt_keys.py).
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from actors.prompt_keys import key_hash
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
DOMAINS = ("chat", "coding", "math")

# A turn that shows code or names a programming language or task. Matched on the last user turn
# only: the earlier turns are context, the reply answers the last one. Checked first, so a
# numeric coding question counts as coding. Read on a sample: about 4 in 5 are coding requests.
_CODING = re.compile(
    r"```|^\s*(def |class |import |from \S+ import|#include|public |function |const |SELECT )"
    r"|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react(?:js)?|"
    r"node\.?js|django|flask|regex|bash|powershell|kotlin|php|ruby|scala|matlab|pandas|numpy|"
    r"code|coding|script|programming|algorithm|compile|debug)\b",
    re.IGNORECASE | re.MULTILINE,
)
# Arithmetic written out, or the vocabulary of a math task. Not arithmetic: ShareGPT's "2 / 2"
# regeneration counters ("/" is left out), ranges, dates and ids ("1-4": "-" needs spaces).
_MATH = re.compile(
    r"\d\s*[+*^×÷=]\s*\d|\d\s-\s\d|\\frac|\\int|\\sum|\b(solve|equation|calculate|probability|integral|"
    r"derivative|theorem|prove|algebra|geometry|polynomial|logarithm|arithmetic|fraction|"
    r"mathematics|math)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Pool:
    prompts: list[Prompt]  # distinct by prompt key, in a seeded order
    counts: dict[str, int]  # per source, in the pool
    left_out: dict[str, int]  # per source, prompts left out because the demo uses them
    duplicates: int  # prompts dropped as repeats of an earlier one
    trained_before: int = 0  # distinct prompts left out because the starting drafter had them
    domains: dict[str, int] | None = None  # per domain, in the pool


def domain_of(conv: Conversation) -> str:
    """A ShareGPT prompt's domain, from its last user turn (see `_CODING`, `_MATH`)."""
    text = conv[-1]["content"]
    return "coding" if _CODING.search(text) else "math" if _MATH.search(text) else "chat"


def build_pool(
    excluded: set[str],
    seed: int = 0,
    turn_chars: int = TURN_CHARS,
    context_chars: int = CONTEXT_CHARS,
    trained: frozenset[str] = frozenset(),
    last_turn: bool = False,
) -> Pool:
    """The pool without the prompts whose keys are `excluded` and those whose key hashes are
    `trained` (see the module docstring). `last_turn`: each ShareGPT prompt is its user turn
    alone, without the turns before it (`data.pool_turns: last`)."""
    left_out: Counter[str] = Counter()
    candidates: list[Prompt] = []
    for rec in sharegpt_records():
        conv = parse_conversation(rec.get("conversations") or [])
        candidates += [
            Prompt(c[-1:] if last_turn else c, domain_of(c), "sharegpt")
            for c in bounded_turns(conv, turn_chars, context_chars)
        ]
    candidates += humaneval_prompts() + lm_eval_prompts()
    unique: dict[str, Prompt] = {}
    lengths = {len(k) for k in excluded}
    for p in candidates:
        if _starts_with_any(p.messages, excluded, lengths):
            left_out[p.source] += 1
        else:
            unique.setdefault(prompt_key(p.messages), p)
    seen = {k for k, p in unique.items() if trained and key_hash(p.messages) in trained}
    unique = {k: p for k, p in unique.items() if k not in seen}
    keys = sorted(unique)  # the order depends on the seed only, not on the sources' order
    random.Random(seed).shuffle(keys)
    kept = [unique[k] for k in keys]
    return Pool(
        kept,
        dict(Counter(p.source for p in kept)),
        {s: left_out.get(s, 0) for s in ("sharegpt", "humaneval", "lm_eval")},
        len(candidates) - sum(left_out.values()) - len(kept) - len(seen),
        len(seen),
        {d: sum(p.domain == d for p in kept) for d in DOMAINS},
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
