"""What a prompt is, shared by the readers (actors/sources.py) and the planner (actors/prompts.py):
the conversation type, a prompt tagged with its domain and source, and the key that makes two
prompts the same. Its own module so that the planner imports the readers and not the reverse."""

from __future__ import annotations

from dataclasses import dataclass

Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class Prompt:
    """A conversation with the benchmark domain it counts toward and the source it came from."""

    messages: Conversation
    domain: str
    source: str
    reply: str | None = None  # the source's own answer to the last turn, where it has one


def conversation_chars(conv: Conversation) -> int:
    """A conversation's length in characters, its contents only (`data.max_prompt_chars`)."""
    return sum(len(m["content"]) for m in conv)


def prompt_key(conv: Conversation) -> str:
    """The text that makes two prompts the same (roles and contents)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in conv)
