"""The OpenAI wire format: request bodies (validated by msgspec), the errors the API answers with, and the JSON of
responses and stream chunks. No I/O here; `engine.api_server` does the serving.

Extras beyond OpenAI's fields: `top_k`, `ignore_eos`, and an SLO per request (`slo: {"ttft_ms", "tpot_ms"}` or
`slo_tier: "name"` in the body, or the headers x-slo-ttft-ms + x-slo-tpot-ms, or x-slo-tier).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Mapping

import msgspec

from engine.sampling_params import SamplingParams
from scheduler.slo import SLO

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class APIError(Exception):
    """An answer other than success: HTTP status, OpenAI error type and code, and a message naming the problem."""

    def __init__(self, status: int, message: str, code: str, type: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type: str, code: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type, "param": None, "code": code}})


def bad_request(message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code)


# ---- request bodies -----------------------------------------------------------------------------------------------
class SLOBody(msgspec.Struct):
    ttft_ms: Annotated[float, msgspec.Meta(gt=0)]
    tpot_ms: Annotated[float, msgspec.Meta(gt=0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does for most."""
    model: str | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None  # what torch generators take
    stop: str | list[str] | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    slo: SLOBody | None = None
    slo_tier: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list  # a string, token ids, or a batch of one of either (checked in `prompt_of`)
    max_tokens: PositiveInt = 16  # OpenAI's default for completions
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False  # chosen tokens' only: top_logprobs come back empty


def decode_body(raw: bytes, kind: type[msgspec.Struct]):
    try:
        req = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request body: {e}", "invalid_field") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", "invalid_json") from None
    if req.n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {req.n}", "invalid_field")
    return req


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids (a batch of one is unwrapped)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request, got a batch of {len(prompt)}", "invalid_field")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "invalid_field")
        return prompt
    if not prompt:
        raise bad_request("prompt is empty", "invalid_field")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request("prompt must be a string or a list of integer token ids", "invalid_field")
    return prompt


def messages_of(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them: role and text content (text parts joined)."""
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise bad_request(f"messages[{i}]: only text content parts are supported", "invalid_field")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


def sampling_params_of(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    logprobs = req.logprobs is not None if isinstance(req, CompletionRequest) else req.logprobs
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            max_tokens=max_tokens, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs)
    except ValueError as e:
        raise bad_request(str(e), "invalid_field") from None


SLOSpec = str | SLO | None  # a tier name, an SLO of the request's own, or None for the default tier


def slo_spec_of(req: CompletionRequest | ChatCompletionRequest, headers: Mapping[str, str]) -> SLOSpec:
    """The SLO the client asked for, from at most one of: body `slo`, body `slo_tier`, x-slo-* headers."""
    ttft_h, tpot_h, tier_h = (headers.get(f"x-slo-{k}") for k in ("ttft-ms", "tpot-ms", "tier"))
    given = [name for name, v in (("body field slo", req.slo), ("body field slo_tier", req.slo_tier),
                                  ("x-slo-ttft-ms/x-slo-tpot-ms headers", ttft_h or tpot_h),
                                  ("x-slo-tier header", tier_h)) if v is not None]
    if len(given) > 1:
        raise bad_request(f"give the SLO once; got {' and '.join(given)}", "invalid_slo")
    if req.slo is not None:
        return SLO(ttft_ms=req.slo.ttft_ms, tpot_ms=req.slo.tpot_ms)
    if req.slo_tier is not None or tier_h is not None:
        return req.slo_tier if req.slo_tier is not None else tier_h
    if ttft_h is None and tpot_h is None:
        return None
    if ttft_h is None or tpot_h is None:
        raise bad_request("x-slo-ttft-ms and x-slo-tpot-ms go together; one of them is missing", "invalid_slo")
    try:
        return SLO(ttft_ms=float(ttft_h), tpot_ms=float(tpot_h))
    except ValueError:
        raise bad_request(f"x-slo-ttft-ms and x-slo-tpot-ms must be positive numbers of milliseconds, "
                          f"got {ttft_h!r} and {tpot_h!r}", "invalid_slo") from None


# ---- responses ----------------------------------------------------------------------------------------------------
def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """OpenAI's legacy logprobs object, chosen tokens only (no alternatives: top_logprobs is null)."""
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


class ResponseWriter:
    """Builds the bodies of one request's response, completion or chat, whole or as stream chunks."""

    __slots__ = ("request_id", "model", "chat", "created")

    def __init__(self, request_id: str, model: str, chat: bool):
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, text: str, finish_reason: str, logprobs: dict | None, usage_: dict) -> bytes:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": logprobs,
                                                       "finish_reason": finish_reason}])
        body["usage"] = usage_
        return msgspec.json.encode(body)

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or finish_reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": logprobs,
                                                       "finish_reason": finish_reason}])
        return sse(msgspec.json.encode(body))

    def usage_chunk(self, usage_: dict) -> bytes:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_
        return sse(msgspec.json.encode(body))


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
