"""The shard format: round trip, size bound, manifest verification and batch sidecars."""

from __future__ import annotations

import json
import os

import pytest
import torch

from actors.shards import (
    HEADER_RESERVE,
    MANIFEST,
    Sample,
    ShardError,
    ShardWriter,
    finished_batch,
    iter_samples,
    pack_lengths,
    pack_parts,
    read_shard,
    read_shard_metadata,
    shard_name,
    verify_manifest,
    write_batch_record,
    write_manifest,
    write_shard,
)

H = 8


def _sample(n: int, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (n,), generator=g).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(
        ids,
        mask,
        torch.randn(n, 3 * H, generator=g).bfloat16(),
        torch.randn(n, H, generator=g).bfloat16(),
    )


def test_round_trip_exact(tmp_path):
    samples = [_sample(n, i) for i, n in enumerate([5, 1, 9])]
    info = write_shard(tmp_path / "s.safetensors", samples, {"note": "hi"})
    assert (info.num_samples, info.num_tokens, info.num_loss_tokens) == (3, 15, 3 + 1 + 5)
    assert info.bytes == (tmp_path / "s.safetensors").stat().st_size
    t = read_shard(tmp_path / "s.safetensors")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "input_ids": (torch.int32, (15,)),
        "loss_mask": (torch.uint8, (15,)),
        "offsets": (torch.int64, (4,)),
        "aux_hidden": (torch.bfloat16, (15, 3 * H)),
        "final_hidden": (torch.bfloat16, (15, H)),
    }
    assert t["offsets"].tolist() == [0, 5, 6, 15]
    for s, got in zip(samples, iter_samples(t), strict=True):
        assert got["input_ids"].tolist() == s.input_ids
        assert got["loss_mask"].tolist() == s.loss_mask
        assert torch.equal(got["aux_hidden"], s.aux_hidden) and torch.equal(
            got["final_hidden"], s.final_hidden
        )
    assert read_shard_metadata(tmp_path / "s.safetensors")["note"] == "hi"
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left


def test_parts_respect_the_size_bound(tmp_path):
    samples = [_sample(40, i) for i in range(30)]
    limit = HEADER_RESERVE + 5000
    parts = pack_parts(samples, limit)
    assert len(parts) > 1 and [s for p in parts for s in p] == samples
    for k, part in enumerate(parts):
        info = write_shard(tmp_path / shard_name(0, k), part)
        assert info.bytes <= limit
    with pytest.raises(ValueError, match="data.shard_max_bytes"):
        pack_parts([_sample(400, 0)], limit)


def test_packing_planned_from_lengths_equals_packing_the_samples():
    """The data stage plans a batch's shards before capturing it (`pack_lengths`); the plan must
    be `pack_parts` over the captured samples, or the shards would differ."""
    lengths = [40, 1, 17, 60, 3, 3, 88, 9, 25, 70, 2]
    samples = [_sample(n, i) for i, n in enumerate(lengths)]
    index = {id(s): i for i, s in enumerate(samples)}
    for limit in (HEADER_RESERVE + 6100, HEADER_RESERVE + 9000, HEADER_RESERVE + 50_000):
        want = [[index[id(s)] for s in part] for part in pack_parts(samples, limit)]
        assert pack_lengths(lengths, 4 * H, limit) == want
    with pytest.raises(ValueError, match="one sample of 400 tokens"):
        pack_lengths([3, 400], 4 * H, HEADER_RESERVE + 5000)


def _dataset(tmp_path):
    infos = [
        write_shard(tmp_path / shard_name(b, 0), [_sample(6, b), _sample(3, b + 10)])
        for b in range(3)
    ]
    write_manifest(tmp_path, {"model": "m", "hidden_size": H}, [1, 2, 3], "cfg123", infos)
    return infos


def test_manifest_totals_and_verify(tmp_path):
    infos = _dataset(tmp_path)
    m = verify_manifest(tmp_path)
    assert m.num_samples == 6 and m.num_tokens == 27 and m.shards == tuple(infos)
    assert m.aux_layer_ids == (1, 2, 3) and m.config_hash == "cfg123"
    assert m.shard_paths() == [tmp_path / i.file for i in infos]
    d = json.loads((tmp_path / MANIFEST).read_text())
    assert d["format"] == "eagle-loop-shards/1" and set(d["shards"][0]) == {
        "file", "sha256", "bytes", "num_samples", "num_tokens", "num_loss_tokens"
    }  # fmt: skip
    assert verify_manifest(tmp_path / MANIFEST) == m


def test_verify_names_missing_truncated_and_corrupted_shards(tmp_path):
    infos = _dataset(tmp_path)
    (tmp_path / infos[0].file).unlink()
    with open(tmp_path / infos[1].file, "r+b") as f:
        f.truncate(infos[1].bytes - 10)
    p = tmp_path / infos[2].file
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(raw)
    with pytest.raises(ShardError) as e:
        verify_manifest(tmp_path)
    msg = str(e.value)
    assert f"{infos[0].file}: missing" in msg
    assert f"{infos[1].file}: truncated" in msg
    assert f"{infos[2].file}: corrupted" in msg


