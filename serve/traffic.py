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

Each replica appends to its own file (`traffic-<replica>-<n>.jsonl`) and fsyncs every line
(the server awaits it off its event loop before answering), so a crash loses at most the requests
in flight; a replica that reuses a dead one's pid first cuts a torn last line off, and the reader
skips any torn line. A request's id is the router's, the same in every attempt (serve/router.py):
one written by a replica that died before its answer went out and again by the retry is read
once. Files rotate at `max_bytes`; the whole directory keeps at most `max_files`
files (every replica and restart together, oldest deleted first), so the log is bounded by
`max_files × max_bytes`. A record over `max_record_bytes` is dropped. Benchmark requests
(`"record": false`) are never written. With recording off nothing is opened.

Fields that can hold user text: `messages`, `prompt`, `prompt_ids` (the same text as token
ids) and `completion_ids` (the target's reply, which may quote it). A redaction hook
(`module:function`) sees each whole record first, ids included, and returns what to write (or
None to drop it). When it changes `messages`/`prompt` but returns `prompt_ids` unchanged (or
leaves them out), the ids are derived again from the text it returned, so stale ids never carry
the masked text; `completion_ids` are the hook's to mask or drop (a record without them is never
trained on).
"""

from __future__ import annotations

import hashlib
import heapq
import importlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.files import fsync_dir

VERSION = 1
PATTERN = "traffic-*.jsonl"
MAX_RECORD_BYTES = 1 << 20  # a record over this is dropped (a bounded log, bounded lines)

log = logging.getLogger(__name__)

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
    """Append-only, fsynced, rotated JSONL log of one replica, in a directory bounded as a whole.

    `retokenize(record) -> prompt_ids` re-derives the prompt ids from a redacted record's text
    (the server passes its tokenizer); without it such a record is dropped."""

    def __init__(
        self,
        directory: str | Path,
        replica: str,
        max_bytes: int = 64 << 20,
        max_files: int = 8,
        redact: Redactor | None = None,
        retokenize: Callable[[dict[str, Any]], list[int]] | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.replica, self.max_bytes, self.max_files = replica, max_bytes, max_files
        self.redact, self.retokenize = redact, retokenize
        self.max_record_bytes = min(max_record_bytes, max_bytes)
        self._lock = threading.Lock()
        mine = sorted(self.dir.glob(f"traffic-{replica}-*.jsonl"))
        self._n = int(mine[-1].stem.rsplit("-", 1)[1]) if mine else 0
        self._fh = None

    def _path(self, n: int) -> Path:
        return self.dir / f"traffic-{self.replica}-{n:06d}.jsonl"

    def append(self, record: dict[str, Any]) -> bool:
        """Write one record (blocking: fsync). False when it was dropped (hook, size)."""
        rec = self._redacted(record)
        if rec is None:
            return False
        line = (json.dumps({"v": VERSION, **rec}, separators=(",", ":")) + "\n").encode()
        if len(line) > self.max_record_bytes:
            log.warning("traffic log: a %d-byte record dropped (cap %d)", len(line), self.max_record_bytes)  # fmt: skip
            return False
        with self._lock:
            if self._fh is not None and os.fstat(self._fh.fileno()).st_nlink == 0:
                self._fh.close()  # another replica's pruning deleted our file: start it again
                self._fh = None
            if self._fh is None:
                self._open()  # first write, or another replica's pruning deleted our file
            elif self._fh.tell() + len(line) > self.max_bytes:
                self._fh.close()
                self._n += 1
                self._open()
            try:
                self._fh.write(line)
                self._fh.flush()
                os.fsync(self._fh.fileno())
            except OSError:
                # A full disk may have taken part of the line: the next record appended after it
                # would share its line and be lost with it. Reopening cuts the torn tail.
                self._drop_handle()
                raise
        return True

    def _drop_handle(self) -> None:
        """Close the file after a failed write (its unwritten buffer discarded); the next
        append reopens it and cuts what part of the line reached the disk."""
        fh, self._fh = self._fh, None
        try:
            fh.close()  # flushes the buffer again: may fail the same way
        except OSError:
            pass

    def _redacted(self, record: dict[str, Any]) -> dict[str, Any] | None:
        if not self.redact:
            return record
        rec = self.redact(json.loads(json.dumps(record)))  # a deep copy: the hook may mutate
        if rec is None:
            return None
        changed = any(rec.get(k) != record.get(k) for k in ("messages", "prompt"))
        stale = changed and rec.get("prompt_ids") == record.get("prompt_ids")
        if stale or rec.get("prompt_ids") is None:
            if self.retokenize is None:
                return None  # stale ids would still spell the masked text
            rec = {**rec, "prompt_ids": list(self.retokenize(rec))}
        return rec

    def _open(self) -> None:
        """Open the current file for appending: cut a torn tail a dead replica with our pid left,
        sync the directory when the file is new, then prune the directory."""
        path = self._path(self._n)
        new = not path.exists()
        self._fh = open(path, "ab")  # noqa: SIM115 - held open
        if not new:
            _cut_torn_tail(self._fh)
        else:
            fsync_dir(self.dir)
        self._prune(keep=path)

    def _prune(self, keep: Path) -> None:
        files = sorted(self.dir.glob(PATTERN), key=_age)
        old = [f for f in files if f != keep]
        for f in old[: max(0, len(files) - self.max_files)]:
            f.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def _age(p: Path) -> tuple[float, str]:
    try:
        return (p.stat().st_mtime, p.name)
    except FileNotFoundError:  # pruned by another replica meanwhile
        return (0.0, p.name)


def _cut_torn_tail(fh: Any) -> None:
    """Truncate a file opened for appending to just after its last newline."""
    size = fh.seek(0, os.SEEK_END)
    if not size:
        return
    with open(fh.name, "rb") as r:
        pos = size
        while pos > 0:
            step = min(pos, 1 << 16)
            r.seek(pos - step)
            chunk = r.read(step)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
    if pos != size:
        fh.truncate(pos)
        fh.seek(pos)
        os.fsync(fh.fileno())
        log.warning("traffic log: cut a torn last line (%d bytes) off %s", size - pos, fh.name)


@dataclass
class Skipped:
    """The lines of the log a reader passed over, so the round that reads it can say so."""

    torn: int = 0
    """Lines that are not whole JSON: cut by a crash mid-write (the last line of a file), or
    another writer's junk."""
    foreign: int = 0
    """Whole JSON that is no record to learn from: another version, or without ids."""
    repeated: int = 0
    """Records whose `id` an earlier line had: one request written by a replica that died
    before its answer went out, and again by the attempt the router sent after it
    (serve/router.py); the first is kept."""


