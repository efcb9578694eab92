"""A disk that fills from another process after the plan's check passed (issue 51), on a real
filesystem that runs out: a small tmpfs. Every file a stage writes is written beside and renamed
in (actors/files.py), so a write that runs out of space leaves nothing under its name, says which
file and how many bytes were free, and works again once space is freed. Skipped where mounting a
tmpfs needs privileges the test lacks."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from actors.files import DiskFull, atomic_write
from actors.shards import Sample, write_shard
from serve.traffic import Skipped, TrafficLog, read_traffic

pytestmark = pytest.mark.ray_free


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A real 32 MiB tmpfs (root, or a container with CAP_SYS_ADMIN); unmounted after."""
    d = tmp_path / "small"
    d.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(d)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=True)


def fill(d: Path, leave: int) -> Path:
    """Another process's file taking all but about `leave` bytes of `d`'s filesystem."""
    filler = d / "filler"
    with filler.open("wb", buffering=0) as f:  # unbuffered: close has nothing left to write
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC
    # tmpfs counts whole pages: give back `leave` rounded up to pages
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def _no_temp_left(d: Path) -> list[str]:
    return [p.name for p in d.rglob("*") if ".tmp-" in p.name]


def test_a_full_disk_names_the_file_and_the_free_bytes_and_leaves_nothing(small_fs):
    path = small_fs / "manifest.json"
    filler = fill(small_fs, 64 << 10)
    with pytest.raises(DiskFull) as err:
        atomic_write(path, b"x" * (1 << 20))
    msg = str(err.value)
    assert str(path) in msg and "bytes free" in msg and "run again" in msg, msg
    assert err.value.errno == errno.ENOSPC
    assert not path.exists() and not _no_temp_left(small_fs)
    filler.unlink()  # space freed: the same write goes through
    atomic_write(path, b"x" * (1 << 20))
    assert path.stat().st_size == 1 << 20


def test_a_shard_cut_by_a_full_disk_is_never_there(small_fs):
    """The data stage's shard writer streams a multi-MiB file; the disk fills halfway."""
    t = 2000
    s = Sample(list(range(t)), [1] * t, torch.zeros(t, 3 * 256, dtype=torch.bfloat16),
               torch.zeros(t, 256, dtype=torch.bfloat16))  # fmt: skip
    fill(small_fs, 1 << 20)  # the shard is 4 MiB
    shard = small_fs / "batch-000000-part-000.safetensors"
    with pytest.raises(DiskFull, match="bytes free"):
        write_shard(shard, [s])
    assert not shard.exists() and not _no_temp_left(small_fs)


def test_a_drafter_export_cut_by_a_full_disk_keeps_the_old_one_whole(small_fs, tiny_lm):
    """The train stage's export (pipeline/best.py write_drafter_dir) over the drafter a
    resume would read: the old one stays whole, the error names the folder and the free bytes."""
    from conftest import save_random_drafter

    from eagle3.checkpoint import load_drafter
    from pipeline.best import write_drafter_dir

    dest = small_fs / "drafter"
    save_random_drafter(tiny_lm, dest, seed=1)
    cfg, old = load_drafter(dest)
    new = {k: v + 1 if v.is_floating_point() else v for k, v in old.items()}
    fill(small_fs, 256 << 10)
    with pytest.raises(DiskFull) as err:
        write_drafter_dir(dest, None, new, cfg)
    assert str(dest) in str(err.value) and "bytes free" in str(err.value), err.value
    assert not _no_temp_left(small_fs)
    _, kept = load_drafter(dest)  # strict: a torn file would raise
    assert all(torch.equal(kept[k], old[k]) for k in old)


def test_a_traffic_line_cut_by_a_full_disk_costs_only_that_record(small_fs):
    """The server keeps answering when its traffic log cannot be written (it logs the record
    dropped); the line the full disk cut must not swallow the next record written after space
    is freed."""
    log = TrafficLog(small_fs / "traffic", "7")
    rec = {"messages": None, "prompt": "p", "completion_ids": [4, 5]}
    log.append({**rec, "id": "before", "prompt_ids": [1, 2, 3]})
    filler = fill(small_fs, 16 << 10)
    with pytest.raises(OSError):
        log.append({**rec, "id": "cut", "prompt_ids": list(range(20_000))})  # ~100 KB
    filler.unlink()
    log.append({**rec, "id": "after", "prompt_ids": [1, 2, 3]})
    log.close()
    skipped = Skipped()
    got = [r["id"] for r in read_traffic(small_fs / "traffic", skipped)]
    assert got == ["before", "after"], (got, skipped)
    assert skipped == Skipped(torn=0, foreign=0)
    assert all(line.startswith(b"{") for f in (small_fs / "traffic").iterdir()
               for line in f.read_bytes().splitlines())  # fmt: skip
