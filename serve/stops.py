"""Stop strings, as OpenAI clients send them (`stop`: a string or a list of up to 4): a reply
ends where the first of them begins, the string itself left out, with `finish_reason: "stop"`.

Tokens and strings do not line up: a stop string can end inside a token, span several, or start
in a token whose text is only partly shown yet. So the match runs on the decoded text, never on
token ids, and a stream holds back the tail of its text that could still become a stop string.
The engine is told to stop the request as soon as one appears (the deployment's token callback),
so a stop costs at most one cycle past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_STOPS = 4  # OpenAI's limit


def stop_problem(value: object) -> str | None:
    """Why `value` is no `stop` field (None: fine). null, "" and [] mean no stop strings."""
    items = [value] if isinstance(value, str) else value
    if value is None or value == "" or value == []:
        return None
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in items)
    ):
        return (
            f"stop: {str(value)[:80]!r} must be a non-empty string or a list of 1 to "
            f"{MAX_STOPS} non-empty strings"
        )
    return None


def stop_strings(value: object) -> tuple[str, ...]:
    """The stop strings of a checked `stop` field (stop_problem(value) is None)."""
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the reply ends: the start of the earliest stop string in `text`, None if none."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that a stream must not send yet: the longest tail that
    is the start of a stop string (the next tokens may complete it)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopWatch:
    """The stop strings of one request over its growing token list: `feed` (the engine's
    thread, each cycle's new tokens) says when one has appeared (`hit`), so the engine can drop
    the row; `reset` before a retry, which produces the tokens again. `reply` and `streamable`
    cut a text as the response and a stream may show it."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops, self.decode = tuple(stops), decode
        self.tokens: list[int] = []
        self.hit = False  # a stop string is in the text of every token fed so far

    def feed(self, tokens: list[int]) -> bool:
        self.tokens += tokens
        self.hit = find_stop(self.decode(self.tokens), self.stops) is not None
        return self.hit

    def reset(self) -> None:
        self.tokens, self.hit = [], False

    def reply(self, text: str) -> str:
        """The whole reply: up to where its first stop string begins."""
        cut = find_stop(text, self.stops)
        return text if cut is None else text[:cut]

    def streamable(self, text: str) -> str:
        """What a stream may send of the text so far: the reply, less a tail that the next
        tokens could still turn into a stop string."""
        cut = find_stop(text, self.stops)
        return text[: len(text) - held_back(text, self.stops)] if cut is None else text[:cut]
