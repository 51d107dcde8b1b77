"""The OpenAI-compatible HTTP API, shared by both entry points: `build_app(backend)` serves whatever implements
`Backend` (one engine in-process: `engine.engine_backend.EngineBackend`; the cluster router: `RouterBackend`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (whole or server-sent events), GET /v1/models,
GET /health, GET /metrics. A client that disconnects aborts its request (the handler is cancelled, which closes the
backend's output iterator).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
import uuid
from typing import AsyncIterator, Protocol

from aiohttp import web

from engine.engine import InvalidRequestError, RequestOutput
from engine.metrics import ServerMetrics
from engine.openai_protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, ResponseWriter,
                                    SLOSpec, bad_request, chat_logprobs, completion_logprobs, decode_body,
                                    error_body, messages_of, prompt_of, sampling_params_of, slo_spec_of, sse,
                                    usage)
from engine.sampling_params import SamplingParams
from engine.serving import NoInstanceError, QueueFullError, freeze_startup_heap
from engine.tokenizer import Tokenizer
from scheduler.attainment import measure_request
from scheduler.slo import SLO

log = logging.getLogger(__name__)


# ---- what the HTTP layer serves from --------------------------------------------------------------------------
class Backend(Protocol):
    model_name: str  # the `model` clients name; /v1/models lists it
    max_model_len: int  # context length: prompt + output tokens
    tokenizer: Tokenizer | None  # the model's (chat template, token counts); None: token-id prompts only, no chat

    @property
    def ready(self) -> bool:
        """Can take requests now (/health answers 200, else 503)."""
        ...

    async def start(self) -> None:
        """Called once when the app starts, on its event loop."""
        ...

    async def stop(self) -> None:
        """Called once when the app shuts down."""
        ...

    def bind_metrics(self, metrics: ServerMetrics) -> None:
        """Called once by `build_app`, before `start`. The backend records on `metrics` what only it sees:
        observe_queue_time(tier, s), observe_batch(instance, num_seqs), observe_step(instance, duration_s,
        kv_usage, num_running, num_waiting), set_instances(tier, n), forget_instance(instance)."""
        ...

    def slo_for(self, spec: SLOSpec, num_prompt_tokens: int, max_tokens: int) -> tuple[str, SLO]:
        """(tier name, SLO to hold the request to) for a tier name, an SLO of the request's own, or None (the
        default tier). Raises InvalidRequestError for an unknown tier or an SLO no instance could meet even idle."""
        ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: str, slo: SLO,
                 arrival: float) -> AsyncIterator[RequestOutput]:
        """One request's outputs as they are produced, under the tier and SLO `slo_for` made concrete; `arrival`
        is time.monotonic() when the HTTP request came in.

        Admission happens on the first `__anext__`, which raises InvalidRequestError (400), or engine.serving's
        QueueFullError (429) or NoInstanceError (503). Each output's `new_token_ids` and `new_text` are what it
        adds; `logprobs`, when `params.logprobs`, holds the chosen-token log-probabilities of all output tokens so
        far. The last output has `finished` set; `finish_reason` "error" with `error` set means the request failed
        after admission.
        Closing the iterator before the last output (`aclose`) aborts the request and frees what it holds."""
        ...


# ---- app ------------------------------------------------------------------------------------------------------------
BACKEND = web.AppKey("backend", Backend)
METRICS = web.AppKey("metrics", ServerMetrics)
DEFAULT_MAX_BODY_BYTES = 4 << 20


def build_app(backend: Backend, *, client_max_size: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The aiohttp app over `backend`, with a metrics registry of its own. Serve it with `start_site`,
    `ServerThread` or `serve_forever`, which cancel a handler whose client disconnects."""
    metrics = ServerMetrics()
    app = web.Application(client_max_size=client_max_size, middlewares=[_errors])
    app[BACKEND], app[METRICS] = backend, metrics
    backend.bind_metrics(metrics)
    app.on_startup.append(lambda app: backend.start())
    app.on_cleanup.append(lambda app: backend.stop())
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def _error_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI error body; counts answers by endpoint and status."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    try:
        response = await handler(request)
    except APIError as e:
        response = _error_response(e.status, e.body(), e.headers)
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body over client_max_size
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status, "http_error")
        response = _error_response(e.status, error_body(e.text or e.reason, "invalid_request_error", code))
    except Exception as e:
        log.exception("unhandled error serving %s", request.path)
        response = _error_response(500, error_body(f"internal error: {type(e).__name__}: {e}", "server_error",
                                                   "internal_error"))
    request.app[METRICS].http_requests.labels(endpoint, str(response.status)).inc()
    return response


