"""Capture-stage throughput on a GPU (issue 7, P2): target forward + aux layers + shard write + sha256.

A random-weight target of a real shape is built from its config on the GPU (no download, no
tokenizer), and `HFTarget.from_model(...).capture_async` feeds a `ShardWriter` exactly as the
generate stage does. Beside it, in the same process, the anchor: a plain HF forward of the same
tokens, with and without `output_hidden_states`.

    python benchmarks/gpu_capture.py --shape llama-3.1-8b --seq 2048 --n 32
    python benchmarks/gpu_capture.py --device cpu --shape tiny --seq 128 --n 4   # smoke test

`--worker TOKENIZER_DIR` measures the data stage itself instead: the random target is saved
with that tokenizer (any chat-template tokenizer; the ids are random anyway) and loaded by a real
`TargetWorker` (`data.capture: forward`); each batch's `.gen.jsonl` is written with
`write_generated` and `TargetWorker.capture_batch` captures it, two calls in flight as the actor
runs them. Needs pydantic (pipeline.config), not Ray.

    python benchmarks/gpu_capture.py --worker .devtok --shape llama-3.1-8b --seq 2048 --n 48

Prints one JSON line per measurement (benchmarks/harness.py; also to $OUT/capture.jsonl when $OUT
is set).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.hf_backend import HFTarget, PinnedPool  # noqa: E402
from actors.shards import Sample, ShardWriter, bytes_per_token, read_shard  # noqa: E402
from benchmarks.harness import Results, median_ms, parser, pick_device, sync  # noqa: E402


def llama_shape(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, **more) -> dict:  # fmt: skip
    """LlamaConfig arguments of a target shape."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, **more)  # fmt: skip


SHAPES = {
    "llama-3.1-8b": llama_shape(
        128256,
        4096,
        14336,
        32,
        32,
        8,
        128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),  # fmt: skip
    "tiny": llama_shape(4096, 64, 128, 4, 4, 2, 16, max_position_embeddings=4096),
}


def build_target(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Llama of `shape`, built directly on `device` (an 8B model initialised on the
    CPU would take minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device, dtype).eval()


def run_capture(
    target: HFTarget,
    seqs: list[list[int]],
    aux_ids: list[int],
    out_dir: Path,
    per_shard: int,
    threads: int,
    pool: PinnedPool | None,
    sync_mode: str = "fsync",
) -> tuple[float, float, list]:
    """The whole stage: forwards queued back to back, each group of `per_shard` sequences handed
    to a writer thread as soon as it is queued; each sample's `ready` waits for its own copy, so a
    shard streams while its later sequences run. Returns (seconds, seconds until the last
    forward's states were on the host, shard infos); the difference is the writer's tail."""
    sync(target.device)
    t = time.perf_counter()
    futures = []
    last = None
    with ShardWriter(threads, sync_mode) as writer:
        for i in range(0, len(seqs), per_shard):
            group = seqs[i : i + per_shard]
            pending = target.capture_async(group, aux_ids, pool)
            samples = [
                Sample(s, [1] * len(s), p.aux, p.final, ready=p.wait)
                for s, p in zip(group, pending, strict=True)
            ]

            def release(pending=pending) -> None:  # pooled host buffers go back once written
                for p in pending:
                    p.release()

            path = out_dir / f"s{i:05d}.safetensors"
            futures.append(writer.submit(path, samples, after=release))
            last = pending[-1]
        if last is not None:
            last.wait()
        forward_s = time.perf_counter() - t
        infos = [f.result() for f in futures]
    return time.perf_counter() - t, forward_s, infos


def decode_anchor(model, device: torch.device, res: Results, iters: int, ctx: int = 512) -> None:
    """Plain HF eager, batch 1, DynamicCache holding `ctx` tokens: forwards of 1, 4 and 8 new
    tokens (the cache is cropped back after each, so every call sees the same `ctx`)."""
    from transformers import DynamicCache

    V = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(3, V, (1, ctx), device=device), past_key_values=cache)
    for q in (1, 4, 8):
        x = torch.randint(3, V, (1, q), device=device)

        def step(x=x, q=q):
            model(input_ids=x, past_key_values=cache, logits_to_keep=q)
            cache.crop(-q)  # back to ctx (negative = drop that many; both 5.17 and 5.24)

        ms = median_ms(step, device, max(iters, 10), warm=3)
        res.emit({"what": "hf_eager_decode", "ctx": ctx, "q": q, "ms": round(ms, 3)})


