"""Config sections the serving side owns: `serve:` (the engine and its deployment) and `bench:` (the
benchmark). pipeline/config.py composes them into the one tree the YAML files load.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from actors.config import Strict


def _app_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v):
        raise ValueError("a Ray Serve application name: letters, digits, '_', '.', '-' (at most 63), e.g. eagle3-b")  # fmt: skip
    return v


def _route_prefix(v: str) -> str:
    if not re.fullmatch(r"/([A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*)?", v):
        raise ValueError("an HTTP path: '/' or '/' and segments of letters, digits, '_', '.', '-', e.g. /b")  # fmt: skip
    return v


def batch_problem(max_batch_size: int, batch_wait_s: float) -> str | None:
    """What is wrong with the embedded replica's batching (serve/endpoint.py's `deploy()`
    keywords, the CLI's `--max-batch-size`), or None. Checked before Serve starts because
    Ray's setters (`set_max_batch_size`, `set_batch_wait_timeout_s`) take any value unchecked."""
    if type(max_batch_size) is not int or max_batch_size < 1:  # type(): True is no batch size
        return f"max_batch_size={max_batch_size!r}: a batch holds at least 1 request (default 8)"
    if type(batch_wait_s) not in (int, float) or not 0 <= batch_wait_s < math.inf:  # NaN too
        return (
            f"batch_wait_s={batch_wait_s!r}: seconds a batch waits for mates, >= 0 (default 0.01)"
        )
    return None


class ServeConfig(Strict):
    engine: Literal["embedded", "sglang", "vllm"] = "embedded"
    """`embedded`: PyTorch engine on Ray Serve. `sglang`: a deployment owning sglang.launch_server.
    `vllm`: a deployment owning vLLM's OpenAI server (its own Python: docs/vllm.md); chains only."""
    host: str = "127.0.0.1"
    """Bind address of HTTP servers."""
    port: int = Field(8000, ge=1, le=65535)
    """HTTP port. Embedded engine: Ray Serve has one HTTP proxy per cluster, so every run on a
    cluster uses the port Serve already listens on."""
    app: Annotated[str, AfterValidator(_app_name)] = "eagle3"
    """Embedded engine: the Ray Serve application's name. A run never replaces an application
    of that name that another run (or `serve.cli`) deployed on the cluster: it is refused
    before round 0. Two runs on one cluster each take their own, with their own route_prefix."""
    route_prefix: Annotated[str, AfterValidator(_route_prefix)] = "/"
    """Embedded engine: the path the application answers under on Serve's proxy: `/` serves
    http://host:port/v1/...; `/b` serves http://host:port/b/v1/... (a second run's)."""
    steps: int = Field(3, ge=1)
    """Draft steps per cycle (--speculative-num-steps)."""
    topk: int = Field(1, ge=1)
    """Branching of tree drafting (--speculative-eagle-topk); 1 = chain."""
    num_draft_tokens: int | None = None
    """Tokens verified per cycle (--speculative-num-draft-tokens); None = steps+1 for chains."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs the serving replica reserves."""
    static_batch: int = Field(1, ge=1)
    """Embedded engine on a GPU: rows of its static runner, so a batch's concurrent requests
    decode together, up to this many at once (each gets the tokens it gets alone); 1 = one
    after another (docs/performance.md). Each row holds a KV cache of the engine's capacity."""
    drafter_compile: Literal["inductor"] | None = "inductor"
    """Embedded engine on a GPU: torch.compile backend of the static drafter's graphed step, so
    its CUDA graphs replay fused kernels (an H100, SmolLM2's base drafter, 2026-12-07: a 3-step
    draft 0.59 -> 0.23 ms, chain-3 at batch 1 1.00x -> 1.24x plain); null = eager. It compiles
    at the replica's start, before requests. On CPUs the drafter runs eagerly either way."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs the serving replica reserves; the embedded engine uses that many torch threads."""
    num_replicas: int = Field(1, ge=1)
    """Embedded engine: replicas of the engine behind the app's router (serve/router.py), each
    reserving `num_cpus` and `num_gpus` and loading the target. A request in flight on a replica
    that dies is sent again: with 1 it waits for the replacement (~11 s on a 2-core host), with
    2 the other replica answers it at once (docs/serving.md)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the SGLang or vLLM server. A secret flag among them
    (`--api-key K`) reaches the server through a file only its user can read (`--config`),
    never its command line (actors/engine_server.py)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for the server process (NCCL variables)."""
    record_traffic: bool = False
    """Append every finished request (messages, prompt and completion token ids, sampling
    settings, accept_len, verify count, time) to the run's traffic log, `traffic/` in the run
    directory, one fsynced JSON line per request. Benchmark requests are never recorded. Off:
    nothing is written."""
    traffic_max_mb: float = Field(64.0, gt=0)
    """Size of one traffic file before it rotates to the next."""
    traffic_max_files: int = Field(8, ge=1)
    """Traffic files kept in the whole traffic directory (every replica and restart together),
    so the log stays under traffic_max_files x traffic_max_mb; the oldest is deleted beyond this."""
    traffic_redact: str | None = None
    """`module:function` applied to each record (a dict) before it is written, e.g. to mask
    user content; it returns the record to write, or None to drop it. User text lives in
    `messages`, `prompt`, `prompt_ids` and `completion_ids` (docs/serving.md, "The traffic log
    and user text"): a hook that masks the text but returns the prompt ids unchanged gets them
    derived again from its text; completion ids are the hook's to mask or drop."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Embedded engine: HTTP requests one replica holds at once, whatever they are doing
    (sending their body, waiting for the engine, generating, `/health`). Far above what the
    engine runs, so that slow clients cannot fill the replica and stall `/health`; beyond it
    Serve's proxy queues up to `max_queued_requests` more and answers 503 past them."""
    max_queued_requests: int = Field(32, ge=0)
    """Embedded engine: requests waiting for the engine beyond one full batch
    (`max_batch_size`); one more is answered 503 with `Retry-After` at once instead of waiting
    without bound. Also the length of Serve's proxy queue when the replica holds
    `max_ongoing_requests`."""
    retry_after_s: int = Field(2, ge=1)
    """Embedded engine: the `Retry-After` seconds of a 503 (queue full)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Embedded engine: a request still unanswered this long after its body arrived is stopped
    (the engine drops it at its next step) and answered 504, or ends its stream with an error."""
    body_timeout_s: float = Field(10.0, gt=0)
    """Embedded engine: seconds a client has to send its whole request body; a slower one gets
    a 408 and its slot back."""
    simulate_users: int = Field(0, ge=0)
    """After each round's benchmark (when another round follows), replay this many prompts from
    the simulated users' pool (`data.user_prompts`) against the live server, as users would send
    them: the demo's stand-in for real traffic. Loopback only."""
    simulate_concurrency: int = Field(4, ge=1)
    """Simulated users in flight at once."""


