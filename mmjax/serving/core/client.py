"""The API process's side of the engine core: spawns it, sends requests, turns its token ids into streamed text.

`EngineCoreClient` has the face the HTTP app uses (`EngineService` has the same): `submit` (admission and add,
decided in the core on its current queue), `open_stream` / `close_stream`, `snapshot` (for /metrics), `health`,
`tokenizer` and `model_info` (what the handlers need of the model; both arrive with the core's `Ready`). A
receiver thread reads the core's per-step messages and, per request, detokenizes the new ids
(`IncrementalDetokenizer`), applies stop strings (aborting the request in the core when one is found) and hands a
`RequestOutput` to the request's stream on the event loop. The same thread watches the core process: if it
exits without being asked, `Health.fail` ends every open stream with `EngineFailed` naming the cause, /health
turns 503 and the server exits 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

import numpy as np
import zmq

from mmjax.serving.core import protocol as M
from mmjax.serving.core.process import run_core
from mmjax.serving.detokenize import IncrementalDetokenizer
from mmjax.serving.engine import Engine, RequestMetrics, RequestOutput
from mmjax.serving.http.admission import Decision
from mmjax.serving.http.health import Health
from mmjax.serving.http.service import EngineFailed, Stream, deliver, deliver_all
from mmjax.serving.request import RequestError, SamplingParams
from mmjax.serving.served_model import ModelSource
from mmjax.serving.step_types import SampledToken

log = logging.getLogger(__name__)

POLL_MS = 100  # the receiver's wait for a message or the core's exit
SHUTDOWN_TIMEOUT_S = 10.0  # a core asked to stop gets this long before it is killed


@dataclasses.dataclass
class ModelInfo:
    """What the handlers need of the served model (the core sends it in `Ready`)."""

    model_cfg: Any
    max_model_len: int
    prepare_image = Engine.prepare_image  # the engine's own image preparation: it reads only `model_cfg`


class _Tracked:
    """One request's text state in the API process: the ids so far, the detokenizer, stop strings."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""
        self.detokenize_s = 0.0

    def absorb(self, o: M.CoreOutput) -> RequestOutput:
        """The core's output as the engine in this process would have made it (text, stop strings applied)."""
        new, lps = list(o.new_token_ids), o.logprobs
        finished, reason, stop_reason = o.finished, o.finish_reason, o.stop_reason
        t0 = time.perf_counter()
        detok = self.detok
        if self.params.use_beam_search:  # the best beam's tokens come whole, at the end
            text = detok.push(new) if new else ""
            text += detok.flush() if finished and not detok.stopped else ""
            pieces = [(new, text)]
        else:  # token by token (a stream sends each token's text), ending where a stop string completes
            pieces = detok.push_each(new, last=finished)
            if detok.stopped:
                new, lps = new[:len(pieces)], lps[:len(pieces)]
                finished, reason, stop_reason = True, "stop", detok.stop_str
            text = "".join(t for _, t in pieces)
        self.detokenize_s += time.perf_counter() - t0
        self.token_ids.extend(new)
        self.text += text
        metrics = RequestMetrics(*o.metrics)
        metrics.detokenize_s += self.detokenize_s
        if detok.stopped:
            metrics.num_generated_tokens = len(self.token_ids)
        logprobs = [SampledToken(int(t), float(lp), tuple(ids), tuple(p)) for t, lp, ids, p in lps]
        return RequestOutput(o.request_id, self.prompt_ids, new, text, self.token_ids, self.text, finished, reason,
                             stop_reason, logprobs, metrics, [(list(t), float(s)) for t, s in o.beams], o.error,
                             pieces)


