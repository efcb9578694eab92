"""Which prompts a drafter was trained on: its key file, `prompt_keys.txt.gz` beside its weights.

One line per prompt, the first `HASH_HEX` hex digits of the SHA-256 of its prompt key
(`actors.prompt_record.prompt_key`), sorted and gzipped without a timestamp, so the same prompts
always give the same bytes. 64 bits a prompt: about 6 bytes each once gzipped (the 52k-prompt
pool would fit in 330 KB), and among 10^5 trained prompts the chance that any of 10^5 pool
prompts collides with one is about 5e-10. Lines starting with `#` are comments.

The pool (actors/pool.py) leaves out every prompt whose hash the starting drafter's file lists:
regenerating a prompt the drafter already learned the target's greedy reply to teaches it
nothing new. A round's exported drafter lists its start's keys and the round's prompts'
(pipeline/loop.py), so the file follows a drafter from round to round.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterable
from pathlib import Path

from actors.prompt_record import Conversation, prompt_key

KEY_FILE = "prompt_keys.txt.gz"
HASH_HEX = 16


def key_hash(conv: Conversation) -> str:
    """The hash a key file lists for this prompt."""
    return hashlib.sha256(prompt_key(conv).encode("utf-8")).hexdigest()[:HASH_HEX]


def write_key_file(path: str | Path, hashes: Iterable[str], comment: str = "") -> int:
    """Write `hashes` (deduplicated, sorted) with an optional one-line `comment`; returns how
    many. gzip's header keeps no name or time, so the bytes depend on the hashes only."""
    keys = sorted(set(hashes))
    bad = [h for h in keys if len(h) != HASH_HEX or h.strip("0123456789abcdef")]
    if bad:
        raise ValueError(f"{path}: not {HASH_HEX}-digit hex prompt-key hashes: {bad[:3]}")
    head = f"# {comment}\n" if comment else ""
    body = (head + "".join(h + "\n" for h in keys)).encode("ascii")
    Path(path).write_bytes(gzip.compress(body, mtime=0))
    return len(keys)


def read_key_file(path: str | Path) -> frozenset[str]:
    lines = gzip.decompress(Path(path).read_bytes()).decode("ascii").splitlines()
    return frozenset(x.strip() for x in lines if x.strip() and not x.startswith("#"))


def drafter_prompt_hashes(drafter: str | Path) -> frozenset[str] | None:
    """The hashes a drafter folder's key file lists; None when the folder has none (a Hub
    drafter, a drafter trained before key files, `scratch`)."""
    path = Path(drafter) / KEY_FILE
    return read_key_file(path) if path.is_file() else None
