"""Run the app under uvicorn: warm-up on the engine thread while /health answers, SIGTERM drains.

SIGTERM: stop admitting (503 on new requests, /ready 503), let running requests finish (at most
`serve.drain_timeout_s`), then shut uvicorn down and return 0. A second SIGTERM or SIGINT exits at once.
An engine failure (`Health.fail`) shuts the server down at once: in-flight requests have their error by then,
uvicorn gets `FAILED_EXIT_GRACE_S` to send it, and `run` returns 1 so a supervisor restarts the process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from mmjax.serving.gc_policy import raise_gc_thresholds
from mmjax.serving.http.app import build_app
from mmjax.serving.http.request_log import RequestLog
from mmjax.serving.http.service import EngineService

log = logging.getLogger(__name__)

FAILED_EXIT_GRACE_S = 2.0  # after an engine failure: time to send the in-flight requests' errors before exiting


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains instead of closing in-flight streams."""

    def __init__(self, config: uvicorn.Config, app_state: Any) -> None:
        super().__init__(config)
        self.app_state = app_state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.app_state.draining:
            self.drain()
            return
        super().handle_exit(sig, frame)

    def drain(self) -> None:
        """Refuse new requests, and exit once every admitted one has finished (or the drain timeout passed)."""
        state = self.app_state
        state.draining = True
        log.info("draining: %d requests in flight", state.active)

        def wait() -> None:
            deadline = time.monotonic() + state.serve.drain_timeout_s
            while (time.monotonic() < deadline and not state.health.failed
                   and (state.active > 0 or state.service.has_unfinished())):
                time.sleep(0.05)
            self.should_exit = True

        threading.Thread(target=wait, name="mmjax-drain", daemon=True).start()

    def shut_down_failed(self, _reason: str) -> None:
        """Health's failure callback: stop now, and stop waiting for connections after a short grace."""
        self.should_exit = True
        timer = threading.Timer(FAILED_EXIT_GRACE_S, lambda: setattr(self, "force_exit", True))
        timer.daemon = True
        timer.start()


def make_server(engine: Any, tokenizer: Any, serve: Any, model_name: str, *, warmup: bool = True,
                log_level: str = "info") -> tuple[DrainingServer, EngineService]:
    """The uvicorn server of an engine (not started) and its engine service (started: it warms up now)."""
    return serve_service(EngineService(engine, serve, warmup=warmup, tokenizer=tokenizer), model_name,
                         log_level=log_level)


def serve_service(service: Any, model_name: str, *, log_level: str = "info") -> tuple[DrainingServer, Any]:
    """The uvicorn server of an engine service (`EngineService`, or an `EngineCoreClient` of an engine-core
    process), not started; the service is started (it warms up now) and its failure shuts the server down."""
    serve = service.serve
    app = build_app(service, model_name, RequestLog(serve.request_log or None))
    config = uvicorn.Config(app, host=serve.host, port=serve.port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(serve.drain_timeout_s)))
    server = DrainingServer(config, app.state.mmjax)
    service.health.on_fail(server.shut_down_failed)
    service.start()
    return server, service


def run(engine: Any, tokenizer: Any, serve: Any, model_name: str) -> int:
    """Serve until shut down (SIGTERM drains first); 0 on a clean exit, 1 once the engine failed."""
    return _serve(*make_server(engine, tokenizer, serve, model_name))


def run_service(service: Any, model_name: str) -> int:
    """`run` for an engine service built by the caller (e.g. an `EngineCoreClient`)."""
    return _serve(*serve_service(service, model_name))


def _serve(server: DrainingServer, service: Any) -> int:
    raise_gc_thresholds()  # the API process streams every token: full collections of its heap become rare
    try:
        server.run()
    finally:
        service.stop()
        server.app_state.request_log.close()
        server.app_state.media_pool.shutdown(wait=False, cancel_futures=True)
    return service.health.exit_code
