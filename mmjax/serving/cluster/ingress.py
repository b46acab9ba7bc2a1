"""The cluster's OpenAI-compatible front: every request goes whole to one engine replica, whose app answers it.

The ingress parses nothing it does not need: it reads the body, computes the route key (`router.route_key`),
and forwards method, path, headers and body to the replica the router picks (`EngineReplica.handle_http`). So
endpoints, errors, streaming, admission and per-request metrics are the single server's, answered by the
replica's own app. The ingress adds what only it can do:

* retries: until the first byte of an answer reaches the client (a plain response is held whole; a stream's
  status and first event are awaited) a request whose replica died or became unreachable is sent again to
  another replica (`serve.router_retries` times; the dead one excluded), so an unstarted request is not lost;
  a stream whose replica dies later ends with an error event and `[DONE]`;
* `/metrics`: the router's counters, and every replica's `mmjax:` series with a `replica` label;
* `/cluster/replicas`: each replica's id, process and load, as the router last saw them.

The `Guard` (API keys, body limits) runs here too, so a refused request never reaches a replica.
"""

from __future__ import annotations

import collections
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from mmjax.serving.cluster.router import ROUTING, route_key
from mmjax.serving.cluster.spec import EngineSpec
from mmjax.serving.http import protocol as P
from mmjax.serving.http.guard import Guard, api_keys
from mmjax.serving.http.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

REPLICA_FAILED = (RayActorError, ActorUnavailableError)  # the replica is gone: retry elsewhere if nothing was sent
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}  # set by the ingress's server