def test_missing_manifest_says_how_to_make_one(tmp_path):
    with pytest.raises(ShardError, match="actors.generate"):
        verify_manifest(tmp_path)


def test_batch_sidecar_marks_finished_batches(tmp_path):
    info = write_shard(tmp_path / shard_name(4, 0), [_sample(5, 0)])
    assert finished_batch(tmp_path, 4, "k") is None  # no sidecar yet: not finished
    write_batch_record(tmp_path, 4, "k", [info], {"aux_layer_ids": [1, 2, 3]})
    rec = finished_batch(tmp_path, 4, "k")
    assert rec is not None and rec["shards"] == [info] and rec["aux_layer_ids"] == [1, 2, 3]
    assert finished_batch(tmp_path, 4, "other-prompts") is None
    os.truncate(tmp_path / info.file, info.bytes - 1)
    assert finished_batch(tmp_path, 4, "k") is None


def test_streamed_shard_is_deterministic_and_writer_threads_agree(tmp_path):
    """The streamed file reads back through safetensors, identical samples give identical bytes
    (resume compares sha256), and `ShardWriter` writes the same file from a thread and runs
    `after` once per shard, also when the write fails."""
    samples = [_sample(n, i) for i, n in enumerate([7, 3])]
    a = write_shard(tmp_path / "a.safetensors", samples, {"k": "v"})
    b = write_shard(tmp_path / "b.safetensors", [_sample(7, 0), _sample(3, 1)], {"k": "v"})
    assert a.sha256 == b.sha256 and a.bytes == b.bytes
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert read_shard_metadata(tmp_path / "a.safetensors")["k"] == "v"
    calls = []
    with ShardWriter(threads=2) as w:
        ok = w.submit(
            tmp_path / "c.safetensors", lambda: samples, {"k": "v"}, lambda: calls.append(1)
        )
        bad_sample = Sample(
            [1, 2], [0, 1], torch.zeros(3, 3 * H).bfloat16(), torch.zeros(2, H).bfloat16()
        )
        bad = w.submit(tmp_path / "d.safetensors", [bad_sample], after=lambda: calls.append(2))
    assert ok.result().sha256 == a.sha256
    with pytest.raises(ValueError, match="aux_hidden"):
        bad.result()
    assert sorted(calls) == [1, 2] and not (tmp_path / "d.safetensors").exists()


def test_ready_samples_stream_in_chunks_to_the_same_file(tmp_path, monkeypatch):
    """Samples whose states arrive late (`ready`, as from GPU copies) give the same bytes and
    sha256 as ready ones, also in many small chunks (hashing and writing are pipelined, writeback
    requested as it goes), and with sync="none"; each
    `ready` runs before its sample's states are read, in file order; a failing one leaves no file."""
    import hashlib

    import actors.shards as shards

    monkeypatch.setattr(shards, "CHUNK", 40)  # bytes: every tensor spans several chunks
    monkeypatch.setattr(shards, "KICK", 100)  # and writeback is requested along the way
    want = [_sample(n, i) for i, n in enumerate([7, 3, 5])]
    plain = write_shard(tmp_path / "plain.safetensors", want, {"k": "v"})
    calls: list[int] = []

    def late(i: int, s: Sample) -> Sample:
        aux, final = torch.empty_like(s.aux_hidden), torch.empty_like(s.final_hidden)

        def fill() -> None:  # the "copy" lands only when the writer asks for it
            calls.append(i)
            aux.copy_(s.aux_hidden)
            final.copy_(s.final_hidden)

        return Sample(s.input_ids, s.loss_mask, aux, final, ready=fill)

    got = write_shard(
        tmp_path / "late.safetensors", [late(i, s) for i, s in enumerate(want)], {"k": "v"}
    )
    data = (tmp_path / "late.safetensors").read_bytes()
    assert data == (tmp_path / "plain.safetensors").read_bytes()
    assert got.sha256 == plain.sha256 == hashlib.sha256(data).hexdigest()
    assert calls == [0, 1, 2, 0, 1, 2]  # before its aux rows, and again before its final rows
    lazy = write_shard(tmp_path / "lazy.safetensors", want, {"k": "v"}, sync="none")
    assert lazy.sha256 == plain.sha256
    (tmp_path / "lazy.safetensors").unlink()

    def fail() -> None:
        raise RuntimeError("copy failed")

    s = want[0]
    with pytest.raises(RuntimeError, match="copy failed"):
        write_shard(
            tmp_path / "x.safetensors",
            [Sample(s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden, fail)],
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.safetensors", "plain.safetensors"]
    with pytest.raises(ValueError, match="contiguous bf16"):
        write_shard(
            tmp_path / "y.safetensors",
            [Sample(s.input_ids, s.loss_mask, s.aux_hidden.float(), s.final_hidden, lambda: None)],
        )
