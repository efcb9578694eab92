"""Prompts for the generate stage: load them, hold some out for the benchmark, hand out fresh ones
per round.

A prompt is a conversation: a list of ``{"role", "content"}`` dicts that ends with a user turn. The
target regenerates the assistant reply, so any assistant turns after the last user turn of a
source record are dropped.

Sources (``DataConfig.source``):
- ``builtin``: an offline English set built on any machine from the Python standard library's
  docstrings, templated word problems, unit conversions, writing tasks and explain/compare
  questions; deterministic for a seed, a few thousand distinct short prompts.
- ``jsonl``: one record per line, ``{"conversations": [{"role", "content"}...]}`` (or
  ``"messages"``), ShareGPT ``{"conversations": [{"from", "value"}...]}``, or ``{"prompt": "..."}``.
- ``hf``: an HF dataset by name (``DataConfig.path``, ``DataConfig.split``) whose rows have one of
  the shapes above; needs the optional ``datasets`` package.
"""

from __future__ import annotations

import importlib
import json
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.builtin import builtin_prompts  # noqa: F401  (re-exported: callers take it here)
from actors.config import DataConfig
from actors.pool import build_pool
from actors.prompt_keys import KEY_FILE, drafter_prompt_hashes

# Conversation, Prompt and prompt_key live in actors/prompt_record.py (the readers in
# actors/sources.py need them too) and stay importable from here, where callers take them.
from actors.prompt_record import Conversation, Prompt, prompt_key
from actors.sources import READERS, sharegpt_prompts

BENCH_FILES = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"  # never trained on
ACCEPTED_FORMATS = (
    '{"conversations": [{"role": "user", "content": "..."}, ...]} (or "messages"), '
    'ShareGPT {"conversations": [{"from": "human", "value": "..."}, ...]}, '
    'or {"prompt": "..."}'
)
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}  # fmt: skip


@dataclass(frozen=True)
class SelfWritten:
    """A batch of `count` conversations whose user turn the target writes itself before it
    answers (Magpie: sampling continues the chat template's user header), drawn with `seed`.
    Such turns follow the target's own idea of what users ask: the breadth of its chat tuning,
    which a narrow prompt source lacks (docs/data.md)."""

    count: int
    seed: int


@dataclass(frozen=True)
class Answered:
    """A batch the target has already answered: served requests from the traffic log. At
    temperature 0 a served completion is the target's own greedy output (sampled, a sample from
    the target), so these need only the capture pass, no generation."""

    prompt_ids: tuple[tuple[int, ...], ...]
    completion_ids: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Replied:
    """A batch of conversations with the reply their source gives (a ShareGPT turn's assistant
    answer), trained on as written: capture only, no generation. The drafter still learns the
    target's own next-token distribution at every position (soft labels from the target); the
    reply only sets the contexts, which are another model's text, not the target's."""

    conversations: tuple[Conversation, ...]
    replies: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.conversations)


Batch = list[Conversation] | SelfWritten | Answered | Replied


def self_written_batches(
    count: int, batch_size: int, seed: int, round_index: int
) -> list[SelfWritten]:
    """`count` self-written conversations of round `round_index` in batches; seeds differ per
    round and batch, so every round draws fresh turns."""
    sizes = [min(batch_size, count - s) for s in range(0, count, batch_size)]
    return [
        SelfWritten(n, (seed * 1_000_003 + round_index) * 10_007 + b) for b, n in enumerate(sizes)
    ]


def keep_written_turns(texts: list[str], ended: list[bool]) -> list[Conversation]:
    """User turns worth answering: ended within the token budget, at least three words, not a
    repeat of an earlier one in the batch."""
    seen: set[str] = set()
    out: list[Conversation] = []
    for text, done in zip(texts, ended, strict=True):
        t = text.strip()
        if done and len(t.split()) >= 3 and t not in seen:
            seen.add(t)
            out.append([{"role": "user", "content": t}])
    return out


class PromptFormatError(ValueError):
    """A prompt record that no accepted format matches."""