class _Failed(Exception):
    """A replica failed before the client got a byte; carries the attempt to exclude its replica."""

    def __init__(self, attempt: str, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.attempt = attempt


@serve.ingress()
class Ingress:
    """The Ray Serve ingress deployment over the `EngineReplica` deployment's handle."""

    def __init__(self, replicas: Any, spec: EngineSpec) -> None:
        self.replicas = replicas.options(stream=True)
        self.serve_cfg = spec.config().serve
        ROUTING.configure(self.serve_cfg.router == "prefix", self.serve_cfg.router_max_imbalance)

    def __serve_build_asgi_app__(self) -> Any:
        cfg = self.serve_cfg
        app = FastAPI(title="mmjax cluster", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(Guard, keys=api_keys(cfg.api_key), public_paths=cfg.public_paths,
                           max_request_bytes=cfg.max_request_bytes)

        @app.exception_handler(Exception)
        async def internal_error(_: Request, e: Exception) -> JSONResponse:
            log.error("unhandled error while forwarding a request", exc_info=e)
            return JSONResponse(P.error_body("internal server error", "server_error"), status_code=500)

        @app.get("/metrics")
        async def metrics() -> Response:
            registry = CollectorRegistry()
            registry.register(_ClusterCollector())
            return Response(generate_latest(registry), media_type=CONTENT_TYPE)

        @app.get("/cluster/replicas")
        async def replicas() -> JSONResponse:
            return JSONResponse({rid: {k: v for k, v in s.items() if k != "metrics"}
                                 for rid, s in sorted(ROUTING.stats.items())})

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
        async def forward(path: str, raw: Request) -> Response:
            return await self.forward(raw)

        return app

    async def forward(self, raw: Request) -> Response:
        body = await raw.body()
        headers = [(k, v) for k, v in raw.headers.items()]
        request = {"method": raw.method, "path": raw.url.path, "query": raw.url.query.encode(), "headers": headers,
                   "body": body, "client": (raw.client.host, raw.client.port) if raw.client else None}
        key = route_key(body, self.serve_cfg.router_block_chars, dict(raw.headers)) if raw.method == "POST" else None
        route: dict[str, Any] = {"blocks": list(key.blocks) if key else [], "session": key.session if key else "",
                                 "exclude": []}
        last: BaseException | None = None
        for attempt_no in range(self.serve_cfg.router_retries + 1):
            if attempt_no:
                ROUTING.retries += 1
            try:
                return await self._attempt(request, route)
            except _Failed as e:
                last = e
                failed = ROUTING.replica_of(e.attempt)
                if failed is not None:
                    ROUTING.failures[failed] += 1
                    route["exclude"] = [*route["exclude"], failed]
                log.warning("replica %s failed before answering (%s); %s", failed or "?", e,
                            "retrying on another" if attempt_no < self.serve_cfg.router_retries else "giving up")
        return JSONResponse(P.error_body(f"no engine replica could serve the request: {last}", "service_unavailable"),
                            status_code=503, headers={"Retry-After": "5"})

    async def _attempt(self, request: dict[str, Any], route: dict[str, Any]) -> Response:
        attempt = uuid.uuid4().hex
        gen = self.replicas.handle_http.remote(request, route={**route, "attempt": attempt})
        try:
            head = await gen.__anext__()
            headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
            headers["x-mmjax-replica"] = head["replica"]
            if not headers.get("content-type", "").startswith("text/event-stream"):
                chunks = [chunk async for chunk in gen]
                return Response(b"".join(chunks), status_code=head["status"], headers=headers)
            first = await anext(gen, b"")
        except REPLICA_FAILED as e:
            raise _Failed(attempt, e) from e
        ROUTING.replica_of(attempt)  # answered: nothing to exclude
        return StreamingResponse(_rest(gen, first), status_code=head["status"], headers=headers)


async def _rest(gen: Any, first: bytes) -> AsyncIterator[bytes]:
    """A stream's remaining events; a replica dying now ends it with an error event (its bytes are out)."""
    if first:
        yield first
    try:
        async for chunk in gen:
            yield chunk
    except REPLICA_FAILED as e:
        log.warning("replica failed mid-stream: %s", e)
        body = P.error_body("the engine replica serving this stream failed; retry the request", "server_error",
                            code="replica_failed")
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


class _ClusterCollector:
    """Router counters plus each replica's own metrics (from its routing stats) labelled `replica`."""

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily("mmjax:router_requests_routed", "Requests routed, by the rule that chose the "
                                     "replica: session, prefix or load.", labels=["reason"])
        for reason in ("session", "prefix", "load"):
            routed.add_metric([reason], ROUTING.router.reasons.get(reason, 0))
        yield routed
        yield CounterMetricFamily("mmjax:router_retries", "Requests sent again after their replica failed before "
                                  "answering.", value=ROUTING.retries)
        failures = CounterMetricFamily("mmjax:router_replica_failures", "Requests whose replica failed before "
                                       "answering, by replica.", labels=["replica"])
        for rid, n in sorted(ROUTING.failures.items()):
            failures.add_metric([rid], n)
        yield failures
        yield CounterMetricFamily("mmjax:router_replicas_removed", "Replicas Ray reported dead.", value=ROUTING.removed)
        stats = dict(ROUTING.stats)
        healthy = GaugeMetricFamily("mmjax:router_replica_healthy", "1 while a replica is ready and its engine has "
                                    "not failed.", labels=["replica"])
        in_flight = GaugeMetricFamily("mmjax:router_requests_in_flight", "Requests the router has in flight on a "
                                      "replica.", labels=["replica"])
        for rid, s in sorted(stats.items()):
            healthy.add_metric([rid], float(bool(s.get("ready")) and not s.get("failed")))
            in_flight.add_metric([rid], ROUTING.router.in_flight(rid))
        yield healthy
        yield in_flight
        yield from _labelled(stats)


def _labelled(stats: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each replica's metric families merged by name, every sample labelled with its replica."""
    families: dict[str, Metric] = collections.OrderedDict()
    for rid, s in sorted(stats.items()):
        text = s.get("metrics") or ""
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                merged.add_sample(sample.name, {"replica": rid, **sample.labels}, sample.value)
    yield from families.values()
