"""The generate stage end to end: a tiny random Llama target in 2 Ray actors writes real shards."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

for _dep in ("pydantic", "ray"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.batch_records import Generated, write_generated
from actors.chat import prompt_ids, user_turn_prefix
from actors.generate import _check_storage, batch_key, prompt_batches, run_generate
from actors.hf_backend import HFTarget, resolve_aux_layer_ids
from actors.prompts import SelfWritten, builtin_prompts
from actors.shards import (
    MANIFEST,
    Sample,
    ShardError,
    finished_batch,
    iter_samples,
    pack_parts,
    read_shard,
    shard_name,
    verify_manifest,
    write_shard,
)
from actors.target import CAPTURE_SLOTS, TargetWorker
from pipeline.config import DataConfig, TargetConfig

AUX = [2, 0, 1]  # distinct and unsorted: pins id k <-> hidden_states[k+1] and the concat order
PROMPTS = builtin_prompts(0)[:10]


def _cfgs(tiny_target: Path) -> tuple[TargetConfig, DataConfig]:
    target = TargetConfig(model=str(tiny_target), aux_layer_ids=AUX)
    data = DataConfig(
        batch_size=4, num_actors=2, max_new_tokens=12, max_length=96, shard_max_bytes=2**20
    )
    return target, data


@pytest.fixture(scope="module")
def stage(tiny_target, ray_local, tmp_path_factory):
    """One run of the stage: 10 prompts in batches of 4 -> 3 batches over 2 actors."""
    target, data = _cfgs(tiny_target)
    out = tmp_path_factory.mktemp("data")
    result = run_generate(target, data, PROMPTS, out, "cfghash")
    return target, data, out, result


def _samples(out: Path):
    m = verify_manifest(out)
    return m, [s for p in m.shard_paths() for s in iter_samples(read_shard(p))]


def test_shards_and_manifest(stage):
    _, _, out, result = stage
    m, samples = _samples(out)
    assert result.manifest == str(out / MANIFEST)
    assert [s.file for s in m.shards] == [
        "b00000-00.safetensors",
        "b00001-00.safetensors",
        "b00002-00.safetensors",
    ]
    assert m.num_samples == result.num_samples == len(samples) == len(PROMPTS)
    assert m.num_tokens == result.num_tokens == sum(len(s["input_ids"]) for s in samples)
    assert m.num_loss_tokens == sum(int(s["loss_mask"].sum()) for s in samples) == len(PROMPTS) * 12
    assert m.aux_layer_ids == tuple(AUX) and m.config_hash == "cfghash"
    assert (
        m.target["num_layers"] == 4
        and m.target["hidden_size"] == 64
        and len(m.target["tokenizer_hash"]) == 64
    )
    assert result.gen_tok_per_s > 0 and result.capture_tok_per_s == 0  # no capture pass


def _direct_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) of one plain HF forward of a sequence, in bf16, one thread (the actors' kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            hs = model(input_ids=ids.long()[None], output_hidden_states=True).hidden_states
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(
        torch.cat([hs[k + 1][0] for k in AUX], -1), torch.cat([hs[k][0] for k in AUX], -1)
    )  # id k is hidden_states[k+1], not [k]
    return torch.cat([hs[k + 1][0] for k in AUX], -1).bfloat16(), hs[-1][0].bfloat16()


def test_decode_captured_states_match_a_direct_hf_forward(stage, tiny_target):
    """data.capture=decode (the HF default): the states kept from batched, cached decoding equal a
    clean forward of the finished sequence up to kernel rounding, for every position (the last
    token of each response included)."""
    _, _, out, _ = stage
    _, samples = _samples(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for s in samples:
        want_aux, want_final = _direct_states(model, s["input_ids"])
        assert s["aux_hidden"].shape == want_aux.shape
        torch.testing.assert_close(s["aux_hidden"].float(), want_aux.float(), rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(
            s["final_hidden"].float(), want_final.float(), rtol=2e-2, atol=2e-3
        )


def test_forward_captured_states_equal_a_direct_hf_forward(two_phase_stage, tiny_target):
    """data.capture=forward (two-phase here): bit-equal to a plain HF forward."""
    out, _ = two_phase_stage
    _, samples = _samples(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for s in samples[:4]:
        want_aux, want_final = _direct_states(model, s["input_ids"])
        assert torch.equal(s["aux_hidden"], want_aux)
        assert torch.equal(s["final_hidden"], want_final)


def test_decode_capture_with_early_stops_keeps_every_position(tiny_target):
    """Rows leave the batch at different steps; each keeps prompt + response states, in order."""
    t = HFTarget(TargetConfig(model=str(tiny_target)), num_threads=1)
    prompts = [prompt_ids(t.tokenizer, c) for c in PROMPTS[:5]]
    free = t.generate(prompts, 10)
    t._info = dataclasses.replace(t.info(), eos_token_ids=(free[0][2], free[3][5]))
    got = t.generate_and_capture(prompts, 10, 0.0, 0, AUX)
    assert [g for g, _ in got] == t.generate(prompts, 10)  # same tokens as plain generate
    assert len(got[0][0]) == 3
    for p, (new, (aux, final)) in zip(prompts, got, strict=True):
        want_aux, want_final = _direct_states(t.model, torch.tensor(p + new))
        assert aux.shape == want_aux.shape and final.shape == want_final.shape
        torch.testing.assert_close(aux.float(), want_aux.float(), rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(final.float(), want_final.float(), rtol=2e-2, atol=2e-3)


def test_samples_are_prompt_plus_greedy_response_with_the_response_masked(stage, tiny_target):
    _, _, out, _ = stage
    _, samples = _samples(out)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drawn = [c for b in prompt_batches(PROMPTS, 4) for c in b]  # the order batches are made in
    for conv, s in list(zip(drawn, samples, strict=True))[:3]:
        p = prompt_ids(tok, conv)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        assert ids[: len(p)] == p and tok.decode(p).endswith("<|im_start|>assistant\n")
        assert mask == [0] * len(p) + [1] * (len(ids) - len(p))
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[
                0, len(p) :
            ].tolist()
        assert ids[len(p) :] == ref[: len(ids) - len(p)]


def test_batched_generation_with_early_stops_matches_one_by_one(tiny_target):
    """Rows that hit EOS leave the batch; the others must not notice (left padding, cache select)."""
    t = HFTarget(TargetConfig(model=str(tiny_target)), num_threads=1)
    prompts = [prompt_ids(t.tokenizer, c) for c in PROMPTS[:5]]
    free = t.generate(prompts, 10)
    # make an early token of each of some rows a stop token, so rows finish at different steps
    stops = (free[0][2], free[3][5])
    t._info = dataclasses.replace(t.info(), eos_token_ids=stops)
    got = t.generate(prompts, 10)
    for p, g in zip(prompts, got, strict=True):
        with torch.inference_mode():
            ref = t.model.generate(
                torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=list(stops)
            )
        ref = ref[0, len(p) :].tolist()
        assert g == ref[: len(g)] and len(g) == len(ref)
    assert len(got[0]) == 3 and len(got[3]) <= 6


def test_decoding_gives_the_cache_by_the_name_the_model_takes(tiny_target):
    """transformers before 5.2x names the forward's KV cache `past_key_values`, later ones
    `cache`; a model that takes the old name must still decode with its context. Passing the new
    name made every reply one repeated token on transformers 5.17 (the GPU host's), because
    `**kwargs` swallowed it. The old-style forward here forwards to the real one."""
    t = HFTarget(TargetConfig(model=str(tiny_target)), num_threads=1)
    prompts = [prompt_ids(t.tokenizer, c) for c in PROMPTS[:3]]
    want = t.generate(prompts, 10)
    model = t.model
    real = model.forward

    def old_style(input_ids=None, attention_mask=None, position_ids=None,
                  past_key_values=None, logits_to_keep=0, **kwargs):  # fmt: skip
        assert "cache" not in kwargs, "the cache went in under a name this forward ignores"
        return real(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    cache=past_key_values, logits_to_keep=logits_to_keep)  # fmt: skip

    model.forward = old_style
    assert t.generate(prompts, 10) == want


def test_sampling_is_seeded(tiny_target):
    t = HFTarget(TargetConfig(model=str(tiny_target)), num_threads=1)
    prompts = [prompt_ids(t.tokenizer, c) for c in PROMPTS[:3]]
    a = t.generate(prompts, 8, temperature=1.0, seed=5)
    assert a == t.generate(prompts, 8, temperature=1.0, seed=5)
    assert a != t.generate(prompts, 8, temperature=1.0, seed=6)
    assert a != t.generate(prompts, 8)  # greedy differs from sampling at temperature 1


def test_rerun_redoes_only_missing_shards(stage, tiny_target, tmp_path):
    target, data, out, _ = stage
    work = tmp_path / "data"
    shutil.copytree(out, work)
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    old = verify_manifest(work)
    (work / MANIFEST).unlink()
    (work / "b00001-00.safetensors").unlink()
    result = run_generate(target, data, PROMPTS, work, "cfghash")
    after = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    assert after.keys() == before.keys()
    changed = sorted(n for n in after if after[n] != before[n])
    assert changed == ["b00001-00.safetensors"]
    new = verify_manifest(work)
    assert new.shards == old.shards  # greedy and deterministic: the redone shard is byte-identical
    assert result.num_samples == len(PROMPTS)


def test_flipped_byte_is_reported_by_name(stage, tmp_path):
    _, _, out, _ = stage
    work = tmp_path / "data"
    shutil.copytree(out, work)
    p = work / "b00002-00.safetensors"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(raw)
    with pytest.raises(ShardError, match=r"b00002-00\.safetensors: corrupted"):
        verify_manifest(work)


def test_bad_layer_ids_name_the_field(tiny_target):
    with pytest.raises(
        ValueError, match=r"target.aux_layer_ids: \[1, 4\] invalid for a 4-layer target"
    ):
        resolve_aux_layer_ids([1, 4], 4)
    assert resolve_aux_layer_ids(None, 30) == [1, 14, 26]
    target, data = _cfgs(tiny_target)
    with pytest.raises(ValueError, match="target.aux_layer_ids"):
        TargetWorker(target.model_copy(update={"aux_layer_ids": [0, 1, 7]}), data, num_threads=1)


def test_target_without_chat_template_names_target_model(tiny_target, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_target, plain)
    for f in plain.glob("chat_template.*"):
        f.unlink()
    tok = AutoTokenizer.from_pretrained(plain)
    tok.chat_template = None
    tok.save_pretrained(plain)
    assert not AutoTokenizer.from_pretrained(plain).chat_template
    with pytest.raises(ValueError, match=r"target.model: .*plain.* has no chat template"):
        HFTarget(TargetConfig(model=str(plain)))


def test_storage_check_refuses_a_full_disk(tmp_path):
    info = {"target": {"hidden_size": 8192}, "aux_layer_ids": [1, 2, 3]}
    data = DataConfig(max_new_tokens=2048, max_length=4096)
    with pytest.raises(
        OSError, match=rf"{tmp_path}: the shards need about \d+ bytes but only \d+ are free"
    ):
        _check_storage(tmp_path, info, [2048] * 10**6, data)


# --- the two-phase round (the SGLang backend's path, forced here on the HF backend) ----------


@pytest.fixture(scope="module")
def two_phase_stage(stage, tmp_path_factory):
    target, data, _, _ = stage
    out = tmp_path_factory.mktemp("data2")
    return out, run_generate(target, data, PROMPTS, out, "cfghash", two_phase=True)


def test_two_phase_round_writes_the_same_samples(stage, two_phase_stage):
    """Two phases (generate all, then a capture forward per conversation) store the same tokens
    as the one-pass stage, and states equal up to rounding."""
    _, _, out, _ = stage
    out2, result = two_phase_stage
    (_, one), (_, two) = _samples(out), _samples(out2)
    assert len(one) == len(two) == len(PROMPTS)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        torch.testing.assert_close(
            a["aux_hidden"].float(), b["aux_hidden"].float(), rtol=2e-2, atol=2e-3
        )
    assert sorted(p.name for p in out2.glob("*.gen.jsonl")) == [
        "b00000.gen.jsonl",
        "b00001.gen.jsonl",
        "b00002.gen.jsonl",
    ]
    head = json.loads((out2 / "b00002.gen.jsonl").read_text().splitlines()[0])
    assert head["num_samples"] == head["num_prompts"] == 2  # 10 prompts in batches of 4
    assert result.gen_tok_per_s > 0 and result.capture_tok_per_s > 0
    assert result.switch_seconds == 0.0  # the HF backend holds one model for both phases


def test_two_phase_rerun_captures_from_the_sidecar_without_regenerating(
    stage, two_phase_stage, tmp_path
):
    """After a kill: batch 1 lost its shards but kept its .gen.jsonl (killed in phase 2), batch 2
    lost both (killed in phase 1). The rerun captures batch 1 from its .gen.jsonl (edited here, so
    the shard shows where its ids came from), regenerates batch 2 and leaves batch 0 alone."""
    target, data, _, _ = stage
    src, _ = two_phase_stage
    work = tmp_path / "data"
    shutil.copytree(src, work)
    for name in (MANIFEST, "b00001.json", "b00001-00.safetensors", "b00002.json",
                 "b00002-00.safetensors", "b00002.gen.jsonl"):  # fmt: skip
        (work / name).unlink()
    side = work / "b00001.gen.jsonl"
    head, *rows = [json.loads(x) for x in side.read_text().splitlines()]
    rows[0]["input_ids"][-1] = (rows[0]["input_ids"][-1] + 1) % 49152  # not what greedy says
    side.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")
    mtime = side.stat().st_mtime_ns

    result = run_generate(target, data, PROMPTS, work, "cfghash", two_phase=True)

    old, new = verify_manifest(src), verify_manifest(work)
    assert new.shards[0] == old.shards[0] and new.shards[2] == old.shards[2]  # b2 regenerated
    assert new.shards[1].sha256 != old.shards[1].sha256
    first = next(iter_samples(read_shard(work / "b00001-00.safetensors")))
    assert first["input_ids"].tolist() == rows[0]["input_ids"]  # the edited ids: not regenerated
    assert side.stat().st_mtime_ns == mtime and (work / "b00002.gen.jsonl").is_file()
    assert result.num_samples == len(PROMPTS) and result.gen_tok_per_s > 0


def test_capture_phase_refuses_a_sidecar_of_other_settings(stage, two_phase_stage, tmp_path):
    target, data, _, _ = stage
    src, _ = two_phase_stage
    shutil.copytree(src, tmp_path / "d")
    worker = TargetWorker(target, data, num_threads=1)
    with pytest.raises(RuntimeError, match=r"b00000\.gen\.jsonl: made for other prompts"):
        worker.capture_batch(str(tmp_path / "d"), 0, "another-key")


def test_capture_phase_streams_the_bytes_that_capturing_first_would_write(tiny_target, tmp_path):
    """The HF capture phase queues each shard's forwards into one pinned buffer and writes the
    shard while the next one is captured; its files and sidecar are byte for byte those of
    capturing the whole batch and packing it with `pack_parts`. Small shards: several
    sequences share a buffer, and the batch has more shards than the worker has buffers."""
    target, data = _cfgs(tiny_target)
    data = data.model_copy(update={"shard_max_bytes": 2**16, "capture": "forward"})
    worker = TargetWorker(target, data, num_threads=1)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 40, 1, 17, 33, 8, 60, 2, 25, 12, 50, 3, 4, 6, 2, 9] * 2
    seqs = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    gen = Generated(seqs, masks, num_prompts=33, skipped_prompts=1, gen_tokens=9, gen_seconds=1.0)
    out = tmp_path / "d"
    out.mkdir()
    write_generated(out, 3, "key", gen)
    r = worker.capture_batch(str(out), 3, "key")

    states = worker.backend.capture(seqs, worker.aux_layer_ids)
    samples = [Sample(s, m, a, f) for s, m, (a, f) in zip(seqs, masks, states, strict=True)]
    parts = pack_parts(samples, data.shard_max_bytes)
    assert len(parts) > CAPTURE_SLOTS and max(map(len, parts)) > CAPTURE_SLOTS
    meta = {"batch_key": "key", "aux_layer_ids": "2,0,1"}
    want = [write_shard(tmp_path / shard_name(3, j), p, meta) for j, p in enumerate(parts)]
    assert list(r.shards) == want  # names, sizes, sha256, counts
    rec = finished_batch(out, 3, "key")
    assert rec is not None and rec["shards"] == want and rec["aux_layer_ids"] == AUX
    assert (r.num_prompts, r.skipped_prompts, r.gen_tokens) == (33, 1, 0)
    assert r.capture_tokens == sum(lengths) and r.capture_seconds > 0


def test_target_worker_imports_without_ray():
    """GPU hosts have no Ray: `actors.target` loads without it and makes `TargetActor` (the one
    use of Ray there) only when it is asked for."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import actors.target as t\n"
        "assert t.TargetWorker and 'TargetActor' not in vars(t)\n"
        "try:\n    t.TargetActor\nexcept ImportError:\n    print('needs ray')\n"
    )
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "needs ray"


