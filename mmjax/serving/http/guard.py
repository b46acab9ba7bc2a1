"""ASGI middleware in front of the app: API keys, then the request-body limit and content type.

It runs before any route reads a byte of the body. With keys configured (`serve.api_key`, comma-separated, plus
the `MMJAX_API_KEY` environment variable), every route outside `serve.public_paths` needs
`Authorization: Bearer <key>` (401 otherwise). A body whose declared `Content-Length` exceeds
`serve.max_request_bytes` gets 413 before any of it is read; a chunked body is read up to the limit and no
further. A body that is not JSON (`Content-Type` other than application/json or +json) gets 415. Every
refusal is OpenAI's error JSON. The body read here is handed on to the app unchanged, and later `receive`
calls go through to the server, so a handler still learns when its client disconnects.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from mmjax.serving.http.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

API_KEY_ENV = "MMJAX_API_KEY"


def api_keys(setting: str, environ: MutableMapping[str, str] | None = None) -> tuple[str, ...]:
    """The accepted keys: `serve.api_key` and `$MMJAX_API_KEY`, each a comma-separated list (blanks dropped)."""
    env = os.environ if environ is None else environ
    keys = [k.strip() for text in (setting, env.get(API_KEY_ENV, "")) for k in text.split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


class Guard:
    """Authentication and body limits for an ASGI app (see the module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, keys: Iterable[str], public_paths: Iterable[str],
                 max_request_bytes: int) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.public_paths = frozenset(public_paths)
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.keys and scope["path"] not in self.public_paths:
            refusal = self._check_key(headers.get("authorization"))
            if refusal is not None:
                await _reply(send, 401, refusal, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._body(headers, receive, send)
            if receive is None:
                return
        await self.app(scope, receive, send)

    def _check_key(self, authorization: str | None) -> str | None:
        """None when the header carries an accepted key, else the 401's message (which never quotes the key)."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "missing API key: send it in the header `Authorization: Bearer <key>`"
        given = token.strip().encode()
        if not any([hmac.compare_digest(given, key) for key in self.keys]):  # every key compared: constant time
            return "incorrect API key provided"
        return None

    async def _body(self, headers: dict[str, str], receive: Receive, send: Send) -> Receive | None:
        """Read the body within the limit and return a `receive` that replays it; None once a refusal was sent."""
        limit = self.max_request_bytes
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type and content_type != "application/json" and not content_type.endswith("+json"):
            await _reply(send, 415, "the request body must be JSON: send Content-Type: application/json",
                         code="unsupported_media_type")
            return None
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reply(send, 400, "invalid Content-Length header")
                return None
            if int(declared) > limit:
                await _reply(send, 413, _too_large(limit), code="request_too_large")
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return _replay([], message, receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, _too_large(limit), code="request_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return _replay(chunks, None, receive)


def _too_large(limit: int) -> str:
    return f"request body larger than the server's limit of {limit} bytes (serve.max_request_bytes)"


def _replay(chunks: list[bytes], last: Message | None, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body as one message (or the disconnect seen while reading it),
    then defers to the server's."""
    pending: list[Message] = [last] if last is not None else [
        {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


async def _reply(send: Send, status: int, message: str, *, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if status == 413:
        raw.append((b"connection", b"close"))  # the rest of the body is never read
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
