"""The one atomic write: a file appears whole under its name or not at all.

Readers of shards, sidecars, manifests, state.json and caches never see a half-written file: the
bytes go to a hidden temp file beside the target (same filesystem) and `os.replace` swaps it in;
with `fsync` (the default) the file and then its directory are synced, so what a resume reads
survives a crash of the machine too.
The temp name carries the process and thread, so concurrent writers of one name never share it.
A write that runs out of space (a disk another process filled, a quota, a file-size limit) raises
`DiskFull` naming the file and the bytes left, and leaves nothing under the name.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# Out of space: the disk (ENOSPC), a quota (EDQUOT), the process's file-size limit (EFBIG,
# RLIMIT_FSIZE with SIGXFSZ ignored).
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFull(OSError):
    """A write that ran out of space; the message names the file and the bytes left free."""


def disk_full(path: str | Path, err: OSError) -> DiskFull | None:
    """`err` as DiskFull naming `path` and the free bytes of its filesystem, when it is an
    out-of-space error; else None."""
    if err.errno not in _FULL:
        return None
    where = Path(path).parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    return DiskFull(
        err.errno,
        f"{path}: out of space while writing it ({os.strerror(err.errno or 0)}; {free:,} bytes "
        f"free on {where}'s filesystem); nothing was left under its name: free space (or raise "
        "the quota) and run again, a run resumes where it stopped",
    )


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
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if full := disk_full(path, e):
            raise full from e
        raise
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
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if full := disk_full(path, e):
            raise full from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
