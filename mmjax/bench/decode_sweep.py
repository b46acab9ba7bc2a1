"""Decode-shape sweep of the ragged paged attention's tiling: keys per loop step, warps, pipeline stages and key
splits, at batches 1, 8 and 64 (`--batches`) of the 1.24B decoder's attention (H32 KV8 D64, page 16, 16 layers,
context 576-640).

    python -m mmjax.bench.decode_sweep OUT.json [--batches 1 8 64] [--quick]

Each row times 16 layer calls in one jitted loop, each as the engine's multi-step decode runs it (slot order, the
step's k, v written by the kernel, the pools donated and carried) with its jnp pre-pass and merge, and reports
microseconds per call (wall time: a loop of small kernels launched one by one is paced by their launches), the
attention kernels' own device time per call from a trace of a few more iterations (`device_us_per_layer`: the
kernel and its merge, what a step inside a command buffer pays), the KV bandwidth that implies and the largest
difference from the first configuration's output. Few sequences try key splits with their warps and stages; many
try the unsplit tilings. The defaults of `ragged_paged_attention_pallas` come from this sweep's device time
(docs/perf).
`--quick` shrinks everything to check the script on CPU (interpret mode; the timings mean nothing there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels.ragged_paged_attention.pallas import ragged_paged_attention_pallas
from mmjax.observe.profile import summarize_trace

KV, H, D, PAGE = 8, 32, 64, 16


def decode_case(batch: int, layers: int, context: int, max_len: int = 4096):
    """Pools, table, query and the step's k, v with their slots, for `batch` decoding sequences padded to the
    runner's token bucket (>= 16 slots, one token each; padding tokens write to the null page)."""
    t = max(16, batch)
    pages_per = -(-context // PAGE) + 4
    n_pages = 1 + batch * pages_per
    rng = np.random.default_rng(0)
    pools = [jnp.asarray(rng.standard_normal((layers, KV, n_pages, PAGE, D)), jnp.bfloat16) for _ in range(2)]
    table = np.zeros((t, max_len // PAGE), np.int32)
    order = rng.permutation(np.arange(1, n_pages))
    for i in range(batch):
        table[i, :pages_per] = order[i * pages_per:(i + 1) * pages_per]
    qlen = np.zeros(t, np.int32)
    qlen[:batch] = 1
    ctx = np.zeros(t, np.int32)
    ctx[:batch] = context + rng.integers(0, 64, batch)
    q = jnp.asarray(rng.standard_normal((t, H, D)), jnp.bfloat16)
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, KV, D)), jnp.bfloat16) for _ in range(2))
    pos = np.maximum(ctx - 1, 0)
    slots = np.where(qlen > 0, table[np.arange(t), pos // PAGE] * PAGE + pos % PAGE, 0).astype(np.int32)
    return (q, *pools, jnp.asarray(table), jnp.arange(t, dtype=jnp.int32), jnp.asarray(qlen), jnp.asarray(ctx),
            (k_new, v_new, jnp.asarray(slots)))


TRACED_ITERS = 5  # loop calls traced for the kernels' device time


def time_config(case, layers: int, iters: int, traced: int = TRACED_ITERS, **tiling
                ) -> tuple[float, float | None, np.ndarray]:
    """(wall us per layer call, the attention kernels' device us per layer call or None where the trace has no
    device kernels (the CPU), the output)."""
    q, k, v, table, qstart, qlen, ctx, new_kv = case

    def step(q, k, v):
        def layer(i, carry):
            acc, k, v = carry
            out, k, v = ragged_paged_attention_pallas(q, k, v, table, qstart, qlen, ctx, max_query_len=1, layer=i,
                                                      new_kv=new_kv, slot_tokens=True, **tiling)
            return acc + out, k, v
        return jax.lax.fori_loop(0, layers, layer, (jnp.zeros_like(q), k, v))

    step = jax.jit(step, donate_argnums=(1, 2))  # the pools are updated in place, as in the engine
    k, v = jnp.copy(k), jnp.copy(v)  # the case's own pools stay valid for the next configuration
    out, k, v = step(q, k, v)
    out.block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out, k, v = step(q, k, v)
    out.block_until_ready()
    wall = (time.perf_counter() - start) / iters / layers * 1e6
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(traced):
            out, k, v = step(q, k, v)
        out.block_until_ready()
        jax.profiler.stop_trace()
        families = summarize_trace(trace_dir, steps=1, top=1).get("kernel_families", [])
    attention_ms = sum(f["total_ms"] for f in families if "ragged_paged_attention" in f["family"])
    device = 1e3 * attention_ms / (traced * layers) if attention_ms else None
    return wall, device, np.asarray(out, np.float32)


def configs(batch: int) -> list[dict]:
    """Key splits (with their key tiles, warps and stages) for the few sequences of a step of <= 16 tokens, the
    unsplit tilings for many; {} is the kernel's default."""
    if batch <= 16:
        return [dict(block_tokens=bt, kv_splits=k, num_warps=w, num_stages=st)
                for bt, k, (w, st) in itertools.product((16, 32, 64), (4, 8, 16, 32), ((4, 1), (4, 2)))] + [{}]
    return [dict(block_tokens=bt, num_warps=w, num_stages=st, kv_splits=1)
            for bt, w, st in itertools.product((64, 128, 256), (4, 8), (1, 2, 3))] + [{}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = p.parse_args(argv)
    layers, context, iters, batches = (1, 40, 1, (1, 4)) if args.quick else (16, 576, 20, tuple(args.batches))
    rows = []
    for batch in batches:
        case = decode_case(batch, layers, context)
        *_, ctx, _ = case
        kv_bytes = int(np.asarray(ctx).sum()) * KV * D * 2 * 2
        first = None
        todo = configs(batch)[-2:] if args.quick else configs(batch)  # quick: the last tiling and the default
        for tiling in todo:
            try:
                us, device_us, out = time_config(case, layers, iters, 1 if args.quick else TRACED_ITERS, **tiling)
                first = out if first is None else first
                row = dict(batch=batch, us_per_layer=round(us, 2),
                           device_us_per_layer=None if device_us is None else round(device_us, 2),
                           kv_gbps=round(kv_bytes / (device_us or us) / 1e3, 1),
                           max_diff=float(np.abs(out - first).max()), **(tiling or {"tiling": "default"}))
            except Exception as e:  # a tiling that does not compile (shared memory, registers)
                row = dict(batch=batch, error=str(e)[:200], **tiling)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
