"""Kernel benchmarks: each op's implementations against XLA, cuDNN and (for attention) torch SDPA.

Used by `python -m mmjax.tools.bench_kernels`. Every measurement warms up first (GPU clocks ramp up under load),
then times `iters` back-to-back calls between two device syncs. Rows carry the achieved TFLOP/s (matrix
bound ops) or GB/s (memory bound ops) and the fraction of the ceilings measured on the H200 here.
This module times kernels only; the whole train step is `mmjax.bench.train`'s (one FLOP and peak
accounting, `mmjax.observe.flops`), which the tool adds as a section.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mmjax import kernels
from mmjax.kernels.attention import flash_attention

log = logging.getLogger(__name__)

# Measured ceilings, not datasheet peaks: the best bf16 dense matmul and device-to-device copy this H200
# achieved. A kernel row's "of ceiling" is against them (how much headroom is left on this device), while
# the train step's MFU (`mmjax.observe.flops.peak_flops_per_device`, 989 TFLOP/s for an H200) is against
# the datasheet peak so that runs compare across devices and with published numbers.
PEAK_TFLOPS = 750.0   # bf16 dense matmul, measured
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


def time_row(rows: list, op: str, impl: str, shape: str, fn: Callable, args, *, flops=None, nbytes=None,
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


def bench_attention(rows: list, b=4, s=4096, h=16, d=128, dtype=jnp.bfloat16,
                    impls=("mgpu_bwd", "mgpu", "pallas", "cudnn", "xla"), configs=None, torch_sdpa=True):
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
    if "cudnn" in impls:  # without our wrapper's run-time layout check, to see what that check costs
        cands.append(("cudnn_direct", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")))
    for name, cfg in (configs or {}).items():
        cands.append((f"pallas[{name}]", lambda q, k, v, cfg=cfg: flash_attention(q, k, v, config=cfg, **kw)))
    for impl, call in cands:
        f, g = make(call)
        time_row(rows, "attention_fwd", impl, shape, f, (q, k, v), flops=fwd_flops)
        time_row(rows, "attention_fwd_bwd", impl, shape, g, (q, k, v), flops=3.5 * fwd_flops)
    if torch_sdpa:
        _torch_sdpa(rows, b, s, h, d, shape, fwd_flops)


def _torch_sdpa(rows, b, s, h, d, shape, fwd_flops):
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        t = time_torch(functools.partial(sdpa, q, k, v, is_causal=True))
        rows.append(Row("attention_fwd", "torch_sdpa", shape, t * 1e3, tflops=fwd_flops / t / 1e12,
                        note=f"torch {torch.__version__}"))

        def fwd_bwd(q, k, v):
            sdpa(q, k, v, is_causal=True).float().sum().backward()

        t = time_torch(functools.partial(fwd_bwd, q, k, v))
        rows.append(Row("attention_fwd_bwd", "torch_sdpa", shape, t * 1e3, tflops=3.5 * fwd_flops / t / 1e12,
                        note=f"torch {torch.__version__}"))
        del q, k, v  # free the inputs before the next section allocates
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        rows.append(Row("attention_fwd", "torch_sdpa", shape, None, note=f"skipped: {e}"))


def bench_paged_attention(rows: list, b=32, h=32, kvh=8, d=128, page_size=16, length=2048, dtype=jnp.bfloat16,
                          impls=("pallas", "xla")):
    """One decode step over a paged cache: every sequence `length` tokens, pages shuffled in the pool."""
    max_pages = length // page_size
    n_pages = b * max_pages
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (b, h, d), dtype)
    k, v = (jax.random.normal(kk, (kvh, n_pages, page_size, d), dtype) for kk in keys[1:3])
    table = jax.random.permutation(keys[3], n_pages).reshape(b, max_pages).astype(jnp.int32)
    lengths = jnp.full((b,), length, jnp.int32)
    nbytes = 2 * k.size * k.dtype.itemsize  # K and V once; q and the output are negligible
    shape = f"B{b} H{h} KV{kvh} D{d} page{page_size} len{length} {jnp.dtype(dtype).name}"
    for impl in impls:
        f = jax.jit(lambda q, k, v, t, n, impl=impl: kernels.paged_attention(q, k, v, t, n, impl=impl))
        time_row(rows, "paged_attention_decode", impl, shape, f, (q, k, v, table, lengths), nbytes=nbytes)


# ----------------------------------------------------------------------------------------------
# Memory-bound ops


def save_sweep(path, rows: list) -> None:
    """Write a tuning sweep's rows (with the date and command line) to `path` and print one line per row."""
    import datetime
    import json
    import sys
    from pathlib import Path
    record = {"date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
              "rows": [r.as_dict() for r in rows]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))
    for r in rows:
        ms = "" if r.ms is None else f"{r.ms:8.3f} ms"
        rate = "" if r.tflops is None else f"{r.tflops:5.0f} TFLOP/s"
        rate += "" if r.gbps is None else f"{r.gbps:6.0f} GB/s"
        frac = "" if r.fraction is None else f"{r.fraction:4.0%}"
        print(f"{r.op:18} {r.impl:32} {r.shape:36} {ms} {rate} {frac} {r.note[:80]}")
    print(f"wrote {path}")


