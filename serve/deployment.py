"""Ray Serve deployment of the embedded engine with OpenAI-compatible endpoints.

- `POST /v1/chat/completions`, `POST /v1/completions` (SSE with `"stream": true`), `GET /v1/models`,
  `GET /health`, `GET /drafter`. Extra request fields: `speculative` (false = plain decoding, the
  benchmark baseline), `steps`, `topk`, `num_draft_tokens` (drafting shape for this request;
  trees are greedy-only, sampled requests draft chains), `ignore_eos`. The speculative
  statistics ride in `usage` (`spec_accept_len`, `spec_verify_ct`, `spec_accept_hist`, `draft_ms`,
  `verify_ms`, ...).
- Concurrent requests are batched (`serve.batch`): one engine call per group of requests with the
  same sampling settings; streaming requests join batches too and get tokens after every cycle.
- Drafter hot-swap: `reconfigure({"drafter": path})` loads and checks the checkpoint against the
  target before swapping. A checkpoint that fails is refused: the error is logged and kept in
  `drafter_info()`, and the old drafter keeps serving (raising there would kill the replica).
  `swap_drafter` validates through the replica first, so the driver gets an exception instead.

The driver calls one function for either engine: `deploy_endpoint(serve_cfg, target_cfg,
drafter_dir, log_dir) -> ServingEndpoint` (`serve.engine: embedded` = this deployment,
`sglang` = serve/sglang_server.py's `deploy_sglang`, `vllm` = serve/vllm_server.py's
`deploy_vllm`; both swap drafters by a restart).

Everything binds 127.0.0.1 unless `serve.host` says otherwise.
"""

# No `from __future__ import annotations` here: FastAPI must see real types (Request) on the
# ingress methods that Serve re-binds, or it answers 422.
import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from serve.engine import (
    Generation,
    GenParams,
    SpecEngine,
    eos_ids,
    load_eagle,
    load_target,
    tree_problem,
)
from serve.sglang_server import DrafterRejected, deploy_sglang

log = logging.getLogger("ray.serve")

APP_NAME = "eagle3"
DEFAULT_MAX_TOKENS = 256
MAX_STEPS = 16

app = FastAPI()


class BadRequest(ValueError):
    """A request the server cannot serve; answered with HTTP 400."""


@dataclass
class _Job:
    prompt: list[int]
    params: GenParams
    speculative: bool
    queue: asyncio.Queue | None = None  # streaming: token lists, then None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def key(self) -> tuple:
        """Requests with equal keys share one engine call (max_tokens may differ)."""
        p = self.params
        return (
            self.speculative,
            p.temperature,
            p.steps,
            p.seed,
            p.ignore_eos,
            p.topk,
            p.num_draft_tokens,
        )

    def push(self, item: list[int] | None) -> None:
        if self.queue is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@serve.deployment(name="SpecServer", max_ongoing_requests=64, graceful_shutdown_timeout_s=5)