def test_self_written_batch_writes_its_turns_then_answers_them(tiny_target, tmp_path):
    """A `SelfWritten` batch: the target samples user turns from the template's user header,
    keeps those that ended, answers them greedily and writes shards like any batch; the same
    seed draws the same turns, so a rerun writes the same shards."""
    target, data = _cfgs(tiny_target)
    data = data.model_copy(update={"self_prompt_max_tokens": 10})
    worker = TargetWorker(target, data, num_threads=1)
    tok, head = worker.tokenizer, user_turn_prefix(worker.tokenizer)
    free = worker.backend.generate([head] * 6, 10, 0.9, 7)
    # a random model rarely ends a turn by itself: some tokens of its own turns become stop tokens
    stops = tuple({row[k] for row in free[:4] for k in (3, 6)})
    worker.backend._info = dataclasses.replace(worker.backend.info(), eos_token_ids=stops)

    batch = SelfWritten(count=6, seed=7)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    r = worker.process(batch, str(tmp_path / "a"), 0, batch_key(batch, target, data))
    samples = [s for sh in r.shards for s in iter_samples(read_shard(tmp_path / "a" / sh.file))]
    assert r.num_prompts == 6 and 0 < len(samples) == 6 - r.skipped_prompts
    end = tok("<|im_end|>", add_special_tokens=False).input_ids
    answered, texts = 0, set()
    for s in samples:  # each: header, a kept turn, then the greedy answer (masked in)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        assert ids[: len(head)] == head
        n = next(i for i in range(len(head), len(ids)) if ids[i : i + len(end)] == end)
        text = tok.decode(ids[len(head) : n], skip_special_tokens=True).strip()
        p = prompt_ids(tok, [{"role": "user", "content": text}])
        assert ids[: len(p)] == p and len(text.split()) >= 3 and text not in texts
        assert mask == [0] * len(p) + [1] * (len(ids) - len(p))
        texts.add(text)
        answered += len(ids) - len(p)
    assert r.gen_tokens > answered  # the turns' tokens count as generation too

    again = worker.process(batch, str(tmp_path / "b"), 0, batch_key(batch, target, data))
    assert [sh.sha256 for sh in again.shards] == [sh.sha256 for sh in r.shards]
    # two phases: the sidecar carries the dropped turns, so the capture phase counts them too
    (tmp_path / "c").mkdir()
    worker.generate_batch(batch, str(tmp_path / "c"), 0, batch_key(batch, target, data))
    cap = worker.capture_batch(str(tmp_path / "c"), 0, batch_key(batch, target, data))
    assert (cap.num_prompts, cap.skipped_prompts) == (r.num_prompts, r.skipped_prompts)
    assert batch_key(SelfWritten(6, 8), target, data) != batch_key(batch, target, data)


