"""Request validation of the OpenAI endpoints: the one gate between a client's JSON and a batch.

`parse_body` turns raw request bytes into a dict (invalid UTF-8 or JSON is the client's error);
`check_request` checks every field the server reads (type, range, token ids against the
vocabulary, UTF-8 of every string, prompt + max_tokens against the context) and returns the
settled values, or raises BadRequest naming every bad field at once. Nothing that failed here
ever joins a batch, so a malformed request cannot fail the valid requests batched with it.
OpenAI fields the server does not implement are refused by name (UNSUPPORTED), never ignored;
a role is one of ROLES, never template markup; text longer than the context could hold is
refused by its characters before any tokenizer sees it (`Limits.max_chars`).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serve.stops import stop_problem, stop_strings

if TYPE_CHECKING:
    from serve.engine import GenParams

DEFAULT_MAX_TOKENS = 256
MAX_STEPS = 16
MAX_TOPK = 16
MAX_BODY_BYTES = 16 << 20  # far above any context's worth of text; a bigger body is refused
MESSAGE_KEYS = frozenset({"role", "content"})  # what the server reads and the traffic log keeps
# The roles the chat template renders: any other string reached the template verbatim, so a
# role holding "<|im_end|>...<|im_start|>assistant" became real turn markup (issue 43).
ROLES = ("system", "user", "assistant")
# OpenAI (and vLLM) fields this server does not implement -> the values that change nothing
# (clients often send the defaults). Anything else is refused by name: silently ignored, a
# client got plain output and believed it had, e.g., JSON mode or a penalty.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}
# Below this a draw is all but always the greedy token, and far enough down (1e-40) the sampler's
# logits / temperature overflows float32 (NaN probabilities: torch.multinomial raised, a 500), so
# such a temperature is served as 0, greedy (vLLM draws the line at the same place).
MIN_TEMPERATURE = 1e-5


class BadRequest(ValueError):
    """A request the server cannot serve; answered with HTTP 400 (`status`)."""

    status = 400


class BodyTooLarge(BadRequest):
    """A body over MAX_BODY_BYTES; answered with HTTP 413 before it is read whole."""

    status = 413


class BodyTimeout(BadRequest):
    """A body not received within `serve.body_timeout_s`; HTTP 408."""

    status = 408


@dataclass(frozen=True)
class Limits:
    """What the served model allows: token ids in [0, vocab_size), prompt + completion within
    max_context (0 = unknown), and the engine's default drafting shape (for the tree check).
    `static_capacity`: KV slots of the engine's static runner (0 = none), which must also hold
    one verify pass beyond prompt + completion (serve/engine/loop.py `_check_fits`).
    `max_chars`: the most characters of text a prompt may hold (0 = no limit): the context
    times the longest vocabulary entry, since no token covers more characters than its own
    string has (`max_prompt_chars`); longer text cannot fit and is refused untokenized."""

    vocab_size: int
    max_context: int
    steps: int
    topk: int
    num_draft_tokens: int | None
    static_capacity: int = 0
    max_chars: int = 0


@dataclass(frozen=True)
class CheckedRequest:
    prompt: list[int]
    params: GenParams
    speculative: bool
    stream: bool
    include_usage: bool
    record: bool = True
    stop: tuple[str, ...] = ()  # stop strings (serve/stops.py)


async def read_body(chunks: AsyncIterator[bytes], declared: str | None) -> bytes:
    """The request body, refused (BodyTooLarge) past MAX_BODY_BYTES, whether the client declared
    its length or not, without reading more than that."""
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"body: {declared} bytes is over the limit of {MAX_BODY_BYTES}")
    out, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"body: over the limit of {MAX_BODY_BYTES} bytes")
        out.append(chunk)
    return b"".join(out)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; BadRequest for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body: not valid UTF-8 (byte {e.start}); send UTF-8 JSON") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON ({e})") from None
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
    """a == b as JSON values: 0 and 0.0 alike, but a bool is not the number 0 or 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def max_prompt_chars(vocab: dict[str, int], max_context: int) -> int:
    """`Limits.max_chars` for a tokenizer's vocabulary (`get_vocab()`): a byte-level or
    SentencePiece entry spells each byte or character it covers with at least one character,
    so text of more characters than this needs more tokens than the context holds."""
    return max_context * max(map(len, vocab), default=0) if max_context else 0


