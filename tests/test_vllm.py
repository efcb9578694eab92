"""vLLM and the project's own drafters, on a tiny shaped random Llama (HF folder) and a drafter
the project trains briefly and exports (`trained`): the export has the shipped drafter's format
(config keys, layer-id convention, tensor names and dtypes), and the vLLM target backend answers
as HF does while serving that drafter with its vLLM layer ids shifted by one, which loads without
error but loses acceptance against the embedded engine's with the right ids.

vLLM starts once here (about 40 s+ on 2 cores), as the target backend's server with the shifted
drafter. The shaped target is what makes the shift show: on SmolLM2 it barely lowers acceptance
(right 1.471, shifted 1.455). vLLM serving a real drafter right (greedy output, accept length
within 3%, counters, benchmark, refused swap) is checked once for the suite, on SmolLM2 with the
shipped drafter (tests/test_shipped_drafter.py, the other of the suite's two vLLM starts); the
format test here is what carries that over to the project's exports.

Needs a Python with vllm (`make setup-vllm`); skipped otherwise. Run by `make test-vllm`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from actors.vllm_server import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="no Python with vllm: make setup-vllm"),
]

AUX = [1, 2, 4]  # SGLang ids of the 6-layer target; vLLM reads them as (2, 3, 5)
MAX_TOKENS = 32
STEPS = 3
WORDS = "apple river stone cloud music paper light garden window silver tiger ocean".split()


def chat_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [{"role": "user", "content": " ".join(WORDS[j] for j in torch.randint(0, 12, (6,), generator=g))}]
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory):
    """(target folder, exported drafter) -- the drafter trained by the project's train stage on
    shards the tiny target wrote itself. The target is shaped so that the aux layers matter: a
    sharpened head (peaked next tokens), layers 0-4 that each move the residual stream a lot and
    a nearly silent last layer, so the next token is readable from layer 4's output (aux id 4);
    the drafter is narrow (one head, MLP 32), so it cannot redo the target from the tokens alone.
    With a plain random target, drafters ignore the aux states and shifted ids cost nothing."""
    from test_train_ray import capture_shards

    from eagle3.hf_folder import tiny_llama
    from pipeline.config import parse_config
    from pipeline.train import run_train

    root = tmp_path_factory.mktemp("vllm")
    target = tiny_llama(
        root / "target", "smollm2", layers=6, lm_head_scale=60.0, layer_scales=(8.0,) * 5 + (0.05,)
    )
    data = root / "data"
    capture_shards(target, data, n=48, new_tokens=40, aux=AUX)
    cfg = parse_config(
        {
            "target": {"model": str(target), "aux_layer_ids": AUX},
            "drafter": {
                "draft_vocab_size": 512, "intermediate_size": 32, "num_attention_heads": 1,
                "num_key_value_heads": 1, "head_dim": 32,
            },
            "train": dict(
                num_workers=1, epochs=12, lr=3e-3, ttt_length=3, tokens_per_batch=512,
                checkpoint_every=1000, eval_fraction=0.1, warmup_ratio=0.05,
            ),
        }
    )  # fmt: skip
    res = run_train(cfg, [data], root / "train")
    return target, Path(res.drafter_dir)


def shifted_copy(drafter: Path, out: Path, by: int) -> Path:
    """The same drafter with its vLLM (top-level) layer ids moved by `by`: what a checkpoint
    written with SGLang's ids under vLLM's key looks like."""
    shutil.copytree(drafter, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [
        k + by for k in cfg["eagle_aux_hidden_state_layer_ids"]
    ]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def complete(url: str, prompts: list[list[int]]) -> list[dict]:
    """Greedy completions of token-id prompts (one request each, in order)."""
    out = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for p in prompts:
            body = {
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True,
            }  # fmt: skip
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text[:500]
            out.append(r.json())
    return out


def pooled(responses: list[dict]) -> float:
    from actors.vllm_server import spec_stats_from_vllm

    st = [spec_stats_from_vllm(r) for r in responses]
    assert all(s is not None and s["spec_verify_ct"] > 0 for s in st), "no per-request metrics"
    return sum(s["completion_tokens"] for s in st) / sum(s["spec_verify_ct"] for s in st)


def extra_args(max_num_seqs: int = 8) -> list[str]:
    return ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs)]


@pytest.fixture(scope="module")
def reference(trained) -> dict:
    """What vLLM must reproduce, from the HF side: the HF backend's greedy answers (fp32, token
    ids, up to EOS) to the target backend's prompts, and the embedded engine's accept length with
    the drafter (right layer ids) on the prompts the shifted drafter is served."""
    from actors.chat import prompt_ids
    from actors.hf_backend import HFTarget
    from pipeline.config import TargetConfig
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    target, drafter = trained
    lm, tok = load_target(str(target), dtype="float32")
    ids = [prompt_ids(tok, m) for m in chat_prompts(8, seed=1)]
    target_ids = [prompt_ids(tok, m) for m in chat_prompts(6, seed=2)]
    torch.set_num_threads(1)
    engine = SpecEngine(lm, load_eagle(drafter, lm), steps=STEPS, stop_ids=set())
    cfg = TargetConfig(model=str(target), dtype="float32", backend="hf", aux_layer_ids=AUX)
    hf = HFTarget(cfg, num_threads=1)
    gens = engine.generate(ids, GenParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    verify = sum(g.stats.spec_verify_ct for g in gens)
    return {
        "ids": ids,
        "target_ids": target_ids,
        "target_greedy": hf.generate(target_ids, 24, 0.0, 0),
        "accept_len": sum(g.stats.completion_tokens for g in gens) / verify,
    }


DRAFTER_FORMAT_FIELDS = (  # config.json fields every drafter of the format has the same value of
    "architectures", "model_type", "num_hidden_layers", "hidden_act", "tie_word_embeddings",
    "torch_dtype",
)  # fmt: skip


def drafter_format(folder: Path) -> dict:
    """What a drafter folder must share with the shipped drafter, whatever its sizes: the
    config.json keys (top level and `eagle_config`), the fields above, the layer-id convention
    (vLLM's top-level ids = SGLang's `eagle_config` ids + 1, as many as the fc takes), and the
    safetensors tensor names with their dtypes."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    eagle = cfg.get("eagle_config") or {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    vllm_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return {
        "keys": sorted(cfg),
        "eagle_config_keys": sorted(eagle),
        "fields": {k: cfg.get(k) for k in DRAFTER_FORMAT_FIELDS},
        "use_aux_hidden_state": eagle.get("use_aux_hidden_state"),
        "vllm_ids_are_sglang_ids_plus_one": (
            vllm_ids is not None
            and sglang_ids is not None
            and list(vllm_ids) == [k + 1 for k in sglang_ids]
        ),
        "num_aux_ids": len(vllm_ids or ()),
        "tensors": tensors,
    }


