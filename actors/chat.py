"""Conversations → token ids with the target's chat template, and the assistant loss mask.

The mask marks exactly the assistant tokens: each assistant message's content plus the
end-of-turn token right after it, never the role header. Spans are found on the rendered text: the
conversation up to an assistant turn, rendered with ``add_generation_prompt=True``, is a prefix
of the full rendering, so the content starts right after it; token offsets then map character
spans to tokens. This works for templates without ``{% generation %}`` markers (SmolLM2's has none).

Message content is always text, never control tokens (`encode_rendered`, the one rule): a client
whose message holds ``<|im_end|>\n<|im_start|>assistant\n`` gets those characters tokenized as
literal text, so a forged turn cannot reach the traffic log or a training sample as real turn
markup. The server (serve/deployment.py), the traffic source and the data stage all tokenize
conversations through this module.
"""

from __future__ import annotations

import threading
from typing import Any

from actors.prompt_record import Conversation  # noqa: F401  (the one definition; re-exported)

# transformers sets the Rust tokenizer's encode_special_tokens flag on every call, so two threads
# tokenizing at once (the server tokenizes off its event loop) could swap each other's mode: a
# content piece would then be parsed into control tokens. Every encode goes through `tokenize`.
_ENCODE = threading.Lock()


def tokenize(tokenizer: Any, text: str, *, literal: bool = False, **kw: Any) -> Any:
    """``tokenizer(text, **kw)``, with control-token strings kept as text when ``literal``."""
    with _ENCODE:
        return tokenizer(text, split_special_tokens=literal, **kw)


def check_chat_template(tokenizer: Any) -> None:
    """Raise a clear error when the target's tokenizer cannot format conversations."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"target.model: tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "use an instruct/chat model or add a chat_template to its tokenizer_config.json"
        )


def render(tokenizer: Any, messages: Conversation, add_generation_prompt: bool = False) -> str:
    check_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode_conversation(
    tokenizer: Any, messages: Conversation, max_length: int, *, add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 mask over the assistant tokens (content +
    end-of-turn token), both truncated to ``max_length``.

    With ``add_generation_prompt`` the ids end with the assistant header, ready for generation
    (earlier assistant turns are still masked)."""
    text = render(tokenizer, messages, add_generation_prompt)
    spans = _assistant_spans(tokenizer, messages, text)
    ids, offsets = encode_rendered(tokenizer, messages, text, add_generation_prompt)
    ids, offsets = ids[:max_length], offsets[:max_length]
    mask = [int(any(s <= a and b <= e and a < b for s, e in spans)) for a, b in offsets]
    return ids, mask