def _utf8(v: str) -> bool:
    try:
        v.encode("utf-8")  # a lone surrogate (JSON "\ud800") cannot be encoded
    except UnicodeEncodeError:
        return False
    return True


def check_request(
    body: dict[str, Any],
    chat: bool,
    limits: Limits,
    encode: Callable[[str], list[int]],
    apply_template: Callable[[list[dict[str, Any]]], list[int]],
) -> CheckedRequest:
    """Every field the server reads, checked; BadRequest lists each problem as `field: why`."""
    problems = [
        f"{k}: {_short(body[k])} is not supported by this server; leave it out"
        for k, neutral in UNSUPPORTED.items()
        if k in body and not any(_same(body[k], v) for v in neutral)
    ]
    prompt = _prompt(body, chat, encode, apply_template, problems, limits.max_chars)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        field = "messages" if chat else "prompt"
        problems.append(
            f"{field}: token id(s) {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"
        )

    def opt_int(name: str, lo: int, hi: int | None = None) -> int | None:
        v = body.get(name)
        if v is None:
            return None
        if not _is_int(v) or v < lo or (hi is not None and v > hi):
            rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            problems.append(f"{name}: {v!r} must be an integer {rng}")
            return None
        return v

    def opt_number(name: str, default: float, lo: float, hi: float, lo_open: bool = False):
        """A finite number in [lo, hi] ((lo, hi] with `lo_open`); `default` when absent, None
        when bad (reported)."""
        v = body.get(name)
        if v is None:
            return default
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or not (lo < v if lo_open else lo <= v)
            or v > hi
        ):
            problems.append(f"{name}: {v!r} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")  # fmt: skip
            return None
        return float(v)

    def opt_bool(name: str, default: bool) -> bool:
        v = body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            problems.append(f"{name}: {v!r} must be true or false")
            return default
        return v

    cap = limits.max_context or None  # no completion is longer than the context
    max_tokens = opt_int("max_tokens", 1, cap)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = opt_int("max_completion_tokens", 1, cap)
    if max_tokens is None and not any(
        body.get(k) is not None for k in ("max_tokens", "max_completion_tokens")
    ):
        room = limits.max_context - len(prompt) if limits.max_context else DEFAULT_MAX_TOKENS
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))  # absent: the default, within context
    max_tokens = max_tokens or 1  # a bad value, already reported
    temperature = opt_number("temperature", 1.0, 0, 2)  # absent: OpenAI's default
    if temperature is None or temperature < MIN_TEMPERATURE:  # bad (reported), or served greedy
        temperature = 0.0
    top_p = opt_number("top_p", 1.0, 0, 1, lo_open=True)  # absent: the whole distribution
    if top_p is None:  # bad, reported
        top_p = 1.0
    top_k = opt_int("top_k", -1)  # vLLM's and SGLang's extension: -1 or 0 = every token
    top_k = max(0, top_k or 0)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        problems.append(f"n: {n!r}; only 1 completion per request is supported")
    if problem := stop_problem(body.get("stop")):
        problems.append(problem)
    seed = opt_int("seed", -(2**63), 2**63 - 1)
    steps = opt_int("steps", 1, MAX_STEPS)
    topk = opt_int("topk", 1, MAX_TOPK)
    n_tokens = opt_int("num_draft_tokens", 2, 1 + MAX_TOPK + (MAX_STEPS - 1) * MAX_TOPK**2)
    from serve.engine import tree_problem  # here: the body helpers above stay torch-free (router)

    tree = tree_problem(
        steps or limits.steps, topk or limits.topk, n_tokens or limits.num_draft_tokens
    )
    if tree:
        problems.append(f"steps/topk/num_draft_tokens: {tree}")
    speculative = opt_bool("speculative", True)
    ignore_eos = opt_bool("ignore_eos", False)
    stream = opt_bool("stream", False)
    record = opt_bool("record", True)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            problems.append(f"stream_options: {opts!r} must be {{'include_usage': true|false}}")
        else:
            include_usage = opts.get("include_usage", False)
    if prompt and limits.max_context and len(prompt) + max_tokens > limits.max_context:
        problems.append(
            f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context of {limits.max_context}; shorten the prompt or lower max_tokens"
        )
    if prompt and limits.static_capacity:
        need = _kv_need(len(prompt), max_tokens, speculative, steps, topk, n_tokens, limits)
        if need > limits.static_capacity:
            problems.append(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + one "
                f"verify pass needs {need} KV slots, over the server's {limits.static_capacity}; "
                "shorten the prompt or lower max_tokens"
            )
    if problems:
        raise BadRequest("; ".join(problems))
    from serve.engine import GenParams

    params = GenParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        steps=steps,
        seed=seed,
        ignore_eos=ignore_eos,
        topk=topk,
        num_draft_tokens=n_tokens,
    )
    stops = stop_strings(body.get("stop"))
    return CheckedRequest(prompt, params, speculative, stream, include_usage, record, stops)