def test_the_trained_export_has_the_shipped_drafters_format(trained):
    """The drafter the project's train stage exports is in the format of the shipped one, which
    vLLM serves (tests/test_shipped_drafter.py): so vLLM's one start with a real drafter covers
    the project's exports too, and this needs no vLLM start of its own. Sizes may differ."""
    from test_shipped_drafter import SHIPPED

    _, drafter = trained
    got = drafter_format(drafter)
    for shipped in SHIPPED:
        want = drafter_format(shipped)
        assert want["vllm_ids_are_sglang_ids_plus_one"] and want["num_aux_ids"] == 3
        for k in want:
            assert got[k] == want[k], (shipped.name, k, got[k], want[k])


def test_vllm_regenerates_like_hf_and_reads_the_drafters_layer_ids(trained, reference, tmp_path):
    """target.backend: vllm -- vLLM's greedy answers (fp32, token ids) are the HF backend's;
    capture is HFTarget's own forward (inherited), so it needs no test of its own here.

    The same vLLM start (this module's only one) serves a drafter whose vLLM layer ids are off by one:
    it loads without any error and loses acceptance, the failure the layer-id convention check
    is for; vLLM's log shows the ids it read. Speculation does not change greedy answers
    (fp32; tests/test_shipped_drafter.py), so the target's answers are still HF's."""
    from actors.vllm_backend import VLLMTarget
    from actors.vllm_server import speculative_config
    from pipeline.config import ServeConfig, TargetConfig

    target, drafter = trained
    shifted = shifted_copy(drafter, tmp_path / "shifted", by=-1)
    spec_args = [
        "--speculative-config", json.dumps(speculative_config(ServeConfig(steps=STEPS), shifted)),
        "--per-request-spec-decode-metrics", "summary",
    ]  # fmt: skip
    cfg = TargetConfig(model=str(target), dtype="float32", backend="vllm", aux_layer_ids=AUX)
    vt = VLLMTarget(cfg, num_threads=1, log_dir=tmp_path, extra_args=extra_args() + spec_args)
    try:
        got = vt.generate(reference["target_ids"], 24, 0.0, 0)
        off = pooled(complete(vt.server.url, reference["ids"]))
        log = Path(vt.server.starts[-1]["log"]).read_text()
    finally:
        vt.close()
    assert got == reference["target_greedy"]
    ours = reference["accept_len"]  # the embedded engine, right ids (vLLM matches it within 3%)
    assert off < ours - 0.1, (off, ours)
    want = tuple(
        json.loads((shifted / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    )
    assert f"Using auxiliary layers from speculative config: {want}" in log
    print(json.dumps({"shifted_accept_len": off, "embedded_accept_len": ours}))
