"""The FastAPI app: OpenAI routes, health/readiness, /metrics, and the error JSON of every failure.

`build_app(service, model_name)` wires handlers to an engine service (`EngineService`: the engine on a thread
of this process; `serving.core.client.EngineCoreClient`: the engine core in a process of its own; both give
`submit`, streams, `snapshot`, `health`, `tokenizer`, `model_info`), behind the `Guard` middleware (API keys,
body limits). A request is parsed and checked on the event loop (prompt ids, sampling
parameters against the model's vocabulary and context), its images fetched and decoded on the media worker
pool, then admitted and added by the engine's side in one step (so the queue state admission reads is
current), and its outputs are read from its stream: whole for a plain response, as server-sent events for
`stream=true` (a chunk per generated token, however many tokens an engine output carries). A handler whose
client goes away (a closed stream, or a closed connection while a plain response is being made: a watcher task
sees it at once) aborts its requests, which frees their KV pages.
Every error, the framework's own included (unknown route, wrong method, unparsable body), is OpenAI's JSON.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmjax.serving.engine_loop import QUEUE_TIMEOUT
from mmjax.serving.http import protocol as P
from mmjax.serving.http.chat import parse_messages, render_chat
from mmjax.serving.http.guard import Guard, api_keys
from mmjax.serving.http.media import ImageRef, load_image
from mmjax.serving.http.metrics import CONTENT_TYPE, ServerMetrics
from mmjax.serving.http.protocol import ApiError
from mmjax.serving.http.request_log import RequestLog
from mmjax.serving.http.service import EngineFailed, EngineService
from mmjax.serving.request import RequestError

log = logging.getLogger(__name__)

MAX_LOGGED_FIELD_NAMES = 256  # distinct unknown request fields logged; a client inventing names cannot flood the log
MEDIA_WORKERS = 4  # threads that fetch and decode images
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}  # pydantic's union branch names


class ServerState:
    """What the handlers share: the engine service, tokenizer, metrics, request log, drain flag."""

    def __init__(self, service: EngineService, model_name: str, request_log: RequestLog) -> None:
        self.service = service
        self.model_name = model_name
        self.serve = service.serve
        self.health = service.health
        self.metrics = ServerMetrics(lambda: service.snapshot)
        self.request_log = request_log
        self.active = 0  # HTTP generation requests in flight (streams included until their last byte)
        self.created = int(time.time())
        self.media_pool = concurrent.futures.ThreadPoolExecutor(MEDIA_WORKERS, thread_name_prefix="mmjax-media")
        self.unknown_fields_logged: set[str] = set()

    @property
    def tokenizer(self) -> Any:
        return self.service.tokenizer

    @property
    def model(self) -> Any:
        """`model_cfg`, `max_model_len`, `prepare_image` of the served model (set once the engine is ready)."""
        return self.service.model_info

    @property
    def draining(self) -> bool:
        return self.health.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.health.draining = value

    def note_unknown_fields(self, names: list[str]) -> None:
        """Log each request field this server ignores, once per name (clients send fields newer than ours)."""
        for name in names:
            if name in self.unknown_fields_logged or len(self.unknown_fields_logged) > MAX_LOGGED_FIELD_NAMES:
                continue
            self.unknown_fields_logged.add(name)
            if len(self.unknown_fields_logged) > MAX_LOGGED_FIELD_NAMES:
                log.warning("more than %d distinct unknown request fields: no more are logged", MAX_LOGGED_FIELD_NAMES)
            else:
                log.warning("request field %r is not used by this server: accepted and ignored (logged once per "
                            "field name)", name[:64])


def build_app(service: EngineService, model_name: str, request_log: RequestLog | None = None) -> FastAPI:
    serve = service.serve
    docs = serve.enable_docs
    app = FastAPI(title="mmjax", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    state = ServerState(service, model_name, request_log or RequestLog(None))
    app.state.mmjax = state
    app.add_middleware(Guard, keys=api_keys(serve.api_key), public_paths=serve.public_paths,
                       max_request_bytes=serve.max_request_bytes)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        bad_json = next((err for err in errors if err.get("type") == "json_invalid"), None)
        if bad_json is not None:
            why, where = (bad_json.get("ctx") or {}).get("error", "malformed"), bad_json.get("loc", ("", "?"))[-1]
            return JSONResponse(P.error_body(f"invalid JSON body: {why} at character {where}",
                                             "invalid_request_error"), status_code=400)
        if any(err.get("type") == "model_attributes_type" for err in errors):
            return JSONResponse(P.error_body("invalid JSON body: the request body must be one JSON object",
                                             "invalid_request_error"), status_code=400)
        # a union field reports one error per branch: the range error says more than "not a string"
        first = next((err for err in errors if not str(err.get("type", "")).endswith("_type")),
                     errors[0] if errors else {})
        loc = ".".join(_field_path(first.get("loc", ())))
        return JSONResponse(P.error_body(f"{loc}: {first.get('msg', 'invalid value')}", "invalid_request_error",
                                         param=loc or None), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(raw: Request, e: StarletteHTTPException) -> JSONResponse:
        """The framework's own refusals (unknown route, wrong method, a body it cannot parse) in OpenAI's shape."""
        path = raw.url.path[:100]
        if e.status_code == 404:
            message = f"Invalid URL ({raw.method} {path})"
        elif e.status_code == 405:
            message = f"method {raw.method} is not allowed on {path}"
        elif e.status_code == 400:  # undecodable UTF-8, JSON nested too deeply, ...
            message = "invalid JSON body: it could not be parsed (malformed, not UTF-8, or nested too deeply)"
        else:
            message = e.detail if isinstance(e.detail, str) else f"HTTP {e.status_code}"
        return JSONResponse(P.error_body(message, "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error in a request handler", exc_info=e)
        return JSONResponse(P.error_body("internal server error", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not state.health.live:
            return JSONResponse(P.error_body(state.health.unavailable_reason() or "", "service_unavailable"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        reason = state.health.unavailable_reason()
        if reason is not None:
            return JSONResponse(P.error_body(f"not ready: {reason}", "service_unavailable"), status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        if state.model is None:  # an engine core still loading: its model is not known yet
            raise ApiError(503, state.health.unavailable_reason() or "server not ready", type="service_unavailable",
                           headers={"Retry-After": "5"})
        return JSONResponse(P.model_list(state.model_name, state.created, max_model_len=state.model.max_model_len,
                                          vocab_size=state.model.model_cfg.vocab_size,
                                          image_tokens=0 if state.model.model_cfg.text_only else
                                          state.model.model_cfg.image_tokens))

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatRequest, raw: Request) -> Response:
        return await _generate(state, body, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, raw: Request) -> Response:
        return await _generate(state, body, raw, chat=False)

    return app


# -- one generation request ---------------------------------------------------------------------------------------


def _field_path(loc: Any) -> list[str]:
    """A validation error's location as the client wrote it: no `body` prefix, no pydantic union-branch tags."""
    out = []
    for part in loc:
        text = str(part)
        if text == "body":
            continue
        if "[" in text or text in _TYPE_TAGS or text.startswith("function"):
            break
        out.append(text)
    return out


