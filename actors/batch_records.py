"""What a target actor sends back for one prompt batch (`BatchResult`), the sequences a batch
generated (`Generated`), and the two-phase round's sidecar of generated ids on disk
(`b{batch:05d}.gen.jsonl`): small records, no tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from actors.files import atomic_write
from actors.shards import ShardInfo, batch_stem


@dataclass(frozen=True)
class BatchResult:
    """What one call on a prompt batch sends back to the driver (no tensors). A generate-phase
    call has no shards and no capture figures; a capture-phase call no generate figures."""

    batch_index: int
    shards: tuple[ShardInfo, ...]
    num_prompts: int
    skipped_prompts: int  # prompts longer than data.max_length, self-written turns not kept
    gen_tokens: int
    gen_seconds: float
    capture_tokens: int
    capture_seconds: float
    write_seconds: float
    switch_seconds: float = 0.0  # loading/switching the backend's phase (SGLang), not in the above
    cut: bool = False  # decoding stopped at the stage's deadline: the replies so far are kept
    left_out: bool = False  # not started: too little of the deadline was left (nothing written)


@dataclass(frozen=True)
class Generated:
    """The sequences of one batch after generation: prompt + response, truncated, with masks."""

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    num_prompts: int
    skipped_prompts: int
    gen_tokens: int
    gen_seconds: float
    switch_seconds: float = 0.0
    cut: bool = False  # decoding stopped at its stop_at


def not_started(batch_index: int, num_prompts: int) -> BatchResult:
    """A batch its actor did not start: its stop_at left too little time (nothing written)."""
    return BatchResult(batch_index, (), num_prompts, 0, 0, 0.0, 0, 0.0, 0.0, left_out=True)


_Counts = TypeVar("_Counts", "BatchResult", "Generated")


@dataclass(frozen=True)
class Written:
    """What writing a batch's own user turns cost, added to the batch's figures."""

    tokens: int = 0
    seconds: float = 0.0
    dropped: int = 0

    def add_to(self, r: _Counts) -> _Counts:
        """`r` (a batch's Generated record, or its result when nothing else carries it) with
        the turns' tokens, time and dropped turns added."""
        return replace(
            r,
            num_prompts=r.num_prompts + self.dropped,
            skipped_prompts=r.skipped_prompts + self.dropped,
            gen_tokens=r.gen_tokens + self.tokens,
            gen_seconds=r.gen_seconds + self.seconds,
        )


def generated_path(out_dir: str | Path, batch_index: int) -> Path:
    return Path(out_dir) / f"{batch_stem(batch_index)}.gen.jsonl"


def write_generated(out_dir: str | Path, batch_index: int, batch_key: str, g: Generated) -> Path:
    """Line 1: batch key and counts; then one line per sample. Atomic (temp file + rename)."""
    path = generated_path(out_dir, batch_index)
    head = {
        "batch_key": batch_key,
        "num_samples": len(g.input_ids),
        "num_prompts": g.num_prompts,
        "skipped_prompts": g.skipped_prompts,
        "gen_tokens": g.gen_tokens,
        "gen_seconds": g.gen_seconds,
    }
    lines = [json.dumps(head)] + [
        json.dumps({"input_ids": ids, "loss_mask": m})
        for ids, m in zip(g.input_ids, g.loss_mask, strict=True)
    ]
    atomic_write(path, "\n".join(lines) + "\n", fsync=False)
    return path


def has_generated(out_dir: str | Path, batch_index: int, batch_key: str) -> bool:
    """True when the batch's generated ids are on disk for these prompts and settings (reads
    only the first line)."""
    try:
        with open(generated_path(out_dir, batch_index)) as fh:
            return json.loads(fh.readline()).get("batch_key") == batch_key
    except (OSError, ValueError):
        return False


def read_generated(out_dir: str | Path, batch_index: int, batch_key: str) -> Generated:
    path = generated_path(out_dir, batch_index)
    try:
        head, *rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{path}: unreadable ({e}); delete it to regenerate the batch") from None
    if head.get("batch_key") != batch_key or head.get("num_samples") != len(rows):
        raise RuntimeError(
            f"{path}: made for other prompts or settings, or incomplete; delete it to regenerate"
        )
    return Generated(
        input_ids=[r["input_ids"] for r in rows],
        loss_mask=[r["loss_mask"] for r in rows],
        num_prompts=head["num_prompts"],
        skipped_prompts=head["skipped_prompts"],
        gen_tokens=head["gen_tokens"],
        gen_seconds=head["gen_seconds"],
    )