def _kv_need(
    n_prompt: int,
    max_tokens: int,
    speculative: bool,
    steps: int | None,
    topk: int | None,
    n_tokens: int | None,
    limits: Limits,
) -> int:
    """KV slots the static runner needs for this request, as its `_check_fits` counts them:
    prompt + completion + one verify pass (a tree's tokens, a chain's steps + 1, plain: 1) + 1."""
    k, tk = steps or limits.steps, topk or limits.topk
    tree = tk > 1
    width = (n_tokens or limits.num_draft_tokens or k + 1) if tree else k + 1
    return n_prompt + max_tokens + (width if speculative else 1) + 1


def _prompt(
    body: dict[str, Any],
    chat: bool,
    encode: Callable[[str], list[int]],
    apply_template: Callable[[list[dict[str, Any]]], list[int]],
    problems: list[str],
    max_chars: int = 0,
) -> list[int]:
    """The prompt's token ids ([] after recording a problem)."""

    def too_long(n: int, field: str) -> bool:
        if max_chars and n > max_chars:
            problems.append(
                f"{field}: {n} characters cannot fit the context (at most {max_chars} "
                "characters of text); shorten it"
            )
        return bool(max_chars and n > max_chars)

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            problems.append("messages: a non-empty list of {role, content} is required")
            return []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                problems.append(f"messages[{i}]: must be an object with a role and a content")
                return []
            if m.get("role") not in ROLES:
                problems.append(f"messages[{i}].role: {_short(m.get('role'))} must be one of "
                                f"{', '.join(ROLES)}")  # fmt: skip
                return []
            if extra := sorted(set(m) - MESSAGE_KEYS):
                problems.append(f"messages[{i}]: unsupported key(s) {extra}; send role and content only")  # fmt: skip
                return []
            content = m.get("content")
            if not isinstance(content, str) or not _utf8(content):
                problems.append(f"messages[{i}].content: must be a valid UTF-8 string")
                return []
        if too_long(sum(len(m["content"]) for m in messages), "messages"):
            return []
        try:
            return list(apply_template(messages))
        except Exception as e:  # noqa: BLE001 - template errors are the client's
            problems.append(f"messages: cannot apply the chat template ({e})")
            return []
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        if too_long(len(prompt), "prompt"):
            return []
        if not _utf8(prompt):
            problems.append("prompt: not a valid UTF-8 string")
            return []
        return list(encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    problems.append("prompt: a non-empty string or list of token ids is required (one prompt)")
    return []