def _check_available(state: ServerState, sla_class: str) -> None:
    reason = state.health.unavailable_reason()
    if reason is None:
        return
    if state.health.draining and not state.health.failed:
        state.metrics.rejected.labels("draining", sla_class).inc()
    raise ApiError(503, reason, type="service_unavailable", headers={"Retry-After": "5"})


def _prompt(state: ServerState, body: Any, chat: bool) -> tuple[list[int], list[ImageRef]]:
    cfg = state.model.model_cfg
    if chat:
        marker = getattr(state.tokenizer, "image_marker", "<image>")
        turns, images = parse_messages(body.messages, marker, state.serve.max_images_per_request,
                                       state.serve.allowed_local_media_path)
        if images and cfg.text_only:
            raise ApiError(400, "this model is text-only: it takes no images", param="messages")
        return render_chat(state.tokenizer, turns, 0 if cfg.text_only else cfg.image_tokens), images
    if isinstance(body.prompt, str):
        return list(state.tokenizer.encode(body.prompt)), []
    vocab = cfg.vocab_size
    for i, t in enumerate(body.prompt):
        if not 0 <= t < vocab:
            raise ApiError(422, f"prompt[{i}]={t} is not a token id of this model's vocabulary [0, {vocab})",
                           param="prompt")
    return list(body.prompt), []


