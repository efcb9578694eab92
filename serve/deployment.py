"""Ray Serve deployment of the embedded engine with OpenAI-compatible endpoints, behind the
app's router (serve/router.py: the HTTP ingress, which reads the body and hands it to a replica
through a handle, `respond`, and sends it again when the replica dies).

- `POST /v1/chat/completions`, `POST /v1/completions` (SSE with `"stream": true`), `GET /v1/models`,
  `GET /health`, `GET /drafter`. Extra request fields: `speculative` (false = plain decoding, the
  benchmark baseline), `steps`, `topk`, `num_draft_tokens` (drafting shape for this request;
  trees are greedy-only, sampled requests draft chains), `ignore_eos`. The speculative
  statistics ride in `usage` (`spec_accept_len`, `spec_verify_ct`, `spec_accept_hist`, `draft_ms`,
  `verify_ms`, ...).
- The serving shape (`set_shape`, the benchmark's choice: serve/shapes.py) is what a request
  that names no shape drafts; plain = requests that leave `speculative` out do not draft.
- Concurrent requests are batched (`serve.batch`): one engine call per group of requests with the
  same sampling settings; streaming requests join batches too and get tokens after every cycle.
  A batch on the static runner (a GPU, `static_batch` > 1) takes requests of its settings that
  arrive while it runs into its free rows between cycles (`JoinQueue`). Each request is
  answered as it leaves the batch (`_done`), not when the batch ends.
- Nobody waits without bound (serve/config.py has the knobs): a body must arrive within
  `body_timeout_s` (408, from the router); a request the engine cannot take soon (more than `max_batch_size` +
  `max_queued_requests` already wait or run) gets a 503 with `Retry-After` at once; one past
  `request_timeout_s` is stopped (504, or an error event in its stream). A request whose client
  hangs up, streamed or not, is dropped by the engine at its next step (its batch row and KV go
  with it) and never reaches the traffic log. `/health` runs on the event loop, which waits on
  nothing, and the router and the replica hold far more requests (`max_ongoing_requests`) than
  the engine runs, so slow clients cannot queue them.
- A request's id comes from the router, the same in every attempt: the response's `id` and the
  traffic record's, so a record that a dying attempt wrote is read once (serve/traffic.py).
- `GET /drafter` publishes the server's instance id (one per `deploy()`), which `serve.cli swap`
  checks through the Serve handle before it swaps, and `usage.drafter` is the drafter's digest.
- Drafter hot-swap: `reconfigure({"drafter": path})` loads and checks the checkpoint against the
  target before swapping. A checkpoint that fails is refused: the error is logged and kept in
  `drafter_info()`, and the old drafter keeps serving (raising there would kill the replica).
  `swap_drafter` validates through the replica first, so the driver gets an exception instead.

This module is the replica's side; serve/endpoint.py is the driver's (deploy, swap, shut down,
and `deploy_endpoint`, the one function the driver calls for any engine).

Everything binds 127.0.0.1 unless `serve.host` says otherwise.
"""

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from ray import serve

from actors.cluster import reserved_device
from actors.engine_server import DrafterRejected
from serve.config import ServeConfig
from serve.engine import (
    Generation,
    RequestStats,
    SpecEngine,
    eos_ids,
    load_eagle,
    load_target,
    serving_drafter_compile,
)
from serve.jobs import JoinQueue, _Job, answer, answered, await_answer, run_isolated
from serve.shapes import Shape
from serve.startup import grpc_on_loopback
from serve.stops import StopWatch
from serve.validation import BadRequest, Limits, check_request, max_prompt_chars, parse_body

log = logging.getLogger("ray.serve")

APP_NAME = ServeConfig.model_fields["app"].default  # serve.app's default: one place


def _traffic_log(opts: dict[str, Any] | None, tokenizer: Any):
    """The replica's traffic log when recording is on (`serve.record_traffic`), else None; a
    record whose text the redaction hook changed gets its prompt ids from `tokenizer` again.
    Defined above the class: Serve serializes the class when it is decorated, and a helper
    defined below it would be missing in the replica."""
    if not opts:
        return None
    from actors.chat import prompt_ids, tokenize
    from serve.traffic import TrafficLog, load_redactor

    def retokenize(rec: dict[str, Any]) -> list[int]:
        if rec.get("chat"):
            return prompt_ids(tokenizer, rec["messages"])
        p = rec["prompt"]
        p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list) else p
        return list(tokenize(tokenizer, p)["input_ids"]) if isinstance(p, str) else list(p)

    return TrafficLog(
        opts["dir"],
        replica=f"{os.getpid()}",
        max_bytes=int(opts.get("max_bytes", 64 << 20)),
        max_files=int(opts.get("max_files", 8)),
        redact=load_redactor(opts.get("redact")),
        retokenize=retokenize,
    )


