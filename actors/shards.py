"""Shards of captured hidden states: the one format the generate stage writes and the trainer reads.

A shard is one safetensors file holding S samples packed back to back (N tokens in all):

| tensor         | dtype | shape        | meaning                                                      |
| -------------- | ----- | ------------ | ------------------------------------------------------------ |
| `input_ids`    | int32 | [N]          | prompt + regenerated response, chat-templated                |
| `loss_mask`    | uint8 | [N]          | 1 on assistant tokens (content + end-of-turn token)          |
| `offsets`      | int64 | [S+1]        | sample boundaries (cu_seqlens): sample i is [off[i], off[i+1]) |
| `aux_hidden`   | bf16  | [N, A*H]     | target hidden states at the aux layer ids, concatenated (A=3) |
| `final_hidden` | bf16  | [N, H]       | target's last hidden state after the final norm               |

With online states (`data.states: online`, manifest `"online": true`) the two state tensors have
width 0: the shard holds ids and masks, and the training workers compute the states per batch.

Files are written atomically (temp file + ``os.replace``) and never exceed
``DataConfig.shard_max_bytes``. Shards of one prompt batch are named ``b{batch:05d}-{part:02d}``;
a sidecar ``b{batch:05d}.json`` written after them records their sha256, so an interrupted run
knows which batches are finished. ``manifest.json`` lists every shard with its size and sha256;
``verify_manifest`` checks them all and names each missing, truncated or corrupted file.

Reading (what the trainer needs):
    m = verify_manifest(data_dir)          # raises ShardError naming bad shards
    for path in m.shard_paths():
        for sample in iter_samples(read_shard(path)):
            sample["input_ids"], sample["loss_mask"], sample["aux_hidden"], sample["final_hidden"]
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from actors.files import atomic_file, atomic_write

FORMAT = "eagle-loop-shards/1"
MANIFEST = "manifest.json"
META_KEY = "eagle_loop"
HEADER_RESERVE = 16 * 1024  # safetensors JSON header + metadata, generously
TENSORS = ("input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden")


class ShardError(RuntimeError):
    """Missing, truncated or corrupted shards; the message names every bad file."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard file as the manifest lists it (``file`` is relative to the data dir)."""

    file: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int


@dataclass(frozen=True)
class Manifest:
    """The data of one generate stage: target identity, aux layer ids and the shard list."""

    target: dict[str, Any]
    aux_layer_ids: tuple[int, ...]
    config_hash: str
    shards: tuple[ShardInfo, ...]
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    format: str = FORMAT
    online: bool = False  # ids and masks only (width-0 states): the trainer computes the states
    root: str = field(default="", compare=False)  # directory it was read from (not serialised)

    def shard_paths(self) -> list[Path]:
        return [Path(self.root) / s.file for s in self.shards]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("root")
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return {"format": d.pop("format"), **d}


@dataclass
class Sample:
    """One captured conversation, ready to be packed into a shard.

    `ready`, if set, is called on the writing thread right before the hidden states' bytes are
    read (e.g. `PendingCapture.wait`: states still being copied from the GPU). A shard can then
    start its file while its later samples are still on the GPU. The two tensors must already be
    contiguous bf16 CPU tensors of their final shape (checked), since they are not read before."""

    input_ids: list[int]
    loss_mask: list[int]
    aux_hidden: torch.Tensor  # [T, A*H] bf16
    final_hidden: torch.Tensor  # [T, H] bf16
    ready: Callable[[], object] | None = None


def bytes_per_token(hidden_size: int, num_aux: int = 3, online: bool = False) -> int:
    """Bytes one token takes in a shard: ids int32 + mask uint8, and the bf16 aux + final
    states unless they are computed by the trainer (`online`: the shard holds ids only)."""
    return 4 + 1 + (0 if online else 2 * (num_aux + 1) * hidden_size)


def sample_bytes(s: Sample) -> int:
    return len(s.input_ids) * 5 + 8 + s.aux_hidden.numel() * 2 + s.final_hidden.numel() * 2


def token_sample_bytes(num_tokens: int, width: int) -> int:
    """`sample_bytes` of a sample of `num_tokens` tokens whose aux + final states are `width`
    bf16 values a token, known before its states exist."""
    return num_tokens * (5 + 2 * width) + 8


