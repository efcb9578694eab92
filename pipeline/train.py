"""The train stage: fine-tune the EAGLE-3 drafter with time-test training on captured shards,
as a Ray Train (V2) `TorchTrainer`, and export it in SGLang's format.

    python -m pipeline.train --config configs/smollm2-cpu.yaml --data RUN/data/round-000 --out RUN/train/round-000

Driver (`run_train`): checks every input before a worker starts (manifests and shards, target
identity, aux layer ids, vocab sizes, at least one sample), fixes the drafter's starting point
under `<out>/init/` (a vocab map built from loss-token frequencies for `scratch`, or a local copy
of the existing drafter whose d2t/t2d are kept bit for bit), runs the trainer, and returns a
`TrainResult` of paths and numbers. MLflow is not touched here: the loop logs `metrics.jsonl`.

Workers (`train_worker`, pipeline/train_worker.py): read their share of the shards, pack, train,
evaluate, checkpoint through `ray.train.report` and resume; see that module.

Output folder:
    <out>/init/           vocab_map.safetensors (scratch) or drafter/ (existing drafter, as loaded,
                          fp32) and given/ (its files as they came); continue/ (fp32): the state
                          training goes on from after step 0 (`continue_from`), when one is given
    <out>/metrics.jsonl   one JSON line per step ({"step", loss, acc_i, lr, tok_per_s, ...}) and per
                          eval ({"step", eval_loss, eval_acc_i, ...}); rewritten past the resumed step
    <out>/events.jsonl    one line per worker-group start: {"start_step": .., "allocator": ..}
                          (resumes show here; "jemalloc" on CPUs: `worker_env`)
    <out>/ray/<name>/     Ray Train storage: checkpoints (model, optimizer, scheduler, step, RNG)
    <out>/drafter/        the exported drafter (config.json + model.safetensors, SGLang format)
    <out>/last/           the last trained state (fp32), when the round kept its start and
                          `train.continue_kept` asks for it: the next round trains on from it
    <out>/result.json     what TrainResult holds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.config import add_set_argument
from actors.files import atomic_write
from eagle3.train_step import (
    token_counts,
)
from pipeline.config import (
    Config,
    DrafterConfig,
    TargetConfig,
    TrainConfig,
    dump_config,
    load_config,
)
from pipeline.train_worker import TrainJob, _say, train_worker  # noqa: F401  (TrainJob re-exported)

log = logging.getLogger("pipeline.train")


@dataclass(frozen=True)
class TrainResult:
    drafter_dir: str  # <out>/drafter, SGLang format: the best evaluated state (best_step)
    train_tokens: int  # tokens in the training split (one epoch)
    steps: int  # optimizer steps
    tok_per_s: float  # training tokens per second over all steps (all workers)
    final_metrics: dict[str, float]  # last step's (loss, acc_i, lr, tok_per_s, sim_accept_len)
    eval_metrics: dict[str, float]  # the exported drafter's evaluation, {} without eval data
    metrics_file: str  # <out>/metrics.jsonl
    resumed_from: tuple[int, ...] = ()  # steps the run restarted from (failures, restarts)
    best_step: int = 0  # the step the exported drafter is from
    last_eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    kept_start: bool = False  # no trained state beat the drafter given: its files, as they came
    start_eval_metrics: dict[str, float] = field(default_factory=dict)  # step 0's ({}: scratch)
    # the keep-the-start decision (train_worker._gate_record): the state judged, its paired gain
    # over the start, the gain's SE, z, eval batches, replaced_start; {} when nothing was judged
    gate: dict[str, Any] = field(default_factory=dict)
    last_dir: str | None = None  # <out>/last/: the last trained state, when the start was kept
    continued_from: str | None = None  # the state trained from, when not the drafter given


class TrainInputError(ValueError):
    """Inputs the train stage cannot use; the message lists every problem and its fix."""


# ----------------------------------------------------------------------------------------------
# Driver


def run_train(
    cfg: Config,
    data_dirs: Sequence[str | Path],
    out_dir: str | Path,
    init: str | None = None,
    run_name: str | None = None,
    storage_path: str | Path | None = None,
    crash_at_step: int | None = None,
    eval_dirs: Sequence[str | Path] = (),
    continue_from: str | None = None,
) -> TrainResult:
    """Train a drafter on the shards of `data_dirs` into `out_dir`; Ray must be initialised.

    init: `scratch`, or a local folder / HF repo id of an existing drafter (default
    cfg.drafter.init). eval_dirs: the gate set's data (the run's `data/gate/`), evaluated on
    instead of a hold-out of `data_dirs`. continue_from: a state `init` was trained to (a kept
    round's `last_dir`): training goes on from its weights while step 0, the gate and a kept
    start's export stay `init`'s (pipeline/continued.py). Calling again with the same out_dir
    (and run_name) resumes the run."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    done = out / "result.json"
    if done.exists() and Path(json.loads(done.read_text())["drafter_dir"]).is_dir():
        rec = json.loads(done.read_text())  # finished earlier: its checkpoints are pruned
        print(f"[train] already finished: {rec['drafter_dir']}", flush=True)
        return TrainResult(**{**rec, "resumed_from": tuple(rec["resumed_from"])})
    job = prepare(
        cfg, [Path(d).resolve() for d in data_dirs], out, init or cfg.drafter.init, crash_at_step,
        [Path(d).resolve() for d in eval_dirs], continue_from,
    )  # fmt: skip
    atomic_write(out / "train_config.yaml", dump_config(cfg))
    tc = cfg.train
    resources = {"CPU": tc.cpus_per_worker}
    # a share below 1 leaves the rest of the GPU to the server (Config.serves_through_rounds)
    if tc.use_gpu:
        resources["GPU"] = tc.gpus_per_worker
    from pipeline.rendezvous import LoopbackTorchConfig

    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"job": asdict(job)},
        torch_config=LoopbackTorchConfig(),  # rendezvous on 127.0.0.1 when Ray is on loopback
        scaling_config=ScalingConfig(
            num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=run_name or f"train-{out.name}",
            storage_path=str(Path(storage_path or out / "ray").resolve()),
            failure_config=FailureConfig(max_failures=tc.max_failures),
            # Keep every checkpoint while the run lives: with num_to_keep, a driver killed between
            # Ray deleting an old checkpoint and persisting that fact leaves a snapshot naming a
            # missing folder, and the resumed run then fails. Pruned below once fit() returns.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            worker_runtime_env=worker_env(tc),
        ),
    )
    t0, began = time.perf_counter(), time.time()
    result = trainer.fit()  # raises TrainingFailedError once max_failures is spent
    _prune_checkpoints(result)
    rec = json.loads((out / "result.json").read_text())
    print(
        f"[train] done in {time.perf_counter() - t0:.0f}s{phases_line(out, began)}: {rec['steps']} steps, {rec['tok_per_s']:.0f} tok/s, drafter {rec['drafter_dir']}",
        flush=True,
    )
    return TrainResult(**{**rec, "resumed_from": tuple(rec["resumed_from"])})