async def _images(state: ServerState, refs: list[ImageRef]) -> list[Any]:
    """Fetch and decode a request's images on the media pool (never the event loop or the engine thread)."""
    if not refs:
        return []
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(state.media_pool, load_image, ref, state.serve, state.model) for ref in refs]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


def _sampling(state: ServerState, body: Any, n_prompt: int) -> Any:
    max_len = state.model.max_model_len
    vocab = state.model.model_cfg.vocab_size
    if body.top_k > vocab:
        raise ApiError(422, f"top_k={body.top_k} exceeds this model's vocabulary of {vocab} tokens; use at most "
                            f"{vocab} (0 or -1: no top-k cut)", param="top_k")
    if n_prompt >= max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens; the prompt has {n_prompt}",
                       param="messages" if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
    requested = body.requested_max_tokens()
    if requested is not None and n_prompt + requested > max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens; the request has "
                            f"{n_prompt} prompt tokens + max_tokens={requested}; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    logprobs = body.num_logprobs()
    if body.use_beam_search and (logprobs is not None or body.stop):
        raise ApiError(422, "use_beam_search returns neither logprobs nor stops on stop strings (beams end at EOS or "
                            "max_tokens); drop " + ("logprobs" if logprobs is not None else "stop"),
                       param="logprobs" if logprobs is not None else "stop")
    if not body.use_beam_search and (body.best_of or 1) > 1:
        raise ApiError(422, f"best_of={body.best_of} needs use_beam_search=true", param="best_of")
    if (logprobs or 0) > state.serve.max_logprobs:
        raise ApiError(422, f"logprobs={logprobs} exceeds the server's maximum {state.serve.max_logprobs} "
                            "(serve.max_logprobs)", param="top_logprobs" if hasattr(body, "messages") else "logprobs")
    try:
        return body.base_params(requested or max_len - n_prompt, logprobs)
    except RequestError as e:
        raise ApiError(422, str(e)) from None