def drafter_digest(path: str) -> str:
    """What `usage.drafter` names a drafter by: a digest of the files a drafter is loaded from
    (config and weights), never its path (a client learns nothing of the server's disk)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and (f.name == "config.json" or f.suffix == ".safetensors"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


class RequestTimeout(BadRequest):
    """Past `serve.request_timeout_s`; HTTP 504."""

    status = 504


class _Slot:
    """A request's place among those the engine runs or queues (`SpecServer.slots`): freed
    when the request ends, or when nothing refers to it any more (a stream that never began)."""


# health_check_period_s: Serve finds a dead replica at its next health check (Ray 2.60's default
# period is 10 s) and only then starts the replacement that requests the router sent again wait
# for (with one replica). Measured on 2 busy cores (benchmarks/fault_probes.py): found 6.4 s after
# a SIGKILL at 10 s, 1.6 s at 2 s; the new replica's start is most of the rest (~10 s).
@serve.deployment(
    name="SpecServer", max_ongoing_requests=256, graceful_shutdown_timeout_s=5,
    health_check_period_s=2,
)  # fmt: skip
class SpecServer:
    def __init__(self, target: dict[str, Any], options: dict[str, Any], actor: dict | None = None):
        self._spec = {"target": target, "options": options, "actor": actor or {}}
        grpc_on_loopback()
        if options.get("torch_threads"):
            torch.set_num_threads(int(options["torch_threads"]))
        # on the GPU the replica reserved: the engine's static runner then runs CUDA graphs
        device = reserved_device(float((actor or {}).get("num_gpus", 0.0)), "serve.num_gpus")
        t0 = time.perf_counter()  # the replica's start is most of a first benchmark's: its parts
        lm, self.tokenizer = load_target(
            target["model"],
            target.get("gguf_file"),
            target.get("dtype", "float32"),
            target.get("revision"),
            target.get("trust_remote_code", False),
            device,
        )
        stop = eos_ids(lm) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        t_load = time.perf_counter()
        self.engine = SpecEngine(
            lm,
            steps=int(options.get("steps", 3)),
            stop_ids=stop,
            topk=int(options.get("topk", 1)),
            num_draft_tokens=options.get("num_draft_tokens"),
            static_batch=int(options.get("static_batch", 1)),
            drafter_compile=serving_drafter_compile(options.get("drafter_compile"), device),
            runner=options.get("runner", "auto"),  # tests: "static" runs the GPU's code on CPU
        )
        self.model_name = options.get("model_name") or str(target["model"])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
        self.max_chars = max_prompt_chars(self.tokenizer.get_vocab(), self.max_context)
        self.instance = str(options.get("instance") or "")  # which deploy() this server is
        d = ServeConfig.model_fields  # the defaults of the knobs a caller left out
        knob = lambda k: options.get(k, d[k].default)  # noqa: E731
        self.max_running = int(options.get("max_batch_size", 8)) + int(knob("max_queued_requests"))
        self.retry_after_s = int(knob("retry_after_s"))
        self.request_timeout_s = float(knob("request_timeout_s"))
        self.slots: weakref.WeakSet[_Slot] = weakref.WeakSet()  # requests admitted to the engine
        # for tests: requests whose client left before its answer, requests the engine dropped,
        # tokens it generated
        self.counts = {"hung_up": 0, "cancelled": 0, "completion_tokens": 0}
        self.lock = threading.Lock()  # the engine runs one batch at a time
        self.joining = JoinQueue()  # requests that join the running batch between its cycles
        self.drafter_path: str | None = None
        self.drafter_digest: str | None = None
        self.swap_error: str | None = None
        self.swaps = 0
        self.plain = False  # the serving shape is plain decoding: requests that do not ask
        # for `speculative` decode without the drafter (the benchmark still asks for shapes)
        self.configured = False  # Serve calls reconfigure once right after __init__
        self.traffic = _traffic_log(options.get("traffic"), self.tokenizer)
        self._run.set_max_batch_size(int(options.get("max_batch_size", 8)))
        self._run.set_batch_wait_timeout_s(float(options.get("batch_wait_s", 0.01)))
        layers, t_end = self.engine.target.num_layers, time.perf_counter()
        log.info("SpecServer: target %s loaded (%d layers) in %.1f s, its engine built in %.1f s",
                 target["model"], layers, t_load - t0, t_end - t_load)  # fmt: skip

    @property
    def limits(self) -> Limits:
        """What requests are checked against (steps may change through reconfigure)."""
        e = self.engine
        cap = e.static.capacity if e.static is not None else 0
        return Limits(e.target.vocab_size, self.max_context, e.steps, e.topk, e.num_draft_tokens, cap, self.max_chars)  # fmt: skip

    # -- drafter management -----------------------------------------------------------------
    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """user_config: {"drafter": path or None, "fallback": the last good drafter (optional),
        "steps": int (optional), "shape": the serving shape (optional; serve/shapes.py's
        request fields of the benchmark's choice: {"speculative": false} = plain decoding)}. A
        fresh replica (a restart) whose declared drafter does not load serves the fallback
        instead of failing to start."""
        first, self.configured = not self.configured, True
        if user_config.get("steps"):
            self.engine.steps = int(user_config["steps"])
        if (shape := user_config.get("shape")) is not None:
            self._set_shape(shape)
        path = user_config.get("drafter")
        path = str(path) if path else None
        refused = None
        fallback = user_config.get("fallback")
        if first and path and fallback and str(fallback) != path:
            if refused := self.validate_drafter(path):
                log.error("declared drafter refused, serving the last good one: %s", refused)
                path = str(fallback)
        if path == self.drafter_path:
            return
        if path is None:
            with self.lock:
                self.engine.set_drafter(None)
            self.drafter_path, self.drafter_digest, self.swap_error = None, None, None
            return
        t0 = time.perf_counter()
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
        digest = drafter_digest(path)
        with self.lock:
            self.engine.set_drafter(drafter)
        self.drafter_path, self.drafter_digest, self.swap_error = path, digest, refused
        self.swaps += 1
        log.info("drafter now %s (swap %d, %.1f s)", path, self.swaps, time.perf_counter() - t0)

    def _set_shape(self, fields: dict[str, Any]) -> None:
        """Requests that name no shape draft this one (plain: do not draft at all)."""
        self.plain = fields.get("speculative") is False
        if not self.plain:
            self.engine.steps, self.engine.topk = int(fields["steps"]), int(fields["topk"])
            self.engine.num_draft_tokens = fields.get("num_draft_tokens")
        log.info("serving shape: %s", "plain decoding (no drafter)" if self.plain else fields)

    def shape_name(self) -> str:
        e = self.engine
        return "plain" if self.plain else Shape(e.steps, e.topk, e.num_draft_tokens).name

    def validate_drafter(self, path: str) -> str | None:
        """Load and check a checkpoint without swapping; the problem, or None when it fits."""
        try:
            load_eagle(path, self.engine.target.model)
        except Exception as e:  # noqa: BLE001
            return f"{path}: {e}"
        return None

    def drafter_info(self) -> dict[str, Any]:
        """The full picture, for the driver through a handle (paths included)."""
        return {
            "path": self.drafter_path,
            "error": self.swap_error,
            "swaps": self.swaps,
            "steps": self.engine.steps,
            "device": str(self.engine.device),  # where the replica's engine runs, and how
            "cuda_graphs": bool(self.engine.static is not None and self.engine.static.use_graphs),
            "shape": self.shape_name(),  # what a request that names no shape gets
            "pid": os.getpid(),
            "app": serve.get_replica_context().app_name,
            "instance": self.instance,
            "digest": self.drafter_digest,
            "held": len(self.slots),  # requests this replica runs or queues now
            **self.counts,  # requests whose client left, those the engine dropped, its tokens
        }

    def public_drafter_info(self) -> dict[str, Any]:
        """What `GET /drafter` tells any client: no filesystem path, no error text (it names
        paths), no Ray address (whoever reaches the GCS port controls the cluster)."""
        return {
            "drafter": self.drafter_path is not None,
            "swap_refused": self.swap_error is not None,
            "swaps": self.swaps,
            "steps": self.engine.steps,
            "shape": self.shape_name(),
            "app": serve.get_replica_context().app_name,
            "instance": self.instance,  # `serve.cli swap` checks it through the handle
            "digest": self.drafter_digest,
        }

    def spec(self) -> dict[str, Any]:
        """What the app was bound with, so another driver can redeploy it unchanged (a swap)."""
        return self._spec

    # -- generation -------------------------------------------------------------------------
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _run(self, jobs: list[_Job]) -> list[Generation]:
        return await asyncio.to_thread(self._run_sync, jobs)

    def _run_sync(self, jobs: list[_Job]) -> list[Generation | Exception]:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[job.key].append(i)
        results: list[Generation | Exception | None] = [None] * len(jobs)
        try:
            for idx in groups.values():
                sub = [jobs[i] for i in idx]
                for i, out in zip(idx, run_isolated(self._generate, sub), strict=True):
                    results[i] = out
        finally:
            for j in jobs:
                j.push(None)
        self._count([g for g in results if isinstance(g, Generation)])
        return results  # type: ignore[return-value]

    def _count(self, gens: list[Generation]) -> None:
        self.counts["cancelled"] += sum(g.stats.finish_reason == "cancelled" for g in gens)
        self.counts["completion_tokens"] += sum(g.stats.completion_tokens for g in gens)

    def _generate(self, sub: list[_Job]) -> list[Generation]:
        """One engine call for jobs of one key (equal sampling settings); a job nobody waits
        for any more (`_Job.stopped`, e.g. while it waited for the lock) is not started, and
        one that stops while it runs leaves the batch at the engine's next step. A batch on the
        static runner takes requests of its key that arrive while it runs (`joining`)."""
        with self.lock:
            live = [j for j in sub if not j.stopped and not answered(j)]
            started, joined = len(live), []
            joins = None
            if live and self.engine.takes_joins(live[0].params, live[0].speculative):
                self.joining.open(live[0].key)

                def joins(free: int) -> list[tuple[list[int], int]]:
                    taken = self.joining.take(free, lambda j: self.engine.fits(j.prompt, j.params.max_tokens))  # fmt: skip
                    joined.extend(taken)
                    live.extend(taken)
                    return [(j.prompt, j.params.max_tokens) for j in taken]

            gens: list[Generation] | None = None
            try:
                gens = (
                    self.engine.generate(
                        [j.prompt for j in live],
                        live[0].params,
                        on_tokens=lambda r, toks: live[r].push(toks),
                        speculative=live[0].speculative,
                        max_tokens_each=[j.params.max_tokens for j in live],
                        joins=joins,
                        on_done=lambda r, g: self._done(live[r], g),
                    )
                    if live
                    else []
                )
            finally:  # requests that waited to join and never did (or whose batch failed) run next
                for j in self.joining.close() + (joined if gens is None else []):
                    j.restart()
                    self._rerun(j)
            self._count(gens[started:])  # the joined requests (`_done` answered each)
        out = iter(gens[:started])
        ran = {id(j) for j in live}  # by identity: equal requests are equal dataclasses
        skipped = lambda j: Generation([], RequestStats(len(j.prompt), finish_reason="cancelled"))  # noqa: E731
        return [next(out) if id(j) in ran else skipped(j) for j in sub]

    def _done(self, job: _Job, gen: Generation) -> None:
        """The engine's thread, as `job` leaves its batch: its answer now (its stream ends, its
        client gets the response), not when the batch's last request ends. The generation's
        stats are the ones `generate` returns too."""
        if job.stops is not None and job.stops.hit:  # fed every token the engine gave `job`
            gen.stats.finish_reason = "stop"  # the engine dropped it at its stop string
        job.push(None)
        answer(job, gen)

    def _rerun(self, job: _Job) -> None:
        """A request that waited to join a batch that ended without it (or failed): it runs in
        the next engine call, its answer to the future it waits on."""
        assert job.answer is not None

        async def run() -> None:
            answer(job, await self._run(job))

        asyncio.run_coroutine_threadsafe(run(), job.answer[1])

    async def _submit(self, job: _Job) -> Generation | Exception:
        """The request's Generation as soon as it leaves the engine's batch: it joins the batch
        that runs now when it can, else it runs in the next engine call (`serve.batch`)."""
        fut = self.joining.offer(job)
        if fut is not None:
            return await fut
        fut = await_answer(job)
        task = asyncio.ensure_future(self._run(job))
        try:
            await asyncio.wait({fut, task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # as before: the batch call's cancellation drops a queued request
            raise
        if fut.done():
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no stray warning
            return fut.result()
        return task.result()  # it never reached the engine's answer (an error, a skipped job)

    def _text(self, job: _Job, gen: Generation) -> str:
        """The reply's text, cut where its first stop string begins."""
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return text if job.stops is None else job.stops.reply(text)

    async def _job(
        self,
        body: dict[str, Any],
        chat: bool,
        stream: bool,
        deadline: float = float("inf"),
        request_id: str | None = None,
    ) -> _Job:
        """A checked request (BadRequest names every bad field); only these join a batch. The
        tokenizer runs in a thread: a long prompt must not stall the replica's event loop."""
        job = await asyncio.to_thread(self._checked_job, body, chat)
        job.deadline = deadline
        job.id = request_id or job.id
        if stream:
            job.queue, job.loop = asyncio.Queue(), asyncio.get_running_loop()
        return job

    def _checked_job(self, body: dict[str, Any], chat: bool) -> _Job:
        from actors.chat import prompt_ids, tokenize

        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        req = check_request(
            body,
            chat,
            self.limits,
            encode=lambda text: tokenize(self.tokenizer, text)["input_ids"],
            apply_template=lambda messages: prompt_ids(self.tokenizer, messages),
        )
        speculative = req.speculative and not (self.plain and "speculative" not in body)
        job = _Job(req.prompt, req.params, speculative=speculative)
        if req.stop:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            job.stops = StopWatch(req.stop, decode)
        if self.traffic is not None and req.record:
            job.record = {"chat": chat, "messages": body.get("messages") if chat else None,
                          "prompt": None if chat else body.get("prompt")}  # fmt: skip
        return job

    async def complete(
        self,
        body: dict[str, Any],
        chat: bool = True,
        deadline: float = float("inf"),
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """One non-streaming request (also the handle API); returns the OpenAI response body.
        Past `deadline` (time.monotonic()) the engine drops it and RequestTimeout is raised."""
        job = await self._job(body, chat, stream=False, deadline=deadline, request_id=request_id)
        try:
            gen = await self._submit(job)
        except asyncio.CancelledError:  # the client hung up (Serve cancels its task)
            job.cancelled = True  # the engine drops it at its next step
            self.counts["hung_up"] += 1  # one still queued never reaches the engine
            raise
        if isinstance(gen, Exception):
            raise gen  # this request alone failed (run_isolated retried it by itself)
        if gen.stats.finish_reason == "cancelled":
            raise RequestTimeout(self._timeout_message())
        await self._log_traffic(job, gen)
        return self._response(job, gen, chat)

    def _timeout_message(self) -> str:
        return (
            f"request: not finished within serve.request_timeout_s={self.request_timeout_s:g} "
            "s; ask for fewer max_tokens or retry later"
        )

    async def _log_traffic(self, job: _Job, gen: Generation) -> None:
        """Append the finished request to the traffic log (serve/traffic.py), fsynced in a
        thread (off the event loop) before the response goes out, so a crash loses only the
        requests in flight; a logging failure costs the record, never the response."""
        if self.traffic is None or job.record is None or job.stopped:
            return  # a request nobody waited for to the end is not traffic to learn from
        st, p = gen.stats, job.params
        try:
            await asyncio.to_thread(self.traffic.append, {
                "time": time.time(), "id": job.id, "replica": self.traffic.replica,
                **job.record, "prompt_ids": list(job.prompt), "completion_ids": list(gen.token_ids),
                "finish_reason": st.finish_reason, "temperature": p.temperature,
                "top_p": p.top_p, "top_k": p.top_k, "max_tokens": p.max_tokens, "seed": p.seed,
                "speculative": job.speculative and self.engine.drafter is not None,
                "drafter": self.drafter_path, "accept_len": st.accept_len,
                "verify_ct": st.spec_verify_ct, "completion_tokens": st.completion_tokens,
            })  # fmt: skip
        except Exception as e:  # noqa: BLE001
            log.error("traffic log: record dropped (%s)", e)

    def _response(self, job: _Job, gen: Generation, chat: bool) -> dict[str, Any]:
        text = self._text(job, gen)
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
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(gen, job.speculative),
        }

    def _usage(self, gen: Generation, speculative: bool) -> dict[str, Any]:
        usage = gen.stats.usage()
        usage["speculative"] = speculative and self.engine.drafter is not None
        usage["drafter"] = self.drafter_digest if usage["speculative"] else None
        return usage

    async def _sse(
        self, job: _Job, chat: bool, include_usage: bool, created: int
    ) -> AsyncIterator[str]:
        """The stream of one request. Its id (from `job.id`) and `created` are the caller's, so
        another attempt at the same request streams the same chat role chunk first."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{job.id[:24]}"
        obj = "chat.completion.chunk" if chat else "text_completion"

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

        task = asyncio.ensure_future(self._submit(job))
        tokens: list[int] = []
        sent = ""
        try:
            if chat:
                yield chunk(None, role=True)
            assert job.queue is not None
            try:
                while (item := await job.queue.get()) is not None:
                    tokens += item
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if text.endswith("\ufffd"):
                        continue  # an incomplete UTF-8 sequence: wait for the next token
                    if job.stops is not None:  # never send what a stop string may claim
                        text = job.stops.streamable(text)
                    if len(text) > len(sent):
                        yield chunk(text[len(sent) :])
                        sent = text
                gen = await task
                if isinstance(gen, Exception):
                    raise gen
                if gen.stats.finish_reason == "cancelled":
                    raise RequestTimeout(self._timeout_message())
            except Exception as e:  # noqa: BLE001 - report inside the stream, headers are gone
                err = {"message": str(e), "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                yield "data: [DONE]\n\n"
                return
            await self._log_traffic(job, gen)
            text = self._text(job, gen)
            yield chunk(text[len(sent) :] or None, finish=gen.stats.finish_reason)
            if include_usage:
                yield chunk(None, usage=self._usage(gen, job.speculative))
            yield "data: [DONE]\n\n"
        finally:  # ended, or the client hung up (Serve cancels the task, or closes us)
            if not task.done():
                job.cancelled = True  # the engine drops it at its next step
                self.counts["hung_up"] += 1

    # -- requests from the router (serve/router.py) ---------------------------------------------
    async def respond(
        self, raw: bytes, chat: bool, timeout_s: float, request_id: str, created: int
    ) -> AsyncIterator[Any]:
        """One HTTP request's answer, streamed to the router (`handle.options(stream=True)`):
        first its head, `{"status", "headers", "body"}` (the whole JSON answer) or, for a
        stream, `{"status": 200, "stream": True, "preamble": n}`, then the stream's SSE events,
        whose first n (a chat's role chunk) another attempt with the same `request_id` and
        `created` repeats byte for byte. The request is stopped `timeout_s` from now (504)."""
        deadline = time.monotonic() + timeout_s
        slot = None
        try:
            try:
                body = await asyncio.to_thread(parse_body, raw)  # 16 MB of JSON: off the loop
                if len(self.slots) >= self.max_running:
                    yield self._busy()
                    return
                slot = _Slot()
                self.slots.add(slot)  # held until the answer ends (the finally below)
                if body.get("stream", False) is not True:
                    try:  # wait_for cancels complete(), which cancels the job (the engine drops it)
                        left = deadline - time.monotonic()
                        out = await asyncio.wait_for(self.complete(body, chat, deadline, request_id), left)  # fmt: skip
                    except TimeoutError:
                        raise RequestTimeout(self._timeout_message()) from None
                    yield {"status": 200, "body": out}
                    return
                job = await self._job(body, chat, stream=True, deadline=deadline, request_id=request_id)  # fmt: skip
            except BadRequest as e:
                yield {"status": e.status, "body": {"error": {"message": str(e), "type": "invalid_request_error"}}}  # fmt: skip
                return
            opts = body.get("stream_options") or {}
            yield {"status": 200, "stream": True, "preamble": 1 if chat else 0}
            async for event in self._sse(job, chat, bool(opts.get("include_usage", False)), created):  # fmt: skip
                yield event
        finally:
            if slot is not None:
                self.slots.discard(slot)

    def _busy(self) -> dict[str, Any]:
        """The head of a 503: more requests run or wait for the engine than it takes soon."""
        return {
            "status": 503,
            "headers": {"Retry-After": str(self.retry_after_s)},
            "body": {"error": {"message": f"server busy: {len(self.slots)} requests run or wait "
                               "for the engine (serve.max_queued_requests); retry after "
                               f"{self.retry_after_s} s", "type": "server_busy"}},
        }  # fmt: skip

    # async: these run on the event loop, never behind requests in a thread pool
    async def models(self) -> dict[str, Any]:
        """`GET /v1/models` (through the router)."""
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "eagle-loop"}],
        }

    async def health(self) -> dict[str, str]:
        """`GET /health` (through the router): this replica's event loop answers."""
        return {"status": "ok"}
