"""OpenAI request bodies (pydantic) and response shapes, and the error JSON every failure returns.

Requests are validated here (field types, and ranges within what the engine's arrays hold: int32 integers,
finite float32 numbers; FastAPI answers 422 naming the field) before they reach the engine; the bounds that
depend on the served model (vocabulary, context) are checked by the app. `base_params` maps a body onto
`SamplingParams`. Fields a body carries that no model here declares are accepted (OpenAI clients send new
ones) and listed by `unknown_fields`, for the app to log once per name. Responses are plain dicts in OpenAI's
shapes so the official client parses them unchanged.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmjax.errors import MmjaxError
from mmjax.serving.request import INT32_MAX, MAX_LOGPROBS, SamplingParams

SlaClass = Literal["interactive", "batch"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's `seed` is an int64
MAX_STOP_STRINGS = 16


class ApiError(MmjaxError):
    """A request the server refuses: an HTTP status, an OpenAI error type and a one-line message."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's, vLLM's extras, ours)."""

    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use (e.g. `metadata`)

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)  # vLLM extra; 0 or -1 = off; at most the vocabulary (app)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=1e-6, le=1e6, allow_inf_nan=False)  # a float32 divisor: never 0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # choice i draws with seed + i
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # written to the request log
    ignore_eos: bool = False
    priority: int = Field(0, ge=-1000, le=1000)  # lower = more urgent, within the SLA class
    sla_class: SlaClass | None = None  # default: serve.default_sla_class
    # vLLM extras for beam search (Hugging Face semantics): the n best of best_of beams, one engine request
    use_beam_search: bool = False
    best_of: int | None = Field(None, ge=1, le=16)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0, allow_inf_nan=False)  # an exponent of the length
    early_stopping: bool | Literal["never"] = False

    def unknown_fields(self) -> list[str]:
        """Names of the body's fields this server does not use (accepted, not acted on)."""
        return sorted(self.model_extra or ())

    def base_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.use_beam_search:  # deterministic: temperature 0 unless the client sent another (then refused)
            temperature = float(self.temperature) if "temperature" in self.model_fields_set else 0.0
            return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=float(self.top_p),
                                  top_k=max(int(self.top_k), 0), min_p=float(self.min_p),
                                  presence_penalty=float(self.presence_penalty),
                                  frequency_penalty=float(self.frequency_penalty),
                                  repetition_penalty=float(self.repetition_penalty), stop=tuple(stop),
                                  ignore_eos=bool(self.ignore_eos), use_beam_search=True, n=self.n,
                                  best_of=self.best_of, length_penalty=float(self.length_penalty),
                                  early_stopping=self.early_stopping)
        return SamplingParams(max_tokens=max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
                              top_k=max(int(self.top_k), 0), min_p=float(self.min_p),
                              presence_penalty=float(self.presence_penalty),
                              frequency_penalty=float(self.frequency_penalty),
                              repetition_penalty=float(self.repetition_penalty), stop=tuple(stop), seed=self.seed,
                              logprobs=logprobs, ignore_eos=bool(self.ignore_eos))


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    def num_logprobs(self) -> int | None:
        return self.logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    """OpenAI chat logprobs: one entry per token, (token text, logprob, top [(text, logprob)])."""
    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists, top lists as {token: logprob}."""
    offsets, pos = [], offset
    for text, _, _ in entries:
        offsets.append(pos)
        pos += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


def chat_response(rid: str, model: str, created: int, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_, "system_fingerprint": None}


def completion_response(rid: str, model: str, created: int, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_, "system_fingerprint": None}


def chunk(rid: str, model: str, created: int, chat: bool, choices: list[dict[str, Any]],
          usage_: dict[str, Any] | None = None, with_usage_key: bool = False) -> dict[str, Any]:
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": choices, "system_fingerprint": None}
    if usage_ is not None or with_usage_key:
        out["usage"] = usage_
    return out


def model_list(name: str, created: int, **card: Any) -> dict[str, Any]:
    """The served model's card; `card` adds vLLM's `max_model_len` and the like."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mmjax",
                                        **card}]}