class BenchConfig(Strict):
    num_prompts: int = Field(32, ge=1)
    """Held-out prompts scored per round."""
    max_tokens: int = Field(128, ge=1)
    """Most completion tokens per request (a request also ends at its end of sequence)."""
    ignore_eos: bool = False
    """Generate exactly `max_tokens` past the end of sequence (fixed-length load tests); the
    acceptance measured on text after EOS says little about real requests."""
    concurrency: list[int] = Field(default_factory=lambda: [1])
    """Concurrency levels measured."""
    warmup: int = Field(2, ge=0)
    """Requests sent first and excluded."""
    steps_sweep: list[int] = Field(default_factory=list)
    """Draft steps to try (best is kept); empty = only serve.steps."""
    shape_chains: list[Annotated[int, Field(ge=1, le=16)]] = Field(
        default_factory=lambda: [1, 2, 3, 4, 5]
    )
    """Embedded engine: the serving shape is chosen each round among the configured one
    (serve.steps/topk/num_draft_tokens), chains of these steps and plain decoding, on the
    baseline's prompts: the fastest serves, and plain decoding (no drafting) when none beats it
    (serve/shapes.py, docs/serving.md). Empty = always serve the configured shape."""
    baseline_prompts: int | None = Field(None, ge=1)
    """Embedded engine: time the no-drafter baseline on the first N prompts only (None = all).
    The baseline is a speed figure, and a target's decode speed barely depends on the prompt,
    so a few prompts give it at a fraction of the cost; per-domain speedups are then left out."""
    temperature: float = Field(0.0, ge=0, le=2)
    """Sampling temperature of every benchmark request (0 = greedy): the promotion gate, the
    shape choice and the speedup are then measured at the settings the server's users send.
    Sampled figures vary with the draws: compare two drafters at the same settings."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus of the benchmark's sampled requests (with `temperature` > 0)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k cut of the benchmark's sampled requests (with `temperature` > 0; -1 or 0 = off),
    applied before `top_p`, as vLLM's and SGLang's `top_k` (the openai client's `extra_body`)."""
    seed: int = 0
    """Seed of the benchmark's sampled requests; one for all, so requests that arrive together
    still share a batch (the engine batches requests with equal sampling settings)."""
    accept_concurrency: int | None = Field(None, ge=1)
    """Score acceptance on every prompt with this many requests in flight (the server batches
    them; the embedded engine's batches hold `max_batch_size`, 8, and a batch forms from the
    requests waiting when it starts, so keep 2-3 batches' worth in flight), and time speed, the shape
    choice included, on the first `baseline_prompts` only. accept_len varies most between
    prompts, so the gate wants many, and batched they cost a fraction of their one-at-a-time
    time (48 prompts of 64 tokens on one CPU thread: about 40 s against 170 s); speed wants
    requests alone on the server, and a few give it. None = both from the same requests, one
    concurrency level at a time."""
    reuse_baseline: bool = False
    """Embedded engine: measure the no-drafter baseline in the first round only and reuse it for
    later rounds on the same prompts and settings (saves a baseline pass per round; the figures
    then come from another time, so a machine whose load changed skews the speedup)."""
    eval_files: list[str] = Field(default_factory=list)
    """Your own evaluation prompt files (JSONL, formats as data.path): when given, each round is
    judged on every prompt of these files (one domain per file) instead of the held-out split."""
    promote_margin: float = Field(0.0, ge=0)
    """A new drafter replaces the serving one only when its accept_len beats the serving one's
    by more than this, on the same prompts and settings."""
    collapse_accept_len: float = Field(1.1, gt=1)
    """A drafter that serves below this accept_len while its held-out training accuracy predicts
    at least `collapse_predicted` is an error ("acceptance collapsed"), not a weak round."""
    collapse_predicted: float = Field(1.5, gt=1)
    """See `collapse_accept_len`."""
