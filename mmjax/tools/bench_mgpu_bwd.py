"""Time the Mosaic GPU flash backward (`flash_mgpu_bwd`) against the Pallas-Triton one, fwd+bwd on an H200.

    python -m mmjax.tools.bench_mgpu_bwd --out-dir OUT [--check]

Shapes: B4 S4096 H16 D128 and B4 S4096 H32 D64, bf16, causal (plus D128 non-causal). For each backward tile
candidate: fwd+bwd TFLOP/s (FLOPs = 3.5 x forward; forward = 4*B*H*S^2*D/2 causal) and, with --check, the
max |error| of dq/dk/dv against the Pallas backward on a smaller shape. One failing candidate is recorded
with its error and does not stop the others. Writes OUT/bench_mgpu_bwd.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback
from pathlib import Path

from mmjax.bench import kernels as bench
from mmjax.kernels.attention import MgpuFlashConfig, flash_attention_mgpu
from mmjax.kernels.attention import MgpuFlashConfig as M


def candidates():
    return {
        "pallas_bwd": M(),
        "mgpu_q64_kv64": M(bwd_impl="mgpu"),
        "mgpu_q128_kv64": M(bwd_impl="mgpu", bwd_block_q=128),
        "mgpu_q64_kv64_steps3": M(bwd_impl="mgpu", bwd_max_concurrent_steps=3),
    }


def _inputs(b, s, h, d, dtype):
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys[:3])
    seg = jnp.ones((b, s), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    lay = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    return q, k, v, lay


def _grad_fn(cfg, lay, causal):
    import jax
    import jax.numpy as jnp

    loss = lambda q, k, v: jnp.sum(
        flash_attention_mgpu(q, k, v, causal=causal, config=cfg, **lay).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def check(rows, name, cfg):
    """Max |dq|,|dk|,|dv| difference to the Pallas backward (B2 S1024 H8 KV2, D128 and D64, bf16 causal)."""
    import jax.numpy as jnp

    for d in (128, 64):
        q, k, v, lay = _inputs(2, 1024, 8, d, jnp.bfloat16)
        k, v = k[:, :, :2], v[:, :, :2]
        try:
            got = _grad_fn(cfg, lay, True)(q, k, v)
        except Exception as e:  # noqa: BLE001 - record and go on (e.g. tiles that do not fit at this D)
            rows.append(dict(kind="check", config=name, head_dim=d, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"check {name} D{d} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        want = _grad_fn(MgpuFlashConfig(), lay, True)(q, k, v)
        errs = {n: float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                for n, g, w in zip(("dq", "dk", "dv"), got, want)}
        scale = {n: float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for n, w in zip(("dq", "dk", "dv"), want)}
        rows.append(dict(kind="check", config=name, head_dim=d, max_abs_err=errs, max_abs_ref=scale))
        print(f"check {name:28} D{d} " + " ".join(f"{n} {errs[n]:.3g}/{scale[n]:.3g}" for n in errs), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--check", action="store_true", help="also compare gradients with the Pallas backward")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import jax.numpy as jnp

    rows: list = []
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "bench_mgpu_bwd.json").write_text(json.dumps(rows, indent=1))

    for name, cfg in candidates().items():
        if args.check and name != "pallas_bwd":
            try:
                check(rows, name, cfg)
            except Exception as e:  # noqa: BLE001 - record and go on
                rows.append(dict(kind="check", config=name, error=f"{type(e).__name__}: {e}"[:2000]))
                print(f"check {name} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
            save()
    b, s = 4, 4096
    for h, d, causal in ((16, 128, True), (32, 64, True), (16, 128, False)):
        q, k, v, lay = _inputs(b, s, h, d, jnp.bfloat16)
        fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)
        shape = f"B{b} S{s} H{h} D{d} bf16 {'causal' if causal else 'full'}"
        for name, cfg in candidates().items():
            try:
                fn = _grad_fn(cfg, lay, causal)
                sec = bench.time_jax(fn, q, k, v, warmup=5, iters=args.iters)
                tf = 3.5 * fwd_flops / sec / 1e12
                rows.append(dict(kind="time", config=name, shape=shape, ms=sec * 1e3, fwd_bwd_tflops=tf))
                print(f"{shape:30} {name:28} {sec * 1e3:8.3f} ms {tf:6.1f} TFLOP/s fwd+bwd", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing config must not stop the others
                rows.append(dict(kind="time", config=name, shape=shape, error=f"{type(e).__name__}: {e}"[:2000]))
                print(f"{shape:30} {name:28} FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                traceback.print_exc(limit=3)
            save()
    print(f"wrote {out / 'bench_mgpu_bwd.json'}")


if __name__ == "__main__":
    main()