def phases_line(out: Path, began: float) -> str:
    """` (Ray Train start 19 s, load 12 s, ...)`: where a fit's seconds went, from the worker's
    <out>/phases.json (pipeline/time_box.py `Phases`) and when the fit began; "" without it."""
    from pipeline.time_box import PHASES

    if not (out / PHASES).is_file():
        return ""
    p = json.loads((out / PHASES).read_text())
    parts = [f"Ray Train start {p.pop('entered') - began:.0f} s"]
    parts += [f"{k.replace('_', ' ')} {v:.0f} s" for k, v in p.items()]
    return f" ({', '.join(parts)})"


def worker_env(tc: TrainConfig) -> dict[str, Any]:
    """The training workers' runtime env, beside the job's: on CPUs, LD_PRELOAD of the jemalloc
    that Ray ships (ray/core/libjemalloc.so), unless this process already preloads something.
    Each step packs samples of new lengths, so its tensors take new shapes: on 2 cores the demo's
    round-1 steps ran 8-25% faster under jemalloc than under glibc's malloc, and held their speed
    where glibc's slowed as the run went on (docs/training.md "Speed"). The data stage's
    decoding ran alike under both, so only the trainer gets it."""
    import os

    import ray

    lib = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    if tc.use_gpu or os.environ.get("LD_PRELOAD") or not lib.is_file():
        return {}
    return {"env_vars": {"LD_PRELOAD": str(lib)}}


