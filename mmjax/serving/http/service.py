"""One engine thread steps the `Engine`; asyncio handlers talk to it through commands and per-request streams.

The engine is not thread-safe, so every call into it (add, abort, step, stats) runs on this thread: handlers
`call(fn)` and await the result. Each step's outputs go to the request's asyncio queue on the server's event
loop. The thread warms up first (compiling every bucket) and only then reports ready; it also aborts
requests that waited past `serve.max_queue_wait_s` without being scheduled, and keeps the snapshot the
/metrics collector reads. A step failure that no single request caused (the engine's own containment fails
only the request whose values broke a step) ends the thread and fails the server's `Health`: every open
stream and queued command gets `EngineFailed`, and the server shuts down with a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mmjax.serving.engine_loop import expire_waiting, step_or_abort_on_oom
from mmjax.serving.http.admission import CLASS_PRIORITY_OFFSET, CLASSES, Admission
from mmjax.serving.http.health import FAILED_MESSAGE, Health
from mmjax.serving.request import RequestError

log = logging.getLogger(__name__)



@dataclasses.dataclass
class Stream:
    """Where a request's outputs go: its handler's queue gets (RequestOutput, Stream) pairs, or an Exception."""

    request_id: str
    sla_class: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_token_time: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)  # inter-token gaps, seconds
    error: str | None = None  # why the engine thread ended it (queue timeout, device OOM)


class EngineFailed(RuntimeError):
    """Delivered to every open stream (and raised by `call`) once the engine cannot go on; `cause`, when given,
    is what clients may be told of why (e.g. the engine-core process was killed)."""

    def __init__(self, cause: str = "") -> None:
        super().__init__(f"{FAILED_MESSAGE} (cause: {cause})" if cause else FAILED_MESSAGE)


class EngineService:
    """Owns the engine thread. `start()`; `ready` is set after warm-up; `stop()` ends the thread.

    The HTTP app sees only `submit`, `open_stream` / `close_stream`, `snapshot`, `health`, `has_unfinished`,
    `tokenizer` and `model_info`: the face `serving.core.client.EngineCoreClient` has too, for an engine in a
    process of its own."""

    def __init__(self, engine: Any, serve: Any, *, warmup: bool = True, tokenizer: Any = None) -> None:
        self.engine = engine
        self.serve = serve
        self.tokenizer = engine.tokenizer if tokenizer is None else tokenizer
        self.admission = Admission(serve)
        self.engine.scheduler.preempt_for_priority = True  # interactive arrivals preempt batch work
        self._warmup = warmup
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._stop = threading.Event()
        self._command_lock = threading.Lock()  # a command is queued before a failure drains the queue, or refused
        self.health = Health()
        self.ready = self.health.ready
        self.health.on_fail(self._end_everything)
        self._compiles_at_ready = 0
        self.oom_events = 0
        self.snapshot: dict[str, Any] = {"ready": 0}
        self._thread = threading.Thread(target=self._run, name="mmjax-engine", daemon=True)

    # -- called from the event loop ---------------------------------------------------------------------------

    @property
    def model_info(self) -> Any:
        """What the handlers need of the model: `model_cfg`, `max_model_len`, `prepare_image` (the engine has them)."""
        return self.engine

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def failed(self) -> str | None:
        """Why the engine cannot go on (None while it can)."""
        return self.health.failure

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread and await its result (or exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._command_lock:
            if self.health.failed:
                raise EngineFailed()
            self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` on the engine thread without waiting (safe from a cancelled task's cleanup); dropped once
        the engine failed."""
        with self._command_lock:
            if not self.health.failed:
                self._commands.put((fn, concurrent.futures.Future()))

    def open_stream(self, request_id: str, sla_class: str, q: asyncio.Queue) -> Stream:
        """Register where a request's outputs go (`q`, on the running event loop); call before adding it."""
        stream = Stream(request_id, sla_class, asyncio.get_running_loop(), q)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        """The handler is gone: abort the request if still live (frees its pages) and forget its stream."""
        def close() -> None:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)
        self.post(close)

    async def submit(self, prompt_ids: list[int], images: list[Any], choices: list[tuple[str, Any]], sla_class: str,
                     priority: int, rows: int) -> Any:
        """Admit one HTTP request's choices on the current queue state and add them all (or none), in one command
        on the engine thread; returns admission's Decision (raises RequestError, EngineFailed)."""
        max_tokens = choices[0][1].max_tokens

        def admit_and_add() -> Any:
            n_queued, ahead, running = self.queue_state(sla_class)
            decision = self.admission.decide(sla_class, len(prompt_ids) * rows, max_tokens * rows,
                                             queue_len=n_queued, tokens_ahead=ahead, num_running=running)
            if not decision.ok:
                return decision
            added = []
            try:
                for rid, params in choices:
                    self.add(prompt_ids, images, params, rid, sla_class, priority)
                    added.append(rid)
            except RequestError:
                for rid in added:
                    self.engine.abort(rid)
                raise
            return decision
        return await self.call(admit_and_add)

    # -- engine thread only -----------------------------------------------------------------------------------

    def add(self, prompt: Any, images: Any, params: Any, request_id: str, sla_class: str, priority: int) -> None:
        """engine.add_request with the class folded into the scheduler priority (raises RequestError)."""
        self.engine.add_request(prompt, images or None, params, request_id=request_id,
                                priority=CLASS_PRIORITY_OFFSET[sla_class] + priority)

    def queue_state(self, sla_class: str) -> tuple[int, int, int]:
        """(queued requests, prompt tokens queued ahead of a new `sla_class` request, running requests)."""
        waiting = self.engine.scheduler.waiting
        ahead = 0
        for r in waiting:
            s = self._streams.get(r.request_id)
            if sla_class == "batch" or (s is not None and s.sla_class == "interactive"):
                ahead += r.num_tokens - r.num_computed_tokens
        return len(waiting), ahead, len(self.engine.scheduler.running)

    def _run(self) -> None:
        try:
            if self._warmup:
                t0 = time.perf_counter()
                n = self.engine.warmup()
                log.info("warm-up: %d compiles in %.1fs", n, time.perf_counter() - t0)
            self._compiles_at_ready = self.engine.runner.num_compiles
            self._refresh()
            self.ready.set()
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                self._expire_waiting()
                if self.engine.has_unfinished():
                    self._step()
                self._refresh()
        except BaseException as e:  # noqa: BLE001 - reported through Health: /health, every open stream, exit 1
            log.exception("engine thread failed")
            self.health.fail(f"engine thread: {type(e).__name__}: {e}")

    def _end_everything(self, _reason: str) -> None:
        """Health's failure callback: refuse every queued command and end every open stream with EngineFailed."""
        with self._command_lock:
            while True:
                try:
                    _, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineFailed())
        for s in list(self._streams.values()):
            deliver(s, EngineFailed())

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _expire_waiting(self) -> None:
        expire_waiting(self.engine, self.serve.max_queue_wait_s, self._fail_stream)

    def _fail_stream(self, request_id: str, reason: str) -> bool:
        """Record why `request_id`'s stream ends (its client sees `reason`); False if it has no stream here."""
        s = self._streams.get(request_id)
        if s is not None:
            s.error = reason
        return s is not None

    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = step_or_abort_on_oom(self.engine, self._fail_stream)
        if outputs is None:
            self.oom_events += 1
            return
        self.admission.observe_step(time.perf_counter() - t0)
        now = time.monotonic()
        ready: list[tuple[Stream, Any]] = []
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:
                continue
            if out.new_token_ids:
                if s.last_token_time is not None:
                    s.itl.append(now - s.last_token_time)
                s.last_token_time = now
            if out.finished:
                self._streams.pop(out.request_id, None)
            ready.append((s, (out, s)))
        deliver_all(ready)

    def _refresh(self) -> None:
        sched = self.engine.scheduler
        stats = self.engine.stats()
        per = {k: dict.fromkeys(CLASSES, 0) for k in ("running", "waiting")}
        for key, reqs in (("running", sched.running), ("waiting", sched.waiting)):
            for r in reqs:
                s = self._streams.get(r.request_id)
                per[key][s.sla_class if s else CLASSES[0]] += 1
        self.snapshot = {**stats, **per, "ready": int(self.ready.is_set()), "oom_events": self.oom_events,
                         "free_pages": self.engine.kv.num_free_pages,
                         "compiles_after_warmup": self.engine.runner.num_compiles - self._compiles_at_ready}


def deliver(stream: Stream, item: Any) -> None:
    """Hand an output to the stream's handler on its event loop; a closed loop (server shut down) drops it."""
    deliver_all([(stream, item)])


def deliver_all(items: list[tuple[Stream, Any]]) -> None:
    """`deliver` for a step's outputs at once: one wake-up of each event loop (one thread-safe call, one write to
    its self-pipe) for all of them, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass


def _put_all(batch: list[tuple[Stream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