def test_a_damaged_finished_round_heals_and_stale_temp_files_go(stage, tiny_target, tmp_path):
    """The loop's heal (pipeline/loop.py `_heal_data`, run when training finds a bad shard): the
    corrupted and the missing shard of a finished round are regenerated, the intact one kept, and
    a killed writer's partial temp file removed. On main only a hand-run generate repaired it."""
    from actors.prompts import PromptPlan
    from pipeline.config import Config
    from pipeline.loop import _heal_data
    from pipeline.state import RunState

    # the run's prompt plan: round 0 drew exactly the prompts the stage fixture generated
    plan = PromptPlan(train={"builtin": PROMPTS}, heldout=[], users=[], weights={"builtin": 1.0})
    evalset: tuple[list, list] = ([], [])

    target, data, out, result = stage
    cfg = Config(target=target, data=data.model_copy(update={"prompts_per_round": len(PROMPTS)}))
    run_dir = tmp_path / "run"
    work = run_dir / "data" / "round-000"
    shutil.copytree(out, work)
    old = verify_manifest(work)
    state = RunState(config_digest=cfg.digest())
    state.round(0).done["generate"] = {"manifest": str(work / MANIFEST)}
    assert _heal_data(cfg, run_dir, state, 0, plan, evalset) == []  # intact: nothing to do
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    p = work / "b00002-00.safetensors"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(raw)
    (work / "b00000-00.safetensors").unlink()
    stale = work / ".b00001-00.safetensors.tmp-4242-1"
    stale.write_bytes(b"partial")
    with pytest.raises(ShardError):
        verify_manifest(work)
    assert _heal_data(cfg, run_dir, state, 0, plan, evalset) == [0]
    assert verify_manifest(work).shards == old.shards  # greedy: regenerated byte for byte
    after = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    assert after["b00001-00.safetensors"] == before["b00001-00.safetensors"]  # kept
    assert not stale.exists() and not list(work.glob(".*.tmp-*"))


