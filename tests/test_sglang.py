"""The SGLang production path: server arguments, per-request accept length from meta_info, the
decode-log CUDA-graph check, layer-id mapping, GPU reservation in Ray, the baseline cache.

Nothing here runs SGLang itself (no GPU). The `sglang`-marked tests parse our arguments with
SGLang's own parser and run where sglang is importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

for _dep in ("pydantic", "ray"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)

from actors.engine_server import BaselineCache, cached_baseline
from actors.ports import free_port
from actors.sglang_backend import (
    SGLANG_VERSION,
    drafter_layout_for,
    hf_hidden_state_indices,
    resolve_layer_ids,
    token_bounded_batches,
)
from actors.sglang_server import (
    MAX_PORT,
    SGLangServer,
    baseline_key,
    build_server_args,
    parse_decode_log,
    spec_stats_from_sglang,
)
from eagle3.target_weights import target_info_from_dict
from pipeline.config import ServeConfig, TargetConfig, load_config

REPO = Path(__file__).resolve().parents[1]

# Kimi-K2.5's config.json layout: a multimodal wrapper with the DeepSeek-V3 text model nested.
KIMI_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
    },
}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


def _pairs(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:] + [""], strict=True) if a.startswith("--")}


# --- server arguments -------------------------------------------------------------------------


def test_server_args_for_kimi_config():
    cfg = load_config(REPO / "configs" / "kimi-k25-8gpu.yaml")
    args = build_server_args(cfg.serve, cfg.target, "/runs/k/drafters/round-000", 30000)
    kv = _pairs(args)
    assert kv["--model-path"] == "moonshotai/Kimi-K2.5"
    assert kv["--tp-size"] == "8"
    assert kv["--speculative-algorithm"] == "EAGLE3"
    assert kv["--speculative-draft-model-path"] == "/runs/k/drafters/round-000"
    assert (kv["--speculative-num-steps"], kv["--speculative-eagle-topk"]) == ("3", "1")
    assert kv["--speculative-num-draft-tokens"] == "4"
    assert (kv["--host"], kv["--port"], kv["--dtype"]) == ("127.0.0.1", "30000", "bfloat16")
    assert "--trust-remote-code" in args


def test_server_args_baseline_tree_and_extras():
    target = TargetConfig(
        model="meta-llama/Llama-3.1-8B-Instruct", backend="sglang", dtype="bfloat16"
    )
    base = build_server_args(ServeConfig(engine="sglang"), target, None, 31000)
    assert not [a for a in base if a.startswith("--speculative")]
    assert "--trust-remote-code" not in base  # only when the config asks for it

    tree = ServeConfig(
        engine="sglang", steps=5, topk=4, extra_args=["--mem-fraction-static", "0.8"]
    )
    args = build_server_args(tree, target, "/d", 31000)
    assert "--speculative-num-draft-tokens" not in args  # SGLang picks it for trees
    assert args[-2:] == ["--mem-fraction-static", "0.8"]
    chain = build_server_args(ServeConfig(engine="sglang", steps=2), target, "/d", 31000)
    assert _pairs(chain)["--speculative-num-draft-tokens"] == "3"


# --- meta_info --------------------------------------------------------------------------------

# The meta_info SGLang 0.5.14 builds for a finished speculative request (tokenizer_manager.py:
# base fields, token counts, e2e_latency, then _calculate_spec_decoding_metrics).
SPEC_META = {
    "id": "9b1c",
    "finish_reason": {"type": "length", "length": 100},
    "prompt_tokens": 37,
    "weight_version": "default",
    "num_retractions": 0,
    "reasoning_tokens": 0,
    "completion_tokens": 100,
    "cached_tokens": 0,
    "e2e_latency": 0.93,
    "spec_accept_rate": 0.7419,
    "spec_accept_length": 100 / 31,
    "spec_num_correct_drafts": 69,
    "spec_num_proposed_drafts": 93,
    "spec_verify_ct": 31,
    "spec_accepted_drafts": 69,
    "spec_proposed_drafts": 93,
    "spec_correct_drafts_histogram": [3, 4, 6, 18],
}


def test_spec_stats_native_generate():
    resp = {"text": "...", "output_ids": list(range(100)), "meta_info": SPEC_META}
    st = spec_stats_from_sglang(resp)
    assert st["completion_tokens"] == 100 and st["spec_verify_ct"] == 31
    assert st["spec_accept_len"] == pytest.approx(100 / 31)
    assert st["spec_accepted_tokens"] == 69
    assert st["spec_accept_hist"] == [3, 4, 6, 18]
    assert st["speculative"] and st["has_meta_info"]


def test_spec_stats_openai_chat_with_return_meta_info():
    resp = {
        "id": "9b1c",
        "object": "chat.completion",
        "model": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "..."},
                "finish_reason": "length",
                "meta_info": {**SPEC_META, "completion_tokens": 64, "spec_verify_ct": 20},
            }
        ],
        "usage": {"prompt_tokens": 37, "completion_tokens": 64, "total_tokens": 101},
        "metadata": {"weight_version": "default"},
    }
    st = spec_stats_from_sglang(resp)
    assert st["spec_accept_len"] == pytest.approx(3.2)


def test_spec_stats_without_meta_info_or_speculation():
    plain_openai = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 12}}
    st = spec_stats_from_sglang(plain_openai)
    assert st["completion_tokens"] == 12 and st["spec_accept_len"] is None
    assert not st["has_meta_info"] and not st["speculative"]

    baseline = {"text": "x", "meta_info": {"id": "a", "completion_tokens": 50, "prompt_tokens": 3}}
    st = spec_stats_from_sglang(baseline)
    assert st["has_meta_info"] and not st["speculative"] and st["spec_accept_len"] is None


# --- decode log -------------------------------------------------------------------------------

# Built from sglang 0.5.14's format strings (metrics_reporter.py, pool_stats_observer.py) with the
# logger format "[%(asctime)s{ TPn}] %(message)s".
PREFILL = (
    "[2026-11-02 10:00:01 TP0] Prefill batch, #new-seq: 8, #new-token: 2048, #cached-token: 0, "
    "#token: 2048, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, "
    "cuda graph: False, input throughput (token/s): 5120.33"
)
DECODE_SPEC = (
    "[2026-11-02 10:00:03 TP0] Decode batch, #running-req: 8, #token: 5120, token usage: 0.02, "
    "accept len: {a}, accept rate: 0.71, cuda graph: {g}, gen throughput (token/s): {t}, #queue-req: 0"
)


def test_decode_log_cuda_graph_true():
    lines = [
        "[2026-11-02 10:00:00] server_args=ServerArgs(model_path='x')",
        PREFILL,
        DECODE_SPEC.format(a="3.12", g="True", t="812.44"),
        DECODE_SPEC.format(a="3.30", g="True", t="840.10"),
    ]
    st = parse_decode_log(lines)
    assert st.decode_lines == 2 and st.cuda_graph is True  # the prefill line's False is ignored
    assert st.accept_lens == [3.12, 3.30] and st.gen_throughputs == [812.44, 840.10]


def test_decode_log_cuda_graph_false_or_absent():
    lines = [
        DECODE_SPEC.format(a="2.0", g="True", t="300.0"),
        DECODE_SPEC.format(a="2.1", g="False", t="90.5"),
    ]
    assert parse_decode_log(lines).cuda_graph is False
    baseline = (
        "[2026-11-02 10:00:03] Decode batch, #running-req: 1, #token: 700, token usage: 0.00, "
        "cuda graph: True, gen throughput (token/s): 151.20, #queue-req: 0"
    )
    st = parse_decode_log([baseline])
    assert st.cuda_graph is True and st.accept_lens == []
    assert parse_decode_log([PREFILL]).cuda_graph is None


# --- layer ids and drafter layout ------------------------------------------------------------


def test_layer_ids_llama_and_kimi():
    llama = target_info_from_dict(LLAMA_CONFIG)
    kimi = target_info_from_dict(KIMI_CONFIG)
    assert kimi.num_layers == 61 and kimi.hidden_size == 7168  # read from text_config
    assert resolve_layer_ids(None, 61) == [1, 29, 57]
    assert hf_hidden_state_indices(kimi, [1, 29, 57]) == [2, 30, 58]
    # DeepSeek-family quirk: ids not starting with 1 are taken as layer inputs (no +1).
    assert hf_hidden_state_indices(kimi, [2, 30, 58]) == [2, 30, 58]
    assert hf_hidden_state_indices(llama, [2, 15, 28]) == [3, 16, 29]
    with pytest.raises(ValueError, match="target.aux_layer_ids"):
        resolve_layer_ids([1, 29, 60], 61)  # the last layer's output is never captured
    with pytest.raises(ValueError, match="3 ids"):
        resolve_layer_ids([1, 29], 61)


def test_drafter_layout():
    assert drafter_layout_for(target_info_from_dict(KIMI_CONFIG)) == "mla"
    assert drafter_layout_for(target_info_from_dict(LLAMA_CONFIG)) == "llama"


def test_token_bounded_batches():
    assert token_bounded_batches([5, 5, 5, 9, 1], max_tokens=10, max_requests=8) == [
        [0, 1],
        [2],
        [3, 4],
    ]
    assert token_bounded_batches([1, 1, 1], max_tokens=100, max_requests=2) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="max_capture_tokens"):
        token_bounded_batches([11], max_tokens=10, max_requests=2)


# --- baseline cache and server process -------------------------------------------------------


def test_baseline_cache_measures_once(tmp_path):
    target = TargetConfig(
        model="moonshotai/Kimi-K2.5", revision="abc123", tp_size=8, backend="sglang"
    )
    key = baseline_key(target)
    assert "abc123" in key and "tp8" in key and SGLANG_VERSION in key
    calls = []

    def measure():
        calls.append(1)
        return {"tok_per_s": 41.5 + len(calls)}

    cache = BaselineCache(tmp_path / "baseline.json")
    first, was_cached = cached_baseline(cache, key, measure)
    again, was_cached2 = cached_baseline(BaselineCache(tmp_path / "baseline.json"), key, measure)
    assert (was_cached, was_cached2, len(calls)) == (False, True, 1)
    assert again["tok_per_s"] == first["tok_per_s"] == 42.5
    other = baseline_key(target, sglang_version="0.0.1")
    cached_baseline(cache, other, measure)
    assert len(calls) == 2 and set(json.loads((tmp_path / "baseline.json").read_text())) == {
        key,
        other,
    }


def test_server_that_dies_reports_its_log(tmp_path):
    crash = [
        sys.executable,
        "-c",
        "import sys; print('weights not found', flush=True); sys.exit(3)",
    ]
    srv = SGLangServer(
        ServeConfig(
            engine="sglang",
            port=free_port(below=MAX_PORT + 1),
            env={"NCCL_PROTO": "LL"},
            extra_args=["--api-key", "sk-planted"],
        ),  # fmt: skip
        TargetConfig(model="/nowhere", backend="sglang"),
        tmp_path,
        start_timeout_s=30,
        launch=crash,
    )
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        srv.start("/drafter")
    assert "weights not found" in str(err.value)
    logged = (tmp_path / "sglang-000.log").read_text()
    assert "--speculative-draft-model-path /drafter" in logged.splitlines()[0]
    assert "--config" in logged.splitlines()[0]  # the key went to a file (test_engine_server.py)
    assert "--api-key" not in logged and "sk-planted" not in logged + str(err.value)
    # sglang derives its gRPC port as port + 10000
    with pytest.raises(ValueError, match="serve.port: 60000 .* SGLANG_GRPC_PORT"):
        SGLangServer(ServeConfig(engine="sglang", port=60000), srv.target_cfg, tmp_path)


_OWNER_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from pipeline.config import ServeConfig, TargetConfig
    from actors.ports import free_port
    from actors.sglang_server import MAX_PORT, SGLangServer

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]  # never healthy
    port = free_port(below=MAX_PORT + 1)
    srv = SGLangServer(ServeConfig(engine="sglang", port=port),
                       TargetConfig(model="/nowhere", backend="sglang"), sys.argv[1],
                       start_timeout_s=600, launch=sleeper)
    threading.Thread(target=srv.start, args=(None,), daemon=True).start()
    while srv.proc is None:
        time.sleep(0.1)
    print("CHILD", srv.proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the owner dies without cleaning up
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_server_dies_with_its_owner(tmp_path):
    import time

    script = tmp_path / "owner.py"
    script.write_text(_OWNER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    pid = int(proc.stdout.split("CHILD")[1].split()[0])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # SIGTERM arrives when the owner dies; the zombie is reaped by init
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


# --- Ray: one actor owns the placement group's GPUs -------------------------------------------

_RAY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray
    from actors.sglang_backend import SGLangTarget, reserve_target_gpus, target_actor_options
    from pipeline.config import TargetConfig

    ray.init(address="local", num_cpus=3, num_gpus=2, include_dashboard=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"JOB_LEVEL": "job", "NCCL_PROTO": "Simple",
                                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    cfg = TargetConfig(model=sys.argv[1], backend="sglang", tp_size=2, env={"NCCL_PROTO": "LL"})

    @ray.remote
    class Owner:
        def __init__(self, cfg):
            self.t = SGLangTarget(cfg)
        def report(self):
            try:
                self.t.generate([[1, 2]], 4, 0.0, 0)
                err = None
            except RuntimeError as e:
                err = str(e)
            keys = ("CUDA_VISIBLE_DEVICES", "JOB_LEVEL", "NCCL_PROTO")
            return {"env": {k: os.environ.get(k) for k in keys}, "layers": self.t.num_layers,
                    "tokenizer_hash": self.t.tokenizer_hash,
                    "hidden": self.t.hidden_size, "vocab": self.t.vocab_size, "error": err}

    res = reserve_target_gpus(2)
    owner = Owner.options(**target_actor_options(cfg, res)).remote(cfg)
    print("OWNER", json.dumps({"gpu_ids": list(res.gpu_ids), **ray.get(owner.report.remote())}))
    """
)


