"""Host time per engine step: `Engine.step()`'s wall time minus the time it waits for the device, for one-token
decode steps of `batch` sequences, on a tiny decoder so the device part is small (the CPU works).

    python -m mmjax.bench.serving_host [--batch 64] [--steps 100] [--repeats 2] [overrides ...]

What it measures is the scheduler, input building, output handling and detokenization per step: the work the
device waits for between single-step decode calls (`serve.decode_steps=1`; with more steps per call and
`serve.overlap_decode` it runs while the device computes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mmjax.bench.serving import BenchSpec, IdTokenizer, serving_config
from mmjax.config import load_config
from mmjax.serving import transfer
from mmjax.serving.engine import Engine
from mmjax.serving.load import build_model
from mmjax.serving.request import SamplingParams

TINY = ("model.text_only=true", "model.text.dim=64", "model.text.n_layers=2", "model.text.n_heads=4",
        "model.text.n_kv_heads=2", "model.text.head_dim=16", "model.text.mlp_dim=128", "model.vocab_size=512",
        "model.compute_dtype=float32", "model.param_dtype=float32")


class DeviceWait:
    """Sums the time `PackedStep.outputs` blocks on the device's result (while installed)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = transfer.PackedStep.outputs

    def __enter__(self) -> DeviceWait:
        orig, wait = self._orig, self

        def outputs(step, handle):
            t = time.perf_counter()
            handle[0].block_until_ready()
            wait.seconds += time.perf_counter() - t
            return orig(step, handle)
        transfer.PackedStep.outputs = outputs
        return self

    def __exit__(self, *exc) -> None:
        transfer.PackedStep.outputs = self._orig


def measure(engine: Engine, batch: int, steps: int, rng: np.random.Generator) -> dict:
    """One pass: `batch` requests prefilled untimed, then their decode steps timed."""
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(0, engine.model_cfg.vocab_size, 64).tolist(), sampling_params=params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    with DeviceWait() as wait:
        n, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            n += 1
        wall = time.perf_counter() - t0
    return {"batch": batch, "steps": n, "wall_ms": 1e3 * wall / n, "device_wait_ms": 1e3 * wait.seconds / n,
            "host_ms": 1e3 * (wall - wait.seconds) / n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("overrides", nargs="*", help="dotted config overrides on the tiny decoder")
    args = p.parse_args(argv)
    cfg = load_config("models/llama_1b.yaml", [*TINY, *args.overrides])
    cfg = serving_config(cfg, BenchSpec(batches=(args.batch,), prompt_len=64, new_tokens=args.steps + 4,
                                        ttft_prompts=(), num_requests=0))
    engine = Engine(cfg, build_model(cfg, None), IdTokenizer())
    rng = np.random.default_rng(0)
    measure(engine, args.batch, args.steps, rng)  # compiles
    for _ in range(args.repeats):
        r = measure(engine, args.batch, args.steps, rng)
        print(f"batch {r['batch']}: {r['steps']} steps, wall {r['wall_ms']:.2f} ms/step, device wait "
              f"{r['device_wait_ms']:.2f}, host {r['host_ms']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
