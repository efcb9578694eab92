"""The Serve deployment of the engine: handle and HTTP on 127.0.0.1, streaming, batching, the
no-speculation switch, and drafter hot-swap with a bad checkpoint refused; `deploy_endpoint`,
the driver's one entry point for both engines."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
from pathlib import Path

import httpx
import pytest

for _dep in ("fastapi", "ray", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import torch
from transformers import AutoModelForCausalLM

from eagle3.checkpoint import save_drafter
from pipeline.config import ServeConfig, TargetConfig
from serve.deployment import DrafterRejected, _run_app, deploy_endpoint, swap_drafter
from serve.engine import random_drafter
from serve.sglang_server import validate_drafter

APP = "test-serve"
CHAT = {
    "messages": [{"role": "user", "content": "Name three colors."}],
    "max_tokens": 10,
    "temperature": 0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_random(target, out, seed: int, draft_vocab: int = 4000) -> str:
    d = random_drafter(
        target, draft_vocab_size=draft_vocab, seed=seed, aux_layer_ids=[0, 1, 2]
    ).model
    return str(save_drafter(d.state_dict(), d.cfg, out, dtype=torch.float32))


@pytest.fixture(scope="module")
def drafters(tiny_target, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafters")
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    good1, good2 = save_random(target, root / "good1", 1), save_random(target, root / "good2", 2)
    # a drafter built for another target: fc expects a 32-wide target, not this 64-wide one
    other = random_drafter(target, draft_vocab_size=4000, seed=3, aux_layer_ids=[0, 1, 2]).model
    other.cfg.target_hidden_size = 32
    state = dict(other.state_dict(), **{"fc.weight": torch.zeros(64, 3 * 32)})
    wrong = str(save_drafter(state, other.cfg, root / "wrong_target", dtype=torch.float32))
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"hidden_size": 64}))
    return {"good1": good1, "good2": good2, "wrong": wrong, "broken": str(broken)}


@pytest.fixture(scope="module")
def endpoint(ray_local, tiny_target, drafters, tmp_path_factory):
    from ray import serve

    serve_cfg = ServeConfig(port=free_port(), steps=3, num_cpus=1)  # 1 CPU = 1 torch thread
    target_cfg = TargetConfig(model=str(tiny_target))
    logs = tmp_path_factory.mktemp("logs")
    ep = deploy_endpoint(serve_cfg, target_cfg, drafters["good1"], logs, app_name=APP)
    yield ep
    serve.shutdown()


def test_handle_and_http_answer_with_spec_stats(endpoint):
    from ray import serve

    assert endpoint.url.startswith("http://127.0.0.1:")
    handle = serve.get_app_handle(APP)
    by_handle = handle.complete.remote(dict(CHAT, ignore_eos=True)).result()
    u = by_handle["usage"]
    assert u["completion_tokens"] == 10 and u["speculative"] is True
    assert u["spec_verify_ct"] >= 1 and sum(u["spec_accept_hist"]) == u["spec_verify_ct"]
    assert u["spec_accept_len"] == pytest.approx(10 / u["spec_verify_ct"])
    assert u["draft_ms"] > 0 and u["verify_ms"] > 0

    with httpx.Client(base_url=endpoint.url, timeout=120) as c:
        assert c.get("/v1/models").json()["data"][0]["id"]
        spec = c.post("/v1/chat/completions", json=dict(CHAT, ignore_eos=True)).json()
        plain = c.post(
            "/v1/chat/completions", json=dict(CHAT, ignore_eos=True, speculative=False)
        ).json()
        tree = c.post(
            "/v1/chat/completions", json=dict(CHAT, ignore_eos=True, topk=2, num_draft_tokens=4)
        ).json()
        comp = c.post(
            "/v1/completions", json={"prompt": "The sky is", "max_tokens": 5, "temperature": 0}
        ).json()
    text = by_handle["choices"][0]["message"]["content"]
    assert spec["choices"][0]["message"]["content"] == text  # greedy: same text either way
    assert plain["choices"][0]["message"]["content"] == text
    assert plain["usage"]["speculative"] is False and plain["usage"]["spec_verify_ct"] == 0
    assert tree["choices"][0]["message"]["content"] == text and tree["usage"]["spec_verify_ct"] >= 1
    assert comp["object"] == "text_completion" and comp["usage"]["completion_tokens"] <= 5


def test_streaming_matches_non_streaming(endpoint):
    body = dict(CHAT, ignore_eos=True, max_tokens=12)
    with httpx.Client(base_url=endpoint.url, timeout=120) as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        events = []
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json=dict(body, stream=True, stream_options={"include_usage": True}),
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert (
        chunks[-1]["usage"]["completion_tokens"] == 12
        and chunks[-1]["usage"]["spec_verify_ct"] >= 1
    )
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"


def test_concurrent_requests_each_get_their_own_length(endpoint):
    def ask(n: int) -> dict:
        with httpx.Client(base_url=endpoint.url, timeout=120) as c:
            return c.post(
                "/v1/chat/completions", json=dict(CHAT, max_tokens=n, ignore_eos=True)
            ).json()

    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(ask, [4, 7, 9, 12]))
    assert [o["usage"]["completion_tokens"] for o in outs] == [4, 7, 9, 12]


def test_bad_requests_get_400(endpoint):
    with httpx.Client(base_url=endpoint.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=dict(CHAT, steps=0, top_p=0.5))
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "steps" in msg and "top_p" in msg
        assert c.post("/v1/completions", json={"max_tokens": 3}).status_code == 400
        r = c.post("/v1/chat/completions", json=dict(CHAT, topk=2, num_draft_tokens=40))
        assert r.status_code == 400 and "num_draft_tokens=40" in r.json()["error"]["message"]


def test_hot_swap_and_bad_checkpoint_refused(endpoint, drafters):
    from ray import serve

    handle = serve.get_app_handle(APP)
    before = handle.drafter_info.remote().result()
    assert before["path"] == drafters["good1"]

    info = swap_drafter(drafters["good2"], app_name=APP)
    assert (
        info["path"] == drafters["good2"] and info["pid"] == before["pid"]
    )  # in place, no restart

    for bad, words in (("wrong", "target_hidden_size"), ("broken", "config.json")):
        with pytest.raises(DrafterRejected, match=words):
            swap_drafter(drafters[bad], app_name=APP)
    # a bad user_config applied directly (no pre-validation) is refused by reconfigure itself
    _run_app(APP, drafters["wrong"])
    info = handle.drafter_info.remote().result()
    assert info["path"] == drafters["good2"] and "target_hidden_size" in info["error"]
    assert info["pid"] == before["pid"]

    out = handle.complete.remote(dict(CHAT, ignore_eos=True)).result()
    assert out["usage"]["speculative"] is True and out["usage"]["drafter"] == drafters["good2"]
    _run_app(APP, drafters["good2"])  # leave the app on a valid config


def test_endpoint_swaps_and_refuses_through_one_interface(endpoint, drafters, tmp_path):
    info = endpoint.info()
    assert (info["engine"], info["url"], info["app"]) == ("embedded", endpoint.url, APP)
    pid = info["pid"]
    after = endpoint.swap_drafter(drafters["good1"])
    assert after["path"] == drafters["good1"] and after["pid"] == pid
    with pytest.raises(DrafterRejected, match="target_hidden_size"):
        endpoint.swap_drafter(drafters["wrong"])
    assert endpoint.info()["path"] == drafters["good1"]
    # The baseline is per request (`speculative: false`): nothing measured, nothing cached.
    measured: list[str] = []
    cache = tmp_path / "baseline.json"
    assert endpoint.baseline(lambda url: measured.append(url) or {}, cache, "k") is None
    assert measured == [] and not cache.exists()


def test_sglang_drafter_check_without_loading_the_target(tiny_target, drafters, tmp_path):
    """What the SGLang endpoint checks before a restart: the checkpoint and its fit to the
    target's config.json (no weights of the target loaded)."""
    target = TargetConfig(model=str(tiny_target), backend="sglang")
    assert validate_drafter(drafters["good1"], target) is None
    assert "target_hidden_size 32 != target hidden 64" in validate_drafter(
        drafters["wrong"], target
    )
    assert "config.json" in validate_drafter(drafters["broken"], target)
    cfg = json.loads((Path(drafters["good1"]) / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]  # 3 = last layer of 4
    last = tmp_path / "last_layer"
    last.mkdir()
    (last / "config.json").write_text(json.dumps(cfg))
    (last / "model.safetensors").symlink_to(Path(drafters["good1"]) / "model.safetensors")
    assert "eagle_aux_hidden_state_layer_ids" in validate_drafter(last, target)
    # deploy_endpoint refuses it before reserving any GPU (no Ray needed)
    serve_cfg = ServeConfig(engine="sglang", port=30000)  # nothing binds it
    with pytest.raises(DrafterRejected, match="target_hidden_size"):
        deploy_endpoint(serve_cfg, target, drafters["wrong"], tmp_path / "logs")