@serve.ingress(app)
class SpecServer:
    def __init__(self, target: dict[str, Any], options: dict[str, Any]):
        if options.get("torch_threads"):
            torch.set_num_threads(int(options["torch_threads"]))
        lm, self.tokenizer = load_target(
            target["model"],
            target.get("gguf_file"),
            target.get("dtype", "float32"),
            target.get("revision"),
            target.get("trust_remote_code", False),
        )
        stop = eos_ids(lm) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.engine = SpecEngine(
            lm,
            steps=int(options.get("steps", 3)),
            stop_ids=stop,
            topk=int(options.get("topk", 1)),
            num_draft_tokens=options.get("num_draft_tokens"),
        )
        self.model_name = options.get("model_name") or str(target["model"])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
        self.lock = threading.Lock()  # the engine runs one batch at a time
        self.drafter_path: str | None = None
        self.swap_error: str | None = None
        self.swaps = 0
        self.configured = False  # Serve calls reconfigure once right after __init__
        self._run.set_max_batch_size(int(options.get("max_batch_size", 8)))
        log.info(
            "SpecServer: target %s loaded (%d layers)",
            target["model"],
            self.engine.target.num_layers,
        )

    # -- drafter management -----------------------------------------------------------------
    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """user_config: {"drafter": path or None, "steps": int (optional)}."""
        first, self.configured = not self.configured, True
        if user_config.get("steps"):
            self.engine.steps = int(user_config["steps"])
        path = user_config.get("drafter")
        path = str(path) if path else None
        if path == self.drafter_path:
            return
        if path is None:
            with self.lock:
                self.engine.set_drafter(None)
            self.drafter_path, self.swap_error = None, None
            return
        try:
            drafter = load_eagle(path, self.engine.target.model)
        except Exception as e:  # noqa: BLE001 - any load failure refuses the swap
            self.swap_error = f"{path}: {e}"
            if first:
                raise DrafterRejected(self.swap_error) from e  # at startup there is nothing to keep
            log.error(
                "drafter swap refused, still serving %s: %s", self.drafter_path, self.swap_error
            )
            return
        with self.lock:
            self.engine.set_drafter(drafter)
        self.drafter_path, self.swap_error = path, None
        self.swaps += 1
        log.info("drafter now %s (swap %d)", path, self.swaps)

    def validate_drafter(self, path: str) -> str | None:
        """Load and check a checkpoint without swapping; the problem, or None when it fits."""
        try:
            load_eagle(path, self.engine.target.model)
        except Exception as e:  # noqa: BLE001
            return f"{path}: {e}"
        return None

    def drafter_info(self) -> dict[str, Any]:
        return {
            "path": self.drafter_path,
            "error": self.swap_error,
            "swaps": self.swaps,
            "steps": self.engine.steps,
            "pid": os.getpid(),
        }

    # -- generation -------------------------------------------------------------------------
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _run(self, jobs: list[_Job]) -> list[Generation]:
        return await asyncio.to_thread(self._run_sync, jobs)

    def _run_sync(self, jobs: list[_Job]) -> list[Generation]:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[job.key].append(i)
        results: list[Generation | None] = [None] * len(jobs)
        for idx in groups.values():
            sub = [jobs[i] for i in idx]
            try:
                with self.lock:
                    gens = self.engine.generate(
                        [j.prompt for j in sub],
                        sub[0].params,
                        on_tokens=lambda r, toks, sub=sub: sub[r].push(toks),
                        speculative=sub[0].speculative,
                        max_tokens_each=[j.params.max_tokens for j in sub],
                    )
            finally:
                for j in sub:
                    j.push(None)
            for i, g in zip(idx, gens, strict=True):
                results[i] = g
        return results  # type: ignore[return-value]

    def _job(self, body: dict[str, Any], chat: bool, stream: bool) -> _Job:
        prompt = self._prompt_ids(body, chat)
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)  # OpenAI's default
        steps, topk, n_tokens = body.get("steps"), body.get("topk"), body.get("num_draft_tokens")
        tree = tree_problem(
            steps or self.engine.steps,
            topk or self.engine.topk,
            n_tokens or self.engine.num_draft_tokens,
        )
        checks = [
            (isinstance(max_tokens, int) and max_tokens >= 1, f"max_tokens: {max_tokens!r} must be an int >= 1"),
            (temperature >= 0, f"temperature: {temperature} must be >= 0"),
            (body.get("top_p") in (None, 1, 1.0), "top_p: only 1.0 is supported; leave it out"),
            (body.get("n") in (None, 1), "n: only 1 completion per request is supported"),
            (not body.get("stop"), "stop: stop strings are not supported; leave it out"),
            (steps is None or (isinstance(steps, int) and 1 <= steps <= MAX_STEPS), f"steps: {steps!r} must be an int in [1, {MAX_STEPS}]"),
            (topk is None or (isinstance(topk, int) and topk >= 1), f"topk: {topk!r} must be an int >= 1"),
            (tree is None, f"steps/topk/num_draft_tokens: {tree}"),
            (not self.max_context or len(prompt) + max_tokens <= self.max_context, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.max_context}"),
        ]  # fmt: skip
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise BadRequest("; ".join(problems))
        params = GenParams(
            max_tokens=int(max_tokens),
            temperature=temperature,
            steps=steps,
            seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            topk=topk,
            num_draft_tokens=n_tokens,
        )
        job = _Job(prompt, params, speculative=bool(body.get("speculative", True)))
        if stream:
            job.queue, job.loop = asyncio.Queue(), asyncio.get_running_loop()
        return job

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            from actors.chat import prompt_ids

            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages: a non-empty list of {role, content} is required")
            try:
                return prompt_ids(self.tokenizer, messages)
            except Exception as e:  # noqa: BLE001 - template errors are the client's
                raise BadRequest(f"messages: cannot apply the chat template ({e})") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise BadRequest("prompt: a non-empty string or list of token ids is required (one prompt)")

    async def complete(self, body: dict[str, Any], chat: bool = True) -> dict[str, Any]:
        """One non-streaming request (also the handle API); returns the OpenAI response body."""
        job = self._job(body, chat, stream=False)
        gen = await self._run(job)
        return self._response(gen, chat, job.speculative)

    def _response(self, gen: Generation, chat: bool, speculative: bool) -> dict[str, Any]:
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": gen.stats.finish_reason,
            "logprobs": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(gen, speculative),
        }

    def _usage(self, gen: Generation, speculative: bool) -> dict[str, Any]:
        usage = gen.stats.usage()
        usage["speculative"] = speculative and self.engine.drafter is not None
        usage["drafter"] = self.drafter_path if usage["speculative"] else None
        return usage

    async def _sse(self, job: _Job, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            delta: str | None,
            finish: str | None = None,
            usage: dict | None = None,
            role: bool = False,
        ) -> str:
            choices = []
            if delta is not None or finish is not None or role:
                c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
                if chat:
                    c["delta"] = (
                        {"role": "assistant", "content": ""}
                        if role
                        else {"content": delta}
                        if delta
                        else {}
                    )
                else:
                    c["text"] = delta or ""
                choices.append(c)
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        task = asyncio.ensure_future(self._run(job))
        tokens: list[int] = []
        sent = ""
        if chat:
            yield chunk(None, role=True)
        assert job.queue is not None
        try:
            while (item := await job.queue.get()) is not None:
                tokens += item
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                if len(text) > len(sent):
                    yield chunk(text[len(sent) :])
                    sent = text
            gen = await task
        except Exception as e:  # noqa: BLE001 - report inside the stream, headers are gone
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        yield chunk(text[len(sent) :] or None, finish=gen.stats.finish_reason)
        if include_usage:
            yield chunk(None, usage=self._usage(gen, job.speculative))
        yield "data: [DONE]\n\n"

    async def _http(self, request: Request, chat: bool):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            stream = bool(body.get("stream", False))
            if not stream:
                return JSONResponse(await self.complete(body, chat))
            job = self._job(body, chat, stream=True)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
            return StreamingResponse(
                self._sse(job, chat, include_usage), media_type="text/event-stream"
            )
        except (BadRequest, json.JSONDecodeError) as e:
            return JSONResponse(
                {"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400
            )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.get("/v1/models")
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "eagle-loop"}],
        }

    @app.get("/health")
    def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/drafter")
    def drafter(self) -> dict[str, Any]:
        return self.drafter_info()


