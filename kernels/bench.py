"""Kernel benchmarks: each op's implementations against XLA, cuDNN and (for attention) torch SDPA.

Used by `tools/bench_kernels.py`. Every measurement warms up first (GPU clocks ramp: DESIGN.md pitfalls),
then times `iters` back-to-back calls between two device syncs. Rows carry the achieved TFLOP/s (matrix
bound ops) or GB/s (memory bound ops) and the fraction of the ceilings measured on the H200 here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

PEAK_TFLOPS = 750.0   # bf16 dense matmul, measured (DESIGN.md section 7)
PEAK_GBPS = 3750.0    # device copy bandwidth, measured


@dataclasses.dataclass
class Row:
    op: str
    impl: str
    shape: str
    ms: float | None
    tflops: float | None = None
    gbps: float | None = None
    peak_mem_gib: float | None = None
    note: str = ""

    @property
    def fraction(self) -> float | None:
        if self.tflops is not None:
            return self.tflops / PEAK_TFLOPS
        if self.gbps is not None:
            return self.gbps / PEAK_GBPS
        return None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["fraction_of_ceiling"] = self.fraction
        return d


def time_jax(fn: Callable, *args, warmup: int = 20, iters: int = 50) -> float:
    """Mean seconds per call of a jitted fn (async dispatch keeps the GPU busy between the syncs)."""
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def time_torch(fn: Callable, warmup: int = 20, iters: int = 50) -> float:
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def peak_memory_gib(fn: Callable, *args) -> float | None:
    """Compiled temp + output bytes of a jitted fn (XLA's own accounting; None if unavailable)."""
    try:
        ma = fn.lower(*args).compile().memory_analysis()
        return (ma.temp_size_in_bytes + ma.output_size_in_bytes) / 2**30
    except Exception as e:  # noqa: BLE001 - backends without memory analysis
        log.info("no memory analysis: %s", e)
        return None


def _run(rows: list, op: str, impl: str, shape: str, fn: Callable, args, *, flops=None, nbytes=None,
         mem=False, note=""):
    try:
        s = time_jax(fn, *args)
    except Exception as e:  # noqa: BLE001 - one failing candidate must not end the run
        log.warning("%s/%s failed: %s", op, impl, e)
        rows.append(Row(op, impl, shape, None, note=f"failed: {type(e).__name__}: {str(e)[:200]}"))
        return None
    rows.append(Row(op, impl, shape, s * 1e3, tflops=flops / s / 1e12 if flops else None,
                    gbps=nbytes / s / 1e9 if nbytes else None,
                    peak_mem_gib=peak_memory_gib(fn, *args) if mem else None, note=note))
    log.info("%s", rows[-1])
    return s


# ----------------------------------------------------------------------------------------------
# Attention


def bench_attention(rows: list, b=4, s=4096, h=16, d=128, dtype=jnp.bfloat16, impls=("pallas", "cudnn", "xla"),
                    configs=None, torch_sdpa=True):
    import kernels
    from kernels.attention import flash_attention
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in jax.random.split(key, 3))
    seg = jnp.ones((b, s), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    shape = f"B{b} S{s} H{h} D{d} {jnp.dtype(dtype).name} causal"
    fwd_flops = 4 * b * h * s * s * d / 2  # causal: half the score matrix
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True)

    def make(call):
        f = jax.jit(call)
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
        return f, g

    cands = [(i, lambda q, k, v, i=i: kernels.attention(q, k, v, impl=i, **kw)) for i in impls]
    for name, cfg in (configs or {}).items():
        cands.append((f"pallas[{name}]", lambda q, k, v, cfg=cfg: flash_attention(q, k, v, config=cfg, **kw)))
    for impl, call in cands:
        f, g = make(call)
        _run(rows, "attention_fwd", impl, shape, f, (q, k, v), flops=fwd_flops)
        _run(rows, "attention_fwd_bwd", impl, shape, g, (q, k, v), flops=3.5 * fwd_flops)
    if torch_sdpa:
        _torch_sdpa(rows, b, s, h, d, shape, fwd_flops)


def _torch_sdpa(rows, b, s, h, d, shape, fwd_flops):
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        t = time_torch(lambda: sdpa(q, k, v, is_causal=True))
        rows.append(Row("attention_fwd", "torch_sdpa", shape, t * 1e3, tflops=fwd_flops / t / 1e12,
                        note=f"torch {torch.__version__}"))

        def fb():
            sdpa(q, k, v, is_causal=True).float().sum().backward()
        t = time_torch(fb)
        rows.append(Row("attention_fwd_bwd", "torch_sdpa", shape, t * 1e3, tflops=3.5 * fwd_flops / t / 1e12,
                        note=f"torch {torch.__version__}"))
        del q, k, v
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        rows.append(Row("attention_fwd", "torch_sdpa", shape, None, note=f"skipped: {e}"))
