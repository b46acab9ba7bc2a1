"""The messages between the API process and the engine-core process: small typed structs, msgpack on the wire.

Token ids cross, never text; images cross as decoded float arrays (dtype, shape, raw bytes), never PNG bytes;
weights never cross (the core loads the model itself). Each struct is a msgpack extension type of its own code,
so a message decodes back into the same struct (nested ones included) without a schema step. The one pickled
field is `Ready.model`: the model config and tokenizer the core loaded, sent once at start-up to the process
that spawned it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

_NDARRAY = 1  # extension code of a numpy array; the structs take 2, 3, ...


@dataclasses.dataclass
class AddRequests:
    """API -> core: one HTTP request's choices (same prompt and images), admitted together or refused together."""

    ticket: int  # the reply's key
    request_ids: list[str]
    prompt_token_ids: list[int]
    images: list[np.ndarray]  # the encoder's float arrays, decoded and preprocessed in the API process
    params: list[dict[str, Any]]  # SamplingParams fields per choice, stop strings removed (the API side applies them)
    sla_class: str
    priority: int
    rows: int  # sequences the engine will run (beams or choices): what admission budgets
    max_tokens: int


@dataclasses.dataclass
class Abort:
    """API -> core: stop these requests (client gone, or a stop string found in their text)."""

    request_ids: list[str]


@dataclasses.dataclass
class Shutdown:
    """API -> core: leave the loop and exit 0."""


@dataclasses.dataclass
class Reply:
    """core -> API: what became of an `AddRequests` (admission's decision, or why the request is invalid)."""

    ticket: int
    ok: bool
    reason: str = ""  # admission's refusal reason (queue_full, token_budget, ttft, queue_wait)
    message: str = ""
    retry_after_s: float = 0.0
    predicted_wait_s: float | None = None
    invalid: str = ""  # the engine refused the request (RequestError's message): a 400


@dataclasses.dataclass
class CoreOutput:
    """What one step produced for one request: new token ids, and once finished, why."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None  # finish_reason "error": why a step could not serve this request
    logprobs: list[list[Any]]  # per new token: [token, logprob, top_ids, top_logprobs]
    metrics: list[Any]  # RequestMetrics' fields, in order
    beams: list[list[Any]]  # beam search: [token ids, score] of the n best
    stream_error: str | None = None  # the core ended it: queue_timeout, oom


@dataclasses.dataclass
class StepOutputs:
    """core -> API: every request one step touched, and the engine's gauges after it (for /metrics)."""

    outputs: list[CoreOutput]
    stats: dict[str, Any]
    step_s: float  # the step's duration (admission's step-time estimate lives in the core)


@dataclasses.dataclass
class Ready:
    """core -> API: warm-up done. `model` pickles {model_cfg, max_model_len, tokenizer} (see the module doc)."""

    model: bytes
    compiles: int


@dataclasses.dataclass
class CoreFailed:
    """core -> API: the core cannot go on (sent just before it exits 1). `cause` is safe to show to clients."""

    reason: str  # logged
    cause: str


_STRUCTS: tuple[type, ...] = (AddRequests, Abort, Shutdown, Reply, CoreOutput, StepOutputs, Ready, CoreFailed)
_CODES = {cls: code for code, cls in enumerate(_STRUCTS, start=2)}
_CLASSES = {code: cls for cls, code in _CODES.items()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _STRUCTS}


def _default(obj: Any) -> Any:
    code = _CODES.get(type(obj))
    if code is not None:
        return msgpack.ExtType(code, _pack([getattr(obj, name) for name in _FIELDS[type(obj)]]))
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, _pack([a.dtype.str, list(a.shape), a.data]))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot send a {type(obj).__name__} to the engine core")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype, shape, raw = unpack(data)
        return np.frombuffer(raw, np.dtype(dtype)).reshape(shape)
    cls = _CLASSES.get(code)
    if cls is None:
        return msgpack.ExtType(code, data)
    return cls(*unpack(data))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def pack(message: Any) -> bytes:
    """One message (a struct above) -> bytes."""
    return _pack(message)


def unpack(data: bytes) -> Any:
    """bytes -> the struct that was packed (numpy arrays come back read-only, sharing the buffer)."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