async def _models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    return web.json_response({"object": "list", "data": [{
        "id": backend.model_name, "object": "model", "created": 0, "owned_by": "polyserve",
        "max_model_len": backend.max_model_len}]})


async def _health(request: web.Request) -> web.Response:
    if request.app[BACKEND].ready:
        return web.json_response({"status": "ok"})
    raise APIError(503, "no instance is ready", "no_instance", "service_unavailable")


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


# ---- one generation request -----------------------------------------------------------------------------------------
class _Progress:
    """What a request has produced so far, as this server received it: tokens, their receive times, the finish."""

    __slots__ = ("emit_times", "token_ids", "logprobs_sent", "finish_reason")

    def __init__(self):
        self.emit_times: list[float] = []
        self.token_ids: list[int] = []
        self.logprobs_sent = 0  # tokens whose logprobs went out already
        self.finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.emit_times.extend([time.monotonic()] * len(out.new_token_ids))
        self.token_ids.extend(out.new_token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason

    def take_logprobs(self, out: RequestOutput, tokenizer: Tokenizer | None, chat: bool) -> dict | None:
        """The logprobs object for the tokens received since the last call; None when none were asked for."""
        if out.logprobs is None:
            return None
        start, end = self.logprobs_sent, len(self.token_ids)
        self.logprobs_sent = end
        ids = self.token_ids[start:end]
        tokens = [tokenizer.decode([t]) for t in ids] if tokenizer is not None else [str(t) for t in ids]
        values = list(out.logprobs[start:end])
        return chat_logprobs(tokens, values) if chat else completion_logprobs(tokens, values)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    backend, metrics = request.app[BACKEND], request.app[METRICS]
    req = decode_body(await request.read(), ChatCompletionRequest if chat else CompletionRequest)
    if req.model is not None and req.model != backend.model_name:
        raise APIError(404, f"model {req.model!r} is not served here; this server serves {backend.model_name!r}",
                       "model_not_found")
    prompt_ids = _prompt_ids(backend, req, chat)
    room = backend.max_model_len - len(prompt_ids)
    if room < 1:
        raise bad_request(f"prompt of {len(prompt_ids)} tokens leaves no room for output in the context length of "
                          f"{backend.max_model_len} tokens", "context_length_exceeded")
    max_tokens = (req.max_completion_tokens or req.max_tokens or room) if chat else req.max_tokens
    if max_tokens > room:
        raise bad_request(f"prompt of {len(prompt_ids)} tokens plus max_tokens {max_tokens} exceeds the context "
                          f"length of {backend.max_model_len} tokens", "context_length_exceeded")
    params = sampling_params_of(req, max_tokens)
    try:
        tier, slo = backend.slo_for(slo_spec_of(req, request.headers), len(prompt_ids), max_tokens)
    except InvalidRequestError as e:
        raise bad_request(str(e), "invalid_slo") from None

    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = backend.generate(request_id, prompt_ids, params, tier, slo, arrival)
    async with contextlib.aclosing(outputs):
        try:
            first = await anext(outputs)
        except InvalidRequestError as e:
            raise bad_request(str(e)) from None
        except QueueFullError as e:
            raise APIError(429, str(e), "queue_full", "rate_limit_error",
                           headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
        except NoInstanceError as e:
            raise APIError(503, str(e), "no_instance", "service_unavailable") from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        writer = ResponseWriter(request_id, backend.model_name, chat)
        progress = _Progress()
        try:
            if req.stream and first.finish_reason != "error":  # an error before anything was sent: a plain 500
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                return await _stream(request, backend.tokenizer, writer, outputs, first, progress,
                                     len(prompt_ids), include_usage)
            return await _whole(backend.tokenizer, writer, outputs, first, progress, len(prompt_ids))
        finally:  # also when the client went away (the handler is cancelled): that request ends as an abort
            _record(metrics, tier, slo, arrival, progress)


def _prompt_ids(backend: Backend, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> list[int]:
    tokenizer = backend.tokenizer
    if chat:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
        messages = messages_of(req)
        try:
            return tokenizer.apply_chat_template(messages)
        except Exception as e:  # the template rejects what it cannot render (roles, order): the client's input
            raise bad_request(f"messages do not fit the model's chat template: {e}", "invalid_messages") from None
    prompt = prompt_of(req)
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as a list of token ids")
    return tokenizer.encode(prompt)


async def _whole(tokenizer: Tokenizer | None, writer: ResponseWriter, outputs: AsyncIterator[RequestOutput],
                 out: RequestOutput, progress: _Progress, num_prompt_tokens: int) -> web.Response:
    text = []
    while True:
        progress.add(out)
        text.append(out.new_text)
        if out.finished:
            break
        out = await anext(outputs)
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error}", "engine_error", "server_error")
    body = writer.whole("".join(text), out.finish_reason, progress.take_logprobs(out, tokenizer, writer.chat),
                        usage(num_prompt_tokens, len(progress.token_ids)))
    return web.Response(body=body, content_type="application/json")


async def _stream(request: web.Request, tokenizer: Tokenizer | None, writer: ResponseWriter,
                  outputs: AsyncIterator[RequestOutput], out: RequestOutput, progress: _Progress,
                  num_prompt_tokens: int, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    first = True
    try:
        while True:
            progress.add(out)
            if out.finish_reason == "error":
                await response.write(sse(error_body(f"generation failed: {out.error}", "server_error",
                                                    "engine_error")))
                break
            if out.new_text or out.finished or (first and writer.chat):
                await response.write(writer.chunk(out.new_text, out.finish_reason if out.finished else None,
                                                  progress.take_logprobs(out, tokenizer, writer.chat), first))
                first = False
            if out.finished:
                if include_usage:
                    await response.write(writer.usage_chunk(usage(num_prompt_tokens, len(progress.token_ids))))
                break
            out = await anext(outputs)
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream; leaving closes `outputs`, which aborts the request
        log.info("client of %s disconnected mid-stream", writer.request_id)
    return response


def _record(metrics: ServerMetrics, tier: str, slo: SLO, arrival: float, progress: _Progress) -> None:
    reason = progress.finish_reason or "abort"
    metrics.generation_tokens.inc(len(progress.token_ids))
    finished = progress.finish_reason in ("stop", "length") and progress.emit_times
    latency = measure_request(slo, arrival, progress.emit_times) if finished else None
    gaps = [b - a for a, b in zip(progress.emit_times, progress.emit_times[1:])] if finished else []
    metrics.observe_finished(tier, latency, gaps, reason)


# ---- serving --------------------------------------------------------------------------------------------------------
async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts serving `app` (port 0: a free one); returns the runner (`await runner.cleanup()` stops) and the
    bound port. Handlers are cancelled when their client disconnects, which aborts the request."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


async def serve_forever(app: web.Application, host: str, port: int) -> None:
    """Serves until SIGINT or SIGTERM, then shuts the app (and its backend) down. Call from the main thread."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner, bound = await start_site(app, host, port)
    freeze_startup_heap()
    log.info("serving on http://%s:%d", host, bound)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


class ServerThread:
    """Serves an app from a thread with its own event loop: for tests, benchmarks and notebooks."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-server", daemon=True)
        self._thread.start()
        try:
            self._runner, self.port = self.call(start_site(app, host, port))
        except BaseException:
            self._stop_loop()
            raise
        self.url = f"http://{host}:{self.port}"

    def call(self, coro, timeout: float | None = 60.0):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self._runner.cleanup())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