def _prune_checkpoints(result) -> None:
    """Delete all but the latest checkpoint of a finished run (the exported drafter is what
    the next stage reads; the latest checkpoint is what a re-run would resume from)."""
    latest = result.checkpoint.path if result.checkpoint else None
    for ckpt, _ in result.best_checkpoints or []:
        if ckpt.path != latest:
            shutil.rmtree(ckpt.path, ignore_errors=True)


def prepare(
    cfg: Config,
    data_dirs: list[Path],
    out: Path,
    init: str,
    crash_at_step: int | None = None,
    eval_dirs: Sequence[Path] = (),
    continue_from: str | None = None,
) -> TrainJob:
    """Every check that needs no training, then the drafter's starting point under <out>/init.
    The eval data (`eval_dirs`, the gate set) gets the same checks as the training data.
    Raises TrainInputError listing all problems (or ShardError for damaged shards)."""
    from actors.shards import verify_manifest
    from eagle3.target_weights import read_target_info

    if not data_dirs:
        raise TrainInputError("no data dirs; pass --data DIR (a folder holding manifest.json)")
    manifests = [verify_manifest(d) for d in data_dirs]  # ShardError names bad shards
    evals = [verify_manifest(d) for d in eval_dirs]
    tcfg = cfg.target
    info = read_target_info(tcfg.model, tcfg.revision, tcfg.gguf_file)
    problems = [p for m in manifests + evals for p in _target_problems(m, tcfg, info)]
    ids = {tuple(m.aux_layer_ids) for m in manifests + evals}
    if len(ids) > 1:
        problems.append(
            f"data dirs were captured at different aux layer ids {sorted(ids)}; train on data of one capture setting"
        )
    online = {m.online for m in manifests + evals}
    if len(online) > 1:
        problems.append(
            "data dirs (with the gate set) mix ids-only (data.states: online) and captured (offline) data; train on "
            "data of one data.states setting"
        )
    if sum(m.num_samples for m in manifests) == 0 or sum(m.num_loss_tokens for m in manifests) == 0:
        problems.append(
            f"{[str(d) for d in data_dirs]}: no samples with loss tokens; rerun the generate stage"
        )
    tc = cfg.train
    if init != "scratch" and tc.use_gpu and tc.fsdp and tc.anchor:
        # refused here, before Ray starts: in a worker it would fail every retry of the group
        problems.append(
            f"train.finetune.anchor: {tc.anchor} needs DDP (FSDP2 shards the weights it "
            "anchors); set train.fsdp: false, or train.finetune.anchor: 0"
        )
    if evals and sum(m.num_loss_tokens for m in evals) == 0:
        problems.append(
            f"{[str(d) for d in eval_dirs]}: the gate set has no loss tokens; delete the "
            "folder and rerun the loop to remake it, or set data.gate_prompts: 0"
        )
    if problems:
        raise TrainInputError("cannot train:\n  " + "\n  ".join(problems))
    aux_ids = list(next(iter(ids)))
    shards, eval_shards = _shard_refs(manifests), _shard_refs(evals)
    init_dir = out / "init"
    if init == "scratch":
        drafter = _scratch_config(cfg.drafter, info, aux_ids)
        _write_vocab_map([p for p, _ in shards], drafter, init_dir)
        kind = "scratch"
    else:
        drafter = _copy_existing(init, info, aux_ids, init_dir / "drafter")
        kind = "drafter"
    cont = _continued(continue_from if kind == "drafter" else None, init_dir)
    sim = min(cfg.serve.steps, cfg.train.ttt_length)
    return TrainJob(
        str(out),
        shards,
        drafter,
        kind,
        tcfg.model_dump(),
        cfg.train.model_dump(),
        sim,
        crash_at_step,
        eval_shards=eval_shards,
        online=True in online,
        continue_from=cont,
    )


