"""Shared fixtures: a tiny random Llama target with a real chat tokenizer, one local Ray and one
Ray Serve (with one app) for the whole run, and the order that keeps them apart from the tests
that start Ray clusters of their own.

One Ray per run, not one per module (issue 27: Ray started ~10 times in-process and Serve ~7
times per run before). What that needs:
- A second Ray started beside the shared one from this run (a `ray start --head`, a
  `pipeline/run.py` or a script with its own local Ray) confused Ray Train's placement-group
  cleaner in the shared one (it finds its cluster through the address file under RAY_TMPDIR,
  below), which then leaked a finished run's CPUs. Tests that start one are marked
  `own_cluster` and run last, after the shared Ray is shut down (`pytest_collection_modifyitems`,
  `pytest_runtest_setup`); one that needs Ray in-process there gets a fresh one of its module
  (`ray_module`). `make test` (scripts/test_suite.py) runs them in a second pytest beside this
  one instead; each pytest has its own RAY_TMPDIR.
- A module must give back what it reserved: after each module the Serve apps it left are deleted
  and the shared Ray's CPUs must be free again (but the shared app's replica), or the module's
  teardown fails naming them.
- Serve routes "/" to one app: the modules on the shared app (`shared_endpoint`) run first and
  the app is deleted after the last of them; other modules deploy (and delete) their own.
- Tests that check that a command starts no Ray are marked `before_ray` and run first."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Without a GPU, triton's kernels (serve/engine/kernels.py) run under triton's interpreter (numpy),
# so their tests run here too. Set before torch's import, which may import triton.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from actors.ports import free_port  # noqa: F401  (tests import it from here)

# The GPU hosts run torch 2.11, whose dynamo guards less than this VM's: it skips guards on a
# function's constant defaults and trusts a dict whose tag is unchanged. Code compiled here must
# be right under those guards too (start-up's capture once told its trees apart by a default
# argument alone: right on 2.13, while on an H100 every tree drafted the first), so the tests
# compile with 2.11's settings.
torch._dynamo.config.skip_guards_on_constant_func_defaults = True
torch._dynamo.config.use_recursive_dict_tags_for_guards = True

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s, and a worker's `ray.train.report` waits
# until the controller has taken the one before: a tiny fit that checkpoints every few
# milliseconds waited ~2 s a checkpoint, and each fit's end waited for a poll. Every Ray the
# tests start (in-process, `ray start`, a job's) inherits this. A test module took 205 s with it,
# 266 s without (2026-12-06).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# The run's Rays look the machine's latest cluster up in a fresh folder, not /tmp/ray: a `ray
# start` that ended without `ray stop` leaves its address in /tmp/ray/ray_current_cluster, and
# Ray Train's placement-group cleaner, looking the cluster up there, then waits 12 s at the end
# of every fit for a state API that never answers (a trivial fit: 27 s with that file, 17 s
# without). In-process and run.py's Rays keep their session files there too (a `ray start
# --temp-dir` keeps its own). Short, under /tmp: Ray's socket paths are limited.
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray-tests-", dir="/tmp"))


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (with its chat template) saved as plain HF tokenizer files."""
    from transformers import AutoTokenizer

    from eagle3.target_weights import SMOLLM2_GGUF, smollm2_dir

    out = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF).save_pretrained(out)
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


