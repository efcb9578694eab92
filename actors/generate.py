"""The generate stage: target actors regenerate responses for a round's prompts and write shards.

    python -m actors.generate --config configs/smollm2-cpu.yaml --out runs/x/data/round-000 [--round 0]

Prompt batches (``data.batch_size`` prompts each) are numbered in order; batch b writes shards
``b{b:05d}-{part:02d}.safetensors`` and then a sidecar ``b{b:05d}.json`` with their sha256 and a key
of the prompts and settings. A rerun skips every batch whose sidecar matches and whose shards are
intact, so a killed stage resumes where it stopped; ``manifest.json`` is written last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from actors.prompts import Conversation, prompt_key
from actors.shards import MANIFEST, bytes_per_token, finished_batch, write_manifest
from pipeline.config import DataConfig, TargetConfig

STORAGE_MARGIN = 1.1  # headroom over the estimate (headers, sidecars, temp files)


@dataclass(frozen=True)
class DataResult:
    """What the generate stage hands the driver. Throughputs are aggregate over actors and count
    only batches computed in this run (0 when everything was already on disk)."""

    manifest: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    gen_tok_per_s: float
    capture_tok_per_s: float
    seconds: float


def run_generate(
    target: TargetConfig,
    data: DataConfig,
    prompts: list[Conversation],
    out_dir: Path,
    config_hash: str,
) -> DataResult:
    """Generate, capture and write shards for ``prompts`` into ``out_dir``; Ray must be initialised."""
    import ray

    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [prompts[i : i + data.batch_size] for i in range(0, len(prompts), data.batch_size)]
    keys = [batch_key(b, target, data) for b in batches]
    records: dict[int, dict[str, Any]] = {}
    for i, k in enumerate(keys):
        if (rec := finished_batch(out_dir, i, k)) is not None:
            records[i] = rec
    todo = deque(i for i in range(len(batches)) if i not in records)
    print(
        f"[generate] {out_dir}: {len(batches)} batches, {len(records)} already done, {len(todo)} to do",
        flush=True,
    )

    actors, results, info = [], [], {}
    if todo:
        actors = _start_actors(target, data, min(data.num_actors, len(todo)))
        try:
            t0 = time.perf_counter()
            info = ray.get(actors[0].info.remote())
            print(
                f"[generate] {len(actors)} actor(s) loaded the target in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
            lengths = ray.get(
                actors[0].prompt_lengths.remote([p for i in todo for p in batches[i]])
            )
            _check_storage(out_dir, info, lengths, data)
            results = _dispatch(actors, batches, keys, todo, out_dir)
        finally:
            for a in actors:
                ray.kill(a)
    for r in results:
        records[r.batch_index] = {**info, "shards": list(r.shards)}

    first = records[min(records)] if records else {}
    manifest = write_manifest(
        out_dir,
        first.get("target", {}),
        first.get("aux_layer_ids", []),
        config_hash,
        [s for i in sorted(records) for s in records[i]["shards"]],
    )
    gen_s = sum(r.gen_seconds for r in results) / max(1, len(actors))
    cap_s = sum(r.capture_seconds for r in results) / max(1, len(actors))
    return DataResult(
        manifest=str(out_dir / MANIFEST),
        num_samples=manifest.num_samples,
        num_tokens=manifest.num_tokens,
        num_loss_tokens=manifest.num_loss_tokens,
        gen_tok_per_s=sum(r.gen_tokens for r in results) / gen_s if gen_s else 0.0,
        capture_tok_per_s=sum(r.capture_tokens for r in results) / cap_s if cap_s else 0.0,
        seconds=time.perf_counter() - start,
    )


def batch_key(batch: list[Conversation], target: TargetConfig, data: DataConfig) -> str:
    """Identity of a batch's output: its prompts and every setting that changes the shards."""
    settings = {
        "target": target.model_dump(mode="json", exclude={"env", "num_gpus_per_actor"}),
        "data": data.model_dump(mode="json", include={"max_new_tokens", "max_length", "temperature", "seed", "shard_max_bytes"}),
        "prompts": [prompt_key(c) for c in batch],
    }  # fmt: skip
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def _start_actors(target: TargetConfig, data: DataConfig, n: int) -> list[Any]:
    import ray

    from actors.target import TargetActor

    # Torch threads per actor: this node's cores shared by data.num_actors actors (not by the
    # batches left, so a resumed run computes with the same kernels and byte-identical shards).
    # On a small CPU, single-threaded actors beat one multi-threaded one.
    cores = min(int(ray.cluster_resources().get("CPU", 1)), os.cpu_count() or 1)
    threads = max(1, cores // data.num_actors)
    opts: dict[str, Any] = {
        "num_cpus": threads,
        "num_gpus": target.num_gpus_per_actor,
        "max_concurrency": 2,
    }
    if target.env:
        opts["runtime_env"] = {"env_vars": dict(target.env)}
    return [TargetActor.options(**opts).remote(target, data, threads) for _ in range(n)]


def _dispatch(
    actors: list[Any],
    batches: list[list[Conversation]],
    keys: list[str],
    todo: deque,
    out_dir: Path,
) -> list[Any]:
    """Keep two batches in flight per actor (one computing, one writing) until all are done."""
    import ray

    pending: dict[Any, Any] = {}
    results = []

    def submit(actor: Any) -> None:
        if todo:
            i = todo.popleft()
            pending[actor.process.remote(batches[i], str(out_dir), i, keys[i])] = actor

    total = sum(len(batches[i]) for i in todo)
    for a in actors:
        submit(a)
        submit(a)
    t0 = time.perf_counter()
    with tqdm(total=total, unit="prompt", desc="generate", file=sys.stdout, mininterval=2.0) as bar:
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(ref)
            r = ray.get(ref)
            results.append(r)
            submit(actor)
            toks = sum(x.gen_tokens for x in results)
            bar.set_postfix(
                gen_tok_s=f"{toks / (time.perf_counter() - t0):.0f}",
                shards=sum(len(x.shards) for x in results),
            )
            bar.update(r.num_prompts)
    skipped = sum(r.skipped_prompts for r in results)
    if skipped:
        print(f"[generate] skipped {skipped} prompt(s) longer than data.max_length", flush=True)
    return results


def _check_storage(
    out_dir: Path, info: dict[str, Any], lengths: list[int], data: DataConfig
) -> None:
    """Print the storage estimate and refuse to start when the disk cannot hold it."""
    per_tok = bytes_per_token(info["target"]["hidden_size"], len(info["aux_layer_ids"]))
    tokens = sum(min(n + data.max_new_tokens, data.max_length) for n in lengths)
    need = int(per_tok * tokens * STORAGE_MARGIN)
    free = shutil.disk_usage(out_dir).free
    print(
        f"[generate] storage estimate: {per_tok} B/token x {tokens} planned tokens "
        f"({len(lengths)} prompts x (prompt + {data.max_new_tokens} new)) = {need / 2**30:.2f} GiB; "
        f"{free / 2**30:.1f} GiB free in {out_dir}",
        flush=True,
    )
    if need > free:
        raise OSError(
            f"{out_dir}: the shards need about {need} bytes but only {free} are free; free space, point "
            "--out elsewhere, or lower data.prompts_per_round / data.max_new_tokens"
        )


def main(argv: list[str] | None = None) -> None:
    from actors.prompts import load_prompts, round_prompts, split_prompts
    from pipeline.config import load_config

    ap = argparse.ArgumentParser(description="Run the generate stage alone (one round).")
    ap.add_argument("--config", required=True, help="YAML config (pipeline.config)")
    ap.add_argument("--out", required=True, type=Path, help="data directory of the round")
    ap.add_argument(
        "--round", type=int, default=0, help="round index: picks that round's fresh prompts"
    )
    ap.add_argument("overrides", nargs="*", help="dotted.path=value config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)

    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
        )
    train, _ = split_prompts(load_prompts(cfg.data), cfg.data.heldout_prompts, cfg.data.seed)
    prompts = round_prompts(train, args.round, cfg.data.prompts_per_round)
    result = run_generate(cfg.target, cfg.data, prompts, args.out, cfg.digest())
    print(json.dumps(asdict(result), indent=1))


if __name__ == "__main__":
    main()