def _continued(src: str | None, init_dir: Path) -> str | None:
    """`<init>/continue/`, a checked fp32 copy of `src` (the state training goes on from), or
    None: no `src`, or one that is not the drafter given trained further (then the round
    trains from the drafter given, as without it, and says why)."""
    from eagle3.checkpoint import load_drafter
    from pipeline.continued import CONTINUE, copy_continued

    dest = init_dir / CONTINUE
    shutil.rmtree(dest, ignore_errors=True)  # a restarted driver copies it again
    if src is None:
        return None
    why = copy_continued(src, load_drafter(init_dir / "drafter"), dest)
    if why:
        print(f"[train] not continuing from {src}: {why}; training from the drafter given", flush=True)  # fmt: skip
        return None
    print(f"[train] training goes on from {src} (the drafter given is what the gate judges against)", flush=True)  # fmt: skip
    return str(dest)


def _shard_refs(manifests: list) -> tuple[tuple[str, str], ...]:
    """(path, sha256) of every shard of `manifests`, in order."""
    return tuple(
        (str(p), s.sha256)
        for m in manifests
        for p, s in zip(m.shard_paths(), m.shards, strict=True)
    )


def _target_problems(m, tcfg: TargetConfig, info) -> list[str]:
    t, src = m.target, f"{m.root}/manifest.json"
    want = {
        "model": tcfg.model,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "num_layers": info.num_layers,
    }
    out = [
        f"{src}: target.{k} is {t.get(k)!r} but the configured target has {v!r}; these shards come from another "
        "target: regenerate them with this target or point target.model at the one that made them"
        for k, v in want.items()
        if t.get(k) != v
    ]
    if tcfg.revision and t.get("revision") and t["revision"] != tcfg.revision:
        out.append(
            f"{src}: target.revision {t['revision']!r} != target.revision {tcfg.revision!r}; regenerate the data"
        )
    return out


def _scratch_config(d: DrafterConfig, info, aux_ids: list[int]) -> dict[str, Any]:
    from eagle3.config import Eagle3Config

    hidden = d.hidden_size or info.hidden_size
    if hidden != info.hidden_size:
        raise TrainInputError(
            f"drafter.hidden_size={hidden} but the target's hidden size is {info.hidden_size}; an EAGLE-3 drafter "
            "reads the target's own embedding (SGLang shares it), so leave drafter.hidden_size unset"
        )
    heads = d.num_attention_heads or info.num_attention_heads
    head_dim = d.head_dim or (
        info.head_dim
        if hidden == info.hidden_size and heads == info.num_attention_heads
        else hidden // heads
    )
    vd = d.draft_vocab_size
    if vd > info.vocab_size:
        log.warning(
            "drafter.draft_vocab_size %d > target vocab %d: capped to %d",
            vd,
            info.vocab_size,
            info.vocab_size,
        )
        vd = info.vocab_size
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=d.intermediate_size or info.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=d.num_key_value_heads or info.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=info.vocab_size,
        draft_vocab_size=vd,
        target_hidden_size=info.hidden_size,
        aux_layer_ids=aux_ids,
        rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta,
        rope_scaling=info.rope_scaling,
        max_position_embeddings=info.max_position_embeddings or 2048,
    ).as_dict()