def test_rounds_outside_the_training_window_are_deleted_and_never_healed(stage, tmp_path):
    """`train.data_rounds: 1`: before round 1 generates, round 0's shards are deleted (no round
    from 1 on trains on them; its manifest stays, saying what was made), and healing round 1's
    training checks round 1 alone, so round 0 is not remade. On main every round's states
    stayed and healing regenerated round 0: a 64 GB disk held one round of the GPU climb."""
    from actors.prompts import PromptPlan
    from pipeline.config import Config
    from pipeline.layout import RunDir
    from pipeline.loop import _heal_data
    from pipeline.state import RunState
    from pipeline.window import free_data

    plan = PromptPlan(train={"builtin": PROMPTS}, heldout=[], users=[], weights={"builtin": 1.0})
    target, data, out, _ = stage
    data = data.model_copy(update={"prompts_per_round": len(PROMPTS)})
    run_dir = tmp_path / "run"
    state = RunState(config_digest="d")

    def made(r: int) -> Path:
        shutil.copytree(out, RunDir(run_dir).data(r))
        state.round(r).done["generate"] = {"manifest": str(RunDir(run_dir).data(r) / MANIFEST)}
        return RunDir(run_dir).data(r)

    r0 = made(0)
    shard_bytes = sum(p.stat().st_size for p in r0.glob("*.safetensors"))
    free_data(Config(target=target, data=data, train={"data_rounds": 2}), run_dir, state, 1)
    assert len(list(r0.glob("*.safetensors"))) == 3  # in round 1's window of 2: kept
    cfg = Config(target=target, data=data, train={"data_rounds": 1})
    free_data(cfg, run_dir, state, 1)
    assert not list(r0.glob("*.safetensors")) and (r0 / MANIFEST).exists()
    assert state.rounds[0].done["generate"]["freed_bytes"] == shard_bytes
    r1 = made(1)
    assert _heal_data(cfg, run_dir, state, 1, plan, ([], [])) == []
    assert not list(r0.glob("*.safetensors"))  # outside the window: never remade
    (r1 / "b00001-00.safetensors").unlink()  # inside it: healed
    assert _heal_data(cfg, run_dir, state, 1, plan, ([], [])) == [1]
    assert verify_manifest(r1) and not list(r0.glob("*.safetensors"))