def main() -> None:
    ap = parser(__doc__, device="cuda", shapes=SHAPES, shape="llama-3.1-8b", iters=5)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--n", type=int, default=32, help="sequences per capture run")
    ap.add_argument("--per-shard", default="4", help="sequences per shard; a comma list runs each")
    ap.add_argument("--threads", default="4", help="writer threads; a comma list runs each")
    ap.add_argument("--sync", default="fsync", help="write_shard sync modes to run (fsync,none)")
    ap.add_argument("--out-dir", default=None, help="shard directory (default: a temp dir)")
    ap.add_argument("--pool-slots", type=int, default=16, help="0 = no PinnedPool")
    ap.add_argument("--io-mb", type=int, default=256, help="file size of the host I/O probe")
    ap.add_argument("--worker", default=None, help="tokenizer dir: measure TargetWorker instead")
    ap.add_argument("--batch-size", type=int, default=16, help="--worker: sequences per batch")
    ap.add_argument("--slots", default="3", help="--worker: CAPTURE_SLOTS values to run")
    args = ap.parse_args()
    device = pick_device(args.device)
    dtype = torch.bfloat16
    res = Results("capture", device, {"shape": args.shape, "seq": args.seq})
    t0 = time.perf_counter()
    model = build_target(args.shape, device, dtype)
    res.emit({"what": "build", "s": round(time.perf_counter() - t0, 1)})
    if args.worker:
        worker_stage(model, args, res)
        return
    L = model.config.num_hidden_layers
    aux_ids = [1, L // 2 - 1, L - 4]  # SGLang's default for Llama
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    seqs = [torch.randint(3, V, (args.seq,), generator=g).tolist() for _ in range(args.n)]
    x = torch.tensor([seqs[0]], device=device)

    # Anchor: plain HF forward (DynamicCache, full logits), then with output_hidden_states.
    with torch.inference_mode():
        for name, kw in [
            ("hf_forward", {}),
            ("hf_forward_hidden_states", {"output_hidden_states": True}),
            ("hf_forward_no_cache_keep1", {"use_cache": False, "logits_to_keep": 1}),
        ]:
            ms = median_ms(lambda kw=kw: model(input_ids=x, **kw), device, args.iters, warm=2)
            res.emit({"what": name, "ms": round(ms, 2), "tok_s": round(args.seq / ms * 1000)})
            if name == "hf_forward":
                plain_tok_s = args.seq / ms * 1000

        decode_anchor(model, device, res, args.iters)

    target = HFTarget.from_model(model, model_id=f"random-{args.shape}")
    width = bytes_per_token(model.config.hidden_size)
    A1H = (len(aux_ids) + 1) * model.config.hidden_size
    pool = PinnedPool(args.pool_slots, args.seq, A1H) if args.pool_slots else None
    tokens = args.n * args.seq
    # Forward + hooks + pinned copies alone, no writer (what the writer must keep up with):
    # fresh pinned buffers per sequence, then the pool.
    with torch.inference_mode():
        target.capture(seqs[:2], aux_ids)  # warm
        for name, use in [("fresh_pinned", None), ("pool", pool)]:
            if name == "pool" and pool is None:
                continue
            sync(device)
            t = time.perf_counter()
            step = use.slots if use is not None else args.n
            for i in range(0, args.n, step):
                for p in target.capture_async(seqs[i : i + step], aux_ids, use):
                    p.wait()
                    p.release()
            s = time.perf_counter() - t
            res.emit(
                {
                    "what": "capture_forward_only",
                    "host_buffers": name,
                    "tok_s": round(tokens / s),
                    "ms_per_seq": round(s / args.n * 1000, 2),
                }
            )

    root = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="capture_"))
    threads_list = [int(t) for t in str(args.threads).split(",")]
    for sync_mode in args.sync.split(","):
        for per_shard in [int(p) for p in str(args.per_shard).split(",")]:
            for threads in threads_list:
                for rep in range(2):
                    out_dir = root / f"t{threads}-{rep}"
                    out_dir.mkdir(parents=True, exist_ok=True)
                    s, fwd, infos = run_capture(
                        target, seqs, aux_ids, out_dir, per_shard, threads, pool, sync_mode
                    )
                    nbytes = sum(i.bytes for i in infos)
                    res.emit(
                        {
                            "what": "capture_stage",
                            "writer_threads": threads,
                            "sync": sync_mode,
                            "pool_slots": args.pool_slots,
                            "per_shard": per_shard,
                            "n": args.n,
                            "rep": rep,
                            "tok_s": round(tokens / s),
                            "pct_of_plain": round(100 * tokens / s / plain_tok_s, 1),
                            "forwards_s": round(fwd, 3),
                            "writer_tail_s": round(s - fwd, 3),
                            "shard_GB_s": round(nbytes / s / 1e9, 3),
                            "bytes_per_token": width,
                            "shards": len(infos),
                        }
                    )
                    if rep == 1:  # the shards hold the right numbers
                        got = read_shard(out_dir / infos[0].file)
                        want = target.capture(seqs[:1], aux_ids)[0]
                        ok = torch.equal(got["aux_hidden"][: args.seq], want[0]) and torch.equal(
                            got["final_hidden"][: args.seq], want[1]
                        )
                        res.emit({"what": "shard_check", "equal": bool(ok)})
                    shutil.rmtree(out_dir)

    # The writer alone on CPU tensors (disk + hash bandwidth ceiling of this host).
    per_shard = int(str(args.per_shard).split(",")[0])
    fake = [
        Sample(
            s,
            [1] * len(s),
            torch.randn(len(s), 3 * model.config.hidden_size).bfloat16(),
            torch.randn(len(s), model.config.hidden_size).bfloat16(),
        )
        for s in seqs[:per_shard]
    ]
    for sync_mode in args.sync.split(","):
        for threads in sorted({*threads_list, 1}):
            out_dir = root / f"w{threads}"
            out_dir.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            with ShardWriter(threads, sync_mode) as w:
                futs = [w.submit(out_dir / f"w{i}.safetensors", fake) for i in range(8)]
                nbytes = sum(f.result().bytes for f in futs)
            s = time.perf_counter() - t
            res.emit(
                {
                    "what": "writer_only",
                    "writer_threads": threads,
                    "sync": sync_mode,
                    "GB_s": round(nbytes / s / 1e9, 3),
                }
            )
            shutil.rmtree(out_dir)
    host_io(root, res, args.io_mb << 20)


