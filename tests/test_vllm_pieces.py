"""The pure pieces of the vLLM engine, without vLLM: its Prometheus counters, its per-request
metrics, its command line, and the config rules that refuse what it cannot serve."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip
from actors.engine_server import SpecCounters
from actors.ports import free_port
from actors.vllm_server import (
    VLLMServer,
    build_server_args,
    parse_spec_counters,
    spec_stats_from_vllm,
)
from pipeline.config import ServeConfig, TargetConfig, parse_config  # noqa: E402
from serve.bench_stats import _level, extract_stats, level_from_counters

# The lines vLLM 0.32 writes for a 3-token drafter on two engines (names from
# vllm/v1/spec_decode/metrics.py; prometheus_client appends `_total` to counters).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 2.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_counters_sum_engines_and_give_accept_len_and_histogram():
    c = parse_spec_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (20.0, 60.0, 26.0)
    assert c.per_pos == (14.0, 7.0, 5.0)
    assert c.accept_len == pytest.approx(1 + 26 / 20)
    assert c.acceptance_per_position == pytest.approx((0.7, 0.35, 0.25))
    # exactly a accepted: 20-14 drafts accepted none, 14-7 one, 7-5 two, 5 all three
    assert c.accept_hist() == (6, 7, 2, 5)
    assert sum(a * n for a, n in enumerate(c.accept_hist())) == c.accepted
    d = c - SpecCounters(10.0, 30.0, 13.0, (7.0, 3.0, 3.0))
    assert (d.drafts, d.accepted, d.per_pos) == (10.0, 13.0, (7.0, 4.0, 2.0))
    # a server without a drafter has no such lines
    assert parse_spec_counters("vllm:num_requests_running 0.0\n").accept_len is None


def test_per_request_metrics_read_like_the_other_engines():
    body = {
        "usage": {"prompt_tokens": 20, "completion_tokens": 33, "total_tokens": 53},
        "metrics": {
            "speculative_decoding": {
                "mean_acceptance_length": 3.0,
                "acceptance_histogram": [2, 3, 1, 10],
                "num_spec_steps": 16,
                "num_accepted_draft_tokens": 35,
                "num_draft_tokens": 48,
                "num_spec_tokens": 3,
            }
        },
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    }
    st = extract_stats(body, latency_s=2.0)
    assert (st.completion_tokens, st.verify_ct, st.accepted_drafts) == (33, 16, 35)
    assert st.accept_hist == (2, 3, 1, 10) and st.accept_len == 33 / 16
    plain = {"usage": {"completion_tokens": 8}, "metrics": None, "choices": []}
    assert spec_stats_from_vllm(plain) is None and extract_stats(plain, 1.0).verify_ct is None


def test_counters_fill_a_level_only_without_per_request_figures():
    plain = extract_stats({"usage": {"completion_tokens": 10}}, 0.5)
    level = _level([plain, plain], 2, True, 3, 1.0)
    assert level.accept_len is None
    delta = parse_spec_counters(METRICS)
    got = level_from_counters(level, [plain, plain], delta)
    assert got.accept_len == delta.accept_len and got.accept_hist == delta.accept_hist()
    assert got.verify_ms == pytest.approx(1000.0 / 20)
    per_request = _level([extract_stats(b, 0.5) for b in [_spec(20, 8)] * 2], 2, True, 3, 1.0)
    assert level_from_counters(per_request, [], delta) == per_request


def _spec(completion: int, steps: int) -> dict:
    return {
        "usage": {"completion_tokens": completion},
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": completion - steps - 1,
                "acceptance_histogram": [0, 0, steps, 0],
            }
        },
    }


def test_server_args_carry_the_drafter_and_resolve_auto_dtype(tmp_path):
    serve_cfg = ServeConfig(engine="vllm", port=8123, steps=4, extra_args=["--enforce-eager"])
    target = TargetConfig(model="org/m", dtype="auto")
    args = build_server_args(serve_cfg, target, "/models/m", tmp_path / "d", 8123)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 4}
    assert args[args.index("--model") + 1] == "/models/m"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--dtype") + 1] in ("bfloat16", "float32")
    assert "--per-request-spec-decode-metrics" in args and args[-1] == "--enforce-eager"
    base = build_server_args(serve_cfg, target, "/models/m", None, 8123)
    assert "--speculative-config" not in base and "--per-request-spec-decode-metrics" not in base


def test_config_refuses_what_vllm_cannot_do():
    with pytest.raises(ValueError, match="serve.topk"):
        parse_config({"serve": {"engine": "vllm", "topk": 4, "num_draft_tokens": 8}})
    with pytest.raises(ValueError, match="data.capture"):
        parse_config({"target": {"backend": "vllm"}, "data": {"capture": "decode"}})
    ok = parse_config({"target": {"backend": "vllm"}, "serve": {"engine": "vllm"}})
    assert ok.serve.engine == "vllm" and ok.target.backend == "vllm"


def test_job_runtime_env_points_at_the_vllm_venv_without_uploading_it(tmp_path):
    from pipeline.run import job_runtime_env

    cfg = tmp_path / "c.yaml"
    cfg.write_text("serve: {engine: vllm}\n")
    env = job_runtime_env(str(cfg), str(tmp_path))
    assert ".venv-vllm/" in env["excludes"]
    assert "EAGLE_LOOP_VLLM_PYTHON" not in env["env_vars"]
    py = tmp_path / ".venv-vllm" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    env = job_runtime_env(str(cfg), str(tmp_path))
    assert env["env_vars"]["EAGLE_LOOP_VLLM_PYTHON"] == str(py)


def test_the_logged_command_line_hides_a_secret_argument(tmp_path):
    """`serve.extra_args: [--api-key, K]` reaches vLLM (through a --config file:
    tests/test_engine_server.py), never `<log_dir>/vllm-*.log`."""
    import sys

    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    cfg = ServeConfig(engine="vllm", port=free_port(), extra_args=["--api-key", "sk-planted"])
    srv = VLLMServer(cfg, TargetConfig(model="/nowhere"), tmp_path, start_timeout_s=30,
                     launch=crash, model_dir="/nowhere")  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        srv.start(None)
    logged = (tmp_path / "vllm-000.log").read_text()
    assert "--config" in logged.splitlines()[0]
    assert "--api-key" not in logged and "sk-planted" not in logged + str(err.value)