def test_online_states_give_the_training_batch_the_offline_shards_give(stage, tmp_path):
    """`data.states: online`: the data stage keeps ids and masks only (states of width 0, about
    5 B a token), and a training worker's target (pipeline/online_states.py) computes the
    states of each batch it reads: the same batch as the offline shards give, ids, masks and
    packing equal, states within bf16 rounding (offline here: the decode's own states), from
    the batched decoder's forward and from the HF capture alike."""
    from eagle3.train_step import ShardSet, pack
    from pipeline.online_states import OnlineStates

    target, data, out, _ = stage
    online = tmp_path / "online"
    run_generate(target, data.model_copy(update={"states": "online"}), PROMPTS, online, "cfghash")
    m_off, m_on = verify_manifest(out), verify_manifest(online)
    assert m_on.online and not m_off.online and m_on.num_tokens == m_off.num_tokens
    assert sum(s.bytes for s in m_on.shards) < 6 * m_on.num_tokens + 3 * 2**10  # + headers
    sets = [ShardSet(m.shard_paths(), [s.sha256 for s in m.shards]) for m in (m_off, m_on)]
    lengths = [r.length for r in sets[0].samples]
    assert lengths == [r.length for r in sets[1].samples]
    budget = 64  # below data.max_length: longer samples are cut on load, as training cuts them
    fast = OnlineStates(target.model_dump(), AUX, torch.device("cpu"), budget)
    hf = OnlineStates(target.model_dump(), AUX, torch.device("cpu"), budget, batched=False)
    assert fast.decoder is not None and hf.decoder is None
    for b, states in itertools.product(pack(lengths, budget, seed=0), (fast, hf)):
        off = sets[0].load([sets[0].samples[j] for j in b], budget)
        on = states.fill(sets[1].load([sets[1].samples[j] for j in b], budget))
        assert on.cu_seqlens == off.cu_seqlens and torch.equal(on.position_ids, off.position_ids)
        assert torch.equal(on.input_ids, off.input_ids)
        assert torch.equal(on.loss_mask, off.loss_mask)
        for name in ("aux_hidden", "final_hidden"):
            got, want = getattr(on, name), getattr(off, name)
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)

    # ids-only shards hold no states: kept outside the training window (scratch retrains on them)
    from pipeline.config import Config
    from pipeline.state import RunState
    from pipeline.window import free_data

    state = RunState(config_digest="d")
    state.round(0).done["generate"] = {"manifest": str(online / MANIFEST)}
    free_data(Config(target=target, data=data, train={"data_rounds": 1}), tmp_path, state, 1)
    assert verify_manifest(online) and "freed_bytes" not in state.rounds[0].done["generate"]