def _fwd_bwd(f):
    """jit(forward + backward of f(x, p) with a real cotangent dy), returning y as well, as in training.

    A constant cotangent (grad of sum) lets XLA fold the backward into the forward and skip reading dy;
    dropping y lets it delete the forward kernel altogether (both inflated earlier GB/s figures past 100%).
    An op with several outputs (the residual-fused norm's (y, s)) takes one cotangent per output.
    """
    def run(x, p, *cts):
        y, vjp = jax.vjp(f, x, p)
        outs = y if isinstance(y, tuple) else (y,)
        ct = tuple(c.astype(o.dtype) for c, o in zip(cts, outs))
        return y, vjp(ct if isinstance(y, tuple) else ct[0])
    return jax.jit(run)


def bench_copy(rows: list, n=32768, e=4096, dtype=jnp.bfloat16) -> float | None:
    """The measured ceiling: x + 1 (one read, one write) at the size used for the row kernels."""
    x = jnp.ones((n, e), dtype)
    f = jax.jit(lambda x: x + jnp.asarray(1, dtype))
    nbytes = 2 * x.size * x.dtype.itemsize
    s = time_row(rows, "copy", "xla", f"[{n},{e}] {jnp.dtype(dtype).name}", f, (x,), nbytes=nbytes,
                 note="x + 1: the measured copy ceiling")
    return None if s is None else nbytes / s / 1e9


def bench_norms(rows: list, n=32768, e=4096, dtype=jnp.bfloat16, impls=("pallas", "xla")):
    key = jax.random.PRNGKey(1)
    x = jax.random.normal(key, (n, e), dtype)
    r = jax.random.normal(jax.random.PRNGKey(2), (n, e), dtype)
    scale, bias = jnp.ones((e,), jnp.float32), jnp.zeros((e,), jnp.float32)
    b = x.size * x.dtype.itemsize
    shape = f"[{n},{e}] {jnp.dtype(dtype).name}"
    for impl in impls:
        rms = lambda x: kernels.rms_norm(x, scale, eps=1e-5, impl=impl)
        time_row(rows, "rms_norm_fwd", impl, shape, jax.jit(rms), (x,), nbytes=2 * b)
        # fwd reads x, writes y; bwd reads x and dy, writes dx (dscale partials are negligible)
        fwd_bwd = _fwd_bwd(lambda x, s: kernels.rms_norm(x, s, eps=1e-5, impl=impl))
        time_row(rows, "rms_norm_fwd_bwd", impl, shape, fwd_bwd, (x, scale, r), nbytes=5 * b)
        res = jax.jit(lambda x, r: kernels.rms_norm(x, scale, eps=1e-5, residual=r, impl=impl))
        time_row(rows, "add_rms_norm_fwd", impl, shape, res, (x, r), nbytes=4 * b)
        # the decoder's case: fwd reads x, r, writes y, s; bwd reads s, dy, ds, writes dx (= d residual)
        add_norm = lambda x, s: kernels.rms_norm(x, s, eps=1e-5, residual=r, impl=impl)
        time_row(rows, "add_rms_norm_fwd_bwd", impl, shape, _fwd_bwd(add_norm), (x, scale, x[::-1], r[::-1]),
                 nbytes=8 * b)
        ln = jax.jit(lambda x: kernels.layer_norm(x, scale, bias, eps=1e-5, impl=impl))
        time_row(rows, "layer_norm_fwd", impl, shape, ln, (x,), nbytes=2 * b)
        ln_fwd_bwd = _fwd_bwd(lambda x, s: kernels.layer_norm(x, s, bias, eps=1e-5, impl=impl))
        time_row(rows, "layer_norm_fwd_bwd", impl, shape, ln_fwd_bwd, (x, scale, r), nbytes=5 * b)


