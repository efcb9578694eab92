"""What the benchmark sends and what it reads back: the request body, one request's figures
(`RequestStats`, from any engine's response), one concurrency level's (`LevelResult`), and the
requests run at a concurrency. serve/bench.py (the run) and serve/shape_sweep.py (the serving
shape's measurements) both build on it; it imports neither.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import httpx

from actors.engine_server import SpecCounters
from actors.sglang_server import response_spec as sglang_response_spec
from actors.vllm_server import response_spec as vllm_response_spec
from serve.http_client import post

Prompt = list[dict[str, str]] | str
# (prompt, max_tokens, speculative, steps) -> (path, JSON body); the seam for other servers
RequestBuilder = Callable[[Prompt, int, bool, int | None], tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class RequestStats:
    completion_tokens: int
    latency_s: float
    verify_ct: int | None = None  # None: the server reports no speculative statistics
    accepted_drafts: int | None = None
    accept_hist: tuple[int, ...] | None = None  # [a] = cycles that accepted a drafts
    draft_ms: float | None = None
    verify_ms: float | None = None
    steps: int | None = None

    @property
    def accept_len(self) -> float | None:
        """SGLang's definition: completion tokens per verify pass (bonus token included)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else None

    @property
    def tok_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


# Each engine adapter reads its own response format; None means "not mine".
ENGINE_READERS = (vllm_response_spec, sglang_response_spec)


def extract_stats(body: dict[str, Any], latency_s: float) -> RequestStats:
    """Per-request statistics from one response: an external engine's, read by its adapter
    (`response_spec`: vLLM's `metrics.speculative_decoding`, SGLang's `meta_info`), else this
    engine's `usage` fields."""
    for read in ENGINE_READERS:
        if (spec := read(body)) is not None:
            return RequestStats(
                completion_tokens=spec.completion_tokens,
                latency_s=latency_s,
                verify_ct=spec.verify_ct or None,
                accepted_drafts=spec.accepted,
                accept_hist=spec.hist or None,
                # The engines do not split a cycle into draft and verify: the whole request time
                # counts as verify (draft 0), so verify_ms per pass is the cycle time the planner
                # needs.
                draft_ms=0.0 if spec.verify_ct else None,
                verify_ms=latency_s * 1000.0,
            )
    src = body.get("usage") or {}
    if "completion_tokens" not in src:
        raise ValueError(
            f"response has no usage.completion_tokens nor meta_info: keys {sorted(body)}"
        )
    hist = src.get("spec_accept_hist")
    return RequestStats(
        completion_tokens=int(src["completion_tokens"]),
        latency_s=latency_s,
        verify_ct=int(src["spec_verify_ct"]) if src.get("spec_verify_ct") else None,
        accepted_drafts=src.get("spec_accepted_tokens"),
        accept_hist=tuple(int(x) for x in hist) if hist else None,
        draft_ms=src.get("draft_ms"),
        verify_ms=src.get("verify_ms"),
        steps=src.get("spec_steps") or None,
    )


