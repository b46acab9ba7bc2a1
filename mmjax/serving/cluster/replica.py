"""One engine replica: the single server's engine thread and FastAPI app, driven in-process by the ingress.

The replica builds exactly what `python -m mmjax.serve` builds (`load_served`, `EngineService`, `build_app`), so
every endpoint, error, admission decision and metric is the single server's. `handle_http` runs one HTTP request
through that app as ASGI and streams back its response: first the status and headers, then the body chunks.
The ingress's retry rule rests on that order: nothing is sent before the app has produced its first byte.
A client that goes away (Ray cancels this generator) is a disconnect to the app, which aborts the request.

`__init__` returns once warm-up compiled every bucket, so Ray routes to a replica only when it is ready;
`check_health` fails once the engine failed (Ray then replaces the replica); `record_routing_stats` hands the
router the replica's load and the ingress its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from mmjax.parallel.distributed import configure_backend
from mmjax.serving.cluster.spec import EngineSpec
from mmjax.serving.http.app import build_app
from mmjax.serving.http.request_log import RequestLog
from mmjax.serving.http.service import EngineService
from mmjax.serving.served_model import load_served

READY_TIMEOUT_S = 1800.0  # warm-up of a large model on a slow host; Ray's own start-up timeout still applies
DISCONNECT_GRACE_S = 5.0  # after the client went away: time for the app to abort the request and return


class EngineReplica:
    """A Ray Serve replica holding one engine (see the module docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        cfg = spec.config()
        configure_backend(cfg)
        served = load_served(cfg, spec.checkpoint, model=spec.model, random_init=spec.random_init,
                             overrides=spec.overrides)
        self.service = EngineService(served.engine, cfg.serve, tokenizer=served.tokenizer)
        self.app = build_app(self.service, served.name, RequestLog(cfg.serve.request_log or None))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.service.start()
        if not self.service.ready.wait(READY_TIMEOUT_S) or self.service.failed:
            raise RuntimeError(f"engine replica did not become ready: {self.service.failed or 'warm-up timed out'}")

    async def handle_http(self, request: dict[str, Any], route: dict[str, Any]) -> AsyncIterator[Any]:
        """Stream one HTTP request's response: {"status", "headers", "replica"} first, then body bytes.
        `request`: method, path, query (bytes), headers (pairs of str), body (bytes). `route` is the router's."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": request["method"], "scheme": "http", "path": request["path"],
                 "raw_path": request["path"].encode(), "query_string": request.get("query", b""), "root_path": "",
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
                 "client": request.get("client"), "server": ("127.0.0.1", 0)}
        body = request.get("body", b"")
        sent = asyncio.Event()
        gone = asyncio.Event()
        out: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict[str, Any]:
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]
                    yield {"status": message["status"], "headers": headers, "replica": self.replica_id}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)

    def record_routing_stats(self) -> dict[str, Any]:
        """The router's load signals and the ingress's per-replica metrics (Ray polls this)."""
        s = self.service.snapshot
        return {"replica": self.replica_id, "pid": os.getpid(), "ready": int(self.service.ready.is_set()),
                "failed": self.service.failed or "", "num_running": s.get("num_running", 0),
                "num_waiting": s.get("num_waiting", 0), "kv_usage": s.get("kv_usage", 0.0),
                "prefix_cache_queries": s.get("prefix_cache_queries", 0),
                "prefix_cache_hits": s.get("prefix_cache_hits", 0),
                "metrics": self.app.state.mmjax.metrics.render().decode()}

    def check_health(self) -> None:
        """Ray's health check: a failed engine takes the replica out (Ray starts a new one)."""
        if self.service.failed:
            raise RuntimeError(self.service.failed)

    def __del__(self) -> None:
        self.service.stop(timeout=1.0)