@dataclass(frozen=True)
class PromptPlan:
    """The prompts of a run, split once: per source a seeded training order, the held-out
    benchmark prompts (interleaved across domains, so any prefix covers them all), the
    simulated users' pool and the gate set (the train stage's fixed eval set, interleaved like
    the benchmark). The four never share a prompt text."""

    train: dict[str, list[Conversation]]
    heldout: list[Prompt]
    users: list[Prompt]
    weights: dict[str, float]  # of the prompt sources (traffic excluded), summing to 1
    replies: dict[str, str] = field(default_factory=dict)  # prompt_key -> the source's reply
    # the pool's rule: a source (a domain of the pool) that runs out of fresh prompts hands its
    # share to the others (`fresh_quotas`); otherwise each keeps its weight and wraps around
    fill: bool = False
    gate: list[Prompt] = field(default_factory=list)  # `data.gate_prompts` per source


def load_prompts(data: DataConfig) -> list[Conversation]:
    """All prompts of ``data.source`` (every source of a mix), each a conversation ending with a
    user turn."""
    return [
        p.messages for src in data.sources() if src != "traffic" for p in load_source(src, data)
    ]


def load_source(source: str, data: DataConfig) -> list[Prompt]:
    """The prompts of one source, tagged with their domain."""
    if source == "sharegpt":
        return sharegpt_prompts(data.max_prompt_chars)
    if source in READERS:
        return READERS[source]()
    if source == "builtin":
        return [Prompt(c, "builtin", "builtin") for c in builtin_prompts(data.seed)]
    if source == "jsonl":
        paths = data.path if isinstance(data.path, list) else [data.path or ""]
        return [p for path in paths for p in load_jsonl_prompts(Path(path))]
    if source == "hf":
        return [Prompt(c, str(data.path), "hf") for c in _load_hf(data)]
    raise ValueError(
        f"data.source: unknown source {source!r}; use real, sharegpt, humaneval, lm_eval, "
        "builtin, jsonl, hf or traffic"
    )


def load_jsonl_prompts(path: Path) -> list[Prompt]:
    """A prompt file; each record's domain is its `domain` field, else the file's stem."""
    return [Prompt(c, d or path.stem, "jsonl") for c, d in _load_jsonl(path, with_domain=True)]


def plan_prompts(
    data: DataConfig,
    seed: int | None = None,
    eval_files: Sequence[str] = (),
    trained: frozenset[str] = frozenset(),
) -> PromptPlan:
    """Load every prompt source of `data` and split it: per source `data.heldout_prompts` held
    out, then its share of `data.user_prompts`, then `data.gate_prompts` for the gate set, the
    rest training material in a seeded order. The gate set comes last, so the held-out and user
    splits are the same with or without it.
    Source `pool` trains on actors/pool.py's pool, without those, the prompts of `eval_files`
    (`bench.eval_files`) and of the repository's benchmark sets, and the prompts whose key hashes
    are `trained` (the starting drafter's key file: `init_trained_hashes`), one training order
    per domain. The other sources keep the starting drafter's prompts: the demo refits its
    off-policy drafter on the very prompts it learned another model's replies to."""
    seed = data.seed if seed is None else seed
    if "pool" in data.sources():
        return _pool_plan(data, seed, eval_files, trained)
    weights = {k: w for k, w in data.sources().items() if k != "traffic"}
    total = sum(weights.values())
    weights = {k: w / total for k, w in weights.items()}
    shuffled = {}
    for src in weights:
        unique: dict[str, Prompt] = {}
        for p in load_source(src, data):
            unique.setdefault(prompt_key(p.messages), p)
        keys = sorted(unique)  # input order must not matter, only the seed
        random.Random(seed).shuffle(keys)
        shuffled[src] = [unique[k] for k in keys]
    heldout_by, users, gate_by, taken = {}, [], {}, set()
    for src, prompts in shuffled.items():
        n_users = round(data.user_prompts * weights[src])
        held, used = data.heldout_prompts, data.heldout_prompts + n_users
        if used + data.gate_prompts >= len(prompts):
            raise ValueError(
                f"data.heldout_prompts: {held} (+ {n_users} simulated users' prompts + "
                f"data.gate_prompts {data.gate_prompts}) leaves no training prompts out of "
                f"{len(prompts)} distinct ones of source {src!r}; lower them or add prompts"
            )
        heldout_by[src] = prompts[:held]
        users += prompts[held:used]
        gate_by[src] = prompts[used : used + data.gate_prompts]
        taken |= {prompt_key(p.messages) for p in prompts[: used + data.gate_prompts]}
    train = {
        src: [p.messages for p in prompts if prompt_key(p.messages) not in taken]
        for src, prompts in shuffled.items()
    }
    replies = {
        prompt_key(p.messages): p.reply
        for prompts in shuffled.values()
        for p in prompts
        if p.reply and prompt_key(p.messages) not in taken
    }
    heldout, gate = interleave(list(heldout_by.values())), interleave(list(gate_by.values()))
    return PromptPlan(train, heldout, users, weights, replies, gate=gate)