class EngineCoreClient:
    """Runs the engine core in a spawned process. `start()`; `ready` is set once the core warmed up; `stop()`."""

    def __init__(self, source: ModelSource, serve: Any) -> None:
        self.source = source
        self.serve = serve
        self.health = Health()
        self.ready = self.health.ready
        self.health.on_fail(self._end_everything)
        self.snapshot: dict[str, Any] = {"ready": 0}
        self.tokenizer: Any = None
        self.model_info: ModelInfo | None = None
        self.cause = ""  # why the core is gone, as clients are told
        self._streams: dict[str, Stream] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tickets = itertools.count()
        self._lock = threading.Lock()  # sends (one socket, several threads) and failing vs. registering a ticket
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="mmjax-core-")
        self._zmq = zmq.Context()
        self._to_core = self._zmq.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never full: a send that cannot go means no core is connected
        self._from_core = self._zmq.socket(zmq.PULL)
        to_addr, from_addr = f"ipc://{self._dir}/to_core", f"ipc://{self._dir}/from_core"
        self._to_core.bind(to_addr)
        self._from_core.bind(from_addr)
        self._process = multiprocessing.get_context("spawn").Process(  # JAX is not fork-safe
            target=run_core, args=(source, to_addr, from_addr), name="mmjax-engine-core", daemon=True)
        self._thread = threading.Thread(target=self._receive, name="mmjax-core-client", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        return self.health.failure

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._process.start()
        self._thread.start()

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Ask the core to exit (killed if it does not within `timeout`), then close the sockets."""
        self._stopping = True
        if self._process.is_alive():
            self._send(M.Shutdown())
            self._process.join(timeout)
            if self._process.is_alive():
                log.warning("engine core did not exit within %.0fs; killing it", timeout)
                self._process.kill()
                self._process.join(timeout)
        self._thread.join(timeout)
        self._to_core.close(0)
        self._from_core.close(0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    # -- called from the event loop ---------------------------------------------------------------------------

    def open_stream(self, request_id: str, sla_class: str, q: asyncio.Queue) -> Stream:
        stream = Stream(request_id, sla_class, asyncio.get_running_loop(), q)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        """The handler is gone: abort the request in the core if it is still live there, forget its stream."""
        self._tracked.pop(request_id, None)
        if self._streams.pop(request_id, None) is not None and not self.health.failed:
            self._send(M.Abort([request_id]))

    async def submit(self, prompt_ids: list[int], images: list[np.ndarray], choices: list[tuple[str, SamplingParams]],
                     sla_class: str, priority: int, rows: int) -> Decision:
        """Admit and add one HTTP request's choices in the core; its decision (raises RequestError, EngineFailed)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        ticket = next(self._tickets)
        for rid, params in choices:
            self._tracked[rid] = _Tracked(self.tokenizer, prompt_ids, params)
        wire = [dataclasses.replace(p, stop=(), include_stop_str_in_output=False) for _, p in choices]
        msg = M.AddRequests(ticket, [rid for rid, _ in choices], list(prompt_ids), list(images),
                            [dataclasses.asdict(p) for p in wire], sla_class, priority, rows, choices[0][1].max_tokens)
        data = M.pack(msg)
        with self._lock:  # registered before it is sent: the reply may come back before this call goes on
            self._pending[ticket] = (loop, future)
            if self.health.failed or not self._send_now(data):
                self._pending.pop(ticket, None)
                for rid, _ in choices:
                    self._tracked.pop(rid, None)
                raise EngineFailed(self.cause)
        try:
            reply: M.Reply = await future
        finally:
            self._pending.pop(ticket, None)
        if not reply.ok:
            for rid, _ in choices:
                self._tracked.pop(rid, None)
            if reply.invalid:
                raise RequestError(reply.invalid)
        return Decision(reply.ok, reply.reason, reply.message, reply.retry_after_s, reply.predicted_wait_s)

    def _send(self, msg: Any) -> None:
        data = M.pack(msg)
        with self._lock:
            self._send_now(data)

    def _send_now(self, data: bytes) -> bool:
        """Send without blocking (the lock held); False when no core is connected (it died: the receiver thread
        fails the server as soon as it sees the exit)."""
        try:
            self._to_core.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    # -- receiver thread --------------------------------------------------------------------------------------

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(POLL_MS))
                self._drain()
                if self._process.sentinel in events or not self._process.is_alive():
                    self._drain()  # what it sent before exiting (a CoreFailed names the cause)
                    if not self._stopping:
                        self._core_exited()
                    return
        except BaseException as e:  # noqa: BLE001 - a broken receiver leaves nothing to serve with
            log.exception("engine core client failed")
            self.cause = "the API process lost the engine core"
            self.health.fail(f"engine core client: {type(e).__name__}: {e}")

    def _drain(self) -> None:
        while True:
            try:
                data = self._from_core.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(M.unpack(data))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, M.StepOutputs):
            now = time.monotonic()
            ready: list[tuple[Stream, Any]] = []
            for o in msg.outputs:
                self._output(o, now, ready)
            deliver_all(ready)
            self.snapshot = {**msg.stats, "ready": int(self.ready.is_set())}
        elif isinstance(msg, M.Reply):
            pending = self._pending.get(msg.ticket)
            if pending is not None:
                loop, future = pending
                _resolve(loop, future, msg)
        elif isinstance(msg, M.Ready):
            info = pickle.loads(msg.model)  # from the process this one spawned
            self.tokenizer = info["tokenizer"]
            self.model_info = ModelInfo(info["model_cfg"], info["max_model_len"])
            self.ready.set()
            log.info("engine core ready (pid %s, %d compiles)", self._process.pid, msg.compiles)
        elif isinstance(msg, M.CoreFailed):
            self.cause = msg.cause
            self.health.fail(msg.reason)

    def _output(self, o: M.CoreOutput, now: float, ready: list[tuple[Stream, Any]]) -> None:
        """Turn one request's new ids into its `RequestOutput` and append it, with its stream, to `ready`."""
        rid = o.request_id
        tracked, stream = self._tracked.get(rid), self._streams.get(rid)
        if tracked is None or stream is None:  # closed by its handler, or ended here by a stop string
            return
        out = tracked.absorb(o)
        if out.new_token_ids:
            if stream.last_token_time is not None:
                stream.itl.append(now - stream.last_token_time)
            stream.last_token_time = now
        if out.finished:
            self._tracked.pop(rid, None)
            self._streams.pop(rid, None)
            stream.error = o.stream_error
            if not o.finished:  # a stop string ended it here: the core still runs it
                self._send(M.Abort([rid]))
        ready.append((stream, (out, stream)))

    def _core_exited(self) -> None:
        self._process.join(1.0)
        code = self._process.exitcode
        if not self.cause:
            if code is not None and code < 0:
                self.cause = f"the engine-core process was killed by {signal.Signals(-code).name}"
            else:
                self.cause = f"the engine-core process exited with status {code}"
        self.health.fail(f"{self.cause} (pid {self._process.pid})")

    def _end_everything(self, _reason: str) -> None:
        """Health's failure callback: every waiting submit and open stream gets EngineFailed naming the cause."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for loop, future in pending:
            _resolve(loop, future, EngineFailed(self.cause))
        for s in list(self._streams.values()):
            deliver(s, EngineFailed(self.cause))


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    """Set `future` (an exception if `value` is one) on its loop; a closed loop drops it."""
    def apply() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:
        pass
