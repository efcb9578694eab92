"""Issue 58, a replica's death loses no request: a real Serve app of the tiny target (one engine
replica behind the router, traffic recorded) whose replica is SIGKILLed by its pid while
requests run. Before the router, every request in flight got a bare 500 from Serve's proxy.
Now a non-streamed one is sent again (here: held until the replacement is up) and answered 200,
or told to retry (503 with Retry-After); a chat stream that had sent only its role chunk is sent
again and completes with one role chunk; a stream that already sent tokens ends with a
retryable error event; the traffic log holds each answered request once and nothing of an
attempt that died. And the project's own clients send a 503 with Retry-After again."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

for _dep in ("fastapi", "ray", "pydantic"):  # bare GPU host (torch only): skip
    pytest.importorskip(_dep)

from pipeline.config import ServeConfig, TargetConfig
from serve.bench_stats import _run_requests, chat_request
from serve.endpoint import deploy_endpoint
from serve.simulate import simulate_users
from serve.traffic import read_traffic

APP = "test-serve-failover"
# long enough to be mid-generation when the replica dies (seconds of work in one batch)
BODY = {"prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def endpoint(serve_port, tiny_target, drafters, tmp_path_factory):
    root = tmp_path_factory.mktemp("failover")
    cfg = ServeConfig(port=serve_port, steps=2, num_cpus=1, record_traffic=True, route_prefix="/f")  # fmt: skip
    ep = deploy_endpoint(cfg, TargetConfig(model=str(tiny_target)), drafters["good1"],
                         root / "logs", app_name=APP, traffic_dir=root / "traffic")  # fmt: skip
    yield ep, root / "traffic"
    ep.shutdown()


def _post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=180)


def _wait_held(n: int, timeout_s: float = 60) -> None:
    """Until the replica holds n requests (running or queued for its engine)."""
    from ray import serve

    handle, end = serve.get_app_handle(APP), time.monotonic() + timeout_s
    while (held := handle.drafter_info.remote().result()["held"]) < n:
        assert time.monotonic() < end, f"the replica holds {held} requests, not {n}"
        time.sleep(0.05)


def _events(url: str, path: str, body: dict, first: threading.Event, text: bool) -> list[dict]:
    """A stream's events; `first` is set at its first event, or with `text` at the first that
    carried text."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json=dict(body, stream=True), timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                choices = events[-1].get("choices", [])
                if not text or any(c.get("text") for c in choices):
                    first.set()
    return events


def test_a_replica_killed_mid_request_loses_none_and_logs_each_answer_once(endpoint):
    ep, traffic = endpoint
    assert _post(ep.url).status_code == 200  # the replica is up and has served once
    pid = ep.info()["pid"]
    tokens_out, role_out = threading.Event(), threading.Event()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    with cf.ThreadPoolExecutor(6) as pool:
        # the long stream first: its batch runs while the others reach the replica behind it
        long = pool.submit(_events, ep.url, "/v1/completions", BODY, tokens_out, True)
        assert tokens_out.wait(120), "the stream never got a token"
        posts = [pool.submit(_post, ep.url) for _ in range(4)]
        # a chat stream behind the running batch: its role chunk is out, no token yet
        short = pool.submit(_events, ep.url, "/v1/chat/completions", chat, role_out, False)
        assert role_out.wait(60), "the chat stream never began"
        _wait_held(6)  # the four posts too are in the replica, so the kill hits all six
        os.kill(pid, signal.SIGKILL)
        answers = [f.result() for f in posts]
        codes = [r.status_code for r in answers]
        assert 500 not in codes, codes
        for r in answers:
            assert r.status_code == 200 or (r.status_code == 503 and int(r.headers["Retry-After"]) > 0), (r.status_code, r.text)  # fmt: skip
        long_events, chat_events = long.result(), short.result()
    # the stream that had sent tokens ends with an error event that says to send it again
    err = long_events[-1].get("error")
    assert err and err["type"] == "server_unavailable" and err["code"] == 503, long_events[-1]
    # the one that had sent only its role chunk was sent again: one role chunk, then the reply
    deltas = [c["delta"] for e in chat_events for c in e["choices"]]
    assert [d for d in deltas if "role" in d] == [{"role": "assistant", "content": ""}], deltas
    assert chat_events[-1]["choices"][0]["finish_reason"] and "error" not in chat_events[-1]
    assert len({e["id"] for e in chat_events}) == 1
    assert ep.info()["pid"] != pid  # answered by the replacement

    from ray import serve

    router = serve.get_app_handle(APP).router_info.remote().result()
    # the kill hit the chat's and the four posts' first attempts; the long stream had sent tokens
    assert router["retried"] == 5 and router["unavailable"] >= 1, router

    # the log: one record per request answered (the warm-up's, the chat's), by the response's
    # id, and none of the attempts that died (the long stream's, the killed replica's)
    answered = {r.json()["id"].removeprefix("cmpl-") for r in answers if r.status_code == 200}
    answered.add(chat_events[0]["id"].removeprefix("chatcmpl-"))
    lines = [json.loads(x) for p in Path(traffic).glob("traffic-*.jsonl") for x in p.read_text().splitlines()]  # fmt: skip
    assert {rec["id"][:24] for rec in lines} >= answered
    assert len(lines) == len(answered) + 1, [rec["id"] for rec in lines]
    assert len([r["id"] for r in read_traffic(traffic)]) == len(answered) + 1


class _BusyOnce(BaseHTTPRequestHandler):
    """Answers every other POST (the 1st, 3rd, ...) 503 with `Retry-After: 1`, the others 200
    (a completion of 3 tokens): each request of a client that sends one at a time is refused
    once, as the router refuses one whose replicas died."""

    times: list[float] = []  # when each POST came

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        self.times.append(time.monotonic())
        if len(self.times) % 2:
            out, status, headers = b'{"error": {"type": "server_unavailable"}}', 503, {"Retry-After": "1"}  # fmt: skip
        else:
            out, status, headers = b'{"usage": {"completion_tokens": 3}}', 200, {}
        self.send_response(status)
        for k, v in {"content-type": "application/json", "content-length": str(len(out)), **headers}.items():  # fmt: skip
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.ray_free
def test_the_projects_clients_send_a_503_with_retry_after_again():
    """The simulated users and the benchmark (`eagle-loop bench`, the loop's) wait the seconds a
    503's Retry-After names and send the request again; before, both counted it failed."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BusyOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        sim = simulate_users(url, [[{"role": "user", "content": "hi"}]], max_tokens=3, concurrency=1)  # fmt: skip
        assert (sim.requests, sim.failed, sim.completion_tokens) == (1, 0, 3), sim
        assert _BusyOnce.times[1] - _BusyOnce.times[0] >= 1.0  # the header's second, waited
        with httpx.Client(base_url=url, timeout=30) as client:
            stats, _ = _run_requests(client, ["hi"], chat_request, 3, True, None, 1)
        assert [s.completion_tokens for s in stats] == [3] and len(_BusyOnce.times) == 4
    finally:
        server.shutdown()
        server.server_close()