def demo_prompt_keys(data: DataConfig, eval_files: Sequence[str] = ()) -> set[str]:
    """The prompt keys of everything a demo with this `data` section and `bench.eval_files`
    benchmarks, gives its simulated users or gates training on: its held-out split (all of it,
    not only `bench.num_prompts`), its users' pool, its gate set, those files and the
    repository's benchmark sets."""
    return _held_keys(plan_prompts(_as_real(data)), eval_files)


def init_trained_hashes(init: str) -> frozenset[str]:
    """The prompt-key hashes the starting drafter (`drafter.init`, resolved) was trained on:
    its folder's key file (actors/prompt_keys.py); none for `scratch`, a Hub id or a folder
    without one (it warns: the pool may then regenerate prompts the drafter already learned)."""
    if init in ("scratch", "previous"):
        return frozenset()
    hashes = drafter_prompt_hashes(init) if Path(init).is_dir() else None
    if hashes is None:
        warnings.warn(
            f"drafter.init {init!r} has no {KEY_FILE}: the pool cannot leave out the prompts it "
            "was trained on (benchmarks/drafter_prompt_keys.py writes one)",
            stacklevel=2,
        )
    return hashes or frozenset()


def _pool_plan(
    data: DataConfig, seed: int, eval_files: Sequence[str], trained: frozenset[str]
) -> PromptPlan:
    """`data.source: pool`'s split: the held-out, user and gate prompts `real` would give (so a
    pool run is judged on the demo's benchmark), and the pool without them and without the
    `trained` prompts, as one training order per domain weighted by `data.pool_domains`."""
    real = plan_prompts(_as_real(data), seed)
    last = data.pool_turns == "last"
    pool = build_pool(_held_keys(real, eval_files), seed, trained=trained, last_turn=last)
    train = {
        d: [p.messages for p in pool.prompts if p.domain == d]
        for d, w in data.pool_domains.items()
        if w > 0
    }
    train = {d: convs for d, convs in train.items() if convs}  # a domain with none: no share
    total = sum(data.pool_domains[d] for d in train)
    weights = {d: data.pool_domains[d] / total for d in train}
    return PromptPlan(train, real.heldout, real.users, weights, fill=True, gate=real.gate)


def _as_real(data: DataConfig) -> DataConfig:
    """`pool` as `real` (whose prompts it holds): the held-out and user split is per source, and
    traffic's weight does not change it."""
    return data.model_copy(update={"source": "real"}) if "pool" in data.sources() else data


def _held_keys(plan: PromptPlan, eval_files: Sequence[str]) -> set[str]:
    prompts = plan.heldout + plan.users + plan.gate
    files = [Path(f) for f in eval_files] + sorted(BENCH_FILES.glob("*.jsonl"))
    prompts += [p for f in files for p in load_jsonl_prompts(f)]
    return {prompt_key(p.messages) for p in prompts}


def interleave(groups: list[list[Prompt]]) -> list[Prompt]:
    """Round-robin over groups: the first n prompts cover every group as evenly as possible."""
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out += [g[i] for g in groups if i < len(g)]
        i += 1
    return out