def bench_bias_gelu(rows: list, n=32768, e=4096, dtype=jnp.bfloat16, impls=("triton", "pallas", "xla"),
                    rates=(0.0, 0.1)):
    x = jax.random.normal(jax.random.PRNGKey(3), (n, e), dtype)
    bias = jax.random.normal(jax.random.PRNGKey(4), (e,), dtype)
    b = x.size * x.dtype.itemsize
    for rate in rates:
        shape = f"[{n},{e}] {jnp.dtype(dtype).name} dropout={rate}"
        for impl in impls:
            f = jax.jit(lambda x, bb: kernels.bias_gelu(x, bb, dropout_rate=rate, seed=jnp.int32(5), impl=impl))
            time_row(rows, "bias_gelu_fwd", impl, shape, f, (x, bias), nbytes=2 * b)
            g = _fwd_bwd(lambda x, bb: kernels.bias_gelu(x, bb, dropout_rate=rate, seed=jnp.int32(5), impl=impl))
            time_row(rows, "bias_gelu_fwd_bwd", impl, shape, g, (x, bias, x[::-1]), nbytes=5 * b)


def bench_swiglu(rows: list, n=16384, m=8192, dtype=jnp.bfloat16, impls=("pallas", "xla")):
    """The decoder MLP's silu(gate) * up at the 1.2B decoder's B8 S2048 (n = 16384 rows, M = 8192)."""
    h = jax.random.normal(jax.random.PRNGKey(7), (n, 2, m), dtype)
    g = jax.random.normal(jax.random.PRNGKey(8), (n, m), dtype)
    y = g.size * g.dtype.itemsize                           # bytes of one [n, m] tensor; h is 2y
    shape = f"[{n},2,{m}] {jnp.dtype(dtype).name}"
    for impl in impls:
        time_row(rows, "swiglu_fwd", impl, shape, jax.jit(lambda h: kernels.swiglu(h, impl=impl)), (h,), nbytes=3 * y)
        # fwd reads h, writes y; bwd reads h and dy, writes dh
        g_fn = _fwd_bwd(lambda h, _: kernels.swiglu(h, impl=impl))
        time_row(rows, "swiglu_fwd_bwd", impl, shape, g_fn, (h, None, g), nbytes=8 * y)


def bench_cross_entropy(rows: list, n=16384, e=2048, v=128256, dtype=jnp.bfloat16, impls=("chunked", "xla"),
                        chunks=(1024, 2048)):
    """Loss + grads (x, W) at Llama-3 vocab; tied layout [V, E] like the 1B config. Peak = temp + outputs.

    `chunked` runs at its automatic chunk and at each of `chunks` tokens (`model.loss_chunk_tokens`): the
    weight gradient's float32 sum is read and written once per chunk, the temporaries grow with the chunk."""
    x = jax.random.normal(jax.random.PRNGKey(7), (n, e), dtype)
    w = (jax.random.normal(jax.random.PRNGKey(8), (v, e), jnp.float32) * 0.02).astype(dtype)
    labels = jax.random.randint(jax.random.PRNGKey(9), (n,), 0, v)
    weights = jnp.ones((n,), jnp.float32)
    shape = f"N{n} E{e} V{v} {jnp.dtype(dtype).name}"
    flops = 3 * 2 * n * e * v
    runs = [(impl, None) for impl in impls] + [("chunked", c) for c in chunks if "chunked" in impls]
    for impl, chunk in runs:
        f = jax.jit(jax.value_and_grad(lambda x, w: kernels.linear_cross_entropy(
            x, w, labels, weights, w_layout="ve", impl=impl, chunk=chunk), argnums=(0, 1)))
        label = impl if chunk is None else f"{impl} chunk {chunk}"
        time_row(rows, "linear_cross_entropy_fwd_bwd", label, shape, f, (x, w), flops=flops, mem=True)


# ----------------------------------------------------------------------------------------------
# One run, one JSON, one table

SECTIONS = ("attention", "paged_attention", "cross_entropy", "norms", "bias_gelu", "swiglu")