def read_traffic(directory: str | Path, skipped: Skipped | None = None) -> Iterator[dict[str, Any]]:
    """Every complete record under `directory` once, oldest file first; a torn or foreign line
    (a crash mid-write, another writer's junk) or a record whose id was read before is skipped
    and counted in `skipped`. Memory holds the ids read (~100 bytes a record)."""
    d = Path(directory)
    if not d.is_dir():
        return
    skipped = skipped if skipped is not None else Skipped()
    seen: set[str] = set()
    for path in sorted(d.glob(PATTERN), key=lambda p: (p.stat().st_mtime, p.name)):
        with path.open("rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    skipped.torn += 1
                    continue
                if (
                    isinstance(rec, dict)
                    and rec.get("v") == VERSION
                    and rec.get("completion_ids")
                    and isinstance(rec.get("prompt_ids"), list)
                ):
                    if rec.get("id") in seen:
                        skipped.repeated += 1
                        continue
                    if rec.get("id") is not None:
                        seen.add(rec["id"])
                    yield rec
                else:
                    skipped.foreign += 1


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
    records: Iterable[dict[str, Any]],
    n: int,
    used: set[str],
    exclude_keys: set[str],
    max_length: int,
) -> list[dict[str, Any]]:
    """The `n` records a round learns from: not used by an earlier round, not a held-out
    benchmark prompt, with room for a completion under `max_length`; lowest accept_len first
    (the requests the drafter served worst teach it most; a request served without a drafter
    counts as 1.0), oldest first among equals. Duplicates of a prompt keep the first record.
    `records` is streamed: memory holds the `n` kept and a digest per prompt seen."""
    seen: set[bytes] = set()

    def fresh() -> Iterator[dict[str, Any]]:
        for rec in records:
            key = prompt_text_key(rec) or json.dumps(rec.get("prompt_ids"))
            if rec.get("id") in used or key in exclude_keys:
                continue
            digest = hashlib.sha1(key.encode("utf-8", "replace")).digest()
            if digest in seen or len(rec.get("prompt_ids") or ()) >= max_length:
                continue
            seen.add(digest)
            yield rec

    return heapq.nsmallest(n, fresh(), key=lambda r: (r.get("accept_len") or 1.0, r.get("time", 0.0)))  # fmt: skip
