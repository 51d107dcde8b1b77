"""The OpenAI wire format: request bodies (validated by msgspec), the errors the API answers with, and the JSON of
responses and stream chunks. No I/O here; `engine.api_server` does the serving.

Extras beyond OpenAI's fields: `top_k`, `ignore_eos`, and an SLO per request (`slo: {"ttft_ms", "tpot_ms"}` or
`slo_tier: "name"` in the body, or the headers x-slo-ttft-ms + x-slo-tpot-ms, or x-slo-tier).

Logprobs (chat `logprobs` + `top_logprobs`, completions `logprobs: k`, both up to 20 alternatives) are those of the
model's own distribution, before temperature, top-k and top-p (vLLM's default); the legacy object's top_logprobs
also holds the chosen token. Completions `echo` sends the prompt back first, and with `logprobs` its tokens' too (the
first one's null). `n` parallel samples share the prompt's KV blocks (`engine.api_server`); with a seed, sample i
draws from a seed derived from it. Fields that would change the output and are not implemented (`UNSUPPORTED`,
tools and tool messages among them) are refused with a 400 naming them; other unknown fields are ignored.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Mapping

import msgspec

from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from engine.structured_output import JSON_OBJECT, JSON_SCHEMA, StructuredOutput
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


class JsonSchemaBody(msgspec.Struct):
    name: str | None = None  # OpenAI requires it; it names the schema and changes nothing here
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar holds the output to the schema whatever this says
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaBody | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does for most."""
    model: str | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None  # what torch generators take
    stop: str | list[str] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1  # parallel samples of the prompt, each one choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    slo: SLOBody | None = None
    slo_tier: str | None = None
    response_format: ResponseFormat | None = None
    # Fields that would change the output and that this server does not implement: any value but a harmless one
    # is refused by `decode_body`, naming the field (`UNSUPPORTED`). Declared so that they are seen at all.
    logit_bias: Any = msgspec.UNSET
    presence_penalty: Any = msgspec.UNSET
    frequency_penalty: Any = msgspec.UNSET
    repetition_penalty: Any = msgspec.UNSET  # vLLM's extras from here on
    min_p: Any = msgspec.UNSET
    min_tokens: Any = msgspec.UNSET
    use_beam_search: Any = msgspec.UNSET


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list  # a string, token ids, or a batch of one of either (checked in `prompt_of`)
    max_tokens: PositiveInt = 16  # OpenAI's default for completions
    # the chosen token's log-probability and this many alternatives per token (OpenAI allows 5)
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False  # the prompt comes back before the completion, with its logprobs when they are asked
    best_of: Any = msgspec.UNSET
    suffix: Any = msgspec.UNSET


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: Any = msgspec.UNSET  # refused unless empty: no tool calling


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # with logprobs only
    tools: Any = msgspec.UNSET
    tool_choice: Any = msgspec.UNSET
    functions: Any = msgspec.UNSET
    function_call: Any = msgspec.UNSET
    audio: Any = msgspec.UNSET
    modalities: Any = msgspec.UNSET
    prediction: Any = msgspec.UNSET
    reasoning_effort: Any = msgspec.UNSET
    web_search_options: Any = msgspec.UNSET


MAX_N = 128  # as OpenAI
# field -> the values of it that change nothing; any other value is refused with a 400 naming the field
UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "min_tokens": (None, 0), "use_beam_search": (None, False),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # -> template's


def decode_body(raw: bytes, kind: type[msgspec.Struct]):
    """The request of one endpoint, checked: what it cannot be (types, ranges) and what this server does not do
    (`UNSUPPORTED`, best_of other than n, tool messages)."""
    try:
        req = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request body: {e}", "invalid_field") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", "invalid_json") from None
    for name, harmless in UNSUPPORTED.items():
        value = getattr(req, name, msgspec.UNSET)
        if value is not msgspec.UNSET and value not in harmless:
            raise bad_request(f"{name} is not supported by this server", "unsupported_field")
    if isinstance(req, CompletionRequest) and req.best_of not in (msgspec.UNSET, None, req.n):
        raise bad_request(f"best_of is not supported by this server (other than equal to n, {req.n})",
                          "unsupported_field")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "invalid_field")
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise bad_request(f"messages[{i}]: role {m.role!r} is not supported (one of "
                                  f"{', '.join(CHAT_ROLES)}; this server does no tool calling)", "invalid_field")
            if m.tool_calls not in (msgspec.UNSET, None, []):
                raise bad_request(f"messages[{i}]: tool_calls is not supported by this server", "unsupported_field")
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
        out.append({"role": CHAT_ROLES[m.role], "content": content})
    return out


def structured_output_of(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The structured output `response_format` asks for; None for free text."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == JSON_OBJECT:
        return StructuredOutput(JSON_OBJECT)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", "invalid_field")
    return StructuredOutput(JSON_SCHEMA, msgspec.json.encode(fmt.json_schema.schema).decode())


def sampling_params_of(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    if isinstance(req, CompletionRequest):
        logprobs, top_logprobs = req.logprobs is not None, req.logprobs or 0
        prompt_logprobs = req.echo and logprobs
    else:
        logprobs, top_logprobs, prompt_logprobs = req.logprobs, req.top_logprobs or 0, False
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            max_tokens=max_tokens, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=structured_output_of(req))
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


Alternatives = list[tuple[str, float]]  # a position's most likely tokens as text, with their log-probabilities


def completion_logprobs(tokens: list[str], logprobs: list[float | None], top: list[Alternatives | None],
                        text_offset: list[int]) -> dict:
    """OpenAI's legacy logprobs object. A position's top_logprobs maps token text to log-probability: its
    alternatives and the chosen token (up to logprobs + 1 entries, as OpenAI's); null, with a null logprob, for an
    echoed prompt's first token, which nothing predicts."""
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [None if alts is None else {**dict(alts), t: lp}
                             for t, lp, alts in zip(tokens, logprobs, top)],
            "text_offset": text_offset}


def chat_logprobs(tokens: list[str], logprobs: list[float], top: list[Alternatives]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alts]}
                        for t, lp, alts in zip(tokens, logprobs, top)]}


class ResponseWriter:
    """Builds the bodies of one request's response, completion or chat, whole or as stream chunks."""

    __slots__ = ("request_id", "model", "chat", "created")

    def __init__(self, request_id: str, model: str, chat: bool):
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, choices: list[tuple[str, str, dict | None]], usage_: dict) -> bytes:
        """choices: (text, finish reason, logprobs object) of each, in index order."""
        if self.chat:
            body = self._envelope("chat.completion", [
                {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": finish_reason} for i, (text, finish_reason, logprobs) in enumerate(choices)])
        else:
            body = self._envelope("text_completion", [
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                for i, (text, finish_reason, logprobs) in enumerate(choices)])
        body["usage"] = usage_
        return msgspec.json.encode(body)

    def chunk(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool = False,
              index: int = 0) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or finish_reason is None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            body = self._envelope("text_completion", [{"index": index, "text": text, "logprobs": logprobs,
                                                       "finish_reason": finish_reason}])
        return sse(msgspec.json.encode(body))

    def usage_chunk(self, usage_: dict) -> bytes:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_
        return sse(msgspec.json.encode(body))


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