def test_a_deadline_cuts_the_stage_at_a_batch_and_healing_makes_the_same_batches(
    stage, tiny_target, tmp_path
):
    """A data stage past its deadline hands out no more batches: what it made is a complete,
    verified round (served requests first), and healing that round remakes exactly those."""
    import time

    from actors.prompts import Answered

    target, data, _, _ = stage
    data = data.model_copy(update={"batch_size": 1, "num_actors": 1})
    prompts = builtin_prompts(1)[:12]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    served = Answered((tuple(prompt_ids(tok, prompts[0])),), ((5, 6, 7),))
    out = tmp_path / "cut"
    # One actor, a deadline already passed: it is handed two batches before any has been timed.
    # The served request (the last index) goes first and is captured; the actor does not start
    # decoding the prompt batch past its deadline; then nothing more is handed out.
    res = run_generate(
        target, data, prompts[1:], out, "h", answered=[served], deadline=time.monotonic()
    )
    assert res.made == (11,) and res.left_out == 11 and res.cut == 0
    m = verify_manifest(out)
    assert m.num_samples == len(res.made)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    (out / shard_name(res.made[0], 0)).unlink()
    healed = run_generate(
        target, data, prompts[1:], out, "h", answered=[served], only=set(res.made)
    )
    assert healed.made == res.made and healed.left_out == 0
    after = {p.name for p in out.glob("*.safetensors")}
    assert after == set(before)
    assert verify_manifest(out).shards == m.shards

    # The deadline is on the monotonic clock (a wall-clock step cuts nothing): one an hour on
    # cuts none of 3 batches. Compared with time.time() it had passed long ago: the third was
    # left out.
    whole = run_generate(target, data, prompts[1:4], tmp_path / "whole", "h",
                         deadline=time.monotonic() + 3600)  # fmt: skip
    assert whole.made == (0, 1, 2) and whole.left_out == 0


def test_a_deadline_stops_decoding_and_keeps_the_replies_so_far(tiny_target, tmp_path):
    """Past its stop_at the decode loop ends every row at the token it has, states included;
    the worker writes those replies (cut) and starts no batch with too little time left."""
    import time

    t = HFTarget(TargetConfig(model=str(tiny_target)), num_threads=1)
    prompts = [prompt_ids(t.tokenizer, c) for c in PROMPTS[:3]]
    free = t.generate(prompts, 6)
    got = t.generate_and_capture(prompts, 6, 0.0, 0, AUX, stop_at=time.time())
    assert [g for g, _ in got] == [f[:1] for f in free]  # the token each had when it passed
    for p, (new, (aux, final)) in zip(prompts, got, strict=True):
        want_aux, want_final = _direct_states(t.model, torch.tensor(p + new))
        assert aux.shape == want_aux.shape and final.shape == want_final.shape
    assert t.generate(prompts, 6, stop_at=time.time()) == [f[:1] for f in free]

    target, _ = _cfgs(tiny_target)
    data = DataConfig(batch_size=3, max_new_tokens=20_000, max_length=30_000)
    w = TargetWorker(target, data, num_threads=1)
    res = w.process(PROMPTS[:3], str(tmp_path), 0, "k", stop_at=time.time() + 0.3)
    assert res.cut and not res.left_out and len(res.shards) == 1
    m = _batch_samples(tmp_path, res)
    lengths = [int(s["loss_mask"].sum()) for s in m]
    assert all(0 < n < data.max_new_tokens for n in lengths)  # cut, not run out
    assert all(s["aux_hidden"].shape[0] == len(s["input_ids"]) for s in m)
    late = w.process(PROMPTS[3:6], str(tmp_path), 1, "k", stop_at=time.time() + 0.01)
    assert late.left_out and not late.shards  # 0.01 s is under 40% of the last decode
    assert not list(tmp_path.glob("b00001*"))


def test_a_worker_asked_to_stop_cuts_its_decode_and_starts_no_other_batch(tiny_target, tmp_path):
    """`stop_now`, called beside a decoding batch (as the actor's third call slot does), ends it
    at the token it has with its replies written, long before its own stop time; the worker then
    starts no batch."""
    import threading
    import time

    target, _ = _cfgs(tiny_target)
    data = DataConfig(batch_size=3, max_new_tokens=20_000, max_length=30_000)
    w = TargetWorker(target, data, num_threads=1)
    decoding, decode = threading.Event(), w.backend.generate_and_capture

    def entered(*args, **kwargs):  # the real decode, once the test knows it began
        decoding.set()
        return decode(*args, **kwargs)

    w.backend.generate_and_capture = entered
    got: dict = {}
    run = threading.Thread(
        target=lambda: got.update(res=w.process(PROMPTS[:3], str(tmp_path), 0, "k", stop_at=time.time() + 3600))
    )  # fmt: skip
    run.start()
    assert decoding.wait(60)
    w.stop_now()
    run.join(60)
    assert not run.is_alive(), "stop_now did not end the decode"
    res = got["res"]
    assert res.cut and not res.left_out and len(res.shards) == 1
    assert all(
        0 < int(s["loss_mask"].sum()) < data.max_new_tokens for s in _batch_samples(tmp_path, res)
    )
    late = w.process(PROMPTS[3:6], str(tmp_path), 1, "k", stop_at=time.time() + 3600)
    assert late.left_out and not late.shards