def pack_parts(samples: list[Sample], max_bytes: int) -> list[list[Sample]]:
    """Split samples (in order) into groups that each fit one shard of at most ``max_bytes``."""
    groups = _pack(
        [sample_bytes(s) for s in samples], [len(s.input_ids) for s in samples], max_bytes
    )
    return [[samples[i] for i in g] for g in groups]


def pack_lengths(lengths: list[int], width: int, max_bytes: int) -> list[list[int]]:
    """`pack_parts` planned from token counts alone (indices into `lengths`): the same groups,
    before any state is captured, so each shard's sequences can be captured and streamed to its
    file together."""
    return _pack([token_sample_bytes(n, width) for n in lengths], lengths, max_bytes)


def _pack(sizes: list[int], tokens: list[int], max_bytes: int) -> list[list[int]]:
    budget = max_bytes - HEADER_RESERVE
    parts: list[list[int]] = [[]]
    used = 0
    for i, b in enumerate(sizes):
        if b > budget:
            raise ValueError(
                f"data.shard_max_bytes: one sample of {tokens[i]} tokens needs {b + HEADER_RESERVE} "
                f"bytes, more than {max_bytes}; raise data.shard_max_bytes or lower data.max_length"
            )
        if parts[-1] and used + b > budget:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += b
    return [p for p in parts if p]


def write_shard(
    path: Path,
    samples: list[Sample],
    metadata: dict[str, str] | None = None,
    sync: str = "fsync",
) -> ShardInfo:
    """Pack samples into one safetensors file, atomically; returns its manifest entry.

    The file is streamed: header, then each tensor's bytes sample by sample, straight from the
    samples' memory in chunks of `CHUNK` bytes. No concatenated copy and no whole-file blob exist
    (safetensors' `save` would build two full copies). Each chunk is hashed on this thread while a
    helper thread writes the one before (see `_hash_and_write`), and a sample's `ready` is called
    just before its first byte is needed, so a shard of captured states is written while its
    later samples are still on the GPU.

    `sync`: "fsync" (default) makes the file durable before the rename, asking the kernel to
    start writing it back while it is still being written (see `_hash_and_write`); "none" leaves
    that to the OS (a batch's sidecar records each shard's sha256 and a resumed run re-hashes
    them, so a shard lost in a crash is redone)."""
    if sync not in SYNC_MODES:
        raise ValueError(f"write_shard: sync={sync!r}, use one of {SYNC_MODES}")
    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    n = int(offsets[-1])
    ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32)
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.uint8)
    aux = [_bf16_rows(s.aux_hidden, s, "aux_hidden") for s in samples]
    final = [_bf16_rows(s.final_hidden, s, "final_hidden") for s in samples]
    aux_w = _width(aux, "aux_hidden")
    final_w = _width(final, "final_hidden")
    ready = [s.ready for s in samples]
    none = [None]
    # Largest alignment first, like safetensors' own writer; every offset stays 8-aligned.
    parts: list[tuple[str, str, list[int], list[torch.Tensor], list[Callable[[], object] | None]]]
    parts = [
        ("offsets", "I64", [len(samples) + 1], [offsets], none),
        ("aux_hidden", "BF16", [n, aux_w], aux, ready),
        ("final_hidden", "BF16", [n, final_w], final, ready),
        ("input_ids", "I32", [n], [ids], none),
        ("loss_mask", "U8", [n], [mask], none),
    ]
    # One metadata key holding sorted JSON: identical shards must be identical byte-wise
    # (resume compares sha256).
    meta = json.dumps({"format": FORMAT, **(metadata or {})}, sort_keys=True)
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta}}
    pos = 0
    for name, dtype, shape, chunks, _ in parts:
        size = sum(c.numel() * c.element_size() for c in chunks)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def pieces() -> Iterator[bytes | memoryview]:
        yield len(head).to_bytes(8, "little")
        yield head
        for _, _, _, chunks, waits in parts:
            for c, wait in zip(chunks, waits, strict=True):
                if wait is not None:
                    wait()
                if c.numel():
                    mv = memoryview(c.reshape(-1).view(torch.uint8).numpy())
                    for a in range(0, len(mv), CHUNK):
                        yield mv[a : a + CHUNK]

    h = hashlib.sha256()
    with atomic_file(path, fsync=sync == "fsync") as f:
        _hash_and_write(pieces(), h, f, kick=sync == "fsync")
    return ShardInfo(
        file=path.name,
        sha256=h.hexdigest(),
        bytes=8 + len(head) + pos,
        num_samples=len(samples),
        num_tokens=n,
        num_loss_tokens=int(mask.sum()),
    )


