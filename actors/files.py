"""The one atomic write: a file appears whole under its name or not at all.

Readers of shards, sidecars, manifests, state.json and caches never see a half-written file: the
bytes go to a hidden temp file beside the target (same filesystem) and `os.replace` swaps it in;
with `fsync` (the default) the file and then its directory are synced, so what a resume reads
survives a crash of the machine too.
The temp name carries the process and thread, so concurrent writers of one name never share it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_file(path: str | Path, fsync: bool = True) -> Iterator[BinaryIO]:
    """Open a temp file for writing bytes; on a clean exit it is flushed (fsynced when `fsync`)
    and renamed to `path`, on an error it is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with tmp.open("wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:  # the rename itself is durable only once the directory is synced
            fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(d: str | Path) -> None:
    """Sync a directory, so a file created or renamed in it survives a power loss."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str, fsync: bool = True) -> None:
    """Write `data` (str as UTF-8) to `path` atomically."""
    with atomic_file(path, fsync=fsync) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def replaced_dir(path: str | Path) -> Iterator[Path]:
    """Yield a new empty folder beside `path` to fill; on a clean exit it takes `path`'s place,
    on an error it is removed and `path` is left as it was. A reader finds the old folder whole
    or the new one whole: the old one is renamed aside, the new one renamed in, then the old
    removed; a crash between the two renames leaves the old one beside as `.<name>.old-*`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server running as another user
    try:
        yield tmp
        old = path.parent / tmp.name.replace(".tmp-", ".old-", 1)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