def test_a_stopped_stage_keeps_its_batches_and_the_next_goes_on_from_them(
    stage, tmp_path, monkeypatch
):
    """A stage told to stop (`stop`, as pipeline/round_data.py's early data is when the server's
    core comes back) cuts the batch decoding, writes it, and hands out nothing more; the round's
    own stage over the same prompts keeps that batch and goes on with the next."""
    import threading
    import time

    import actors.generate as generate

    target, data, _, _ = stage
    data = data.model_copy(update={"batch_size": 1, "num_actors": 1, "max_new_tokens": 20_000,
                                   "max_length": 30_000, "shard_max_bytes": 2**26})  # fmt: skip
    prompts, out, stop, dispatching = (
        PROMPTS[:5],
        tmp_path / "early",
        threading.Event(),
        threading.Event(),
    )
    check = generate._check_storage  # the stage's last step before it hands out batches

    def checked(*args) -> None:
        check(*args)
        dispatching.set()

    monkeypatch.setattr(generate, "_check_storage", checked)

    def stop_while_the_first_batch_decodes(stop: threading.Event) -> threading.Event:
        def wait() -> None:  # 20,000 tokens take far longer
            dispatching.wait()
            time.sleep(1.0)
            stop.set()

        dispatching.clear()
        threading.Thread(target=wait, daemon=True).start()
        return stop

    t0 = time.monotonic()
    stop = stop_while_the_first_batch_decodes(threading.Event())
    early = run_generate(target, data, prompts, out, "h", deadline=t0 + 3600, stop=stop)
    # The actor takes its two batches one at a time, in the order its threads reach the compute
    # lock: batch 0 or 1 decodes first (it was batch 1 in one suite run of 2026-12-06).
    (first,) = early.made
    assert first in (0, 1) and early.cut == 1 and early.left_out == 4
    assert time.monotonic() - t0 < 60
    (sample,) = _samples(out)[1]
    assert 0 < int(sample["loss_mask"].sum()) < data.max_new_tokens  # cut, its reply so far kept
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob(f"b{first:05d}*")}
    assert kept
    stop = stop_while_the_first_batch_decodes(threading.Event())
    rest = run_generate(target, data, prompts, out, "h", deadline=t0 + 3600, stop=stop)
    assert first in rest.made and len(rest.made) == 2 and rest.cut == 1  # it went on with another
    assert {p.name: p.stat().st_mtime_ns for p in out.glob(f"b{first:05d}*")} == kept


def _batch_samples(out: Path, res) -> list[dict]:
    """The samples of one batch result's shards."""
    return [s for sh in res.shards for s in iter_samples(read_shard(out / sh.file))]


def test_prompt_batches_sort_each_window_by_length():
    """Each run of 4 batches is sorted by length (less left padding), windows keep their
    order, and every prompt is drawn once."""
    from actors.generate import LENGTH_WINDOW

    convs = [[{"role": "user", "content": "x" * ((i * 37) % 50 + 1)}] for i in range(21)]
    got = prompt_batches(convs, 2)
    assert [len(b) for b in got] == [2] * 10 + [1]
    flat = [c for b in got for c in b]
    assert sorted(map(id, flat)) == sorted(map(id, convs))
    w = 2 * LENGTH_WINDOW
    for i in range(0, len(flat), w):
        window = flat[i : i + w]
        assert [len(c[0]["content"]) for c in window] == sorted(
            len(c[0]["content"]) for c in convs[i : i + w]
        )


def test_a_replied_batch_trains_on_the_sources_reply_without_generating(
    stage, tiny_target, tmp_path
):
    """`Replied`: the prompt as templated for generation, then the source's reply as the template
    renders an assistant turn (end-of-turn included), cut at max_new_tokens, masked in; no
    generation time is spent."""
    from actors.prompts import Replied

    target, data, _, _ = stage
    data = data.model_copy(update={"num_actors": 1, "max_new_tokens": 6})
    tok = AutoTokenizer.from_pretrained(tiny_target)
    convs = PROMPTS[:2]
    replies = ("Sure.", "Here is a much longer answer that runs well past six tokens of reply.")
    out = tmp_path / "replied"
    res = run_generate(target, data, [], out, "h", replied=[Replied(tuple(convs), replies)])
    assert res.gen_tok_per_s == 0.0 and res.num_samples == 2
    _, samples = _samples(out)
    for conv, reply, s in zip(convs, replies, samples, strict=True):
        p = prompt_ids(tok, conv)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        rendered = tok.apply_chat_template(
            [*conv, {"role": "assistant", "content": reply}], tokenize=False
        )
        want = tok(rendered, add_special_tokens=False)["input_ids"][len(p) :][:6]
        assert ids == p + want and mask == [0] * len(p) + [1] * len(want)
    assert tok.decode(samples[0]["input_ids"][len(prompt_ids(tok, convs[0])) :]).startswith("Sure.")
    keys = {batch_key(Replied(tuple(convs), replies), target, data), batch_key(convs, target, data)}
    assert len(keys) == 2  # a replied batch is not the regenerated one