SYNC_MODES = ("fsync", "none")
CHUNK = 8 << 20  # bytes hashed/written per step: large enough that both calls release the GIL
KICK = 64 << 20  # bytes written between two writeback requests


def _hash_and_write(pieces: Iterator[bytes | memoryview], h: Any, f: Any, kick: bool) -> None:
    """sha256 on this thread while one helper thread writes the file, in order. Both release the
    GIL on large buffers, so a shard streams at the rate of the slower of the two instead of
    their sum (on the H200 host: sha256 1.1-1.4 GB/s, page-cache writes 3.2 GB/s).

    `kick`: every KICK bytes the helper asks the kernel to start writing back what it has
    written (posix_fadvise DONTNEED starts writeback without waiting, and drops the pages once
    they are clean), so the closing fsync finds little left. That host's disk takes 1.3-2 GB/s;
    a 268 MB shard fsynced only at its end kept the capture stage waiting 0.3 s after its last
    forward."""
    fd = f.fileno()
    done = kicked = 0

    def write(p: bytes | memoryview) -> None:
        nonlocal done, kicked
        f.write(p)
        done += memoryview(p).nbytes
        if kick and done - kicked >= KICK:
            f.flush()
            os.posix_fadvise(fd, kicked, done - kicked, os.POSIX_FADV_DONTNEED)
            kicked = done

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-io") as io:
        writes = []
        for p in pieces:
            writes.append(io.submit(write, p))
            h.update(p)
        for w in writes:
            w.result()


def _bf16_rows(t: torch.Tensor, s: Sample, name: str) -> torch.Tensor:
    """t as a contiguous bf16 CPU tensor of the sample's rows (a view when it already is one)."""
    rows = len(s.input_ids)
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"Sample.{name}: shape {tuple(t.shape)}, want [{rows} tokens, width]")
    if s.ready is None:
        return t.to("cpu", torch.bfloat16).contiguous()
    if t.device.type != "cpu" or t.dtype != torch.bfloat16 or not t.is_contiguous():
        raise ValueError(
            f"Sample.{name}: with `ready`, states must already be contiguous bf16 on the CPU "
            f"(got {t.dtype} on {t.device}): they are read only after ready()"
        )
    return t


def _width(chunks: list[torch.Tensor], name: str) -> int:
    widths = {c.shape[1] for c in chunks}
    if len(widths) > 1:
        raise ValueError(f"Sample.{name}: samples of one shard differ in width {sorted(widths)}")
    return widths.pop() if widths else 0


class ShardWriter:
    """Writes shards on background threads so packing, hashing and disk writes overlap the
    target's next forward. `submit` takes the samples, or a function producing them (run on the
    writer thread). Samples of states still being copied from the GPU carry `ready`
    (`PendingCapture.wait`, see HFTarget.capture_async): the shard then streams while its later
    samples are captured."""

    def __init__(self, threads: int = 4, sync: str = "fsync"):
        self.sync = sync  # see write_shard
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shard")

    def submit(
        self,
        path: Path,
        samples: list[Sample] | Callable[[], list[Sample]],
        metadata: dict[str, str] | None = None,
        after: Callable[[], None] | None = None,
    ) -> Future[ShardInfo]:
        """Queue one shard; `after` runs on the writer thread once it is written (or failed),
        e.g. to hand pinned capture buffers back."""

        def job() -> ShardInfo:
            try:
                got = samples() if callable(samples) else samples
                return write_shard(path, got, metadata, self.sync)
            finally:
                if after is not None:
                    after()

        return self._pool.submit(job)

    def close(self) -> None:
        """Wait for every submitted shard."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_shard(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a shard (see the module docstring for names, dtypes and shapes)."""
    return load_file(str(path))


def read_shard_metadata(path: str | Path) -> dict[str, str]:
    """The small strings stored with a shard (format, batch_key, aux_layer_ids ...)."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get(META_KEY, "{}"))


def iter_samples(shard: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Per-sample views into a shard: input_ids [T], loss_mask [T], aux_hidden [T, A*H],
    final_hidden [T, H]."""
    off = shard["offsets"].tolist()
    for a, b in zip(off[:-1], off[1:], strict=True):
        yield {k: shard[k][a:b] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}


