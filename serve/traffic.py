"""The traffic log: every request the server finished, as one JSON line, for the next round to
learn from (`data.source: traffic`).

At temperature 0 a served completion is the target's own greedy output, which is exactly what a
drafter must learn, so these records go straight to hidden-state capture without a second
generation (actors/generate.py). A record:

    {"v": 1, "time": 1764581000.12, "id": "...", "replica": "<pid>", "chat": true,
     "messages": [...] | null, "prompt": "..." | null, "prompt_ids": [...],
     "completion_ids": [...], "finish_reason": "stop", "temperature": 0.0, "max_tokens": 96,
     "seed": null, "speculative": true, "drafter": "/run/train/round-000/drafter",
     "accept_len": 2.4, "verify_ct": 31, "completion_tokens": 75}

Each replica appends to its own file (`traffic-<replica>-<n>.jsonl`) and fsyncs every line, so
a crash loses at most the request in flight and a torn last line is skipped by the reader.
Files rotate at `max_bytes`; beyond `max_files` per replica the oldest is deleted. A redaction
hook (`module:function`) sees each record first and returns what to write (or None to drop it).
Benchmark requests (`"record": false`) are never written. With recording off nothing is opened.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

VERSION = 1
PATTERN = "traffic-*.jsonl"

Redactor = Callable[[dict[str, Any]], dict[str, Any] | None]


def load_redactor(spec: str | None) -> Redactor | None:
    """`module:function` -> the function; None -> None. A bad spec fails at server start."""
    if not spec:
        return None
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"serve.traffic_redact: {spec!r} must be 'module:function'")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"serve.traffic_redact: cannot load {spec!r} ({e})") from None


class TrafficLog:
    """Append-only, fsynced, rotated JSONL log of one replica."""

    def __init__(
        self,
        directory: str | Path,
        replica: str,
        max_bytes: int = 64 << 20,
        max_files: int = 8,
        redact: Redactor | None = None,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.replica, self.max_bytes, self.max_files, self.redact = (
            replica,
            max_bytes,
            max_files,
            redact,
        )
        self._lock = threading.Lock()
        mine = sorted(self.dir.glob(f"traffic-{replica}-*.jsonl"))
        self._n = int(mine[-1].stem.rsplit("-", 1)[1]) if mine else 0
        self._fh = None

    def _path(self, n: int) -> Path:
        return self.dir / f"traffic-{self.replica}-{n:06d}.jsonl"

    def append(self, record: dict[str, Any]) -> None:
        rec = self.redact(dict(record)) if self.redact else record
        if rec is None:
            return
        line = (json.dumps({"v": VERSION, **rec}, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fh is None:
                self._fh = open(self._path(self._n), "ab")  # noqa: SIM115 - held open
            if self._fh.tell() and self._fh.tell() + len(line) > self.max_bytes:
                self._rotate()
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def _rotate(self) -> None:
        self._fh.close()
        self._n += 1
        self._fh = open(self._path(self._n), "ab")  # noqa: SIM115
        mine = sorted(self.dir.glob(f"traffic-{self.replica}-*.jsonl"))
        for old in mine[: max(0, len(mine) - self.max_files)]:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_traffic(directory: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record under `directory`, oldest file first; a torn or foreign line (a
    crash mid-write, another writer's junk) is skipped."""
    d = Path(directory)
    if not d.is_dir():
        return
    for path in sorted(d.glob(PATTERN), key=lambda p: (p.stat().st_mtime, p.name)):
        with path.open("rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("v") == VERSION and rec.get("completion_ids"):
                    yield rec


def prompt_text_key(rec: dict[str, Any]) -> str | None:
    """The record's prompt as `actors.prompts.prompt_key` spells a conversation, so held-out
    prompts can be recognised in the log; None for raw-id prompts."""
    from actors.prompts import prompt_key

    msgs = rec.get("messages")
    if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs):
        return prompt_key([{"role": m.get("role"), "content": m.get("content")} for m in msgs])
    if isinstance(rec.get("prompt"), str):
        return prompt_key([{"role": "user", "content": rec["prompt"]}])
    return None


def select_traffic(
    records: list[dict[str, Any]],
    n: int,
    used: set[str],
    exclude_keys: set[str],
    max_length: int,
) -> list[dict[str, Any]]:
    """The `n` records a round learns from: not used by an earlier round, not a held-out
    benchmark prompt, with room for a completion under `max_length`; lowest accept_len first
    (the requests the drafter served worst teach it most; a request served without a drafter
    counts as 1.0), oldest first among equals. Duplicates of a prompt keep the first record."""
    seen: set[str] = set()
    pool = []
    for rec in records:
        key = prompt_text_key(rec) or json.dumps(rec.get("prompt_ids"))
        if rec.get("id") in used or key in exclude_keys or key in seen:
            continue
        if len(rec.get("prompt_ids") or ()) >= max_length:
            continue
        seen.add(key)
        pool.append(rec)
    pool.sort(key=lambda r: (r.get("accept_len") or 1.0, r.get("time", 0.0)))
    return pool[:n]