async def _generate(state: ServerState, body: Any, raw: Request, chat: bool) -> Response:
    arrival = time.monotonic()
    sla = body.sla_class or state.serve.default_sla_class
    _check_available(state, sla)
    if body.model != state.model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")
    state.note_unknown_fields(body.unknown_fields())
    ids, refs = _prompt(state, body, chat)
    params = _sampling(state, body, len(ids))
    images = await _images(state, refs)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    # n choices: n engine requests, or one beam search returning its n best beams
    copies = 1 if body.use_beam_search else body.n
    sub_ids = [f"{rid}-{i}" for i in range(copies)]
    seeds = [None if params.seed is None else params.seed + i for i in range(copies)]
    rows = params.num_beams or copies  # sequences in the engine: what admission budgets
    q: asyncio.Queue = asyncio.Queue()
    service = state.service
    for sub in sub_ids:
        service.open_stream(sub, sla, q)  # one queue for all choices of this HTTP request

    state.active += 1
    handed_off = False
    watcher = None
    try:
        try:
            choices = [(sub, params if seed is None else dataclasses.replace(params, seed=seed))
                       for sub, seed in zip(sub_ids, seeds)]
            decision = await service.submit(ids, images, choices, sla, body.priority, rows)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        except EngineFailed as e:
            raise ApiError(503, str(e), type="service_unavailable") from None
        if not decision.ok:
            state.metrics.rejected.labels(decision.reason, sla).inc()
            raise ApiError(429, decision.message, type="rate_limit_exceeded", code=decision.reason,
                           headers={"Retry-After": decision.retry_after})
        # until a stream is handed to the response (which watches its connection itself), abort on disconnect
        watcher = asyncio.create_task(_watch_disconnect(raw, q, lambda: [service.close_stream(s) for s in sub_ids]))
        gen = _Generation(state, body, rid, sub_ids, ids, q, chat, sla, arrival)
        if body.stream:
            first = await gen.next_output()
            watcher.cancel()
            handed_off = True
            return StreamingResponse(gen.sse(first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await gen.whole())
    finally:
        if watcher is not None:
            watcher.cancel()
        if not handed_off:
            for sub in sub_ids:
                service.close_stream(sub)
            state.active -= 1


_DISCONNECTED = object()  # put in a request's queue when its client closed the connection


async def _watch_disconnect(raw: Request, q: asyncio.Queue, abort: Callable[[], Any]) -> None:
    """Wait for the client to close its connection; then abort the request's choices at once (freeing their
    pages) and wake its handler. The body was read already, so the next ASGI message is the disconnect."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            abort()
            q.put_nowait(_DISCONNECTED)
            return


class _Generation:
    """The outputs of one HTTP request's choices, turned into an OpenAI response or SSE chunks."""

    def __init__(self, state: ServerState, body: Any, rid: str, sub_ids: list[str], prompt_ids: list[int],
                 q: asyncio.Queue, chat: bool, sla: str, arrival: float) -> None:
        self.state, self.body, self.rid, self.chat, self.sla = state, body, rid, chat, sla
        self.q = q
        self.index = {s: i for i, s in enumerate(sub_ids)}
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        n = body.n  # choices: one per engine request, or the n best beams of one
        self.text = [""] * n
        self.logprobs: list[list[tuple[str, float, list[tuple[str, float]]]]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.done: list[bool] = [False] * n
        self.metrics: list[Any] = [None] * n
        self.beam_tokens = 0  # tokens of the returned beams (usage of a beam search)
        self.post_s = [0.0] * n
        self.arrival = arrival  # the HTTP request's, before parsing: end-to-end latency counts from here
        self.streams: list[Any] = [None] * n
        self.lp_offset = [0] * n  # a streamed choice's text_offset: its logprob entries' text so far

    async def next_output(self) -> Any:
        """The next engine output of any choice; raises ApiError when the request failed, None on disconnect."""
        item = await self.q.get()
        if item is _DISCONNECTED:
            return None
        if isinstance(item, EngineFailed):
            raise ApiError(500, str(item), type="server_error", code="engine_failed")
        if isinstance(item, Exception):
            log.error("a request's stream ended with an error", exc_info=item)
            raise ApiError(500, "internal server error", type="server_error")
        out, stream = item
        self.streams[self.index[out.request_id]] = stream
        if out.finished and out.finish_reason == "error":  # a step failed because of this request's values
            raise ApiError(500, f"the engine could not serve this request: {out.error}", type="server_error",
                           code="engine_error")
        stream_error = stream.error if out.finished else None
        if stream_error == QUEUE_TIMEOUT:
            self.state.metrics.rejected.labels(QUEUE_TIMEOUT, self.sla).inc()
            raise ApiError(429, f"request waited longer than serve.max_queue_wait_s={self.state.serve.max_queue_wait_s}"
                                "s for its first step; retry later", type="rate_limit_exceeded", code=QUEUE_TIMEOUT,
                           headers={"Retry-After": str(max(1, int(self.state.serve.max_queue_wait_s)))})
        if stream_error == "oom":
            raise ApiError(503, "the engine ran out of device memory on this request's step; retry",
                           type="service_unavailable", headers={"Retry-After": "1"})
        return out

    def _absorb(self, out: Any) -> int:
        """Record one engine output; returns its choice index (a finished beam search fills every choice)."""
        i = self.index[out.request_id]
        t0 = time.perf_counter()
        if self.body.use_beam_search and out.finished:
            tok = self.state.tokenizer
            beams = out.beams or [(list(out.token_ids), 0.0)]  # an aborted search has no beams
            for j in range(len(self.text)):
                tokens = beams[j][0] if j < len(beams) else []
                self.text[j] = tok.decode(tokens)
                ended = any(t in tok.stop_ids for t in tokens)
                self.finish[j] = "stop" if ended else (out.finish_reason if not out.beams else "length")
                self.done[j], self.metrics[j] = True, out.metrics
                self.beam_tokens += len(tokens)
            self.post_s[i] += time.perf_counter() - t0
            return i
        self.text[i] += out.new_text
        if out.logprobs and self._num_logprobs() is not None:
            decode = self.state.tokenizer.decode
            for lp in out.logprobs:
                self.logprobs[i].append((decode([lp.token]), float(lp.logprob),
                                         [(decode([a]), float(b)) for a, b in zip(lp.top_ids, lp.top_logprobs)]))
        self.post_s[i] += time.perf_counter() - t0
        self.metrics[i] = out.metrics  # the latest, so a choice the client abandons still logs its timings
        if out.finished:
            self.done[i] = True
            self.finish[i] = out.finish_reason
        return i

    def _num_logprobs(self) -> int | None:
        return self.body.num_logprobs()

    def _choice_logprobs(self, entries: list, offset: int = 0) -> Any:
        if self._num_logprobs() is None:
            return None
        return P.chat_logprobs(entries) if self.chat else P.completion_logprobs(entries, offset)

    def _usage(self) -> dict[str, Any]:
        gen = self.beam_tokens if self.body.use_beam_search else sum(
            m.num_generated_tokens for m in self.metrics if m is not None)
        cached = max((m.num_cached_prompt_tokens for m in self.metrics if m is not None), default=0)
        return P.usage(len(self.prompt_ids), gen, cached)

    def _finish_reason(self, i: int) -> str:
        return self.finish[i] if self.finish[i] in ("stop", "length") else "stop"

    def _record_undone(self, status: int) -> None:
        for i, d in enumerate(self.done):
            if not d:
                self._record(i, status=status)
                self.done[i] = True

    def _record(self, i: int, status: int = 200) -> None:
        """Metrics and the request-log line of choice i (once, when it finished or was abandoned)."""
        m = self.metrics[i]
        now = time.monotonic()
        rec: dict[str, Any] = {"request_id": f"{self.rid}-{i}", "sla_class": self.sla, "priority": self.body.priority,
                               "user": self.body.user,
                               "status": status, "finish_reason": self.finish[i] or "abort",
                               "prompt_tokens": len(self.prompt_ids), "e2e_s": now - self.arrival}
        if m is not None:
            rec.update(cached_tokens=m.num_cached_prompt_tokens, generated_tokens=m.num_generated_tokens,
                       queue_s=m.queue_s, ttft_s=m.time_to_first_token_s, prefill_s=m.prefill_s, decode_s=m.decode_s,
                       postprocess_s=m.detokenize_s + self.post_s[i], preemptions=m.num_preemptions)
        s = self.streams[i]
        self.state.metrics.observe_finished(self.sla, rec, s.itl if s is not None else [])
        self.state.request_log.write(rec)

    # -- whole response -------------------------------------------------------------------------------------------

    async def whole(self) -> dict[str, Any]:
        while True:
            try:
                out = await self.next_output()
            except ApiError as e:
                self._record_undone(e.status)
                raise
            if out is None:  # client went away: its choices were aborted already
                self._record_undone(499)
                return {}
            i = self._absorb(out)
            if self.done[i]:
                self._record(i)
            if all(self.done):
                break
        choices = []
        for i in range(len(self.text)):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i],
                                                        "refusal": None, "tool_calls": []},
                                "logprobs": self._choice_logprobs(self.logprobs[i]),
                                "finish_reason": self._finish_reason(i)})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": self._choice_logprobs(self.logprobs[i]),
                                "finish_reason": self._finish_reason(i)})
        make = P.chat_response if self.chat else P.completion_response
        return make(self.rid, self.state.model_name, self.created, choices, self._usage())

    # -- server-sent events ---------------------------------------------------------------------------------------

    async def sse(self, first: Any) -> AsyncIterator[bytes]:
        state = self.state
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        make = _chunk_maker(P.chunk(self.rid, state.model_name, self.created, self.chat, [],
                                    with_usage_key=include_usage))
        try:
            async for chunk in self._chunks(first, make, include_usage):
                yield chunk
        except ApiError as e:  # the engine failed, or a step could not serve this request: say so, then end
            self._record_undone(e.status)
            yield _sse(e.body())
            yield b"data: [DONE]\n\n"
        finally:
            for sub in self.index:
                state.service.close_stream(sub)
            self._record_undone(499)  # client closed the connection
            state.active -= 1

    async def _chunks(self, first: Any, make: Callable[..., bytes], include_usage: bool) -> AsyncIterator[bytes]:
        if self.chat:
            yield b"".join(make([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]) for i in range(len(self.text)))
        out = first
        while out is not None and self.body.use_beam_search:  # its beams arrive whole, at the end
            i = self._absorb(out)
            if not self.done[i]:
                out = await self.next_output()
                continue
            for j, text in enumerate(self.text):
                fin = self._finish_reason(j)
                yield make([{"index": j, "delta": {"content": text}, "logprobs": None, "finish_reason": fin}
                            if self.chat else {"index": j, "text": text, "logprobs": None, "finish_reason": fin}])
            self._record(i)
            out = None
        while out is not None:
            before = len(self.logprobs[self.index[out.request_id]])
            i = self._absorb(out)
            t0 = time.perf_counter()
            events = self._token_events(i, out, self.logprobs[i][before:], make)
            self.post_s[i] += time.perf_counter() - t0
            if events:
                yield events  # one write for all of the output's tokens
            if self.done[i]:
                self._record(i)
            if all(self.done):
                break
            out = await self.next_output()
        if include_usage:
            yield make([], self._usage())
        yield b"data: [DONE]\n\n"

    def _token_events(self, i: int, out: Any, entries: list, make: Callable[..., bytes]) -> bytes:
        """The SSE events of one engine output of choice i, one chunk per token: each carries the text its token
        released and, with logprobs, that token's entry. A token whose text is held back (or empty) has no
        chunk of its own without logprobs (its text comes with a later token's); finish_reason goes on the
        output's last chunk once the choice is done."""
        pieces = out.pieces or ([(out.new_token_ids, out.new_text)] if out.new_token_ids or out.new_text else [])
        parts, k = [], 0
        for ids, text in pieces:
            lps, k = entries[k:k + len(ids)], k + len(ids)
            if text or lps:
                parts.append((text, lps))
        if self.done[i] and not parts:
            parts.append(("", []))
        events = []
        for n, (text, lps) in enumerate(parts):
            lp = self._choice_logprobs(lps, self.lp_offset[i])
            self.lp_offset[i] += sum(len(t) for t, _, _ in lps)
            fin = self._finish_reason(i) if self.done[i] and n == len(parts) - 1 else None
            choice = ({"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": fin}
                      if self.chat else {"index": i, "text": text, "logprobs": lp, "finish_reason": fin})
            events.append(make([choice]))
        return b"".join(events)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps builds an encoder per call with options


def _dumps(obj: Any) -> str:
    return _COMPACT.encode(obj)


def _chunk_maker(envelope: dict[str, Any]) -> Callable[..., bytes]:
    """`make(choices, usage=None)`: the SSE event of a chunk of `envelope` (its id, model, created; `choices`
    empty). A stream sends a chunk per token, so the envelope is serialised once and each event only adds
    its choices' JSON; a usage chunk is serialised whole."""
    head, tail = _dumps(envelope).split('"choices":[]', 1)  # JSON strings escape quotes: the key itself
    head_b, tail_b = b"data: " + head.encode() + b'"choices":[', b"]" + tail.encode() + b"\n\n"

    def make(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        if usage is not None:
            return _sse({**envelope, "choices": choices, "usage": usage})
        return head_b + ",".join(_dumps(c) for c in choices).encode() + tail_b
    return make