def run_all(sections=SECTIONS, *, extra: dict[str, Callable[[list], None]] | None = None, save=None) -> dict:
    """Runs the selected benchmarks in one process (peers timed in the same run) and returns the record.

    `extra` adds sections by name, each a function appending `Row`s (`python -m mmjax.tools.bench_kernels` adds the
    train step, timed by `mmjax.bench.train`). `save(record)` is called after every section, so a run cut
    short still leaves its numbers.
    """
    import datetime
    import platform
    rows: list[Row] = []
    dev = jax.devices()[0]
    versions = {"jax": jax.__version__, "python": platform.python_version()}
    for mod in ("jaxlib", "triton", "jax_triton", "torch", "flax"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            pass
    record = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  device=getattr(dev, "device_kind", str(dev)), versions=versions,
                  ceilings=dict(matmul_tflops=PEAK_TFLOPS, copy_gbps=PEAK_GBPS, copy_gbps_measured_now=None),
                  rows=[])
    steps = {
        "attention": lambda: bench_attention(rows),
        "paged_attention": lambda: bench_paged_attention(rows),
        "cross_entropy": lambda: bench_cross_entropy(rows),
        "norms": lambda: bench_norms(rows),
        "bias_gelu": lambda: bench_bias_gelu(rows),
        "swiglu": lambda: bench_swiglu(rows),
        **{name: functools.partial(fn, rows) for name, fn in (extra or {}).items()},
    }
    if set(sections) & {"norms", "bias_gelu", "swiglu", "paged_attention"}:
        record["ceilings"]["copy_gbps_measured_now"] = bench_copy(rows)
    for name in sections:
        steps[name]()
        record["rows"] = [r.as_dict() for r in rows]
        if save is not None:
            save(record)
    return record


def table(record: dict) -> str:
    """Markdown table of a `run_all` record."""
    lines = ["| op | impl | shape | ms | TFLOP/s | GB/s | of ceiling | peak GiB | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    f = lambda v, p: "" if v is None else f"{v:.{p}f}"
    for r in record["rows"]:
        frac = "" if r["fraction_of_ceiling"] is None else f"{r['fraction_of_ceiling']:.0%}"
        note = " ".join(str(r["note"]).split()).replace("|", "/")  # one cell: error texts span lines
        lines.append(f"| {r['op']} | {r['impl']} | {r['shape']} | {f(r['ms'], 3)} | {f(r['tflops'], 0)} | "
                     f"{f(r['gbps'], 0)} | {frac} | {f(r['peak_mem_gib'], 2)} | {note} |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.0f}"


HEADLINE_ATTENTION = "B4 S4096 H16 D128 bfloat16 causal"
BASELINES = ("torch_sdpa", "cudnn_direct")  # peers timed beside mmjax's implementations, not mmjax's numbers


def latest_values(record: dict, source: str | None = None) -> dict:
    """The record's headline numbers as `docs/perf/latest.json`'s `kernels` metrics: the fastest mmjax
    implementation of causal attention at the headline shape, and the row kernels' fwd+bwd share of the copy
    ceiling. Only what this run measured is returned (a run of some sections updates those metrics alone)."""
    rows = [r for r in record["rows"] if r["impl"] not in BASELINES and r.get("ms") is not None]

    def best(op: str, shape_prefix: str, field: str) -> dict | None:
        found = [r for r in rows if r["op"] == op and r["shape"].startswith(shape_prefix) and r.get(field)]
        return max(found, key=lambda r: r[field]) if found else None

    values = {}
    for key, op in (("attention_fwd_tflops", "attention_fwd"), ("attention_fwd_bwd_tflops", "attention_fwd_bwd")):
        row = best(op, HEADLINE_ATTENTION, "tflops")
        if row:
            kind = "fwd" if op == "attention_fwd" else "fwd+bwd"
            values[key] = {"value": round(row["tflops"], 1),
                           "label": f"causal attention {kind}, B4 S4096 H16 D128 bf16 ({row['impl']})"}
    for key, op, shape in (("rms_norm_fwd_bwd_of_copy", "rms_norm_fwd_bwd", "[32768,4096]"),
                           ("bias_gelu_fwd_bwd_of_copy", "bias_gelu_fwd_bwd", "[32768,4096] bfloat16 dropout=0.0")):
        row = best(op, shape, "fraction_of_ceiling")
        if row:
            values[key] = {"value": round(row["fraction_of_ceiling"], 3)}
    if source:
        values = {k: {**v, "source": source} for k, v in values.items()}
    return values
