"""The train stage end to end on CPU: real shards captured from a tiny target, 2 Ray Train workers,
a worker killed mid-run, resume, export, and the checks that reject bad inputs before training."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

for _dep in ("pydantic", "ray"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import torch
from safetensors.torch import load_file, save_file

from actors.shards import Sample, ShardError, shard_name, write_manifest, write_shard
from eagle3.checkpoint import load_drafter, save_drafter
from eagle3.config import Eagle3Config
from eagle3.model import Eagle3Drafter, drafter_from_state
from eagle3.target_weights import load_target_tensors
from eagle3.train_step import SoftTargets
from pipeline.config import parse_config
from pipeline.train import TrainInputError, phases_line, prepare, run_train
from pipeline.train_worker import read_metrics

# On a Ray of its own (ray_module), so scripts/test_suite.py runs this module beside the
# shared-Ray tests: most of its time is Ray Train starting workers and polling, not CPU.
pytestmark = pytest.mark.own_cluster

AUX = [0, 1, 2]


def sharpen(src: Path, dst: Path, scale: float) -> Path:
    """The tiny target with its lm_head scaled: same greedy tokens and hidden states, but peaked
    next-token distributions like a trained LM's (a random 4-layer model's are near uniform,
    which leaves a drafter nothing to learn in a few steps)."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * scale
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def capture_shards(
    target: Path, out: Path, n: int, new_tokens: int, seed: int = 0, aux: list[int] = AUX
):
    """Chat prompts -> greedy continuation by the target -> HF hidden states at the SGLang ids
    `aux` -> one shard."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    words = "apple river stone cloud music paper light garden window silver tiger ocean".split()
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        text = " ".join(words[j] for j in torch.randint(0, len(words), (6,), generator=g))
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        ids = torch.tensor(ids)[None]
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            hs = model(full, output_hidden_states=True).hidden_states  # hs[k+1] = output of layer k
        states = torch.cat([hs[k + 1][0] for k in aux], -1)
        mask = [0] * ids.shape[1] + [1] * (full.shape[1] - ids.shape[1])
        samples.append(
            Sample(full[0].tolist(), mask, states.to(torch.bfloat16), hs[-1][0].to(torch.bfloat16))
        )
    out.mkdir(parents=True)
    info = write_shard(out / shard_name(0, 0), samples)
    c = model.config
    rec = dict(
        model=str(target), revision=None, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        vocab_size=c.vocab_size, tokenizer_hash="test",
    )  # fmt: skip
    return write_manifest(out, rec, aux, "test", [info])


@pytest.fixture(scope="module")
def sharp_target(tiny_target, tmp_path_factory) -> Path:
    return sharpen(tiny_target, tmp_path_factory.mktemp("sharp") / "target", 60.0)


@pytest.fixture(scope="module")
def target_and_data(sharp_target, tmp_path_factory):
    """24 conversations of ~76 tokens: enough for a visible learning curve in 32 steps."""
    data = tmp_path_factory.mktemp("train_data") / "data"
    capture_shards(sharp_target, data, n=24, new_tokens=40)
    return sharp_target, data


@pytest.fixture(scope="module")
def small_data(sharp_target, tmp_path_factory):
    """A few short conversations: enough for the input checks."""
    data = tmp_path_factory.mktemp("small_data") / "data"
    capture_shards(sharp_target, data, n=4, new_tokens=8)
    return sharp_target, data


@pytest.fixture(scope="module")
def weak(ray_module, target_and_data, tmp_path_factory):
    """One epoch of training from scratch: the weak start two tests fine-tune from (one Ray
    Train fit, not one each)."""
    target, data = target_and_data
    return run_train(config(target, epochs=1), [data], tmp_path_factory.mktemp("weak") / "weak")


def config(target: Path, **train):
    t = dict(
        num_workers=2, epochs=8, lr=3e-3, ttt_length=3, tokens_per_batch=256, checkpoint_every=4,
        eval_fraction=0.15, warmup_ratio=0.05, max_failures=2,
    )  # fmt: skip
    t.update(train)
    return parse_config(
        {"target": {"model": str(target)}, "drafter": {"draft_vocab_size": 512}, "train": t}
    )


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def existing_drafter(out: Path, seed: int, **over) -> tuple[Path, Eagle3Config, dict]:
    """A drafter for the tiny target with an arbitrary (not frequency-based) vocab map."""
    base = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=49152, draft_vocab_size=300, target_hidden_size=64, aux_layer_ids=AUX,
    )  # fmt: skip
    cfg = Eagle3Config(**{**base, **over})
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size]).values
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    model.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
    model.t2d.zero_()
    model.t2d[used] = True
    state = model.state_dict()
    save_drafter(state, cfg, out, dtype=torch.float32)
    return out, cfg, state


# ----------------------------------------------------------------------------------------------
# Bad inputs: rejected by the driver before any worker starts


def test_bad_inputs_are_rejected_before_training(small_data, tmp_path):
    target, data = small_data
    cfg = config(target)

    def edited(name: str, **target_fields) -> Path:
        d = tmp_path / name
        shutil.copytree(data, d)
        m = json.loads((d / "manifest.json").read_text())
        m["target"].update(target_fields)
        (d / "manifest.json").write_text(json.dumps(m))
        return d

    for field, value in [
        ("model", "someone/other-model"),
        ("hidden_size", 128),
        ("vocab_size", 32000),
    ]:
        with pytest.raises(TrainInputError, match=rf"target\.{field} is .*another target"):
            prepare(
                cfg, [data, edited(f"other-{field}", **{field: value})], tmp_path / "out", "scratch"
            )

    empty = tmp_path / "empty"
    empty.mkdir()
    write_manifest(
        empty, json.loads((data / "manifest.json").read_text())["target"], AUX, "test", []
    )
    with pytest.raises(TrainInputError, match="no samples"):
        prepare(cfg, [empty], tmp_path / "out", "scratch")

    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ShardError, match="truncated"):
        prepare(cfg, [broken], tmp_path / "out", "scratch")

    other_ids, *_ = existing_drafter(tmp_path / "ids", 0, aux_layer_ids=[0, 1, 1])
    with pytest.raises(
        TrainInputError,
        match=r"aux layer ids \[0, 1, 1\] but the shards were captured at \[0, 1, 2\]",
    ):
        prepare(cfg, [data], tmp_path / "out", str(other_ids))

    too_big, *_ = existing_drafter(tmp_path / "big", 0, vocab_size=60000, draft_vocab_size=50000)
    with pytest.raises(TrainInputError, match="draft_vocab_size 50000 > target vocab 49152"):
        prepare(cfg, [data], tmp_path / "out", str(too_big))

    with pytest.raises(TrainInputError, match="no previous round"):
        prepare(cfg, [data], tmp_path / "out", "previous")
    wide = parse_config({**cfg.model_dump(), "drafter": {"hidden_size": 128}})
    with pytest.raises(TrainInputError, match="target's own embedding"):
        prepare(wide, [data], tmp_path / "out", "scratch")

    given, *_ = existing_drafter(tmp_path / "given", 0)
    sharded = config(target, use_gpu=True, fsdp=True, anchor=0.01)
    with pytest.raises(TrainInputError, match=r"train\.finetune\.anchor: 0\.01 needs DDP"):
        prepare(sharded, [data], tmp_path / "out", str(given))

    # A draft vocab above the target's is capped (DrafterConfig.draft_vocab_size), not an error.
    capped = parse_config({**cfg.model_dump(), "drafter": {"draft_vocab_size": 60000}})
    job = prepare(capped, [data], tmp_path / "capped", "scratch")
    assert job.drafter["draft_vocab_size"] == 49152


# ----------------------------------------------------------------------------------------------
# Training on Ray


@pytest.mark.slow
def test_two_workers_learn_survive_a_crash_and_export(ray_module, target_and_data, tmp_path):
    target, data = target_and_data
    out = tmp_path / "train"
    res = run_train(config(target), [data], out, crash_at_step=10)

    # The killed worker group resumed from the step-8 checkpoint, not from 0.
    assert (out / ".crashed-at-10").exists()
    assert [e["start_step"] for e in read_jsonl(out / "events.jsonl")] == [0, 8]
    assert res.resumed_from == (8,)
    # metrics.jsonl keeps both attempts' lines (appended, with a resume marker); the reader
    # gives the steps as the resumed attempt left them
    lines = read_metrics(Path(res.metrics_file))
    train = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in train] == list(range(1, res.steps + 1)) and res.steps == 32
    assert len(evals) == 8 and res.last_eval_metrics["loss"] == evals[-1]["eval_loss"]
    # The export is the best evaluated state by simulated acceptance (the first of equals).
    best = max(evals, key=lambda m: m["eval_sim_accept_len"])
    assert res.best_step == best["step"] and res.eval_metrics["loss"] == best["eval_loss"]

    # It learned: loss falls, step-0 accuracy rises.
    first, last = train[:4], train[-4:]
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(last, "loss") < 0.75 * mean(first, "loss")
    assert mean(last, "acc_0") > mean(first, "acc_0") + 0.03
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert set(res.final_metrics) >= {
        "loss",
        "acc_0",
        "acc_1",
        "acc_2",
        "lr",
        "tok_per_s",
        "sim_accept_len",
    }
    assert res.tok_per_s > 0 and res.train_tokens > 0

    # The export loads back and computes what the trained model computes.
    cfg, state = load_drafter(res.drafter_dir)
    vm = load_file(str(out / "init" / "vocab_map.safetensors"))
    assert torch.equal(state["d2t"], vm["d2t"]) and torch.equal(state["t2d"], vm["t2d"])
    embed = load_target_tensors(target)["embed"].float()
    exported = drafter_from_state(cfg, state, embed)
    ckpt = sorted((out / "ray").glob("*/step-*/train_state.pt"))[-1]
    assert ckpt.parent.name == "step-0000032"
    if res.best_step == 32:
        trained = torch.load(ckpt, weights_only=True)["model"]
        trained = {k.removeprefix("drafter."): v for k, v in trained.items()}
    else:  # an earlier state was better: exported as kept then (pruned checkpoints are gone)
        trained = load_drafter(out / "best")[1]
    fp32 = drafter_from_state(cfg, trained, embed)
    rounded = drafter_from_state(
        cfg, {k: v.bfloat16() if v.is_floating_point() else v for k, v in trained.items()}, embed
    )

    from eagle3.train_step import ShardSet

    shards = ShardSet(sorted(data.glob("*.safetensors")), ["x"])
    b = shards.load(shards.samples[:3], 512)
    tp, valid = SoftTargets(
        load_target_tensors(target)["lm_head"], state["d2t"], state["t2d"], torch.float32, "cpu"
    )(b)
    args = (b.input_ids, b.aux_hidden.float(), tp, valid, b.cu_seqlens, b.position_ids, 3)
    with torch.no_grad():
        got = exported.ttt_forward(*args, return_logits=True).step_logits
        same = rounded.ttt_forward(*args, return_logits=True).step_logits
        ref = fp32.ttt_forward(*args, return_logits=True).step_logits
    for g, s, r in zip(got, same, ref, strict=True):
        torch.testing.assert_close(
            g, s, rtol=0, atol=0
        )  # bf16 export = the trained weights, rounded
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05 * float(r.abs().max()))

    # Only the latest checkpoint is kept once the run finished; calling again (a driver that
    # died after the stage ended) returns the same result without starting workers. A restart
    # in the middle of training is exercised end to end in tests/test_closed_loop.py.
    assert [p.name for p in ckpt.parent.parent.glob("step-*")] == ["step-0000032"]
    res2 = run_train(config(target), [data], out)
    assert [e["start_step"] for e in read_jsonl(out / "events.jsonl")] == [0, 8]
    assert read_metrics(Path(res2.metrics_file)) == lines
    assert torch.equal(load_drafter(res2.drafter_dir)[1]["fc.weight"], state["fc.weight"])


@pytest.mark.slow
def test_fine_tuning_in_a_time_box_keeps_the_vocab_map_and_decays_over_the_steps_that_fit(
    ray_module, target_and_data, tmp_path
):
    """Fine-tuning an existing drafter (`init`) keeps its vocab map (d2t/t2d), copies it as it
    was and trains its weights. `train.max_seconds` on the same run (one Ray Train start for
    both): after its first steps the workers fix the step count that fits the box (far fewer
    than the 1,000 epochs asked: the box binds on any machine slower than 2 ms a step), keep it for a resumed attempt, and the LR reaches its floor at that step,
    as it would at the end of the epochs. What is checked is what the code enforces (the step
    count, from the probe's measured speed), never how long the run took."""
    from pipeline.time_box import PROBE_STEPS

    target, data = target_and_data
    init, _, before = existing_drafter(tmp_path / "existing", seed=7)
    out = tmp_path / "boxed"
    res = run_train(
        config(target, epochs=1000, max_seconds=8.0, eval_fraction=0.0), [data], out, init=str(init)
    )

    _, after = load_drafter(res.drafter_dir)
    assert torch.equal(after["d2t"], before["d2t"]) and torch.equal(after["t2d"], before["t2d"])
    _, copied = load_drafter(out / "init" / "drafter")
    assert torch.equal(copied["d2t"], before["d2t"]) and torch.equal(
        copied["fc.weight"], before["fc.weight"]
    )
    assert not torch.equal(after["fc.weight"], before["fc.weight"].bfloat16())  # it did train
    assert res.eval_metrics == {}
    # its workers ran under the jemalloc Ray ships (pipeline/train.py `worker_env`): seen
    # "malloc" without the runtime env
    assert json.loads((out / "events.jsonl").read_text().splitlines()[0])["allocator"] == "jemalloc"

    boxed = json.loads((out / "boxed_total.json").read_text())
    assert res.steps == boxed["total"] < 1000 * 4
    lines = [m for m in read_jsonl(Path(res.metrics_file)) if "loss" in m]
    assert [m["step"] for m in lines] == list(range(1, res.steps + 1))
    assert lines[-1]["lr"] < 0.2 * max(m["lr"] for m in lines)  # decayed over the box
    # The box fixed the step count: as many steps as fit what its 8 s had left after the probe's
    # PROBE_STEPS steps, at their warm speed (the slowest rank's median, so at least rank 0's own
    # steps') plus a share of a checkpoint every 4 steps (here each waits for Ray Train's
    # controller to take the last: the probe's slowest), less the last checkpoint; one more step
    # than the probe at least. Start-up and export are outside the box.
    per_step, spent, ckpt = boxed["s_per_step"], boxed["spent_s"], boxed["s_per_checkpoint"]
    assert per_step >= statistics.median(m["step_s"] for m in lines[:PROBE_STEPS])
    assert spent >= sum(m["step_s"] for m in lines[:PROBE_STEPS]) + ckpt and ckpt > 0
    left = 8.0 - spent - ckpt
    want = max(PROBE_STEPS + 1, PROBE_STEPS + int(left / (per_step + ckpt / 4)))
    assert boxed["total"] == want, boxed


def test_cpu_workers_get_the_jemalloc_ray_ships_unless_something_is_preloaded(monkeypatch):
    """`worker_env`: CPU training preloads ray/core/libjemalloc.so; GPU training and a process
    that already preloads a library are left alone."""
    from pipeline.train import worker_env

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cpu = config(Path("unused")).train
    lib = worker_env(cpu)["env_vars"]["LD_PRELOAD"]
    assert lib.endswith("ray/core/libjemalloc.so") and Path(lib).is_file()
    assert worker_env(cpu.model_copy(update={"use_gpu": True})) == {}
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")
    assert worker_env(cpu) == {}


@pytest.mark.slow
def test_patience_stops_training_when_acceptance_stops_improving(
    ray_module, target_and_data, tmp_path
):
    """`train.patience`: with a learning rate too small to move a weight, every evaluation after
    the first scores the same, so patience 2 with an evaluation per step ends training at step 3
    of the epochs' dozens; the stop is kept for a resumed attempt and the export is step 1's."""
    target, data = target_and_data
    out = tmp_path / "patient"
    res = run_train(config(target, lr=1e-12, eval_every=1, patience=2), [data], out)
    evals = [m for m in read_jsonl(Path(res.metrics_file)) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [1, 2, 3]
    assert res.steps == 3 and res.best_step == 1
    assert json.loads((out / "boxed_total.json").read_text()) == {"total": 3, "early_stop": True}


def ids_only(data: Path, out: Path) -> Path:
    """The shards of `data` as `data.states: online` writes them: ids and masks, no states."""
    from actors.shards import iter_samples, read_shard, verify_manifest

    m = verify_manifest(data)
    none = torch.empty(0, 0, dtype=torch.bfloat16)
    samples = [
        Sample(s["input_ids"].tolist(), s["loss_mask"].tolist(), none.new_empty(len(s["input_ids"]), 0),
               none.new_empty(len(s["input_ids"]), 0))
        for p in m.shard_paths()
        for s in iter_samples(read_shard(p))
    ]  # fmt: skip
    out.mkdir(parents=True)
    info = write_shard(out / shard_name(0, 0), samples)
    write_manifest(out, m.target, list(m.aux_layer_ids), "test", [info], online=True)
    return out


def test_online_states_train_from_ids_only_shards(ray_module, target_and_data, tmp_path):
    """`data.states: online`: the worker loads the target beside the drafter and computes each
    batch's states from its ids (pipeline/online_states.py); training runs, learns and exports
    as on captured shards. Data of both kinds in one round is refused before any worker starts."""
    target, data = target_and_data
    online = ids_only(data, tmp_path / "ids")
    with pytest.raises(TrainInputError, match="mix ids-only .* and captured"):
        prepare(config(target), [data, online], tmp_path / "mixed", "scratch")
    assert prepare(config(target), [online], tmp_path / "job", "scratch").online
    res = run_train(config(target, num_workers=1, epochs=4), [online], tmp_path / "out")
    lines = [m for m in read_jsonl(Path(res.metrics_file)) if "loss" in m]
    assert res.steps == len(lines) > 4 and Path(res.drafter_dir, "config.json").is_file()
    first, last = lines[0]["loss"], lines[-1]["loss"]
    assert last < 0.9 * first, (first, last)
    # where the fit's seconds went (the `[train] done` line shows them beside Ray Train's start)
    phases = json.loads((tmp_path / "out" / "phases.json").read_text())
    assert list(phases) == [
        "entered", "load_drafter", "load_target", "load", "step0_eval", "steps", "export"
    ]  # fmt: skip
    assert phases["steps"] > 0 and phases_line(tmp_path / "out", phases["entered"] - 5).startswith(
        " (Ray Train start 5 s, load drafter "
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_worker_trains_over_nccl_and_exports(ray_module, target_and_data, tmp_path):
    """Ray Train with `use_gpu`: the worker takes the GPU Ray gives it, NCCL joins the group."""
    target, data = target_and_data
    res = run_train(config(target, num_workers=1, use_gpu=True, epochs=2), [data], tmp_path / "gpu")
    log = (tmp_path / "gpu" / "metrics.jsonl").read_text()
    assert res.steps >= 2 and res.tok_per_s > 0 and log
    _, state = load_drafter(res.drafter_dir)
    assert (
        state["fc.weight"].dtype == torch.bfloat16
        and not torch.isnan(state["fc.weight"].float()).any()
    )


@pytest.mark.slow
def test_a_round_whose_training_only_hurts_exports_its_start_unchanged(
    ray_module, target_and_data, tmp_path
):
    """A round starts from a drafter that already fits (trained here first) and trains at a
    learning rate that wrecks it: the starting drafter is evaluated at step 0, no later state
    beats it, and the round exports the files it was given, byte for byte (`kept_start`)."""
    target, data = target_and_data
    start = run_train(config(target, epochs=6), [data], tmp_path / "start")
    given = Path(start.drafter_dir)
    res = run_train(
        config(target, epochs=2, lr=3.0, warmup_ratio=0.0, eval_every=2),
        [data],
        tmp_path / "hurt",
        init=str(given),
    )
    # the goal first: what the round exports is the drafter it was given, as it came
    assert res.kept_start and res.best_step == 0
    for f in ("config.json", "model.safetensors"):
        assert (Path(res.drafter_dir) / f).read_bytes() == (given / f).read_bytes()
    # why: step 0 scored the start, and every trained state scored below it
    evals = [m for m in read_jsonl(Path(res.metrics_file)) if "eval_loss" in m]
    assert evals[0]["step"] == 0 and len(evals) > 2
    first = evals[0]["eval_sim_accept_len"]
    assert all(m["eval_sim_accept_len"] < first for m in evals[1:]), evals
    assert res.start_eval_metrics["sim_accept_len"] == first
    assert res.eval_metrics == res.start_eval_metrics  # the exported drafter's figures


@pytest.mark.slow
def test_the_train_stage_evaluates_on_the_gate_set_and_its_gate_decides(
    ray_module, target_and_data, weak, tmp_path
):
    """With a gate set (`eval_dirs`, the run's data/gate/) every training sample is trained on
    and every evaluation scores the gate set. From a weak start, real training clears the
    paired gate (z = 2) and replaces it; from that trained drafter, steps at a learning rate
    too small to change anything gain only noise, and the round keeps its start."""
    target, data = target_and_data
    gate = tmp_path / "gate"
    gm = capture_shards(target, gate, n=24, new_tokens=40, seed=7)
    up = run_train(
        config(target, epochs=4, gate_z=2.0, eval_every=4), [data], tmp_path / "up",
        init=weak.drafter_dir, eval_dirs=[gate],
    )  # fmt: skip
    # no hold-out: the training split is all of the data's tokens (each sample < the budget)
    from actors.shards import load_manifest

    assert up.train_tokens == load_manifest(data).num_tokens
    evals = [m for m in read_jsonl(Path(up.metrics_file)) if "eval_loss" in m]
    assert {m["eval_tokens"] for m in evals} == {evals[0]["eval_tokens"]}  # the same set each time
    # the gate set's (positions whose target token is in the draft vocab), not a 15% hold-out
    assert evals[0]["eval_tokens"] > 0.5 * gm.num_loss_tokens
    g = up.gate
    assert not up.kept_start and g["replaced_start"] and g["z"] == 2.0 and g["batches"] >= 6
    assert g["gain"] > 2.0 * g["gain_se"] > 0 and g["step"] == up.best_step
    still = run_train(
        config(target, epochs=1, lr=1e-9, gate_z=2.0), [data], tmp_path / "still",
        init=up.drafter_dir, eval_dirs=[gate],
    )  # fmt: skip
    assert still.kept_start and still.best_step == 0 and not still.gate["replaced_start"]
    assert abs(still.gate["gain"]) <= 2.0 * still.gate["gain_se"]


@pytest.mark.slow
def test_a_round_after_a_kept_start_trains_on_from_its_last_state(
    ray_module, target_and_data, weak, tmp_path
):
    """`train.continue_kept`, through the loop's own `_train`: round 0 fine-tunes a drafter
    behind a gate no trained state can clear, so it keeps its start, and round 1 trains on from
    round 0's last state instead of from the serving drafter again: the steps add up. The gate
    and the export stay on the serving drafter: round 1's step 0 scores it, and round 1 exports
    it byte for byte. Seen failing without the option (round 1 restarted from the start: its
    first step's drift from the start was one step's, not round 0's whole)."""
    from pipeline.loop import _train
    from pipeline.state import RoundState, RunState

    target, data = target_and_data
    start = Path(weak.drafter_dir)
    cfg = parse_config({
        "target": {"model": str(target)}, "drafter": {"init": str(start)},
        "train": {"num_workers": 2, "epochs": 2, "ttt_length": 3, "tokens_per_batch": 256,
                  "checkpoint_every": 100, "eval_fraction": 0.15, "data_rounds": 1,
                  # anchor 1e-12: nothing pulls, but every step logs its drift from the start
                  "finetune": {"lr": 3e-3, "warmup_ratio": 0.05, "anchor": 1e-12, "gate_z": 1e9}},
    })  # fmt: skip
    made = {"generate": {"manifest": str(data / "manifest.json")}}
    state = RunState(
        "test", rounds=[RoundState(0, done=dict(made)), RoundState(1, done=dict(made))]
    )

    class Tracker:  # the loop's MLflow seam, kept in a dict
        logged: dict[str, float] = {}

        def log(self, child, metrics, step=None):
            self.logged.update(metrics)

        def log_steps(self, child, steps):
            for _, metrics in steps:
                self.logged.update(metrics)

        def log_artifact(self, child, path, name):
            pass

    r0 = _train(cfg, tmp_path / "run", state, 0, Tracker(), "round-0")
    state.rounds[0].done["train"] = r0
    state.champion = {"round": 0, "drafter_dir": r0["drafter_dir"]}  # promoted over none
    r1 = _train(cfg, tmp_path / "run", state, 1, Tracker(), "round-1")

    def drift(rec):
        return [m["drift_rms"] for m in read_metrics(Path(rec["metrics_file"])) if "drift_rms" in m]

    # the goal: round 1 begins where round 0's training ended, not at the serving drafter
    d0, d1 = drift(r0), drift(r1)
    assert d0[-1] > 2 * d0[0], d0  # round 0 moved away from its start
    assert d1[0] > 0.9 * d0[-1] and d1[-1] > d0[-1], (d0, d1)
    assert r1.get("continued_from") and Tracker.logged["train/continued"] == 1.0
    # judged against the serving drafter: the same step-0 score, and both rounds keep it
    assert r0["kept_start"] and r1["kept_start"] and Path(r0["last_dir"]).is_dir()
    assert r1["start_eval_metrics"]["sim_accept_len"] == pytest.approx(
        r0["start_eval_metrics"]["sim_accept_len"], rel=1e-6
    )
    for f in ("config.json", "model.safetensors"):  # the trained state is never exported
        assert (Path(r1["drafter_dir"]) / f).read_bytes() == (start / f).read_bytes()
