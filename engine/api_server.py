"""The OpenAI-compatible HTTP API, shared by both entry points: `build_app(backend)` serves whatever implements
`Backend` (one engine in-process: `engine.engine_backend.EngineBackend`; the cluster router: `RouterBackend`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (whole or server-sent events), GET /v1/models,
GET /health, GET /metrics. A client that disconnects aborts its request (the handler is cancelled, which closes the
backend's output iterator). With an API key, every endpoint but /health (and /metrics, if left open) wants
`Authorization: Bearer <key>`. A request body is decoded, templated and tokenized on a worker thread, never on the
event loop that streams everyone's tokens; so is the detokenizing and JSON of an answer whose logprobs or echoed
prompt cover many tokens.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import logging
import math
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Protocol, TypeVar

from aiohttp import web

from engine.engine import InvalidRequestError, RequestOutput
from engine.metrics import ServerMetrics
from engine.openai_protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, ResponseWriter,
                                    SLOSpec, bad_request, chat_logprobs, completion_logprobs, decode_body,
                                    error_body, messages_of, prompt_of, sampling_params_of, slo_spec_of, sse,
                                    usage)
from engine.sampler import TopLogprobs
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
        far, and `top_logprobs` their alternatives when `params.top_logprobs`; `prompt_logprobs` and
        `prompt_top_logprobs`, when `params.prompt_logprobs`, the prompt's, complete from the first output on.
        The last output has `finished` set; `finish_reason` "error" with `error` set means the request failed
        after admission.
        Closing the iterator before the last output (`aclose`) aborts the request and frees what it holds."""
        ...