def source_quotas(weights: dict[str, float], n: int) -> dict[str, int]:
    """`n` split by weight into integers summing to `n` (largest remainders first)."""
    total = sum(weights.values())
    raw = {k: n * w / total for k, w in weights.items()}
    out = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: out[k] - raw[k])[: n - sum(out.values())]:
        out[k] += 1
    return out


def fresh_quotas(weights: dict[str, float], n: int, left: dict[str, int]) -> dict[str, int]:
    """`n` split by weight, no source given more than its `left` fresh prompts while another
    still has some: a source that runs out hands its share to the others, by their weights.
    Only what no source can give fresh is split by weight again (and reused)."""
    out = dict.fromkeys(weights, 0)
    open_ = {k for k, w in weights.items() if w > 0 and left.get(k, 0) > 0}
    need = n
    while need and open_:
        share = source_quotas({k: weights[k] for k in open_}, need)
        full = {k for k in open_ if share[k] >= left[k]}
        if not full:
            for k in open_:
                out[k] += share[k]
            return out
        for k in full:  # give these all they have left, then split the rest again
            out[k] += left[k]
            need -= left[k]
        open_ -= full
    if need:  # nothing fresh is left anywhere: the rest reuses prompts, by weight
        for k, v in source_quotas(weights, need).items():
            out[k] += v
    return out


def mixed_round(
    plan: PromptPlan, n: int, drawn: dict[str, int]
) -> tuple[list[Conversation], dict[str, int]]:
    """`n` fresh training prompts split across sources by weight (the pool's domains:
    `fresh_quotas`), each source continuing after the `drawn` prompts earlier rounds took from
    it (wrapping, with a warning, when it runs out), interleaved so that every prefix holds the
    sources in the round's proportions (`interleaved`); returns the prompts and how many came
    from each source."""
    if plan.fill:
        left = {s: max(0, len(plan.train[s]) - drawn.get(s, 0)) for s in plan.weights}
        counts = fresh_quotas(plan.weights, n, left)
    else:
        counts = source_quotas(plan.weights, n)
    blocks: list[list[Conversation]] = []
    for src, k in counts.items():
        pool = plan.train[src]
        start = drawn.get(src, 0)
        if k and start + k > len(pool):
            warnings.warn(
                f"source {src!r}: its {len(pool)} training prompts are used up after {start}; "
                "reusing prompts (add prompts for fresh data)",
                stacklevel=2,
            )
        blocks.append([pool[(start + i) % len(pool)] for i in range(k)])
    return interleaved(blocks), counts


def interleaved(blocks: list[list[Conversation]]) -> list[Conversation]:
    """The blocks merged, each item placed at its fractional rank in its block ((i + 1/2) / len),
    ties in block order: every prefix holds the blocks in their proportions. A data stage makes
    its batches in this order and a deadline cuts the tail, so a cut round keeps its source mix
    (in source order, the demo's cut rounds had left out the last source, math, whole)."""
    ranked = [((i + 0.5) / len(b), j, i) for j, b in enumerate(blocks) for i in range(len(b))]
    return [blocks[j][i] for _, j, i in sorted(ranked)]


def round_slices(
    plan: PromptPlan, n: int, earlier: list[dict[str, int]]
) -> tuple[list[Conversation], dict[str, list[int]]]:
    """A round's `n` fresh prompts and the slice of each source's training order they are:
    `{source: [start, end)}`, starting where the `earlier` rounds' draws (`{source: count}`
    each) ended. The same earlier draws give the same slice, so a resumed round redoes its own;
    consecutive rounds get consecutive, disjoint slices (until a source wraps, with a warning)."""
    drawn: dict[str, int] = {}
    for counts in earlier:
        for src, k in counts.items():
            drawn[src] = drawn.get(src, 0) + k
    prompts, counts = mixed_round(plan, n, drawn)
    return prompts, {s: [drawn.get(s, 0), drawn.get(s, 0) + k] for s, k in counts.items() if k}