@pytest.mark.own_cluster  # its script starts a local Ray (conftest: after the shared one)
def test_target_actor_owns_all_reserved_gpus(tiny_target, no_sglang_run):
    got = no_sglang_run["OWNER"]
    assert sorted(got["gpu_ids"]) == ["0", "1"]
    assert sorted(got["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]  # both bundles' GPUs
    assert got["env"]["JOB_LEVEL"] == "job"  # the job's runtime_env reaches the actor ...
    assert got["env"]["NCCL_PROTO"] == "LL"  # ... and target.env wins over it
    assert (got["layers"], got["hidden"], got["vocab"]) == (4, 64, 49152)
    from transformers import AutoTokenizer

    from actors.hf_backend import tokenizer_hash

    assert got["tokenizer_hash"] == tokenizer_hash(AutoTokenizer.from_pretrained(tiny_target))
    assert "target.backend" in got["error"] and "pip install '.[sglang]'" in got["error"]


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# --- SGLang itself (only where sglang is installed) -----------------------------------------


def _sglang_on_this_host(monkeypatch) -> tuple[list[str], tuple]:
    """Extra CLI args / ServerArgs overrides that let SGLang run here: on a host without CUDA,
    SGLang's CPU engine with torch-native attention (the capture path is the same code)."""
    import torch

    if torch.cuda.is_available():
        return [], ()
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    return ["--device", "cpu"], (("device", "cpu"), ("attention_backend", "torch_native"))


@pytest.mark.sglang
def test_sglang_parses_our_server_args(tiny_target, tmp_path, monkeypatch):
    pytest.importorskip("sglang")
    import argparse

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from eagle3.config import Eagle3Config

    # Kimi's values through SGLang's argparse (the full parse would fetch Kimi's config).
    cfg = load_config(REPO / "configs" / "kimi-k25-8gpu.yaml")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(build_server_args(cfg.serve, cfg.target, "/d", 30000))
    assert ns.tp_size == 8 and ns.speculative_algorithm == "EAGLE3"
    assert (
        ns.speculative_num_steps,
        ns.speculative_eagle_topk,
        ns.speculative_num_draft_tokens,
    ) == (3, 1, 4)
    assert ns.trust_remote_code and ns.host == "127.0.0.1"

    # The same serve values, fully validated (__post_init__) on the tiny target and a drafter config.
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    dcfg = Eagle3Config(64, 128, 4, 2, 16, 49152, 1024, 64, [1, 1, 0])
    (drafter / "config.json").write_text(json.dumps(dcfg.to_json_dict()))
    target = TargetConfig(model=str(tiny_target), backend="sglang", dtype="float32")
    extra, _ = _sglang_on_this_host(monkeypatch)
    sa = prepare_server_args(build_server_args(cfg.serve, target, drafter, 30000) + extra)
    assert (sa.speculative_algorithm, sa.speculative_draft_model_path) == ("EAGLE3", str(drafter))
    assert (
        sa.speculative_num_steps,
        sa.speculative_eagle_topk,
        sa.speculative_num_draft_tokens,
    ) == (3, 1, 4)


@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_generate_and_capture_match_transformers(tiny_target, monkeypatch):
    """The real Engine and the real non-speculative ModelRunner on the tiny Llama: greedy tokens
    equal transformers' and id k captures HF hidden_states[k+1]; final = the last (normed) one."""
    pytest.importorskip("sglang")
    import torch
    from transformers import AutoModelForCausalLM

    from actors.sglang_backend import SGLangOptions, SGLangTarget

    _, overrides = _sglang_on_this_host(monkeypatch)
    opts = SGLangOptions(mem_fraction_static=0.1, max_capture_tokens=64, max_capture_requests=4,
                         start_timeout_s=600, call_timeout_s=600, server_overrides=overrides)  # fmt: skip
    target = SGLangTarget(
        TargetConfig(model=str(tiny_target), backend="sglang", dtype="float32"), options=opts
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    try:
        out = target.generate(prompts, 6, 0.0, 0)
        captured = target.capture(prompts, [0, 1, 2])
    finally:
        target.close()
    assert [p for p, _ in target.phase_switch_s] == ["generate", "capture"]
    for ids, new, (aux, final) in zip(prompts, out, captured, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[
                0, len(ids) :
            ].tolist()
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert new == ref
        assert aux.shape == (len(ids), 3 * 64) and final.shape == (len(ids), 64)
        torch.testing.assert_close(
            aux, torch.cat([hs[k + 1][0] for k in (0, 1, 2)], -1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(final, hs[-1][0], atol=1e-5, rtol=1e-5)


# --- the data stage on the SGLang backend: two phases, resume, GPUs released -------------------

# The data stage's two attempts; `model`, `out` and `cpu` come from the script it ends. Its
# placement groups are those made after `pgs_before`: the no-sglang script's Ray held another.
_DATA_STAGE = textwrap.dedent(
    """
    import dataclasses
    from actors.generate import run_generate
    from actors.prompts import builtin_prompts
    from actors.sglang_backend import SGLangOptions
    from pipeline.config import DataConfig

    pgs_before = set(ray.util.placement_group_table())
    # On a host without CUDA: SGLang's CPU engine with torch-native attention.
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}
    overrides = (("device", "cpu"), ("attention_backend", "torch_native")) if cpu else ()
    target = TargetConfig(model=model, backend="sglang", dtype="float32", aux_layer_ids=[0, 1, 2],
                          env=env)
    data = DataConfig(batch_size=2, num_actors=1, max_new_tokens=6, max_length=96,
                      shard_max_bytes=2**20)
    opts = SGLangOptions(mem_fraction_static=0.1, max_capture_tokens=256, max_capture_requests=4,
                         start_timeout_s=600, call_timeout_s=600, server_overrides=overrides)
    runs = []
    for attempt in range(2):
        try:
            r = run_generate(target, data, builtin_prompts(0)[:4], out, "h", sglang_options=opts)
            runs.append({"result": dataclasses.asdict(r)})
        except Exception as e:
            runs.append({"error": str(e)})
            break
        if attempt == 0:  # as if killed in phase 2 before batch 1 was captured
            for name in ("manifest.json", "b00001.json", "b00001-00.safetensors"):
                (out / name).unlink()
    states = [p["state"] for k, p in ray.util.placement_group_table().items() if k not in pgs_before]
    print("RESULT", json.dumps({"runs": runs, "placement_groups": states}))
    """
)
_DATA_SCRIPT = (
    textwrap.dedent(
        """
    import json, sys
    from pathlib import Path
    import ray
    from pipeline.config import TargetConfig

    model, out, cpu = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "cpu"
    ray.init(address="local", num_cpus=3, num_gpus=1, include_dashboard=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    """
    )
    + _DATA_STAGE
)


# Without sglang: the owner's check, its GPUs given back, then the data stage, on one Ray (one
# script: a Ray start each cost the suite ~40 s).
_NO_SGLANG_SCRIPT = (
    _RAY_SCRIPT
    + textwrap.dedent(
        """
    from pathlib import Path
    ray.kill(owner)
    ray.util.remove_placement_group(res.placement_group)
    model, out, cpu = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "cpu"
    """
    )
    + _DATA_STAGE
)


def _run_script(text: str, tiny_target: Path, out: Path, timeout: int) -> tuple[dict, str]:
    """Run `text` as a script (tiny_target, out, cpu|gpu): its `TAG {json}` lines by tag, and
    its stdout."""
    import torch

    script = out.parent / f"run_{out.name}.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    device = "gpu" if torch.cuda.is_available() else "cpu"
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_target), str(out), device],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    got = {}
    for ln in proc.stdout.splitlines():
        tag, _, rest = ln.partition(" ")
        if tag in ("OWNER", "RESULT"):
            got[tag] = json.loads(rest)
    assert "RESULT" in got, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got, proc.stdout


@pytest.fixture(scope="module")
def no_sglang_run(tiny_target, tmp_path_factory) -> dict:
    """_NO_SGLANG_SCRIPT's OWNER and RESULT, run once for the module's two tests of it."""
    if importlib_find("sglang"):
        pytest.skip("checks the missing-sglang error; sglang is installed here")
    out = tmp_path_factory.mktemp("no_sglang") / "data"
    return _run_script(_NO_SGLANG_SCRIPT, tiny_target, out, timeout=400)[0]


@pytest.mark.own_cluster  # its script starts a local Ray (conftest: after the shared one)
def test_data_stage_on_sglang_backend_without_sglang(no_sglang_run):
    got = no_sglang_run["RESULT"]
    assert list(got["runs"][0]) == ["error"]
    assert "target.backend" in got["runs"][0]["error"]
    assert "pip install '.[sglang]'" in got["runs"][0]["error"]
    assert got["placement_groups"] == ["REMOVED"]  # the actor's GPUs were given back


@pytest.mark.sglang
@pytest.mark.slow
def test_data_stage_on_sglang_backend(tiny_target, tmp_path):
    """The whole round generated by sglang.Engine, then captured by the ModelRunner ranks, in a
    Ray actor on a reserved placement group; the rerun after a phase-2 kill only captures."""
    pytest.importorskip("sglang")
    import torch
    from transformers import AutoModelForCausalLM

    from actors.shards import iter_samples, read_shard, verify_manifest

    out = tmp_path / "data"
    got, stdout = _run_script(_DATA_SCRIPT, tiny_target, out, timeout=900)
    got = got["RESULT"]
    first, rerun = (r.get("result") or pytest.fail(r["error"]) for r in got["runs"])
    assert "phase 1 (generate): 2 batch(es), 0 already generated" in stdout
    assert "phase 1 (generate): 0 batch(es), 1 already generated" in stdout
    assert first["num_samples"] == rerun["num_samples"] == 4
    assert first["gen_tok_per_s"] > 0 and first["switch_seconds"] > 0
    assert rerun["gen_tok_per_s"] == 0 and rerun["capture_tok_per_s"] > 0
    assert got["placement_groups"] == ["REMOVED", "REMOVED"]

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    m = verify_manifest(out)
    assert m.aux_layer_ids == (0, 1, 2) and m.target["num_layers"] == 4
    for path in m.shard_paths():
        for s in iter_samples(read_shard(path)):
            ids, mask = s["input_ids"].long(), s["loss_mask"]
            n_prompt = int((mask == 0).nonzero().max()) + 1
            with torch.no_grad():
                want = hf.generate(ids[None, :n_prompt], max_new_tokens=6, do_sample=False)
                hs = hf(ids[None], output_hidden_states=True).hidden_states
            assert ids[n_prompt:].tolist() == want[0, n_prompt:].tolist()[: len(ids) - n_prompt]
            aux = torch.cat([hs[k + 1][0] for k in (0, 1, 2)], -1)
            torch.testing.assert_close(s["aux_hidden"].float(), aux, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(s["final_hidden"].float(), hs[-1][0], atol=2e-2, rtol=2e-2)


# --- serving through deploy_endpoint: a live sglang.launch_server ----------------------------

_SERVE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    from pathlib import Path
    import httpx, ray
    from pipeline.config import ServeConfig, TargetConfig
    from serve.bench import bench_endpoint
    from serve.deployment import DrafterRejected
    from serve.endpoint import deploy_endpoint
    from actors.sglang_server import spec_stats_from_sglang

    model, good, broken, port, logs, cpu = sys.argv[1:7]
    logs, cpu = Path(logs), cpu == "cpu"
    ray.init(address="local", num_cpus=3, num_gpus=1, include_dashboard=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    extra = ["--mem-fraction-static", "0.1"]
    if cpu:  # SGLang's CPU engine with torch-native attention
        extra += ["--device", "cpu", "--attention-backend", "torch_native"]
    serve_cfg = ServeConfig(engine="sglang", port=int(port), steps=3, extra_args=extra,
                            env={"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {})
    target = TargetConfig(model=model, backend="sglang", dtype="float32")
    out = {}
    ep = deploy_endpoint(serve_cfg, target, None, logs)
    try:
        out["info0"] = ep.info()
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "return_meta_info": True}
        resp = httpx.post(f"{ep.url}/v1/chat/completions", json=body, timeout=300).json()
        out["stats"] = spec_stats_from_sglang(resp)
        for name, path in (("broken", broken), ("good", good)):
            try:
                out[name] = {"ok": ep.swap_drafter(path)}
            except DrafterRejected as e:
                out[name] = {"error": str(e), "starts": len(ep.info()["starts"])}
        out["info1"] = ep.info()
        prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(3)]
        cfg = {"num_prompts": 3, "max_tokens": 6, "concurrency": [1], "warmup": 1,
               "steps_sweep": [1, 2]}
        runs = [bench_endpoint(ep, prompts, cfg, logs / "bench", tag=t,
                               baseline_cache=logs / "baseline.json") for t in ("r1", "r2")]
        out["bench"] = [{"cached": r.extra["baseline_cached"], "sweep": len(r.sweep),
                         "steps": r.steps, "baseline_tok_per_s": r.baseline_tok_per_s,
                         "settings": r.extra["settings"]} for r in runs]
        out["info2"] = ep.info()
    finally:
        ep.shutdown()
    out["placement_groups"] = [p["state"] for p in ray.util.placement_group_table().values()]
    print("RESULT", json.dumps(out, default=str))
    """
)


@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_endpoint_serves_swaps_and_benchmarks(tiny_target, tmp_path):
    """deploy_endpoint(engine=sglang) in a Ray actor on a reserved GPU: meta_info per request,
    a refused drafter (no restart), a drafter swap by restart (on a host without CUDA SGLang's
    EAGLE-3 worker cannot start, so the previous server is restored), the baseline measured
    once by restarting without a drafter and then read from the cache."""
    pytest.importorskip("sglang")
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    d = random_drafter(hf, draft_vocab_size=4000, seed=1, aux_layer_ids=[0, 1, 2]).model
    good = save_drafter(d.state_dict(), d.cfg, tmp_path / "good", dtype=torch.float32)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    port = 30000 + os.getpid() % 20000  # SGLang needs port + 10000 <= 65535 (its gRPC port)
    cuda = torch.cuda.is_available()
    script = tmp_path / "serve_sglang.py"
    script.write_text(_SERVE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    args = [tiny_target, good, broken, port, tmp_path / "logs", "gpu" if cuda else "cpu"]
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[len("RESULT ") :])

    info0 = got["info0"]
    assert (info0["engine"], info0["running"], info0["drafter"]) == ("sglang", True, None)
    assert got["stats"]["has_meta_info"] and got["stats"]["completion_tokens"] == 8
    assert not got["stats"]["speculative"]  # no drafter: no spec_verify_ct in meta_info
    assert "config.json" in got["broken"]["error"] and got["broken"]["starts"] == 1  # no restart
    first_line = (tmp_path / "logs" / "sglang-000.log").read_text().splitlines()[0]
    assert first_line.startswith("# ") and f"--model-path {tiny_target}" in first_line
    if cuda:
        assert got["good"]["ok"]["drafter"] == str(good)
    else:  # EAGLE-3 on SGLang's CPU engine dies in the draft KV pool: the old server is back
        assert "did not come up" in got["good"]["error"] and got["good"]["starts"] == 2
        assert (got["info1"]["running"], got["info1"]["drafter"]) == (True, None)
        assert "Traceback" in (tmp_path / "logs" / "sglang-001.log").read_text()
    r1, r2 = got["bench"]
    assert (r1["cached"], r2["cached"]) == (False, True)
    assert r1["sweep"] == r2["sweep"] == 0 and r1["steps"] == 3  # steps fixed at launch
    assert r1["baseline_tok_per_s"] == r2["baseline_tok_per_s"] > 0
    assert len(got["info2"]["starts"]) == len(got["info1"]["starts"]) + 2  # baseline: 2 restarts
    assert got["info2"]["decode_lines"] > 0 and got["info2"]["cuda_graph"] is cuda
    assert got["placement_groups"] == ["REMOVED"]
