"""The engine-core process: a busy loop that owns the `Engine` (scheduler, KV manager, device) and never waits on HTTP.

The API process spawns it (`multiprocessing` spawn: JAX is not fork-safe) with a `ModelSource`
(`serving.served_model`: the arguments the model was named by) and two ZeroMQ addresses. The core loads the model
itself, warms up (compiling every bucket), sends `Ready`, then loops: take what the API sent (admit and add
requests, abort), expire requests that waited too long, run one engine step, send every request's new token ids with
the engine's gauges. Text is the API process's work: the core's engine gets an `IdsOnlyTokenizer`, and stop strings
are found (and the request aborted here) on the API side. A step failure no request caused is sent as `CoreFailed`
and the process exits 1; the core also exits when the process that spawned it is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from mmjax.observe.gc_time import process_load
from mmjax.parallel.distributed import configure_backend
from mmjax.serving.core import protocol as M
from mmjax.serving.engine import Engine, RequestMetrics, RequestOutput
from mmjax.serving.engine_loop import expire_waiting, step_or_abort_on_oom
from mmjax.serving.http.admission import CLASS_PRIORITY_OFFSET, CLASSES, Admission
from mmjax.serving.request import RequestError, SamplingParams
from mmjax.serving.served_model import ModelSource

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle core waits for a message before checking on its parent
PARENT_CHECK_S = 1.0  # how often a busy core checks that the API process is still there
METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


class IdsOnlyTokenizer:
    """The tokenizer the core's engine sees: the special ids it stops on, and no text. The core receives token ids
    and sends token ids; decoding happens in the API process, so the engine's detokenizer decodes to ""."""

    decodes_text = False  # the engine's detokenizer skips its work (see IncrementalDetokenizer)

    def __init__(self, tokenizer: Any) -> None:
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.stop_ids = list(getattr(tokenizer, "stop_ids", []) or [])
        self.image_marker = getattr(tokenizer, "image_marker", None)

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        raise RequestError("the engine core takes token ids; tokenize in the API process")