# ---- app ------------------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Access:
    """Who may call: anyone (no key), or whoever sends the key; /health is always open, /metrics where told."""
    api_key: bytes | None
    metrics_open: bool = False

    def guards(self, path: str) -> bool:
        return self.api_key is not None and path != "/health" and not (self.metrics_open and path == "/metrics")

    def admits(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        # compared in constant time: how long a refusal takes must not tell how much of a guess was right
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


BACKEND = web.AppKey("backend", Backend)
METRICS = web.AppKey("metrics", ServerMetrics)
ACCESS = web.AppKey("access", Access)
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
PARSERS = web.AppKey("parsers", concurrent.futures.ThreadPoolExecutor)
DEFAULT_MAX_BODY_BYTES = 4 << 20
# Tokenizers run outside the GIL, so a few threads let small requests pass a big one being tokenized.
PARSER_THREADS = 4
# A chunk or answer that detokenizes more token positions than this (an echoed prompt, logprobs of many tokens at
# once) is built on a worker thread: its detokenizing and JSON take time in proportion, which the event loop that
# streams everyone's tokens must not spend. Fewer are built in place, where a thread hop would cost more than they.
INLINE_POSITIONS = 64


def build_app(backend: Backend, *, client_max_size: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
              metrics_open: bool = False) -> web.Application:
    """The aiohttp app over `backend`, with a metrics registry of its own. Serve it with `start_site`,
    `ServerThread` or `serve_forever`, which cancel a handler whose client disconnects. `api_key` (None or empty:
    none) is what clients must send as `Authorization: Bearer <key>`; `metrics_open` leaves /metrics open."""
    metrics = ServerMetrics()
    app = web.Application(client_max_size=client_max_size, middlewares=[_errors, _authorize, _body_limit])
    app[BACKEND], app[METRICS] = backend, metrics
    app[ACCESS] = Access(api_key.encode() if api_key else None, metrics_open)
    app[MAX_BODY_BYTES] = client_max_size
    app[PARSERS] = concurrent.futures.ThreadPoolExecutor(PARSER_THREADS, thread_name_prefix="http-parse")
    backend.bind_metrics(metrics)
    app.on_startup.append(lambda app: backend.start())
    app.on_cleanup.append(lambda app: backend.stop())
    app.on_cleanup.append(_stop_parsers)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _stop_parsers(app: web.Application) -> None:
    app[PARSERS].shutdown(wait=False, cancel_futures=True)


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


@web.middleware
async def _authorize(request: web.Request, handler) -> web.StreamResponse:
    access = request.app[ACCESS]
    if access.guards(request.path) and not access.admits(request.headers.get("Authorization")):
        given = "Authorization" in request.headers
        raise APIError(401, "incorrect API key" if given else "no API key: send it as `Authorization: Bearer <key>`",
                       "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


@web.middleware
async def _body_limit(request: web.Request, handler) -> web.StreamResponse:
    """Refuses a body over the limit by its Content-Length, before reading any of it (aiohttp's own check, for a
    body without one, reads up to the limit first)."""
    limit, length = request.app[MAX_BODY_BYTES], request.content_length
    if length is not None and length > limit:
        raise APIError(413, f"maximum request body size of {limit} bytes exceeded: this one has {length}",
                       "request_too_large")
    return await handler(request)


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
@dataclass(slots=True)
class _Echo:
    """A completion's prompt, sent back before its output (`echo`); with logprobs, its tokens' too."""
    text: str
    token_ids: list[int]
    logprobs: list[float | None] | None = None  # None for the first token: nothing predicts it
    top_logprobs: list[TopLogprobs | None] | None = None


def _token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def _echo_text(tokenizer: Tokenizer | None, req: CompletionRequest, prompt_ids: list[int]) -> str:
    prompt = prompt_of(req)
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt_ids) if tokenizer is not None else ""


_T = TypeVar("_T")


async def _built(pool: concurrent.futures.Executor, positions: int, build: Callable[..., _T], *args) -> _T:
    """`build(*args)`, which detokenizes `positions` token positions: in place when they are few, else on a worker
    thread. What a build writes (how much of a choice's logprobs went out) only the next build of that choice reads,
    and the caller awaits each before the next."""
    if positions <= INLINE_POSITIONS:
        return build(*args)
    return await asyncio.get_running_loop().run_in_executor(pool, build, *args)


class _Progress:
    """What one choice has produced so far, as this server received it: tokens, their receive times, the finish;
    and what of it went out already (logprobs, the echoed prompt)."""

    __slots__ = ("emit_times", "token_ids", "logprobs_sent", "finish_reason", "echo", "text_offset")

    def __init__(self, echo: _Echo | None = None):
        self.emit_times: list[float] = []
        self.token_ids: list[int] = []
        self.logprobs_sent = 0  # tokens whose logprobs went out already
        self.finish_reason: str | None = None
        self.echo = echo  # until it is sent
        self.text_offset = 0  # characters of the choice's tokens sent so far: the legacy logprobs' text_offset

    def add(self, out: RequestOutput) -> None:
        self.emit_times.extend([time.monotonic()] * len(out.new_token_ids))
        self.token_ids.extend(out.new_token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason

    def take_echo(self) -> _Echo | None:
        """The prompt to send before this choice's first text, once."""
        echo, self.echo = self.echo, None
        return echo

    def positions_to_send(self, out: RequestOutput, echo: _Echo | None) -> int:
        """Token positions the next `take_logprobs(out, ..., echo)` detokenizes, or whose text `echo` carries."""
        pending = len(self.token_ids) - self.logprobs_sent if out.logprobs is not None else 0
        return pending + (len(echo.token_ids) if echo is not None else 0)

    def take_logprobs(self, out: RequestOutput, tokenizer: Tokenizer | None, chat: bool,
                      echo: _Echo | None = None) -> dict | None:
        """The logprobs object for the tokens received since the last call, after `echo`'s prompt tokens; None
        when none were asked for."""
        if out.logprobs is None:
            return None
        start, end = self.logprobs_sent, len(self.token_ids)
        self.logprobs_sent = end
        tokens = [_token_text(tokenizer, t) for t in self.token_ids[start:end]]
        values: list[float | None] = list(out.logprobs[start:end])
        tops = out.top_logprobs[start:end] if out.top_logprobs is not None else [[]] * len(tokens)
        alternatives = [[(_token_text(tokenizer, t), v) for t, v in top] for top in tops]
        if chat:
            return chat_logprobs(tokens, values, alternatives)
        if echo is not None and echo.logprobs is not None:
            prompt_tops = echo.top_logprobs or [None] + [[]] * (len(echo.token_ids) - 1)
            tokens = [_token_text(tokenizer, t) for t in echo.token_ids] + tokens
            values = list(echo.logprobs) + values
            alternatives = [None if top is None else [(_token_text(tokenizer, t), v) for t, v in top]
                            for top in prompt_tops] + alternatives
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return completion_logprobs(tokens, values, alternatives, offsets)


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The SamplingParams of each of n parallel samples. A seeded request's samples draw from seeds derived from
    its seed (the first keeps it): they differ, and they reproduce. Only the first computes the prompt's
    logprobs, which every choice echoes."""
    return [params] + [replace(params, prompt_logprobs=False,
                               seed=None if params.seed is None else (params.seed + i * SEED_STRIDE) % (1 << 63))
                       for i in range(1, n)]


SEED_STRIDE = 0x9E3779B97F4A7C15  # the golden-ratio increment: consecutive derived seeds share no low bits


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A backend request's first output: its admission, or the answer that refuses it."""
    try:
        return await anext(outputs)
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None
    except QueueFullError as e:
        raise APIError(429, str(e), "queue_full", "rate_limit_error",
                       headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
    except NoInstanceError as e:
        raise APIError(503, str(e), "no_instance", "service_unavailable") from None


class _Choices:
    """The n parallel samples of one request, each a backend request of its own (`<id>-<i>` when n > 1). The first
    is admitted alone; when its first output is back its prompt is computed and its full KV blocks are in the
    prefix cache, and the others, admitted then, share those blocks instead of computing the prompt again (on the
    router, when they are placed on the same instance). `async with` it: leaving closes every stream, which aborts
    the samples still running."""

    def __init__(self, backend: Backend, request_id: str, prompt_ids: list[int], params: list[SamplingParams],
                 tier: str, slo: SLO, arrival: float):
        ids = [request_id] if len(params) == 1 else [f"{request_id}-{i}" for i in range(len(params))]
        self.streams = [backend.generate(rid, prompt_ids, p, tier, slo, arrival) for rid, p in zip(ids, params)]
        self.firsts: list[RequestOutput] = []
        self._ready: deque[tuple[int, RequestOutput]] = deque()
        self._pending: dict[asyncio.Future, int] = {}  # n > 1: the next output of each sample still running
        self._single_running = False  # n == 1: read directly, no task per token

    async def __aenter__(self) -> "_Choices":
        return self

    async def __aexit__(self, *exc) -> None:
        for future in self._pending:
            future.cancel()
        if self._pending:
            await asyncio.wait(self._pending)
        for stream in self.streams:
            await stream.aclose()

    async def start(self) -> None:
        """Admits every sample, or raises the APIError that refuses one (the others are then closed on leaving)."""
        self.firsts = [await _first(self.streams[0])]
        rest = await asyncio.gather(*(_first(s) for s in self.streams[1:]), return_exceptions=True)
        for r in rest:
            if isinstance(r, BaseException):
                raise r
        self.firsts += rest
        self._ready.extend(enumerate(self.firsts))
        if len(self.streams) == 1:
            self._single_running = not self.firsts[0].finished
        else:
            for i, out in enumerate(self.firsts):
                if not out.finished:
                    self._pending[asyncio.ensure_future(anext(self.streams[i]))] = i

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any sample, with the sample's index; None when every sample has finished."""
        if self._ready:
            return self._ready.popleft()
        if len(self.streams) == 1:
            if not self._single_running:
                return None
            out = await anext(self.streams[0])
            self._single_running = not out.finished
            return 0, out
        if not self._pending:
            return None
        done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        for future in sorted(done, key=self._pending.__getitem__):
            i = self._pending.pop(future)
            out = future.result()
            self._ready.append((i, out))
            if not out.finished:
                self._pending[asyncio.ensure_future(anext(self.streams[i]))] = i
        return self._ready.popleft()


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    backend, metrics = request.app[BACKEND], request.app[METRICS]
    body = await request.read()
    req, prompt_ids = await asyncio.get_running_loop().run_in_executor(request.app[PARSERS], _parse, backend, body,
                                                                       chat)
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
    pool = request.app[PARSERS]
    async with _Choices(backend, request_id, prompt_ids, _choice_params(params, req.n), tier, slo,
                        arrival) as choices:
        await choices.start()
        metrics.prompt_tokens.inc(len(prompt_ids))
        writer = ResponseWriter(request_id, backend.model_name, chat)
        echo = None
        if not chat and req.echo:
            text = await _built(pool, len(prompt_ids), _echo_text, backend.tokenizer, req, prompt_ids)
            first = choices.firsts[0]  # the one sample that computed the prompt's logprobs, when asked
            echo = _Echo(text, prompt_ids, first.prompt_logprobs, first.prompt_top_logprobs)
        progress = [_Progress(echo) for _ in choices.streams]
        try:
            # an error before anything was sent: a plain 500
            if req.stream and all(out.finish_reason != "error" for out in choices.firsts):
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                return await _stream(request, pool, backend.tokenizer, writer, choices, progress, len(prompt_ids),
                                     include_usage)
            return await _whole(pool, backend.tokenizer, writer, choices, progress, len(prompt_ids))
        finally:  # also when the client went away (the handler is cancelled): those requests end as aborts
            for p in progress:
                _record(metrics, tier, slo, arrival, p)


def _parse(backend: Backend, body: bytes, chat: bool) -> tuple[CompletionRequest | ChatCompletionRequest, list[int]]:
    """The request and its prompt's token ids: what a worker thread does for `_serve`."""
    req = decode_body(body, ChatCompletionRequest if chat else CompletionRequest)
    if req.model is not None and req.model != backend.model_name:
        raise APIError(404, f"model {req.model!r} is not served here; this server serves {backend.model_name!r}",
                       "model_not_found")
    return req, _prompt_ids(backend, req, chat)


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
    limit = backend.max_model_len
    if (at_least := tokenizer.min_num_tokens(prompt)) >= limit:
        raise bad_request(f"prompt of at least {at_least} tokens leaves no room for output in the context length "
                          f"of {limit} tokens", "context_length_exceeded")
    return tokenizer.encode(prompt)


async def _whole(pool: concurrent.futures.Executor, tokenizer: Tokenizer | None, writer: ResponseWriter,
                 choices: _Choices, progress: list[_Progress], num_prompt_tokens: int) -> web.Response:
    texts: list[list[str]] = [[] for _ in progress]
    last: list[RequestOutput | None] = [None] * len(progress)
    while (item := await choices.next()) is not None:
        i, out = item
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed: {out.error}", "engine_error", "server_error")
        progress[i].add(out)
        texts[i].append(out.new_text)
        last[i] = out
    echoes = [p.take_echo() for p in progress]

    def build() -> bytes:
        bodies = [((echo.text if echo else "") + "".join(text), out.finish_reason,
                   p.take_logprobs(out, tokenizer, writer.chat, echo))
                  for p, text, out, echo in zip(progress, texts, last, echoes)]
        return writer.whole(bodies, usage(num_prompt_tokens, sum(len(p.token_ids) for p in progress)))

    positions = sum(p.positions_to_send(out, echo) for p, out, echo in zip(progress, last, echoes))
    return web.Response(body=await _built(pool, positions, build), content_type="application/json")


def _chunk(writer: ResponseWriter, progress: _Progress, out: RequestOutput, tokenizer: Tokenizer | None,
           echo: _Echo | None, first: bool, index: int) -> bytes:
    """The stream chunk of one choice's output `out`, after `echo`'s prompt when it is the choice's first."""
    return writer.chunk((echo.text if echo else "") + out.new_text, out.finish_reason if out.finished else None,
                        progress.take_logprobs(out, tokenizer, writer.chat, echo), first, index)


async def _stream(request: web.Request, pool: concurrent.futures.Executor, tokenizer: Tokenizer | None,
                  writer: ResponseWriter, choices: _Choices, progress: list[_Progress], num_prompt_tokens: int,
                  include_usage: bool) -> web.StreamResponse:
    """Every choice's chunks as they come, each with its index; the usage chunk once all have finished."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    first = [True] * len(progress)
    try:
        while (item := await choices.next()) is not None:
            i, out = item
            p = progress[i]
            p.add(out)
            if out.finish_reason == "error":
                await response.write(sse(error_body(f"generation failed: {out.error}", "server_error",
                                                    "engine_error")))
                break
            if out.new_text or out.finished or (first[i] and (writer.chat or p.echo is not None)):
                echo = p.take_echo()
                await response.write(await _built(pool, p.positions_to_send(out, echo), _chunk, writer, p, out,
                                                  tokenizer, echo, first[i], i))
                first[i] = False
        else:
            if include_usage:
                await response.write(writer.usage_chunk(usage(num_prompt_tokens,
                                                              sum(len(p.token_ids) for p in progress))))
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
    if app[ACCESS].api_key is None and not _is_loopback(host):
        log.warning("serving on %s without an API key: anyone who reaches it may use it (set --api-key)", host)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost, or "" (every interface)
        return False


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
