"""The deployment's retry path (serve/jobs.py `run_isolated`) with a request that passes the gate
and then fails inside the engine, mid-generation: its batchmates still get their answer, and a
streamed one gets each token once, though its batch ran again request by request.

Where the failure comes from: on the CPU engine no request that passes the gate fails by itself
(token ids, the context, the tree shape and the static runner's KV slots are checked there; RoPE
positions are computed, not looked up; the drafter's cache is sized per call). So the fault is
put where no code of the server is touched, in the target's weights: one token's embedding row
is NaN, as an fp16 overflow leaves it. A request whose reply reaches that token gets NaN
probabilities on its next forward, and the engine's sampler (torch.multinomial) raises, for the
whole batch it is in. The requests sample (greedy decoding takes an argmax, which never raises)
at a temperature far below every gap between their top two logits, so each draw is the greedy
token and a retry reproduces the text."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading
from pathlib import Path

import httpx
import pytest

for _dep in ("fastapi", "ray", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.checkpoint import save_drafter
from pipeline.config import ServeConfig, TargetConfig
from serve.endpoint import deploy
from serve.engine import random_drafter

APP = "test-serve-retry"
TEMPERATURE = 2e-5
SAMPLED = {"temperature": TEMPERATURE, "ignore_eos": True}  # one batch key for all requests
GOOD_TOKENS, BAD_TOKENS = 4, 16
POISON_AT = 6  # the bad request's 7th token is the poisoned one: its batchmates are done by then


def _clear_reply(model, prompt: list[int], n: int) -> list[int] | None:
    """The target's greedy reply, when at each step its top logit leads the next by over 100 x
    TEMPERATURE (a draw at TEMPERATURE is then the greedy token, all but e^-100 of the time)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            top = model(torch.tensor([ids])).logits[0, -1].topk(2)
            if float(top.values[0] - top.values[1]) < 100 * TEMPERATURE:
                return None
            ids.append(int(top.indices[0]))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def poisoned(tiny_target, tmp_path_factory) -> tuple[Path, Path, list[list[int]], list[int]]:
    """(target with one NaN embedding row, drafter, good prompts, the prompt whose reply reaches
    that row)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    drafter = random_drafter(model, draft_vocab_size=4000, seed=1, aux_layer_ids=[0, 1, 2]).model
    goods, taken = [], {0}  # 0: the batch's padding id
    for i in range(100):
        p = [5 + i, 17, 300 + i]
        if len(goods) < 5 and (reply := _clear_reply(model, p, GOOD_TOKENS + 1)) is not None:
            goods.append(p)
            taken |= set(p + reply)
    # the poisoned token never reaches a good request: not in its prompt or reply, nor drafted
    # for it (outside the drafter's vocabulary)
    for j in range(200):
        bad = [1000 + j, 42, 7]
        out = _clear_reply(model, bad, POISON_AT + 1)
        if out is None:
            continue
        x = out[POISON_AT]
        if x not in taken | set(bad) | set(out[:POISON_AT]) and not bool(drafter.t2d[x]):
            break
    else:
        pytest.fail("no prompt among 200 reaches a token no good request uses")
    assert len(goods) == 5
    root = tmp_path_factory.mktemp("poisoned")
    with torch.no_grad():
        model.get_input_embeddings().weight[x] = float("nan")
    model.save_pretrained(root / "target", safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(root / "target")
    d = save_drafter(drafter.state_dict(), drafter.cfg, root / "drafter", dtype=torch.float32)
    return root / "target", Path(d), goods, bad


@pytest.fixture(scope="module")
def endpoint(serve_port, poisoned):
    target, drafter, _, _ = poisoned
    serve_cfg = ServeConfig(port=serve_port, steps=3, num_cpus=1)
    # a batch waits 0.5 s for its mates, not 10 ms: requests sent together then share a batch
    # even when the other pytest of make test keeps both cores busy (10 ms missed there)
    return deploy(
        serve_cfg, TargetConfig(model=str(target)), drafter, app_name=APP, batch_wait_s=0.5
    )


def _send(client: httpx.Client, body: dict) -> tuple[int, str]:
    """(status, text); a streamed reply is joined from its deltas, an error event is a 500."""
    if not body.get("stream"):
        r = client.post("/v1/completions", json=body)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    text = ""
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if "error" in ev:
                    return 500, ev["error"]["message"]
                text += "".join(ch["text"] for ch in ev["choices"])
    return r.status_code, text


def _failed_batches() -> list[int]:
    """Sizes of the batches the replica ran again request by request, from its log."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    logs = "".join(p.read_text(errors="replace") for p in session.glob("logs/serve/replica_*.log"))
    return [int(n) for n in re.findall(r"a batch of (\d+) failed", logs)]


def test_a_request_that_fails_in_the_engine_fails_alone_and_batchmates_stream_once(
    endpoint, poisoned
):
    _, _, good_prompts, bad_prompt = poisoned
    bad = dict(SAMPLED, prompt=bad_prompt, max_tokens=BAD_TOKENS)
    goods = [dict(SAMPLED, prompt=p, max_tokens=GOOD_TOKENS, stream=True) for p in good_prompts]
    with httpx.Client(base_url=endpoint.url, timeout=120) as c:
        alone = [_send(c, g) for g in goods]  # the reference: each one in a batch of its own
        assert all(code == 200 and text for code, text in alone), alone
        code, msg = _send(c, bad)
    # it passed the gate (a 400 would name a field) and failed in the engine
    assert code == 500, (code, msg)
    assert _failed_batches() == []  # alone, it is nobody's batchmate

    def send(body: dict, start: threading.Barrier) -> tuple[int, str]:
        with httpx.Client(base_url=endpoint.url, timeout=120) as c:
            c.get("/health")  # connected before the start, so the requests arrive together
            start.wait()
            return _send(c, body)

    # the requests batch when they reach the replica within its 0.5 s window: sent together,
    # they nearly always do; each round is checked, and one must have shared the bad one's batch
    for _ in range(4):
        start = threading.Barrier(len(goods) + 1)
        with cf.ThreadPoolExecutor(len(goods) + 1) as pool:
            futures = [pool.submit(send, b, start) for b in [*goods, bad]]
            *got, (bad_code, _) = [f.result() for f in futures]
        assert bad_code == 500
        assert got == alone  # every batchmate answered, its text streamed once
        if any(n > 1 for n in _failed_batches()):
            break
    assert any(n > 1 for n in _failed_batches()), "the bad request never shared a batch"