def worker_stage(model, args: argparse.Namespace, res: Results) -> None:
    """The data stage's capture phase as it runs: `TargetWorker.capture_batch` on `.gen.jsonl`
    sidecars, two calls in flight (the actor's max_concurrency=2), against the plain forward of
    the worker's own model. Also the capture-then-write path the SGLang backend keeps
    (`_capture_then_write`, what the HF backend ran before), and whether both wrote the same
    bytes."""
    import actors.target as target_mod
    from actors.target import Generated, TargetWorker, read_generated, write_generated
    from pipeline.config import DataConfig, TargetConfig

    device = next(model.parameters()).device
    root = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="capture_"))
    L = model.config.num_hidden_layers
    aux_ids = [1, L // 2 - 1, L - 4]
    model_dir = root / "target"
    t0 = time.perf_counter()
    model.save_pretrained(model_dir)
    for f in Path(args.worker).iterdir():
        shutil.copy(f, model_dir / f.name)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    target = TargetConfig(
        model=str(model_dir),
        dtype="bfloat16",
        aux_layer_ids=aux_ids,
        num_gpus_per_actor=1.0 if device.type == "cuda" else 0.0,
    )
    data = DataConfig(capture="forward", max_length=args.seq, batch_size=args.batch_size)
    worker = TargetWorker(target, data)
    shutil.rmtree(model_dir)  # loaded: free the disk for the shards
    res.emit({"what": "worker_load", "s": round(time.perf_counter() - t0, 1)})
    model = worker.backend.model
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, V, (args.seq,), generator=g).tolist() for _ in range(args.n)]
    x = torch.tensor([seqs[0]], device=device)
    with torch.inference_mode():
        ms = median_ms(lambda: model(input_ids=x), device, args.iters, warm=2)
    plain_tok_s = args.seq / ms * 1000
    res.emit({"what": "hf_forward", "ms": round(ms, 2), "tok_s": round(plain_tok_s)})

    B = args.batch_size
    batches = [seqs[i : i + B] for i in range(0, len(seqs), B)]
    masks = [[[0] * (len(s) // 4) + [1] * (len(s) - len(s) // 4) for s in b] for b in batches]
    key = "bench"

    def sidecars(out: Path, count: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            gen = Generated(batches[i], masks[i], len(batches[i]), 0, 0, 0.0)
            write_generated(out, i, key, gen)

    def inline(out: str, i: int, k: str):  # the pre-change path, SGLang's today
        return worker._capture_then_write(read_generated(out, i, k), out, i, k)

    def use_slots(n: int) -> None:
        """`CAPTURE_SLOTS` = n from here on (the worker makes its pinned buffers on its next
        capture; a first capture makes them, so no timed run pays for pinning)."""
        target_mod.CAPTURE_SLOTS = n
        worker._pinned = None
        warm = root / "warm"
        sidecars(warm, 1)
        worker.capture_batch(str(warm), 0, key)
        shutil.rmtree(warm)

    tokens = sum(map(len, seqs))
    slots = [int(n) for n in str(args.slots).split(",")]
    runs = [("capture_batch", 2, worker.capture_batch, n) for n in slots for _ in range(2)]
    runs += [("capture_batch", 1, worker.capture_batch, slots[0])]
    runs += [("capture_then_write", 2, inline, 0)]
    first: tuple[list[tuple[str, str]], list[bytes]] | None = None  # run 0's shards, sidecars
    for rep, (name, in_flight, call, n_slots) in enumerate(runs):
        if n_slots and n_slots != target_mod.CAPTURE_SLOTS or rep == 0:
            use_slots(n_slots)
        out = root / f"run{rep}"
        sidecars(out, len(batches))
        sync(device)
        t = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as ex:  # batches in order, `in_flight` at a time
            results = list(
                ex.map(lambda i, out=out, call=call: call(str(out), i, key), range(len(batches)))
            )
        s = time.perf_counter() - t
        shards = [(sh.file, sh.sha256) for r in results for sh in r.shards]
        records = [(out / f"b{i:05d}.json").read_bytes() for i in range(len(batches))]
        first = first or (shards, records)
        res.emit(
            {
                "what": "worker_stage",
                "path": name,
                "calls_in_flight": in_flight,
                "capture_slots": n_slots or None,
                "rep": rep,
                "n": args.n,
                "batch_size": B,
                "shard_max_bytes": data.shard_max_bytes,
                "shards": len(shards),
                "tok_s": round(tokens / s),
                "pct_of_plain": round(100 * tokens / s / plain_tok_s, 1),
                "s": round(s, 3),
                "capture_s": round(sum(r.capture_seconds for r in results), 3),
                "write_s": round(sum(r.write_seconds for r in results), 3),
                # same names and sha256, same sidecar bytes as run 0 (streamed)
                "same_shards_as_run0": shards == first[0],
                "same_sidecars_as_run0": records == first[1],
            }
        )
        if rep == 0:  # the shard holds what a direct capture gives
            got = read_shard(out / shards[0][0])
            want = worker.backend.capture(seqs[:1], aux_ids)[0]
            ok = torch.equal(got["aux_hidden"][: args.seq], want[0]) and torch.equal(
                got["final_hidden"][: args.seq], want[1]
            )
            res.emit({"what": "shard_check", "equal": bool(ok)})
        shutil.rmtree(out)


def host_io(root: Path, res: Results, nbytes: int = 256 << 20, files: int = 6) -> None:
    """What the host's hashing and file writing cost on their own (GB/s): sha256 on one thread;
    writing `files` files of `nbytes` one after another without and with fsync; the same from
    `files` threads at once; and the same into /dev/shm (no disk)."""
    import hashlib
    import threading

    buf = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    t = time.perf_counter()
    hashlib.sha256(buf).digest()
    res.emit(
        {
            "what": "host_io",
            "op": "sha256",
            "GB_s": round(nbytes / (time.perf_counter() - t) / 1e9, 3),
        }
    )

    def write(path: Path, mode: str) -> None:
        with open(path, "wb") as f:
            for a in range(0, nbytes, 8 << 20):
                f.write(buf[a : a + (8 << 20)])
            f.flush()
            if mode != "none":
                os.fsync(f.fileno())

    targets = [("disk", root / "io")]
    if Path("/dev/shm").is_dir():
        targets.append(("shm", Path(tempfile.mkdtemp(prefix="io_", dir="/dev/shm"))))
    for where, d in targets:
        d.mkdir(parents=True, exist_ok=True)
        for mode in ("none", "fsync"):
            for par in (1, files):
                t = time.perf_counter()
                if par == 1:
                    for i in range(files):
                        write(d / f"f{i}", mode)
                else:
                    ths = [
                        threading.Thread(target=write, args=(d / f"f{i}", mode))
                        for i in range(files)
                    ]
                    for th in ths:
                        th.start()
                    for th in ths:
                        th.join()
                s = time.perf_counter() - t
                res.emit(
                    {
                        "what": "host_io",
                        "op": "write",
                        "where": where,
                        "sync": mode,
                        "threads": par,
                        "GB_s": round(files * nbytes / s / 1e9, 3),
                    }
                )
                for i in range(files):
                    (d / f"f{i}").unlink()
        shutil.rmtree(d)


if __name__ == "__main__":
    main()