def _write_vocab_map(paths: list[str], drafter: dict[str, Any], init_dir: Path) -> None:
    """Top-N loss-token frequencies over all shards -> d2t/t2d (eagle3.vocab.build_vocab_map)."""
    from safetensors.torch import load_file, save

    from eagle3.vocab import build_vocab_map, coverage

    f = init_dir / "vocab_map.safetensors"
    counts = token_counts(paths, drafter["vocab_size"])
    if f.exists():  # a restarted run keeps the map its checkpoints were trained with
        t2d = load_file(str(f))["t2d"]
        if int(t2d.sum()) != drafter["draft_vocab_size"]:
            raise TrainInputError(
                f"{f}: holds a {int(t2d.sum())}-token vocab map but drafter.draft_vocab_size gives "
                f"{drafter['draft_vocab_size']}; use a new --out folder for a different drafter"
            )
        print(f"[train] vocab map: kept {f} (restarted run)", flush=True)
    else:
        d2t, t2d = build_vocab_map(counts, drafter["draft_vocab_size"])
        init_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(f, save({"d2t": d2t, "t2d": t2d}))  # a restart keeps it: whole or absent
    print(
        f"[train] vocab map: {drafter['draft_vocab_size']} draft tokens cover {coverage(counts, t2d):.1%} of "
        f"{int(counts.sum())} loss tokens",
        flush=True,
    )


def _copy_existing(init: str, info, aux_ids: list[int], dest: Path) -> dict[str, Any]:
    """Load an existing drafter (folder or repo id), check it against the target and the data,
    and keep a local copy (fp32, d2t/t2d untouched) that every worker loads, beside the files as
    they came (`given/`: what a round exports when no trained state beats its start)."""
    import shutil

    from eagle3.checkpoint import load_drafter, local_or_download, save_drafter

    if init == "previous":
        raise TrainInputError(
            "drafter.init=previous: no previous round to start from here; pass the previous round's "
            "drafter folder (…/train/round-NNN/drafter) or use scratch"
        )
    from eagle3.fit import drafter_fit_problems

    src = local_or_download(
        init, None, ["config.json", "*.safetensors", "*.safetensors.index.json"]
    )
    dcfg, state = load_drafter(src)  # the folder fetched once: read here, copied to given/ below
    problems = drafter_fit_problems(
        dcfg,
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        num_layers=info.num_layers,
        source=init,
    )
    if list(dcfg.aux_layer_ids) != aux_ids:
        problems.append(
            f"{init}: aux layer ids {list(dcfg.aux_layer_ids)} but the shards were captured at {aux_ids}; regenerate the "
            f"data with target.aux_layer_ids={list(dcfg.aux_layer_ids)} or start from scratch"
        )
    if problems:
        raise TrainInputError("cannot fine-tune:\n  " + "\n  ".join(problems))
    given = dest.parent / "given"
    for d in (dest, given):
        if d.exists():
            shutil.rmtree(d)
    save_drafter(state, dcfg, dest, dtype=torch.float32)
    given.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json" or ".safetensors" in f.name:
            shutil.copy2(f, given / f.name)
    return dcfg.as_dict()


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.train") -> TrainResult:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Train an EAGLE-3 drafter on captured shards (Ray Train).",
        epilog=f"example:\n  {prog} --config configs/smollm2-cpu.yaml --data runs/x/data/round-000 "
        "--out runs/x/train/round-000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config", required=True, help="YAML config (target:, drafter:, train: are used)"
    )
    ap.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="data dirs holding manifest.json (rounds accumulate)",
    )
    ap.add_argument(
        "--out", required=True, help="output folder (re-run with the same folder to resume)"
    )
    ap.add_argument(
        "--eval-data",
        nargs="*",
        default=(),
        help="the gate set's data dir (a run's data/gate/): evaluated on instead of a hold-out",
    )
    ap.add_argument(
        "--init",
        default=None,
        help="scratch, or an existing drafter folder / HF repo id (default drafter.init)",
    )
    add_set_argument(ap)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    from actors.cluster import start_ray

    start_ray(cfg.runtime_env)
    from_drafter = (args.init or cfg.drafter.init) != "scratch"
    cfg = cfg.model_copy(update={"train": cfg.train.for_round(0, from_drafter=from_drafter)})
    res = run_train(cfg, args.data, args.out, init=args.init, eval_dirs=args.eval_data)
    _say(json.dumps(dataclasses.asdict(res)))
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main()