# The two-token target's logit per unit of its deciding feature: the chosen token takes almost
# all of the probability (e^20 against the other draft-vocab tokens' e^0) wherever the feature
# is not near 0. The drafter learns from the target's softmax: at +-1 against 0 it was nearly
# uniform over the draft vocab, the signal to learn a few hundredths of the loss, and a
# closed-loop run once learned nothing (accept_len 1.23 against the 2.4 asked; 1 of 3 suite
# runs on 2026-12-04).
TWO_TOKEN_LOGIT = 20.0


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
    drafter from a broken one. Its head is sharp (TWO_TOKEN_LOGIT says why)."""
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
            model.lm_head.weight[two_tokens[0], 0] = TWO_TOKEN_LOGIT
            model.lm_head.weight[two_tokens[1], 0] = -TWO_TOKEN_LOGIT
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def tiny_run_config(tiny_target: Path, tmp: Path, name: str, **sections: dict) -> dict:
    """A run config the preflight passes in seconds: the tiny target, a few prompts, sqlite
    MLflow in `tmp`; `sections` update its sections field by field."""
    cfg: dict = {
        "name": name,
        "target": {"model": str(tiny_target)},
        "data": {"prompts_per_round": 4, "heldout_prompts": 2, "max_new_tokens": 8},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": name},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """Path of a tiny random Llama target (4 layers, hidden 64, SmolLM2 tokenizer)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_target"), chat_tokenizer_dir)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model is overhead-bound; one torch thread avoids fighting over a shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def two_token_lm():
    """A random tiny Llama whose answer is A or B (tests/test_engine_device_cycle.py)."""
    from test_engine_device_cycle import make_two_token_lm

    return make_two_token_lm()


@pytest.fixture(scope="module")
def tiny_lm(tiny_target):
    """tiny_target loaded in fp32, eval mode (the engine tests' target)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def two_token_target(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """A tiny target that answers only " the" or " cat" (see build_tiny_llama): learnable."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    a, b = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" the", " cat"))
    out = tmp_path_factory.mktemp("two_token_target")
    return build_tiny_llama(out, chat_tokenizer_dir, two_tokens=(a, b))


NUM_CPUS = 4  # what every module's Ray had; the shared app's replica gets one more (SHARED_APP)
SHARED_APP = {"name": "test-serve", "num_cpus": 1.0, "steps": 2}
_SHARED: dict[str, bool] = {"ray": False, "serve": False, "app": False, "app_done": False}
_SHARED_APP_LAST_MODULE: list[str | None] = [None]  # its app is deleted after this module


def _init_local_ray(num_cpus: float, **extra) -> None:
    from actors.cluster import init_ray

    init_ray(  # retried: a busy machine can miss Ray's 30 s raylet start-up window
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
        log_to_driver=True,
        **extra,
    )


def _stop_shared_ray() -> None:
    """Shut down the shared Serve and Ray (idempotent): before the first `own_cluster` test, and
    at the end of the run."""
    if not _SHARED["ray"]:
        return
    import ray
    from ray import serve

    _SHARED["ray"] = _SHARED["serve"] = _SHARED["app"] = False
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def pytest_configure(config):
    # here, not in pyproject.toml: a change there re-runs `make setup` (its stamp's dependency)
    config.addinivalue_line(
        "markers", "own_cluster: starts a Ray of its own; runs last, after the shared Ray is down"
    )
    config.addinivalue_line(
        "markers", "before_ray: checks that no Ray starts in-process; runs first"
    )
    config.addinivalue_line(
        "markers",
        "ray_free: needs no Ray; `make test` runs it beside the shared-Ray tests, in the "
        "second pytest, so that the two take about as long",
    )


@pytest.hookimpl(trylast=True)  # after any other plugin's reordering (--lf, --ff)
def pytest_collection_modifyitems(config, items):
    """before_ray tests; then the modules on the shared app (Serve routes "/" to one app, so no
    other app may be deployed while it is up); then the rest on the shared Ray; then own_cluster
    tests. Stable: file order within each group."""
    app_files = {
        it.nodeid.split("::")[0]
        for it in items
        if "shared_endpoint" in it.fixturenames and not it.get_closest_marker("own_cluster")
    }

    def group(item) -> int:
        if item.get_closest_marker("before_ray"):
            return 0
        if item.get_closest_marker("own_cluster"):
            return 3
        return 1 if item.nodeid.split("::")[0] in app_files else 2

    items.sort(key=group)
    users = [it for it in items if group(it) == 1]
    _SHARED_APP_LAST_MODULE[0] = users[-1].nodeid.split("::")[0] if users else None


