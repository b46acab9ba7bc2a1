"""Tile sweep for the flash-attention kernels: Pallas-Triton forward/backward tiles and Mosaic GPU forward tiles.

    python -m mmjax.tools.sweep_attention [--out docs/perf/results/kernels/attention-sweep-<date>.json]

Each candidate is timed forward and forward+backward at B4 S4096 H16 D128 bf16 causal (the bench's shape),
the Mosaic GPU ones also at D64 H32; a candidate that fails (e.g. exceeds shared memory) is listed with its
error. The defaults in `FlashConfig` / `MgpuFlashConfig` come from runs of this sweep (docs/perf/kernels.md).
"""

from __future__ import annotations

import argparse
import datetime
import logging

from mmjax.bench import kernels as bench
from mmjax.kernels.attention import FlashConfig as C
from mmjax.kernels.attention import MgpuFlashConfig as M
from mmjax.kernels.attention import flash_attention, flash_attention_mgpu


def pallas_candidates():
    wide = dict(dkv_block_q=64, dkv_block_k=128, dq_block_q=128, dq_block_k=64)
    return {
        "default": C(),
        "bwd_s3": C(bwd_num_stages=3),
        "bwd_s4": C(bwd_num_stages=4),
        "bwd_kv128_q128_w8s3": C(**wide, bwd_num_warps=8, bwd_num_stages=3),
        "bwd_kv128_q128_w8s2": C(**wide, bwd_num_warps=8, bwd_num_stages=2),
        "bwd_kv128_q128_w4s2": C(**wide, bwd_num_warps=4, bwd_num_stages=2),
        "bwd_128_w8s2": C(dkv_block_q=128, dkv_block_k=128, dq_block_q=128, dq_block_k=128, bwd_num_warps=8),
        "bwd_kv32x128_q128x32_w4s3": C(dkv_block_q=32, dkv_block_k=128, dq_block_q=128, dq_block_k=32,
                                        bwd_num_stages=3),
        "fwd_w8s4": C(num_stages=4),
        "fwd_w8s2": C(num_stages=2),
        "fwd_q128k64w4s3": C(block_k=64, num_warps=4),
    }


def mgpu_candidates():
    return {"default": None, "kv64": M(block_kv=64), "steps2": M(max_concurrent_steps=2)}


def sweep_mgpu(rows: list, b=4, s=4096):
    import jax
    import jax.numpy as jnp

    for h, d in ((16, 128), (32, 64)):
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
        seg = jnp.ones((b, s), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True)
        fwd_flops = 4 * b * h * s * s * d / 2
        shape = f"B{b} S{s} H{h} D{d} bfloat16 causal"
        # Pallas-Triton at the same shapes, for the `auto` choice between the two forwards (D64 included)
        pallas = lambda q, k, v: flash_attention(q, k, v, **kw)
        pgrad = jax.grad(lambda q, k, v: jnp.sum(pallas(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        bench.time_row(rows, "attention_fwd", "pallas[default]", shape, jax.jit(pallas), (q, k, v), flops=fwd_flops)
        bench.time_row(rows, "attention_fwd_bwd", "pallas[default]", shape, jax.jit(pgrad), (q, k, v),
                       flops=3.5 * fwd_flops)
        for name, cfg in mgpu_candidates().items():
            call = lambda q, k, v, cfg=cfg: flash_attention_mgpu(q, k, v, config=cfg, **kw)
            grad = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
            bench.time_row(rows, "attention_fwd", f"mgpu[{name}]", shape, jax.jit(call), (q, k, v), flops=fwd_flops)
            bench.time_row(rows, "attention_fwd_bwd", f"mgpu[{name}]+pallas_bwd", shape, jax.jit(grad), (q, k, v),
                           flops=3.5 * fwd_flops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    today = datetime.date.today().isoformat()
    p.add_argument("--out", default=f"docs/perf/results/kernels/attention-sweep-{today}.json")
    p.add_argument("--skip", nargs="*", default=[], choices=["pallas", "mgpu"])
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows: list = []
    if "pallas" not in args.skip:
        for name, cfg in pallas_candidates().items():
            bench.bench_attention(rows, impls=(), configs={name: cfg}, torch_sdpa=False)
    if "mgpu" not in args.skip:
        sweep_mgpu(rows)
    bench.save_sweep(args.out, rows)


if __name__ == "__main__":
    main()
