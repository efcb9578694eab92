"""The pipeline's stages through Ray on a GPU, small: each reserves the GPU from Ray and must then
run on it. The `gpu` tests run on a GPU host with Ray installed; the CPU test pins the rule that a
reservation torch cannot see is refused rather than run on the CPU.

- the data stage's target actor (num_gpus_per_actor): the batched decoder generates and one
  batched forward captures (`data.capture: auto` resolves to forward there);
- a Ray Train worker with `use_gpu` (NCCL);
- the Serve replica (serve.num_gpus): its engine on CUDA with the static runner's CUDA graphs,
  answering over HTTP.
Each Ray test starts a Ray of its own (`ray_own`, `own_cluster`: after the shared Ray is down).
"""

from __future__ import annotations

from pathlib import Path

import pytest

for _dep in ("fastapi", "ray", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import httpx
import torch
from transformers import AutoModelForCausalLM

from actors.cluster import reserved_device
from actors.ports import free_port
from actors.prompts import builtin_prompts
from actors.shards import iter_samples, read_shard, verify_manifest
from eagle3.checkpoint import save_drafter
from pipeline.config import DataConfig, ServeConfig, TargetConfig
from serve.engine import random_drafter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
AUX = [2, 0, 1]


def test_a_gpu_reservation_torch_cannot_see_is_refused():
    assert reserved_device(0, "serve.num_gpus") == "cpu"
    if torch.cuda.is_available():
        assert reserved_device(1, "serve.num_gpus") == "cuda"
    else:
        with pytest.raises(RuntimeError, match=r"serve.num_gpus: 1 GPU\(s\) reserved.*set serve.num_gpus: 0"):  # fmt: skip
            reserved_device(1, "serve.num_gpus")


@pytest.mark.gpu
@pytest.mark.own_cluster
@cuda
def test_the_data_stage_actor_generates_and_captures_on_its_gpu(tiny_target, ray_own, tmp_path):
    from actors.generate import run_generate

    target = TargetConfig(model=str(tiny_target), aux_layer_ids=AUX, num_gpus_per_actor=1, dtype="float32")  # fmt: skip
    data = DataConfig(batch_size=8, max_new_tokens=16, max_length=128, shard_max_bytes=2**20)
    res = run_generate(target, data, builtin_prompts(0)[:16], tmp_path, "cfghash")
    manifest = verify_manifest(tmp_path)
    assert res.gen_tokens > 0 and res.capture_tokens == manifest.num_tokens
    # the states on disk are the target's own, as one plain forward of each sequence gives them
    lm = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).cuda().eval()
    for s in [x for sh in manifest.shards for x in iter_samples(read_shard(Path(manifest.root) / sh.file))][:4]:  # fmt: skip
        with torch.inference_mode():
            hs = lm(input_ids=s["input_ids"][None].cuda(), output_hidden_states=True).hidden_states
        want = torch.cat([hs[k + 1][0] for k in AUX], -1).float().cpu()
        torch.testing.assert_close(s["aux_hidden"].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.own_cluster
@cuda
def test_the_serve_replica_runs_on_the_gpu_it_reserved(tiny_target, ray_own, tmp_path):
    from serve.endpoint import deploy_endpoint
    from serve.startup import start_serve

    serve_port = free_port()
    start_serve("127.0.0.1", serve_port)  # on this test's own Ray (ray_own shuts it down)

    lm = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    d = random_drafter(lm, draft_vocab_size=4000, seed=1, aux_layer_ids=AUX).model
    drafter = save_drafter(d.state_dict(), d.cfg, tmp_path / "drafter", dtype=torch.float32)
    cfg = ServeConfig(port=serve_port, steps=3, num_gpus=1, num_cpus=1)
    ep = deploy_endpoint(cfg, TargetConfig(model=str(tiny_target)), str(drafter), tmp_path / "logs", app_name="gpu-serve")  # fmt: skip
    try:
        info = ep.info()
        assert info["device"].startswith("cuda") and info["cuda_graphs"] is True
        r = httpx.post(f"{ep.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 12, "temperature": 0})  # fmt: skip
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] > 0
    finally:
        ep.shutdown()


@pytest.mark.parametrize("gpus", [0, pytest.param(1, marks=[pytest.mark.gpu, cuda])])
def test_capture_auto_keeps_decode_states_only_where_the_hf_loop_generates(tiny_target, gpus):
    """CPU: the HF decode loop generates, and its forwards' states are kept (no second pass). GPU:
    the batched decoder generates (it keeps no states), so one capture pass follows."""
    from actors.target import TargetWorker

    target = TargetConfig(model=str(tiny_target), num_gpus_per_actor=gpus)
    worker = TargetWorker(target, DataConfig())
    assert worker.capture_in_decode is (gpus == 0)
    assert TargetWorker(target, DataConfig(capture="forward")).capture_in_decode is False