# ----------------------------------------------------------------------------------------------
# Driver side: deploy, swap, shut down


@dataclass(frozen=True)
class Endpoint:
    url: str  # http://host:port, the OpenAI base without /v1
    app_name: str
    drafter: str | None


_APPS: dict[str, dict[str, Any]] = {}  # app name -> what deploy() bound, for swap_drafter


def _as_dict(cfg: Any) -> dict[str, Any]:
    """A pydantic config section or a plain dict (the CLI passes dicts)."""
    return cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)


def deploy(
    serve_cfg: Any,
    target_cfg: Any,
    drafter_dir: str | Path | None,
    *,
    app_name: str = APP_NAME,
    num_cpus: float = 1.0,
    torch_threads: int | None = None,
    max_batch_size: int = 8,
    model_name: str | None = None,
) -> Endpoint:
    """Start Serve on serve.host:serve.port and run the engine app with `drafter_dir` (None = no
    drafter: plain decoding only). Returns where to send OpenAI requests."""
    s, t = _as_dict(serve_cfg), _as_dict(target_cfg)
    if s.get("engine", "embedded") != "embedded":
        raise ValueError(
            f"serve.engine={s['engine']!r}: this deployment is the embedded engine; use the SGLang deployment"
        )
    problem = tree_problem(s.get("steps", 3), s.get("topk", 1), s.get("num_draft_tokens"))
    if problem:
        raise ValueError(f"serve.steps/topk/num_draft_tokens: {problem}")
    options = {
        "steps": s.get("steps", 3),
        "topk": s.get("topk", 1),
        "num_draft_tokens": s.get("num_draft_tokens"),
        "torch_threads": torch_threads or max(1, int(num_cpus)),
        "max_batch_size": max_batch_size,
        "model_name": model_name,
    }
    actor = {"num_cpus": num_cpus, "num_gpus": s.get("num_gpus", 0.0)}
    serve.start(http_options={"host": s.get("host", "127.0.0.1"), "port": s.get("port", 8000)})
    _APPS[app_name] = {"target": t, "options": options, "actor": actor}
    drafter = str(drafter_dir) if drafter_dir else None
    _run_app(app_name, drafter)
    return Endpoint(f"http://{s.get('host', '127.0.0.1')}:{s.get('port', 8000)}", app_name, drafter)