# ---------------------------------------------------------------------------------------------
# Batch sidecars (resume) and the manifest


def batch_stem(batch_index: int) -> str:
    return f"b{batch_index:05d}"


def shard_name(batch_index: int, part: int) -> str:
    return f"{batch_stem(batch_index)}-{part:02d}.safetensors"


def write_batch_record(
    out_dir: Path,
    batch_index: int,
    batch_key: str,
    shards: list[ShardInfo],
    extra: dict[str, Any] | None = None,
) -> None:
    """Mark a prompt batch finished: its shards, the key of the prompts/settings that made them,
    and ``extra`` (the target identity and aux ids, so a resumed run needs no model to finish)."""
    rec = {**(extra or {}), "batch_key": batch_key, "shards": [asdict(s) for s in shards]}
    atomic_write(out_dir / f"{batch_stem(batch_index)}.json", json.dumps(rec, indent=1).encode())


def finished_batch(out_dir: Path, batch_index: int, batch_key: str) -> dict[str, Any] | None:
    """The sidecar record of a batch a previous run finished (``"shards"`` as ShardInfo), if it
    matches ``batch_key`` and every shard is intact (size and sha256); else None (redo the batch)."""
    side = out_dir / f"{batch_stem(batch_index)}.json"
    try:
        rec = json.loads(side.read_text())
        if rec.get("batch_key") != batch_key:
            return None
        rec["shards"] = [ShardInfo(**s) for s in rec["shards"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if any(_problem(out_dir, s) for s in rec["shards"]):
        return None
    return rec


def write_manifest(
    out_dir: Path,
    target: dict[str, Any],
    aux_layer_ids: list[int],
    config_hash: str,
    shards: list[ShardInfo],
    online: bool = False,
) -> Manifest:
    m = Manifest(
        online=online,
        target=dict(target),
        aux_layer_ids=tuple(aux_layer_ids),
        config_hash=config_hash,
        shards=tuple(shards),
        num_samples=sum(s.num_samples for s in shards),
        num_tokens=sum(s.num_tokens for s in shards),
        num_loss_tokens=sum(s.num_loss_tokens for s in shards),
        root=str(out_dir),
    )
    atomic_write(out_dir / MANIFEST, json.dumps(m.to_json(), indent=1).encode())
    return m


def load_manifest(path: str | Path) -> Manifest:
    """Parse ``manifest.json`` (or the data dir holding it) without checking the shards."""
    p = Path(path)
    p = p / MANIFEST if p.is_dir() else p
    if not p.is_file():
        raise ShardError(
            f"{p}: no manifest; run the generate stage (python -m actors.generate) first"
        )
    d = json.loads(p.read_text())
    if d.get("format") != FORMAT:
        raise ShardError(f"{p}: format {d.get('format')!r} is not {FORMAT!r}; regenerate the data")
    return Manifest(
        target=d["target"],
        aux_layer_ids=tuple(d["aux_layer_ids"]),
        config_hash=d["config_hash"],
        shards=tuple(ShardInfo(**s) for s in d["shards"]),
        num_samples=d["num_samples"],
        num_tokens=d["num_tokens"],
        num_loss_tokens=d["num_loss_tokens"],
        online=d.get("online", False),
        root=str(p.parent),
    )


def verify_manifest(path: str | Path) -> Manifest:
    """Load the manifest and check every shard's presence, size and sha256; raise ShardError
    naming each missing, truncated or corrupted shard."""
    m = load_manifest(path)
    root = Path(m.root)
    problems = [p for s in m.shards if (p := _problem(root, s))]
    if problems:
        raise ShardError(
            f"{root / MANIFEST}: {len(problems)} of {len(m.shards)} shard(s) bad:\n  "
            + "\n  ".join(problems)
            + "\nrerun the generate stage on this directory to regenerate them"
        )
    return m


def _problem(root: Path, s: ShardInfo) -> str | None:
    p = root / s.file
    if not p.is_file():
        return f"{s.file}: missing"
    size = p.stat().st_size
    if size != s.bytes:
        return f"{s.file}: truncated or resized ({size} bytes, manifest says {s.bytes})"
    if _sha256(p) != s.sha256:
        return f"{s.file}: corrupted (sha256 mismatch)"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