def chat_request(
    prompt: Prompt,
    max_tokens: int,
    speculative: bool,
    steps: int | None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    top_k: int = -1,
) -> tuple[str, dict[str, Any]]:
    """OpenAI chat completion, greedy unless `temperature` > 0 (then with `top_p`, `top_k` where
    it cuts (> 0), and `seed`).
    `speculative`/`steps` are this engine's fields (SGLang ignores them); `return_meta_info`
    makes SGLang put its per-request speculative stats under `choices[0].meta_info`
    (non-streaming only; ignored by this engine)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "speculative": speculative,
        "return_meta_info": True,
        "record": False,  # benchmark prompts must never reach the traffic log (training data)
    }
    if steps is not None:
        body["steps"] = steps
    if temperature > 0:
        body["top_p"] = top_p
        if top_k > 0:
            body["top_k"] = top_k
        if seed is not None:
            body["seed"] = seed
    return "/v1/chat/completions", body


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    speculative: bool
    steps: int | None
    requests: int
    wall_s: float
    tok_per_s: float  # aggregate: all completion tokens / wall time
    req_tok_per_s: float  # mean over requests of completion tokens / latency
    latency_p50_s: float
    accept_len: float | None  # mean over requests
    accept_len_pooled: float | None  # all tokens / all verify passes
    accept_lens: tuple[float, ...]
    accept_hist: tuple[int, ...]  # summed over requests
    verify_ms: float | None  # per verify pass (per decode step without speculation)
    draft_ms_per_step: float | None  # one drafter forward


def _level(
    stats: list[RequestStats], concurrency: int, speculative: bool, steps: int | None, wall: float
) -> LevelResult:
    lens = [s.accept_len for s in stats if s.accept_len is not None]
    verify = sum(s.verify_ct or 0 for s in stats)
    k = steps or next((s.steps for s in stats if s.steps), None)
    # SGLang's histogram only reaches the largest count a request saw: pad them to one width
    hists = [s.accept_hist for s in stats if s.accept_hist]
    width = max([len(h) for h in hists] + [k + 1 if k else 0]) if hists else 0
    hist = tuple(sum(h[i] for h in hists if i < len(h)) for i in range(width))
    tokens = sum(s.completion_tokens for s in stats)
    vms = [s.verify_ms for s in stats if s.verify_ms is not None]
    dms = [s.draft_ms for s in stats if s.draft_ms is not None]
    passes = verify if speculative else sum(max(s.completion_tokens - 1, 0) for s in stats)
    return LevelResult(
        concurrency=concurrency,
        speculative=speculative,
        steps=k if speculative else None,
        requests=len(stats),
        wall_s=wall,
        tok_per_s=tokens / wall,
        req_tok_per_s=statistics.fmean(s.tok_per_s for s in stats),
        latency_p50_s=statistics.median(s.latency_s for s in stats),
        accept_len=statistics.fmean(lens) if lens else None,
        accept_len_pooled=tokens / verify if verify else None,
        accept_lens=tuple(lens),
        accept_hist=hist,
        verify_ms=sum(vms) / passes if vms and passes else None,
        draft_ms_per_step=sum(dms) / verify / k if dms and verify and k else None,
    )


def _run_requests(
    client: httpx.Client,
    prompts: list[Prompt],
    build: RequestBuilder,
    max_tokens: int,
    speculative: bool,
    steps: int | None,
    concurrency: int,
) -> tuple[list[RequestStats], float]:
    def one(prompt: Prompt) -> RequestStats:
        path, body = build(prompt, max_tokens, speculative, steps)
        t = time.perf_counter()
        r = post(client, path, body)  # a 503 with Retry-After is sent again (the wait counts)
        latency = time.perf_counter() - t
        if r.status_code != 200:
            raise RuntimeError(f"{client.base_url}{path} answered {r.status_code}: {r.text[:500]}")
        return extract_stats(r.json(), latency)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        stats = list(pool.map(one, prompts))
    return stats, time.perf_counter() - t0


def acceptance_per_position(hist: tuple[int, ...]) -> tuple[float, ...]:
    """hist[a] = cycles that accepted a drafts -> fraction of cycles with >= i accepted, i=1..k."""
    total = sum(hist)
    if not total:
        return ()
    return tuple(sum(hist[i:]) / total for i in range(1, len(hist)))


_REQUIRED = object()


def _get(cfg: Any, name: str, default: Any = _REQUIRED) -> Any:
    """A bench setting from a BenchConfig or a plain dict; without a default it must be there."""
    if hasattr(cfg, name):
        return getattr(cfg, name)
    return cfg[name] if default is _REQUIRED else cfg.get(name, default)


def level_from_counters(
    level: LevelResult, stats: Sequence[RequestStats], delta: SpecCounters
) -> LevelResult:
    """A benchmark level's speculative figures from the server counters' change over its
    requests, for responses without per-request figures (a vLLM server started without
    `--per-request-spec-decode-metrics`): accept_len pooled over the level, the accept
    histogram, and verify_ms as the request time per verify pass (as for SGLang)."""
    if not delta.drafts or level.accept_len is not None:
        return level
    al = delta.accept_len
    ms = sum(s.latency_s for s in stats) * 1000.0
    return replace(
        level,
        accept_len=al,
        accept_len_pooled=al,
        accept_lens=(al,) * len(stats),
        accept_hist=delta.accept_hist(),
        verify_ms=ms / delta.drafts,
        draft_ms_per_step=None,
        steps=level.steps or len(delta.per_pos) or None,
    )