def test_a_cut_stage_keeps_the_rounds_mix():
    """Served requests go first; regenerated prompts and sources' replies are interleaved by how
    far into their kind each batch is, so any prefix a deadline keeps has the planned mix."""
    from actors.generate import _dispatch_order
    from actors.prompts import Answered, Replied

    reply = Replied((PROMPTS[0],), ("ok",))
    batches = [[PROMPTS[0]]] * 3 + [reply] * 6 + [Answered(((1,),), ((2,),))]
    order = _dispatch_order(batches, list(range(10)))
    assert order[0] == 9
    assert order[1:] == [0, 3, 4, 1, 5, 6, 2, 7, 8]  # 1 regenerated : 2 replied all along


def test_a_context_turn_the_target_did_not_write_carries_no_loss(tiny_target, tmp_path):
    """A multi-turn prompt's earlier assistant turn is another model's text: with
    `data.context_turns: context` (the default) only the target's reply carries loss; `learn`
    masks that turn in as well. The manifest's loss tokens are then the target's tokens."""
    target, data = _cfgs(tiny_target)
    conv = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple, which another model wrote."},
        {"role": "user", "content": "And a vegetable?"},
    ]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    p = prompt_ids(tok, conv)
    masks = {}
    for mode in ("context", "learn"):
        d = data.model_copy(update={"context_turns": mode})
        worker = TargetWorker(target, d, num_threads=1)
        (tmp_path / mode).mkdir()
        r = worker.process([conv], str(tmp_path / mode), 0, batch_key([conv], target, d))
        (s,) = [s for sh in r.shards for s in iter_samples(read_shard(tmp_path / mode / sh.file))]
        ids, masks[mode] = s["input_ids"].tolist(), s["loss_mask"].tolist()
        assert ids[: len(p)] == p
    reply = len(masks["context"]) - len(p)
    assert masks["context"] == [0] * len(p) + [1] * reply
    other = sum(masks["learn"][: len(p)])  # the other model's turn, its end-of-turn token included
    assert other >= len(tok("An apple, which another model wrote.").input_ids)
    assert batch_key([conv], target, data) != batch_key(
        [conv], target, data.model_copy(update={"context_turns": "learn"})
    )


def test_data_made_in_the_background_takes_only_the_time_others_leave(tiny_target, ray_local):
    """The data begun early (pipeline/round_data.py `start_early`) yields the cores to the
    server it runs beside: every thread of a background actor is in the idle scheduling class
    (or at niceness 19), a default actor's are not."""
    import os

    import ray

    from actors.generate import _start_actors, _stop_actors

    target, data = _cfgs(tiny_target)
    one = data.model_copy(update={"num_actors": 1})
    back, res = _start_actors(target, one, 1, None, 1, background=True)
    fore, _ = _start_actors(target, one, 1, None, 1)

    def policies(actor) -> set[tuple[int, int]]:
        def read(self):
            tids = [int(t) for t in os.listdir("/proc/self/task")]
            return {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids}

        return ray.get(actor.__ray_call__.remote(read))

    try:
        assert policies(back[0]) == {(os.SCHED_IDLE, 19)}
        assert all(p != os.SCHED_IDLE and n < 19 for p, n in policies(fore[0]))
    finally:
        _stop_actors(back + fore, res)


def test_target_actors_start_beside_a_server_that_holds_cores(tiny_target, ray_local):
    """A GPU server that stays up through rounds holds its `serve.num_cpus` of Ray's CPUs; the
    next round's target actor reserves only what is free and starts, where a reservation of
    every core waited forever (an H100 climb's round 1, 2026-12-07). It still runs the node's
    threads."""
    import ray

    from actors.generate import _start_actors, _stop_actors

    target, data = _cfgs(tiny_target)
    one = data.model_copy(update={"num_actors": 1})
    threads = min(int(ray.cluster_resources()["CPU"]), os.cpu_count() or 1)
    if threads < 2:
        pytest.skip("one core: a reservation of every core is one CPU")
    held = ray.available_resources()["CPU"] - 1  # the server's: one CPU is left free

    @ray.remote(num_cpus=held)
    class Server:
        def ready(self) -> bool:
            return True

    server = Server.remote()
    ray.get(server.ready.remote(), timeout=60)
    actors, res = _start_actors(target, one, 1, None, None)
    try:
        ray.get(actors[0].__ray_ready__.remote(), timeout=60)
        assert (
            ray.get(actors[0].__ray_call__.remote(lambda self: torch.get_num_threads())) == threads
        )
    finally:
        _stop_actors(actors, res)
        ray.kill(server)


def test_a_stage_whose_actor_ray_cannot_place_says_so_and_ends_at_its_deadline(
    tiny_target, ray_local, tmp_path, capfd
):
    """An actor asking for a GPU this Ray lacks: the stage prints what it waits for, and past
    its deadline raises naming it, instead of waiting without a word (run_generate)."""
    import time

    from actors import generate

    target, data = _cfgs(tiny_target)
    target = target.model_copy(update={"num_gpus_per_actor": 1.0})
    one = data.model_copy(update={"num_actors": 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate, "PLACE_WARN_S", 1.0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"past its deadline: 1 of 1 target actor"):
            run_generate(target, one, PROMPTS[:2], tmp_path, "h", deadline=t0 + 3)
    assert time.monotonic() - t0 < 60  # the unplaced actor was not waited on to close
    assert "not placed after 1 s: Ray has CPU" in capfd.readouterr().out
