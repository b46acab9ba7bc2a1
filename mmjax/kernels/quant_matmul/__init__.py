"""`kernels.quant_matmul`: y = x @ dequant(w) for weight-only int8 / e4m3 / int4 weights, sized for decode (M = 1..64).

    y = quant_matmul(x, w, scale, group=0, bits=8, layer=None, out_dtype=None, impl="auto", transposed=False,
                     epilogue="none")

* x [..., K] floating; y [..., N] in `out_dtype` (default x's dtype), accumulated in float32.
* bits=8: w int8 [K, N], or float8_e4m3fn [K, N] (converted in registers like int8; sm89+ on a GPU).
  bits=4: w is `pack_int4(q)` of int4 values q [K, N] in [-7, 7]: int8 [K // 2, N],
  two values per byte in 128-row pack blocks (`pack.py` documents the layout; K a multiple of 128).
* scale float32 [N] per output channel (group=0) or [K // group, N] per group of `group` consecutive rows
  of K (int4 uses 128): y[m, n] = sum_k x[m, k] * q[k, n] * scale[k // group, n].
* layer (int or int32 scalar, optional): w and scale are every layer's stack ([L, ...] in front) and layer
  `layer` is read in place, so a scanned decoder slices (copies) no weight for the kernel.
* transposed: w is stored [N, K] (int8) or [N, K // 2] (int4, `pack_int4(q).T`), each output channel's values
  contiguous.
* epilogue="swiglu": w's N channels are a gate half then an up half, and y = silu(gate) * up [..., N / 2], from
  the float32 sums (a decoder's fused gate/up projection and its activation in one kernel, no [M, N] round trip
  and no activation kernel).

Implementations (`impl="auto"` takes the first that can run):

* `pallas` (GPU sm80+; on CPU interpret mode, named explicitly): `kernel.py`, one read of the weight at
  (near) copy speed, dequantized in registers; needs N a multiple of 16 and the default tiling's limits.
  Under a sharding context (`kernels.use_sharding`) `auto` leaves it to XLA, which partitions the dot.
* `xla` (anywhere): `reference.py` in plain jnp (int4 is unpacked first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.kernels import _dispatch
from mmjax.kernels.quant_matmul import kernel
from mmjax.kernels.quant_matmul.kernel import launch_tiling, output_columns, shape_problem, tiling_problem
from mmjax.kernels.quant_matmul.pack import PACK_BLOCK, pack_int4, unpack_int4
from mmjax.kernels.quant_matmul.reference import quant_matmul_reference
from mmjax.kernels.swiglu import swiglu_reference

__all__ = ["quant_matmul", "quant_matmul_reference", "quant_matmul_supported", "pack_int4", "unpack_int4",
           "PACK_BLOCK", "INT4_GROUP", "OP"]

INT4_GROUP = 128  # the int4 scheme's group size along K (one pack block)

OP = _dispatch.Op("quant_matmul")


def _xla(x, w, scale, *, group: int, bits: int, layer=None, out_dtype=None, transposed: bool = False,
         epilogue: str = "none"):
    if layer is not None:
        take = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
        w, scale = take(w), take(scale)
    if transposed:
        w = w.T
    q = unpack_int4(w) if bits == 4 else w
    if epilogue == "none":
        return quant_matmul_reference(x, q, scale, group=group, out_dtype=out_dtype)
    y = quant_matmul_reference(x, q, scale, group=group, out_dtype=jnp.float32)  # [M, gate and up channels]
    return swiglu_reference(y.reshape(y.shape[0], 2, -1)).astype(x.dtype if out_dtype is None else out_dtype)


def _pallas(x, w, scale, *, group: int, bits: int, layer=None, out_dtype=None, transposed: bool = False,
            epilogue: str = "none"):
    return kernel.quant_matmul(x, w, scale, group=group, bits=bits, layer=layer, out_dtype=out_dtype,
                               transposed=transposed, epilogue=epilogue)


def _pallas_guard(ctx: _dispatch.Ctx) -> str | None:
    """Platform and dtype (the Pallas-Triton guard), then the shapes against the default tiling."""
    reason = _dispatch.pallas_triton(ctx, min_capability=(8, 9) if ctx.get("fp8") else (8, 0))
    if reason is not None:
        return reason if not ctx.get("fp8") else f"float8_e4m3fn weights: {reason}"
    m, k, n, bits, group = (ctx.get(key) for key in ("m", "k", "n", "bits", "group"))
    tiling = launch_tiling(bits, m, k, n, group, transposed=ctx.get("transposed"), epilogue=ctx.get("epilogue"))
    return tiling_problem(m, k, n, bits=bits, group=group, tiling=tiling)


OP.register("xla", _xla, _dispatch.any_float, priority=0)
OP.register("pallas", _pallas, _pallas_guard, priority=10)


def _context(x, w, scale, *, group: int, bits: int, layer, impl: str, transposed: bool = False,
             epilogue: str = "none") -> _dispatch.Ctx:
    m = 1
    for d in x.shape[:-1]:
        m *= d
    problem = shape_problem((m, x.shape[-1]), w.shape, scale.shape, group=group, bits=bits, stacked=layer is not None,
                            transposed=transposed)
    if problem is not None:
        raise ValueError(f"quant_matmul: {problem} (x {tuple(x.shape)} flattened to [M, K])")
    fp8 = w.dtype == jnp.float8_e4m3fn
    if w.dtype != jnp.int8 and not (fp8 and bits == 8):
        raise ValueError(f"quant_matmul: the weight must be int8 (int4 packed by pack_int4) or float8_e4m3fn with "
                         f"bits=8, got {w.dtype} (bits={bits})")
    n = output_columns(w.shape[-2] if transposed else w.shape[-1], epilogue)
    # row_wise: under a mesh a custom call would be replicated, where XLA partitions the dot natively
    return _dispatch.make_ctx(x.dtype, explicit=impl != "auto", m=m, k=x.shape[-1], n=n, bits=bits,
                              group=group, transposed=transposed, fp8=fp8, epilogue=epilogue, row_wise=True)


def quant_matmul_supported(x, w, scale, *, group: int, bits: int, layer=None, transposed: bool = False,
                           epilogue: str = "none") -> str | None:
    """Why `impl="auto"` would not take the Pallas kernel for these arguments here, or None if it would."""
    return OP.reason("pallas", _context(x, w, scale, group=group, bits=bits, layer=layer, impl="auto",
                                        transposed=transposed, epilogue=epilogue))


def quant_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, group: int = 0, bits: int = 8,
                 layer: jax.Array | int | None = None, out_dtype=None, impl: str = "auto",
                 transposed: bool = False, epilogue: str = "none") -> jax.Array:
    """x [..., K] @ dequant(w) -> [..., N] in `out_dtype` (default x's dtype), [..., N / 2] with the swiglu
    epilogue; see the module docstring."""
    ctx = _context(x, w, scale, group=group, bits=bits, layer=layer, impl=impl, transposed=transposed,
                   epilogue=epilogue)
    fn = OP.select(impl, ctx).fn
    lead, k = x.shape[:-1], x.shape[-1]
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    y = fn(x.reshape(-1, k), w, scale, group=group, bits=bits, layer=layer, out_dtype=out_dtype,
           transposed=transposed, epilogue=epilogue)
    return y.reshape(*lead, ctx.get("n"))
