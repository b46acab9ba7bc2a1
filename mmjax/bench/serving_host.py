"""Where an engine step's host time goes: `Engine.step()`'s wall time split into scheduling, building and
launching the device call, waiting for the device, reading its outputs and reporting (stops, detokenizing,
outputs), for decode steps of `batch` sequences.

    python -m mmjax.bench.serving_host [--batch 1 32 64] [--steps 100] [--repeats 2] [--full] [--out F.json]
                                       [overrides ...]

By default on a tiny decoder, so the device part is small and the CPU works; `--full` serves the 1.24B decoder
of `models/llama_1b.yaml` (bf16, text only) to see the same split where the device time is real. With
overlapped scheduling (`serve.async_scheduling`, the default) the device runs step N while the host prepares
N+1, so only `device_wait` is time the host had nothing to do; `launch` is the jitted call itself (argument
handling and the enqueueing of the device work), `put` the copy of its packed inputs to the device before it,
`build` the input arrays around them. With
`serve.launch_thread=true` the call runs on the launcher thread: its time is `launch_async` (not part of the
step's sum), and `build` includes waiting for the call before (the pools it returns).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmjax.bench.serving import BenchSpec, IdTokenizer, serving_config
from mmjax.config import load_config, parse_cli
from mmjax.observe.gc_time import GcTime
from mmjax.serving import transfer
from mmjax.serving.engine import Engine
from mmjax.serving.load import build_model
from mmjax.serving.request import SamplingParams

TINY = ("model.text_only=true", "model.text.dim=64", "model.text.n_layers=2", "model.text.n_heads=4",
        "model.text.n_kv_heads=2", "model.text.head_dim=16", "model.text.mlp_dim=128", "model.vocab_size=512",
        "model.compute_dtype=float32", "model.param_dtype=float32")
FULL = ("model.text_only=true", "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16")
PHASES = ("schedule", "build", "put", "launch", "device_wait", "read", "report")  # on the engine thread


class Phases:
    """Sums the wall time of an engine's step phases while installed (each wraps one method in place)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = dict.fromkeys((*PHASES, "launch_async"), 0.0)
        self._undo: list[Callable[[], None]] = []
        self._engine = engine

    def _time(self, owner: Any, name: str, phase: str, exclusive: tuple[str, ...] = ()) -> None:
        """Shadow `owner.name` with an instance attribute that adds its time to `phase`, less the time its callees
        spent in the `exclusive` phases."""
        orig, seconds = getattr(owner, name), self.seconds

        def timed(*args, **kwargs):
            inner = sum(seconds[p] for p in exclusive)
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t - (sum(seconds[p] for p in exclusive) - inner)

        own = name in vars(owner)  # an instance attribute already (a PackedStep's `_put`): put it back after
        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, orig) if own else owner.__dict__.pop(name, None))

    def __enter__(self) -> Phases:
        e, seconds = self._engine, self.seconds
        self._time(e.scheduler, "schedule", "schedule")
        self._time(e.scheduler, "advance", "schedule")
        self._time(e.runner, "dispatch", "build", exclusive=("launch", "put"))
        self._time(e.runner, "collect", "read", exclusive=("device_wait",))
        self._time(e, "_report", "report")
        orig_launch, orig_outputs = transfer.PackedStep.launch, transfer.PackedStep.outputs
        engine_thread = threading.current_thread()

        def launch(step, *args):
            t, put = time.perf_counter(), seconds["put"]
            try:
                return orig_launch(step, *args)
            finally:
                on_engine = threading.current_thread() is engine_thread
                seconds["launch" if on_engine else "launch_async"] += time.perf_counter() - t - (seconds["put"] - put)

        def outputs(step, handle):
            t = time.perf_counter()
            handle[0].block_until_ready()
            seconds["device_wait"] += time.perf_counter() - t
            return orig_outputs(step, handle)

        transfer.PackedStep.launch, transfer.PackedStep.outputs = launch, outputs
        for step in vars(e.runner).values():  # the host-to-device copy of each step's inputs, apart from the call
            if isinstance(step, transfer.PackedStep):
                self._time(step, "_put", "put")
        self._undo.append(lambda: setattr(transfer.PackedStep, "launch", orig_launch))
        self._undo.append(lambda: setattr(transfer.PackedStep, "outputs", orig_outputs))
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()


def measure(engine: Engine, batch: int, steps: int, rng: np.random.Generator, prompt_len: int = 64) -> dict:
    """One pass: `batch` requests prefilled untimed, then `steps` tokens of each timed, phase by phase (ms/step).

    The requests may run to the engine's longest request (`max_tokens`), so the timed steps decode all `batch` of
    them even where the prefill spread their starts over many calls (which, with multi-step mixed calls, also
    decode the requests already prefilled); what is left is aborted."""
    params = SamplingParams(max_tokens=max(engine.serve.max_model_len - prompt_len, 2 * steps + 16), ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, engine.model_cfg.vocab_size, prompt_len).tolist(), sampling_params=params)
           for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    with Phases(engine) as phases, GcTime() as gc_time:
        n, tokens, t0 = 0, 0, time.perf_counter()
        while tokens < batch * steps and engine.has_unfinished():
            # tokens, not steps: a multi-step call (serve.decode_steps > 1) reports several tokens per request
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            n += 1
        wall = time.perf_counter() - t0
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    ms = {k: 1e3 * v / n for k, v in phases.seconds.items()}
    ms["other"] = 1e3 * wall / n - sum(ms[p] for p in PHASES)
    return {"batch": batch, "steps": n, "tokens": tokens, "wall_ms": 1e3 * wall / n, "tok_s": tokens / wall,
            "host_ms": 1e3 * wall / n - ms["device_wait"], **{f"{k}_ms": v for k, v in ms.items()},
            **gc_time.summary()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--full", action="store_true", help="the 1.24B decoder (bf16), not the tiny one")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out", help="write the rows (the last repeat of each batch) to this JSON file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parse_cli(p, sys.argv[1:] if argv is None else argv)
    cfg = load_config("models/llama_1b.yaml", [*(FULL if args.full else TINY), *args.overrides])
    cfg = serving_config(cfg, BenchSpec(batches=tuple(args.batch), prompt_len=args.prompt_len,
                                        new_tokens=2 * args.steps + 20, ttft_prompts=(), num_requests=0))
    engine = Engine(cfg, build_model(cfg, None), IdTokenizer())
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        measure(engine, batch, args.steps, rng, args.prompt_len)  # compiles
        for _ in range(args.repeats):
            r = measure(engine, batch, args.steps, rng, args.prompt_len)
            print(f"batch {batch}: {r['steps']} steps, {r['tok_s']:.0f} tok/s, wall {r['wall_ms']:.3f} ms/step = "
                  + " + ".join(f"{k} {r[k + '_ms']:.3f}" for k in (*PHASES, "other"))
                  + (f" (launcher thread {r['launch_async_ms']:.3f})" if r["launch_async_ms"] else "")
                  + f"; gc: {r['gc_full_collections']} full collections, {sum(r['gc_ms']):.1f} ms in all", flush=True)
        rows.append({**r, "overrides": args.overrides, "full": args.full})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
