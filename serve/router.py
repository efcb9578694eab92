"""The embedded engine's HTTP front: a thin Serve ingress in front of the engine's replicas
(serve/deployment.py `SpecServer`), so that a replica's death loses no request (issue 58).

Why a router of our own: Ray Serve 2.60 sends a request to another replica only while routing it
(a replica that refuses it, or is found dead before it accepts: `_route_and_send_request_once`
in ray/serve/_private/router.py). Once a replica holds the request, its death reaches the proxy
as an ActorDiedError and the client gets a bare 500 (`get_http_response_status` in
ray/serve/_private/http_util.py); Serve has no setting for more. So this router:
- reads the body (408 past `serve.body_timeout_s`, 413 over the size cap: serve/validation.py)
  and hands the raw bytes to a replica through a DeploymentHandle (`SpecServer.respond`: a
  stream whose first item is the answer's head, the whole answer for a non-streamed request);
- when that replica dies (RayActorError) before any token went out, sends the request again
  (`ATTEMPTS` in all): Serve routes it to another replica, or holds it until the replacement
  is up. A chat stream's role chunk, already sent, comes again byte for byte from the next
  attempt (same id, same `created`) and is skipped;
- otherwise answers with a retryable error, never a bare 500: a 503 with `Retry-After`, or in a
  stream that already sent tokens an error event `{"error": {"type": "server_unavailable",
  "code": 503, "retry_after": s}}` and `[DONE]`.
The request's id (one per HTTP request, the same in every attempt) is the response's `id` and
the traffic record's, so a record written by an attempt whose answer was then lost, and again
by the retry, is read once (serve/traffic.py `read_traffic`); an attempt that died mid-way
wrote none (a replica writes a record only once its answer is complete).

The router holds no model, reserves no CPU and imports no torch. A replica's own errors (a bug:
RayTaskError) are not retried: the proxy answers 500 as before.
"""

# No `from __future__ import annotations` here: FastAPI must see real types (Request) on the
# ingress methods that Serve re-binds, or it answers 422.
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve.startup import grpc_on_loopback
from serve.validation import BadRequest, BodyTimeout, read_body

log = logging.getLogger("ray.serve")

# A request is sent to a replica at most twice: a request whose second replica dies under it
# too is likelier the cause than the victim, and is not sent on to kill a third.
ATTEMPTS = 2
UNAVAILABLE = "server_unavailable"  # the error type of a retryable answer (503, stream event)
GRACE_S = 5.0  # the replica answers 504 itself at the deadline; the router waits this much longer

app = FastAPI()


@dataclass
class _Call:
    """One HTTP request, across its attempts."""

    raw: bytes
    chat: bool
    id: str  # the response's `id` and the traffic record's, the same in every attempt
    created: int  # a stream's `created`, the same in every attempt
    deadline: float  # time.monotonic() past which the request is answered 504
    attempts: int = 0


def _error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = {"error": {"message": message, "type": kind}}
    return JSONResponse(body, status_code=status, headers=headers)