def _run_app(app_name: str, drafter: str | None) -> None:
    spec = _APPS[app_name]
    dep = SpecServer.options(user_config={"drafter": drafter}, ray_actor_options=spec["actor"])
    # A fixed version makes a user_config change an in-place `reconfigure` (no replica restart,
    # no target reload). Ray 2.60 only takes it through the internal flag; without it the swap
    # still works, by restarting the replica.
    version = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]
    try:
        dep = dep.options(version=version, _internal=True)
    except (TypeError, ValueError):
        log.warning(
            "Serve rejected a fixed deployment version; drafter swaps will restart the replica"
        )
    serve.run(dep.bind(spec["target"], spec["options"]), name=app_name, route_prefix="/")


def swap_drafter(drafter_dir: str | Path, app_name: str = APP_NAME) -> dict[str, Any]:
    """Hot-swap the drafter of a running app. The replica validates the checkpoint first; a bad
    one raises DrafterRejected and the current drafter keeps serving."""
    if app_name not in _APPS:
        raise ValueError(f"app {app_name!r} was not deployed by this process; call deploy() first")
    handle = serve.get_app_handle(app_name)
    path = str(drafter_dir)
    problem = handle.validate_drafter.remote(path).result()
    if problem:
        raise DrafterRejected(f"drafter swap refused, the old drafter keeps serving: {problem}")
    _run_app(app_name, path)
    info = handle.drafter_info.remote().result()
    if info["path"] != path:
        raise DrafterRejected(f"drafter swap refused by the replica: {info['error']}")
    return info


def shutdown(app_name: str = APP_NAME) -> None:
    serve.delete(app_name)
    _APPS.pop(app_name, None)


# ----------------------------------------------------------------------------------------------
# One entry point for both engines


class ServingEndpoint(Protocol):
    """A running server the benchmark can score: `SGLangServerHandle` or `EmbeddedEndpoint`."""

    engine: str  # "embedded" | "sglang" | "vllm"
    url: str  # http://host:port, the OpenAI base without /v1

    @property
    def fixed_steps(self) -> int | None:
        """Draft steps the server uses whatever a request asks (SGLang), or None when requests
        may choose (the embedded engine: the benchmark's steps sweep works)."""
        ...

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """Serve another drafter; raises DrafterRejected (the previous one keeps serving)."""
        ...

    def info(self) -> dict[str, Any]: ...

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> tuple[dict[str, Any], bool] | None:
        """Figures of a no-speculation server, when the server cannot run the baseline per
        request (SGLang); None when it can (`speculative: false` on the same replica)."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class EmbeddedEndpoint:
    """The embedded engine's Serve app as a ServingEndpoint."""

    url: str
    app_name: str
    engine: str = "embedded"
    fixed_steps: int | None = None

    def swap_drafter(self, drafter_dir: str | Path) -> dict[str, Any]:
        """In place (`reconfigure`, no target reload), validated by the replica first."""
        swap_drafter(drafter_dir, self.app_name)
        return self.info()

    def info(self) -> dict[str, Any]:
        drafter = serve.get_app_handle(self.app_name).drafter_info.remote().result()
        return {"engine": self.engine, "url": self.url, "app": self.app_name, **drafter}

    def baseline(
        self, measure: Callable[[str], dict[str, Any]], cache_path: str | Path, settings_key: str
    ) -> None:
        return None  # each request may say `speculative: false`: measured on this replica

    def shutdown(self) -> None:
        shutdown(self.app_name)


def deploy_endpoint(
    serve_cfg: Any,
    target_cfg: Any,
    drafter_dir: str | Path | None,
    log_dir: str | Path,
    *,
    app_name: str = APP_NAME,
    launch: Sequence[str] | None = None,
) -> ServingEndpoint:
    """Start the server `serve.engine` names with `drafter_dir` (None = no speculation).

    embedded: the Ray Serve app above, `serve.num_cpus` CPUs and as many torch threads;
    `log_dir` is unused (Serve logs under Ray's session dir). sglang: `sglang.launch_server` in
    an actor that owns max(serve.num_gpus, target.tp_size) GPUs, logging to `log_dir`; `launch`
    replaces `python -m sglang.launch_server` (e.g. another venv's Python). vllm: vLLM's OpenAI
    server in an actor reserving serve.num_cpus / serve.num_gpus (serve/vllm_server.py)."""
    if serve_cfg.engine == "sglang":
        return deploy_sglang(serve_cfg, target_cfg, drafter_dir, log_dir, launch=launch)
    if serve_cfg.engine == "vllm":
        from serve.vllm_server import deploy_vllm

        return deploy_vllm(serve_cfg, target_cfg, drafter_dir, log_dir, launch=launch)
    ep = deploy(
        serve_cfg,
        target_cfg,
        drafter_dir,
        app_name=app_name,
        num_cpus=serve_cfg.num_cpus,
        torch_threads=int(serve_cfg.num_cpus),
    )
    return EmbeddedEndpoint(ep.url, ep.app_name)
