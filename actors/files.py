"""The one atomic write: a file appears whole under its name or not at all.

Readers of shards, sidecars, manifests, state.json and caches never see a half-written file: the
bytes go to a hidden temp file beside the target (same filesystem) and `os.replace` swaps it in.
The temp name carries the process and thread, so concurrent writers of one name never share it.
"""

from __future__ import annotations

import os
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes | str, fsync: bool = True) -> None:
    """Write `data` (str as UTF-8) to `path` atomically."""
    with atomic_file(path, fsync=fsync) as f:
        f.write(data.encode() if isinstance(data, str) else data)