SHARED_RAY_FIXTURES = {"ray_local", "serve_port", "shared_endpoint"}  # the run's one Ray


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up
def pytest_runtest_setup(item):
    if "shared_endpoint" in item.fixturenames and _SHARED["app_done"]:
        pytest.fail(f"{item.nodeid}: the shared app was deleted after its last user module "
                    "(pytest_collection_modifyitems orders its users first)", pytrace=False)  # fmt: skip
    if item.get_closest_marker("ray_free"):
        ray = (SHARED_RAY_FIXTURES | {"ray_module"}) & set(item.fixturenames)
        if ray:
            pytest.fail(f"{item.nodeid} is marked ray_free but uses {sorted(ray)}",
                        pytrace=False)  # fmt: skip
    if item.get_closest_marker("own_cluster"):
        shared = SHARED_RAY_FIXTURES & set(item.fixturenames)
        if shared:
            pytest.fail(
                f"{item.nodeid} is marked own_cluster but uses {sorted(shared)}, the shared Ray "
                "(shut down before own_cluster tests): use ray_module",
                pytrace=False,
            )
        _stop_shared_ray()


@pytest.fixture(scope="session")
def ray_local():
    """The run's local Ray, bound to loopback, started by the first test that needs it."""
    import ray

    _init_local_ray(NUM_CPUS + SHARED_APP["num_cpus"])
    _SHARED["ray"] = True
    yield ray
    _stop_shared_ray()


@pytest.fixture(scope="module", autouse=True)
def _module_gives_back_the_shared_ray(request):
    """After a module: the Serve apps it left are deleted, and the shared Ray's CPUs are free
    again (but the shared app's replica), as they were when every module had a Ray of its own.
    Waits a while: Ray Train and killed actors give theirs back asynchronously."""
    yield
    if not _SHARED["ray"]:
        return
    import ray
    from ray import serve

    if _SHARED["serve"]:  # apps a module left (as its own Ray's end deleted them before)
        keep = {SHARED_APP["name"]}
        if request.node.nodeid == _SHARED_APP_LAST_MODULE[0]:
            keep, _SHARED["app"], _SHARED["app_done"] = set(), False, True  # last user done
        for name in set(serve.status().applications) - keep:
            serve.delete(name)
    allowed = SHARED_APP["num_cpus"] if _SHARED["app"] else 0.0
    deadline = time.monotonic() + 60
    while True:
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        if held <= allowed + 1e-6:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"{request.node.name} left {held - allowed:g} CPU(s) of the shared Ray reserved "
                "60 s after its last test (an actor, placement group or Serve app it did not "
                "end); the next modules would queue behind them"
            )
        time.sleep(1)


@pytest.fixture(scope="module")
def ray_module():
    """A fresh local Ray for one `own_cluster` module (the shared one is down by then)."""
    import ray

    assert not ray.is_initialized(), "ray_module: a Ray is already up in this process"
    _init_local_ray(NUM_CPUS)
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_own():
    """A fresh local Ray for one `own_cluster` test, in a temp dir of its own (session files,
    sockets, the "current cluster" note), shut down with its Serve after the test. Issue 50: the
    GPU tests on the shared Ray errored on ray.init timing out when they ran right after another
    Ray head on the same host; a Ray of their own, after the shared one is down, shares nothing
    with it."""
    import ray
    from ray import serve

    assert not ray.is_initialized(), "ray_own: a Ray is already up in this process"
    _init_local_ray(NUM_CPUS, _temp_dir=tempfile.mkdtemp(prefix="ray-own-", dir="/tmp"))
    try:
        yield ray
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_local) -> Iterator[int]:
    """Ray Serve started once for the run on the shared Ray, through serve/startup.py's retried
    start-up, on a free loopback port, with every proxy HEALTHY before any test deploys onto it.
    Tests delete the apps they deploy (`ep.shutdown()`; what a module leaves is deleted after
    it), never Serve itself."""
    from serve.startup import start_serve

    port = free_port()
    start_serve("127.0.0.1", port)
    _SHARED["serve"] = True
    yield port  # shut down with the shared Ray (_stop_shared_ray)