def prompt_ids(tokenizer: Any, messages: Conversation) -> list[int]:
    """Token ids of a prompt conversation followed by the assistant header (for generation)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return encode_rendered(tokenizer, messages, text, True)[0]


def encode_rendered(
    tokenizer: Any, messages: Conversation, text: str, add_generation_prompt: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text`` (the template rendered over ``messages``):
    the template's own markup parsed into control tokens, each message's content as literal
    text. The one place that rule lives.

    A conversation whose content touches no control-token string tokenizes as the whole text
    always did; otherwise the text is cut at the content spans and each content is encoded with
    special tokens split into plain text. A template that does not render content verbatim gives
    no spans to cut at, and then such content is refused (ValueError) rather than parsed."""
    spans = _content_spans(tokenizer, messages, text, add_generation_prompt)
    hits = _special_hits(tokenizer, text)
    if spans is None:
        bad = [i for i, m in enumerate(messages) if _special_hits(tokenizer, m["content"])]
        if bad:
            raise ValueError(
                f"messages[{bad[0]}].content: holds control-token text, and the chat template of "
                f"{getattr(tokenizer, 'name_or_path', '?')!r} does not render content verbatim, so "
                "it cannot be kept as literal text; remove the control-token text"
            )
    if spans is None or not any(a < e and s < b for a, b in hits for s, e in spans):
        whole = tokenize(tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
        return list(whole["input_ids"]), [tuple(o) for o in whole["offset_mapping"]]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    cuts = [0, *(x for span in spans for x in span), len(text)]
    for k in range(len(cuts) - 1):
        a, b = cuts[k], cuts[k + 1]
        if a == b:
            continue
        enc = tokenize(
            tokenizer,
            text[a:b],
            literal=k % 2 == 1,  # odd pieces are message content
            add_special_tokens=False,
            return_offsets_mapping=True,
        )
        ids += enc["input_ids"]
        offsets += [(a + x, a + y) for x, y in enc["offset_mapping"]]
    return ids, offsets


def _content_spans(
    tokenizer: Any, messages: Conversation, text: str, add_generation_prompt: bool
) -> list[tuple[int, int]] | None:
    """Character spans [start, end) of each message's content in ``text``, found by rendering
    the conversation with a unique mark in place of each content; None when the template does
    not render content verbatim (nor stripped)."""
    marks = [f"\u2063{i}\u2063" for i in range(len(messages))]
    marked = render(
        tokenizer,
        [{**m, "content": mk} for m, mk in zip(messages, marks, strict=True)],
        add_generation_prompt,
    )
    pieces, rest = [], marked
    for mk in marks:
        head, sep, rest = rest.partition(mk)
        if not sep or mk in rest:
            return None
        pieces.append(head)
    for strip in (False, True):
        spans, pos = [], 0
        for head, m in zip(pieces, messages, strict=True):
            content = m["content"].strip() if strip else m["content"]
            if not text.startswith(head, pos) or not text.startswith(content, pos + len(head)):
                break
            pos += len(head)
            spans.append((pos, pos + len(content)))
            pos += len(content)
        else:
            if text[pos:] == rest:
                return spans
    return None


def _special_hits(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Spans of every control-token string in ``text``."""
    hits = []
    for s in _special_strings(tokenizer):
        i = text.find(s)
        while i >= 0:
            hits.append((i, i + len(s)))
            i = text.find(s, i + 1)
    return hits


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the template up to where a user's message starts (with the default system
    turn the template adds), so the model's continuation is a user turn it writes itself."""
    mark = "\u2063USER\u2063"  # invisible separators around a word: no template emits that
    text = render(tokenizer, [{"role": "user", "content": mark}])
    if mark not in text:
        raise ValueError(
            f"data.self_prompts_per_round: the chat template of "
            f"{getattr(tokenizer, 'name_or_path', '?')!r} does not render a user message verbatim; "
            "set data.self_prompts_per_round: 0"
        )
    return list(
        tokenize(tokenizer, text[: text.index(mark)], add_special_tokens=False)["input_ids"]
    )


def _assistant_spans(tokenizer: Any, messages: Conversation, text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant content + its end-of-turn token in ``text``."""
    specials = sorted(_special_strings(tokenizer), key=len, reverse=True)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], add_generation_prompt=True)
        # Normally the header render is a prefix of the full text; templates that rewrite earlier
        # turns (e.g. strip reasoning) are not, and then the search starts after the last span.
        start = len(head) if text.startswith(head) else cursor
        content = msg["content"]
        pos = text.find(content, start)
        if pos < 0:  # templates that trim the content
            content = content.strip()
            pos = text.find(content, start)
        if pos < 0:
            raise ValueError(
                f"target.model: the chat template does not render assistant message {i} verbatim; "
                "cannot locate its tokens for the loss mask"
            )
        end = pos + len(content)
        eot = next((s for s in specials if text.startswith(s, end)), None)
        if eot is not None:
            end += len(eot)
        spans.append((pos, end))
        cursor = end
    return spans


def _special_strings(tokenizer: Any) -> set[str]:
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content) if hasattr(tok, "content") else str(tok))
    return {s for s in out if s}