class EngineCore:
    """The loop. `run()` until a `Shutdown` message, the parent's exit, or a failure (sent, then re-raised)."""

    def __init__(self, engine: Engine, tokenizer: Any, serve: Any, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.tokenizer = tokenizer  # the real one: sent to the API process in `Ready`
        self.serve = serve
        self.inbox, self.outbox = inbox, outbox
        self.admission = Admission(serve)
        engine.scheduler.preempt_for_priority = True  # interactive arrivals preempt batch work
        self.sla: dict[str, str] = {}  # live request -> its SLA class (queue state, per-class gauges)
        self.stream_error: dict[str, str] = {}  # why the core ended a request (queue_timeout, oom)
        self.oom_events = 0
        self.compiles_at_ready = 0
        self._stop = False
        self._parent = multiprocessing.parent_process()
        self._parent_checked = time.monotonic()

    def run(self, warmup: bool = True) -> None:
        if warmup:
            t0 = time.perf_counter()
            n = self.engine.warmup()
            log.info("engine core warm-up: %d compiles in %.1fs", n, time.perf_counter() - t0)
        self.compiles_at_ready = self.engine.runner.num_compiles
        engine = self.engine
        info = pickle.dumps({"model_cfg": engine.model_cfg, "max_model_len": engine.max_model_len,
                             "tokenizer": self.tokenizer})
        self.outbox.send(M.pack(M.Ready(info, self.compiles_at_ready)))
        self._send_step([], 0.0)
        while not self._stop:
            busy = engine.has_unfinished()
            self._drain(IDLE_POLL_MS if not busy else 0)
            if self._stop or not self._parent_alive(force=not busy):
                return
            self._expire_waiting()
            if engine.has_unfinished():
                t0 = time.perf_counter()
                outputs = self._step()
                self._send_step(outputs, time.perf_counter() - t0)
            elif busy:  # the last requests were aborted before a step: say the engine is idle now
                self._send_step([], 0.0)

    # -- messages ---------------------------------------------------------------------------------------------

    def _drain(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(M.unpack(data))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, M.AddRequests):
            self.outbox.send(M.pack(self._add(msg)))
        elif isinstance(msg, M.Abort):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, M.Shutdown):
            self._stop = True
        else:
            raise TypeError(f"engine core: unexpected message {type(msg).__name__}")

    def _add(self, msg: M.AddRequests) -> M.Reply:
        """Admission on the current queue state, then every choice added (or none)."""
        n_queued, ahead, running = self._queue_state(msg.sla_class)
        decision = self.admission.decide(msg.sla_class, len(msg.prompt_token_ids) * msg.rows, msg.max_tokens * msg.rows,
                                         queue_len=n_queued, tokens_ahead=ahead, num_running=running)
        if not decision.ok:
            return M.Reply(msg.ticket, False, decision.reason, decision.message, decision.retry_after_s,
                           decision.predicted_wait_s)
        added: list[str] = []
        try:
            for rid, params in zip(msg.request_ids, msg.params, strict=True):
                self.engine.add_request(msg.prompt_token_ids, msg.images or None, SamplingParams.from_dict(params),
                                        request_id=rid, priority=CLASS_PRIORITY_OFFSET[msg.sla_class] + msg.priority)
                self.sla[rid] = msg.sla_class
                added.append(rid)
        except RequestError as e:
            for rid in added:
                self.engine.abort(rid)
            return M.Reply(msg.ticket, False, invalid=str(e))
        return M.Reply(msg.ticket, True, predicted_wait_s=decision.predicted_wait_s)

    def _queue_state(self, sla_class: str) -> tuple[int, int, int]:
        """(queued requests, prompt tokens queued ahead of a new `sla_class` request, running requests)."""
        waiting = self.engine.scheduler.waiting
        ahead = 0
        for r in waiting:
            if sla_class == "batch" or self.sla.get(r.request_id) == "interactive":
                ahead += r.num_tokens - r.num_computed_tokens
        return len(waiting), ahead, len(self.engine.scheduler.running)

    # -- steps ------------------------------------------------------------------------------------------------

    def _expire_waiting(self) -> None:
        expire_waiting(self.engine, self.serve.max_queue_wait_s, self._fail_request)

    def _fail_request(self, request_id: str, reason: str) -> bool:
        """Record why `request_id` ends (sent with its last output); False if the API process did not send it."""
        if request_id not in self.sla:
            return False
        self.stream_error[request_id] = reason
        return True

    def _step(self) -> list[RequestOutput]:
        outputs = step_or_abort_on_oom(self.engine, self._fail_request)
        if outputs is None:
            self.oom_events += 1
            return []
        return outputs

    def _send_step(self, outputs: list[RequestOutput], step_s: float) -> None:
        if step_s:
            self.admission.observe_step(step_s)
        wire = [self._wire(o) for o in outputs]
        self.outbox.send(M.pack(M.StepOutputs(wire, self._stats(), step_s)))

    def _wire(self, out: RequestOutput) -> M.CoreOutput:
        rid = out.request_id
        error = self.stream_error.pop(rid, None) if out.finished else None
        if out.finished:
            self.sla.pop(rid, None)
        m = out.metrics
        return M.CoreOutput(rid, out.new_token_ids, out.finished, out.finish_reason, out.stop_reason, out.error,
                            [[lp.token, lp.logprob, lp.top_ids, lp.top_logprobs] for lp in out.logprobs],
                            [getattr(m, f) for f in METRIC_FIELDS], [[t, s] for t, s in out.beams], error)

    def _stats(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        per = {k: dict.fromkeys(CLASSES, 0) for k in ("running", "waiting")}
        for key, reqs in (("running", sched.running), ("waiting", sched.waiting)):
            for r in reqs:
                per[key][self.sla.get(r.request_id, CLASSES[0])] += 1
        return {**self.engine.stats(), **per, "oom_events": self.oom_events,
                "free_pages": self.engine.kv.num_free_pages,
                "compiles_after_warmup": self.engine.runner.num_compiles - self.compiles_at_ready,
                "engine_process": process_load()}

    def _parent_alive(self, force: bool) -> bool:
        now = time.monotonic()
        if self._parent is None or (not force and now - self._parent_checked < PARENT_CHECK_S):
            return True
        self._parent_checked = now
        if self._parent.is_alive():
            return True
        log.warning("engine core: the API process is gone; exiting")
        return False


def run_core(source: ModelSource, inbox_addr: str, outbox_addr: str) -> None:
    """The spawned process's entry: build the engine, serve the loop, exit 1 (after `CoreFailed`) on failure."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the API process handles it (and sends Shutdown). SIGTERM keeps its
    # default (exit): it is how multiprocessing ends a core whose server exits without stopping it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(inbox_addr)
    outbox.connect(outbox_addr)
    outbox.setsockopt(zmq.LINGER, 2000)  # a failure report gets out before the process exits
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow reader (a gone one is seen by the parent check)
    process_load()  # counts this process's collections from here on (/metrics: mmjax:engine_process_*)
    code = 0
    try:
        # a spawned interpreter starts with jax's defaults: the persistent compilation cache (a jax setting, not
        # the environment the flags and memory share travel in) must be turned on here, or every start compiles
        configure_backend(source.cfg)
        engine, tokenizer, _ = source.engine(IdsOnlyTokenizer)
        EngineCore(engine, tokenizer, source.cfg.serve, inbox, outbox).run()
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which fails its Health and exits 1
        log.exception("engine core failed")
        outbox.send(M.pack(M.CoreFailed(f"engine core: {type(e).__name__}: {e}",
                                        f"the engine-core process failed ({type(e).__name__})")))
        code = 1
    finally:
        inbox.close(0)
        outbox.close()
        ctx.term()
    sys.exit(code)