def save_random_drafter(target, out: Path, seed: int, draft_vocab: int = 4000) -> str:
    """A random-init drafter for `target` (aux layers 0-2), saved fp32: what the serving tests
    deploy (it accepts next to nothing)."""
    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    d = random_drafter(
        target, draft_vocab_size=draft_vocab, seed=seed, aux_layer_ids=[0, 1, 2]
    ).model
    return str(save_drafter(d.state_dict(), d.cfg, out, dtype=torch.float32))


@pytest.fixture(scope="session")
def drafters(tiny_target, tmp_path_factory) -> dict[str, str]:
    """Drafter folders for tiny_target: two good random ones, one built for another target (fc
    expects a 32-wide target, not this 64-wide one), one without weights."""
    import json

    from transformers import AutoModelForCausalLM

    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    root = tmp_path_factory.mktemp("drafters")
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    good1 = save_random_drafter(target, root / "good1", 1)
    good2 = save_random_drafter(target, root / "good2", 2)
    other = random_drafter(target, draft_vocab_size=4000, seed=3, aux_layer_ids=[0, 1, 2]).model
    other.cfg.target_hidden_size = 32
    state = dict(other.state_dict(), **{"fc.weight": torch.zeros(64, 3 * 32)})
    wrong = str(save_drafter(state, other.cfg, root / "wrong_target", dtype=torch.float32))
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"hidden_size": 64}))
    return {"good1": good1, "good2": good2, "wrong": wrong, "broken": str(broken)}


@pytest.fixture(scope="session")
def shared_endpoint(serve_port, tiny_target, drafters, tmp_path_factory):
    """The run's one Serve app (SHARED_APP): tiny_target with drafters["good1"], 2 draft steps,
    1 CPU (= 1 torch thread). tests/test_serve.py and tests/test_bench.py use it; a test that
    changes its drafter or shape puts the configured one back. Serve routes "/" to one app, so
    its modules run first and it is deleted after the last of them (before other modules deploy
    apps of their own)."""
    from pipeline.config import ServeConfig, TargetConfig
    from serve.endpoint import deploy_endpoint

    serve_cfg = ServeConfig(
        port=serve_port, steps=SHARED_APP["steps"], num_cpus=SHARED_APP["num_cpus"]
    )
    logs = tmp_path_factory.mktemp("shared-app-logs")
    ep = deploy_endpoint(
        serve_cfg, TargetConfig(model=str(tiny_target)), drafters["good1"], logs,
        app_name=SHARED_APP["name"],
    )  # fmt: skip
    _SHARED["app"] = True
    yield ep
    if _SHARED["app"]:
        _SHARED["app"] = False
        ep.shutdown()


@pytest.fixture(scope="session")
def smollm2_gguf_lm():
    """SmolLM2 as transformers loads the bundled GGUF (fp32): the reference that the conversion
    (tests/test_hf_folder.py) and the tensor reader (tests/test_target_weights.py) are checked
    against, dequantised once per run (~20 s). Tests read it and change nothing."""
    from transformers import AutoModelForCausalLM

    from eagle3.target_weights import SMOLLM2_GGUF, smollm2_dir

    return AutoModelForCausalLM.from_pretrained(
        smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """The bundled SmolLM2 GGUF as an HF folder (fp32, eagle3.hf_folder.gguf_to_hf), converted
    once per run (~40 s): tests/test_hf_folder.py checks the conversion and
    tests/test_shipped_drafter.py's vLLM start loads it as its `target.model` (so deploy_vllm
    converts nothing). Tests must not convert into it again with another dtype."""
    from eagle3.hf_folder import gguf_to_hf

    return gguf_to_hf("smollm2", tmp_path_factory.mktemp("smollm2-hf") / "hf", dtype="float32")