@serve.deployment(
    name="Router", max_ongoing_requests=256, graceful_shutdown_timeout_s=5,
    ray_actor_options={"num_cpus": 0},
)  # fmt: skip
@serve.ingress(app)
class Router:
    def __init__(self, engine: DeploymentHandle, options: dict[str, Any]):
        grpc_on_loopback()
        self.engine = engine
        self.streams = engine.options(stream=True)
        self.body_timeout_s = float(options["body_timeout_s"])
        self.request_timeout_s = float(options["request_timeout_s"])
        self.retry_after_s = int(options["retry_after_s"])
        # for tests and probes: attempts sent again after their replica died; requests answered
        # 503 (or a stream's retryable error event) because their replica died
        self.counts = {"retried": 0, "unavailable": 0}

    # -- HTTP -------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return await self._unary("models")

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return await self._unary("health")  # a replica's event loop answers, not only ours

    @app.get("/drafter")
    async def drafter(self) -> dict[str, Any]:
        return await self._unary("public_drafter_info")

    # -- the handle API (tests, scripts): the engine's, its replica's death retried ------------
    async def complete(self, body: dict[str, Any], chat: bool = True) -> dict[str, Any]:
        return await self._unary("complete", body, chat, float("inf"), uuid.uuid4().hex)

    async def drafter_info(self) -> dict[str, Any]:
        return await self._unary("drafter_info")

    def router_info(self) -> dict[str, int]:
        return dict(self.counts)

    async def _unary(self, method: str, *args: Any) -> Any:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return await getattr(self.engine, method).remote(*args)
            except RayActorError as e:
                if attempt == ATTEMPTS:
                    raise
                log.warning("a replica died under %s (%s); sending it again", method, e)
        raise AssertionError("unreachable")

    # -- requests ---------------------------------------------------------------------------
    async def _http(self, request: Request, chat: bool):
        try:
            read = read_body(request.stream(), request.headers.get("content-length"))
            raw = await asyncio.wait_for(read, self.body_timeout_s)
        except TimeoutError:
            s = self.body_timeout_s
            msg = f"body: not received within serve.body_timeout_s={s:g} s; send the whole request at once"  # fmt: skip
            return _error(BodyTimeout.status, msg, "invalid_request_error")
        except BadRequest as e:
            return _error(e.status, str(e), "invalid_request_error")
        deadline = time.monotonic() + self.request_timeout_s
        call = _Call(raw, chat, uuid.uuid4().hex, int(time.time()), deadline)
        try:
            head, gen = await self._head(call)
        except TimeoutError:
            return _error(504, f"request: no replica answered within serve.request_timeout_s="
                          f"{self.request_timeout_s:g} s; retry later", "invalid_request_error")  # fmt: skip
        except BackPressureError:  # every replica holds max_ongoing_requests, its queue is full
            return self._busy()
        if head is None:
            return self._unavailable()
        if not head.get("stream"):
            return JSONResponse(head["body"], status_code=head["status"], headers=head.get("headers"))  # fmt: skip
        return StreamingResponse(self._relay(call, gen, int(head["preamble"])), media_type="text/event-stream")  # fmt: skip

    async def _head(self, call: _Call) -> tuple[dict[str, Any] | None, DeploymentResponseGenerator | None]:  # fmt: skip
        """The head of the first attempt whose replica answers (one that dies is sent again),
        and the rest of that answer; (None, None) when the last attempt's replica died too."""
        while call.attempts < ATTEMPTS:
            call.attempts += 1
            left = call.deadline - time.monotonic()
            gen = self.streams.respond.remote(call.raw, call.chat, left, call.id, call.created)
            try:
                return await asyncio.wait_for(gen.__anext__(), max(0.0, left) + GRACE_S), gen
            except RayActorError as e:
                self._died(call, e)
            except BaseException:  # the client left (cancelled), a timeout: the replica drops it
                gen.cancel()
                raise
        return None, None

    def _died(self, call: _Call, e: RayActorError) -> None:
        again = call.attempts < ATTEMPTS
        self.counts["retried" if again else "unavailable"] += 1
        log.warning("request %s: its replica died (attempt %d of %d), %s: %s", call.id,
                    call.attempts, ATTEMPTS, "sending it again" if again else "answering 503",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)  # fmt: skip

    async def _relay(
        self, call: _Call, gen: DeploymentResponseGenerator, preamble: int
    ) -> AsyncIterator[str]:
        """A stream's events; when its replica dies before any event past the `preamble` went
        out, the next attempt's (its repeated preamble skipped), else a retryable error event."""
        sent, skip = 0, 0
        try:
            while True:
                try:
                    async for event in gen:
                        if skip:
                            skip -= 1
                            continue
                        sent += 1
                        yield event
                    return
                except RayActorError as e:
                    if sent > preamble:  # tokens went out: the client must ask again
                        call.attempts = ATTEMPTS
                    self._died(call, e)
                if call.attempts >= ATTEMPTS:
                    break
                try:
                    head, gen = await self._head(call)
                except (TimeoutError, BackPressureError):
                    head = None
                if head is None or not head.get("stream"):  # died, or refused (busy, timeout)
                    break
                skip = sent
            yield self._unavailable_event(sent - preamble)
        finally:  # ended, or the client left: a replica still at it drops the request
            if gen is not None:
                gen.cancel()

    # -- retryable answers --------------------------------------------------------------------
    def _busy(self) -> JSONResponse:
        # Serve refuses (BackPressureError) when every replica holds max_ongoing_requests and
        # max_queued_requests more wait for them: both knobs set this bound
        return _error(503, "server busy: every replica holds serve.max_ongoing_requests and "
                      "serve.max_queued_requests more wait; retry after "
                      f"{self.retry_after_s} s", "server_busy", self.retry_after_s)  # fmt: skip

    def _unavailable(self) -> JSONResponse:
        return _error(503, f"the replicas that took this request stopped under it ({ATTEMPTS} "
                      f"attempts); retry after {self.retry_after_s} s", UNAVAILABLE,
                      self.retry_after_s)  # fmt: skip

    def _unavailable_event(self, events_sent: int) -> str:
        msg = (f"the replica serving this stream stopped after {max(events_sent, 0)} token "
               f"event(s) went out; send the request again after {self.retry_after_s} s")  # fmt: skip
        err = {"message": msg, "type": UNAVAILABLE, "code": 503, "retry_after": self.retry_after_s}
        return f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n"