def split_prompts(
    prompts: list[Conversation], heldout: int, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministically pick ``heldout`` prompts for the benchmark; the rest (distinct by text from
    every held-out prompt, duplicates removed) is training material in a seeded order."""
    unique: dict[str, Conversation] = {}
    for conv in prompts:
        unique.setdefault(prompt_key(conv), conv)
    if heldout >= len(unique):
        raise ValueError(
            f"data.heldout_prompts: {heldout} leaves no training prompts out of {len(unique)} "
            "distinct ones; lower it or add prompts"
        )
    keys = sorted(unique)  # input order must not matter, only the seed
    random.Random(seed).shuffle(keys)
    return [unique[k] for k in keys[heldout:]], [unique[k] for k in keys[:heldout]]


def round_prompts(train: list[Conversation], round_index: int, n: int) -> list[Conversation]:
    """The ``n`` prompts of round ``round_index``: consecutive, non-overlapping slices of ``train``;
    wraps around (with a warning) once every training prompt has been used."""
    if not train:
        raise ValueError("round_prompts: no training prompts")
    if n > len(train):
        warnings.warn(
            f"data.prompts_per_round={n} > {len(train)} training prompts; using all of them",
            stacklevel=2,
        )
        n = len(train)
    start = round_index * n
    if start + n > len(train):
        warnings.warn(
            f"round {round_index}: the {len(train)} training prompts are exhausted after "
            f"{len(train) // n} rounds of {n}; reusing prompts (add prompts for fresh data)",
            stacklevel=2,
        )
    return [train[(start + i) % len(train)] for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Records from files and datasets


def parse_record(rec: Any, where: str) -> Conversation:
    """One record in any accepted format → a conversation ending with its last user turn."""
    if not isinstance(rec, dict):
        raise PromptFormatError(
            f"{where}: expected a JSON object; accepted formats: {ACCEPTED_FORMATS}"
        )
    if isinstance(rec.get("prompt"), str):
        conv = [{"role": "user", "content": rec["prompt"]}]
    else:
        turns = rec.get("conversations", rec.get("messages"))
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
            raise PromptFormatError(
                f"{where}: unknown record format (keys {sorted(rec)[:8]}); accepted formats: {ACCEPTED_FORMATS}"
            )
        conv = [_turn(t, where) for t in turns]
    last_user = max((i for i, m in enumerate(conv) if m["role"] == "user"), default=-1)
    if last_user < 0:
        raise PromptFormatError(f"{where}: the conversation has no user turn to answer")
    return conv[: last_user + 1]


def _turn(t: dict[str, Any], where: str) -> dict[str, str]:
    if "role" in t and "content" in t and isinstance(t["content"], str):
        return {"role": str(t["role"]), "content": t["content"]}
    if "from" in t and "value" in t and isinstance(t["value"], str):
        role = _SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise PromptFormatError(
                f"{where}: unknown ShareGPT speaker {t['from']!r}; use one of {sorted(_SHAREGPT_ROLES)}"
            )
        return {"role": role, "content": t["value"]}
    raise PromptFormatError(
        f"{where}: unknown turn format (keys {sorted(t)}); accepted formats: {ACCEPTED_FORMATS}"
    )


def _load_jsonl(path: Path, with_domain: bool = False) -> list[Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"data.path: prompt file {path} does not exist; point data.path at a JSONL file"
        )
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFormatError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            conv = parse_record(rec, f"{path}:{lineno}")
            domain = rec.get("domain") if isinstance(rec.get("domain"), str) else None
            out.append((conv, domain) if with_domain else conv)
    if not out:
        raise ValueError(f"data.path: prompt file {path} is empty; add one JSON record per line")
    return out


def _load_hf(data: DataConfig) -> list[Conversation]:
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise ImportError(
            f"data.source=hf (data.path={data.path!r}) needs the `datasets` package: "
            "pip install datasets, or export the prompts to JSONL and use data.source=jsonl"
        ) from None
    ds = datasets.load_dataset(data.path, split=data.split)
    out = [
        parse_record(dict(row), f"{data.path}[{data.split}] row {i}") for i, row in enumerate(ds)
    ]
    if not out:
        raise ValueError(f"data.path: dataset {data.path!r} split {data.split!r} has no rows")
    return out
