"""A quantized weight and its fused matmul.

`QuantizedWeight` replaces the array inside an `nnx.Param` (`param[...]` returns it), so the model's modules,
graph and state tree keep their structure. `mmjax.model.layers.dense` hands it the einsum: the dot runs on the
stored integers / fp8 values converted to the compute dtype and the per-channel scale is applied to the dot's
float32 result (an epilogue XLA fuses), so no dequantized copy of the weight is materialised for per-channel
schemes. Schemes:

* `int8`: symmetric, one scale per output channel: |w - dequant(w)| <= amax_channel / 254. A decode-sized
  step (<= `KERNEL_MAX_ROWS` tokens) on a GPU runs `kernels.quant_matmul`'s Pallas kernel instead of XLA's
  fusion: it reads the int8 weight once and dequantizes in registers (XLA's reads it well below copy speed).
* `fp8`: float8_e4m3fn, one scale per output channel (amax maps to 448): |w - dequant(w)| <= max(|w| / 16,
  scale / 1024) (3 mantissa bits; the second term covers subnormals). With `act_fp8` the activations are cast
  to e4m3 too, with one scale per token, and the dot is fp8 x fp8 with a float32 result (sm89+/sm90 tensor
  cores); otherwise the weight is upcast to the compute dtype at the dot (weight-only). A decode-sized step on
  a GPU (sm89+) runs the e4m3 weight through the same kernel as int8, weight-only: a decode step is bound by
  reading the weight, the kernel reads the same bytes as for int8, and the activations stay in the compute
  dtype (measured in docs/perf/quantization.md: somewhat slower than int8, converting e4m3 costs more).
* `int4`: symmetric, values in [-7, 7], one scale per group of `group` (128) consecutive contracted values and
  output channel: |w - dequant(w)| <= amax_group / 14. Stored two per byte (`kernels.quant_matmul.pack_int4`'s
  layout along the flattened contraction, `contract_shape` set) when the contraction is a multiple of the
  128-row pack block, else as `jnp.int4`. A decode-sized step on a GPU runs the packed weight through the
  kernel (unpacked and group-scaled in registers); elsewhere the weight is dequantized to the compute dtype in
  front of the dot (group scales sit inside the contraction, so they cannot be a per-channel epilogue).

Layout: the contracted axes of the weight come first (after any leading stack axes, e.g. scanned layers),
then the output axes, as for every decoder matmul here. int8 and e4m3 values are stored transposed (`transposed`:
output axes, then contracted axes), so each output channel's contracted values are contiguous: the layout the
decode kernel's tensor-core dot reads its weight operand in without reshuffling bytes (docs/perf/quantization.md).
Packed int4 is stored so too by default (`TRANSPOSED`: the packed bytes output axes first, which the kernel reads
faster with its default conversion at the decode shapes); `quantize(..., transposed=False)` keeps [K // 2, N].
`shape` and `dequantize` always speak of the float weight's own layout.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from mmjax.errors import ConfigError
from mmjax.kernels.quant_matmul import PACK_BLOCK, pack_int4, quant_matmul, quant_matmul_supported, unpack_int4

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
QMAX = {"int8": 127.0, "fp8": FP8_MAX, "int4": 7.0}
STORAGE = {"int8": jnp.int8, "fp8": FP8, "int4": jnp.int4}
BITS = {"int8": 8, "fp8": 8, "int4": 4}
GROUP = 128  # int4 group size along the contraction
_TINY = 1e-12  # floor of a scale: an all-zero channel or token quantizes to zeros
# Whether each scheme's values are stored output axes first by default (see the module docstring): int8 and packed
# int4 measured faster so, fp8 takes the same kernel path.
TRANSPOSED = {"int8": True, "fp8": True, "int4": True}


@flax.struct.dataclass
class QuantizedWeight:
    """Stored values `q` and float32 `scale`. `q` has the float weight's shape, except packed int4 (where
    `contract_shape`, the contracted axes' sizes, is set): int8 `[*lead, contracted // 2, *out]`, two values a
    byte. `scale`: per channel the weight's shape with its contracted axes 1; per group (int4)
    `[*lead, contracted // group, *out]`."""

    q: jax.Array
    scale: jax.Array
    scheme: str = flax.struct.field(pytree_node=False, default="int8")
    n_contract: int = flax.struct.field(pytree_node=False, default=1)
    n_out: int = flax.struct.field(pytree_node=False, default=1)
    group: int = flax.struct.field(pytree_node=False, default=0)  # 0: per output channel
    act_fp8: bool = flax.struct.field(pytree_node=False, default=False)
    contract_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())  # set: packed int4
    transposed: bool = flax.struct.field(pytree_node=False, default=False)  # q is [*lead, *out, *contracted]

    def __getitem__(self, key):
        """`param[...]` yields the container itself (what `nnx.Param.__getitem__` forwards here)."""
        if key is Ellipsis:
            return self
        raise TypeError("a QuantizedWeight is only read whole (param[...])")

    @property
    def packed(self) -> bool:
        return bool(self.contract_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape (a packed `q` is shorter, a transposed one has its axes in another order)."""
        if self.transposed:
            qs = self.q.shape
            lead = self.q.ndim - self.n_out - (1 if self.packed else self.n_contract)
            contracted = self.contract_shape if self.packed else qs[lead + self.n_out:]
            return (*qs[:lead], *contracted, *qs[lead:lead + self.n_out])
        if not self.packed:
            return tuple(self.q.shape)
        lead = self.q.ndim - 1 - self.n_out
        return (*self.q.shape[:lead], *self.contract_shape, *self.q.shape[lead + 1:])

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: values at their nominal width (int4 = half a byte) plus the scales."""
        return math.prod(self.shape) * BITS[self.scheme] // 8 + self.scale.size * self.scale.dtype.itemsize

    def quantized_einsum(self, spec: str, x: jax.Array, dtype, out_dtype=None) -> jax.Array:
        """einsum(spec, x, dequant(w)) computed in `dtype` with float32 accumulation and returned in `out_dtype`
        (default `dtype`), dequantization fused (see the module docstring)."""
        return _einsum(self, spec, x, dtype, dtype if out_dtype is None else out_dtype)

    def quantized_swiglu(self, spec: str, x: jax.Array, dtype) -> jax.Array | None:
        """silu(y[..., 0, :]) * y[..., 1, :] in `dtype` for y = einsum(spec, x, dequant(w)) whose first output axis
        is (gate, up), from the decode kernel's epilogue (`FUSE_SWIGLU`); None where the kernel does not take the
        step (the caller then runs the einsum and the activation)."""
        xs, ws, out = _parse(spec)
        if not FUSE_SWIGLU or _lead(self) or len(ws) != len(self.shape) or self.shape[self.n_contract] != 2:
            return None
        return _kernel_matmul(self, xs, ws[:self.n_contract], ws[self.n_contract:], out, x, dtype, dtype,
                              epilogue="swiglu")


def _lead(w: QuantizedWeight) -> int:
    return len(w.shape) - w.n_contract - w.n_out


def _map_matrices(fn, a: jax.Array, n_lead: int) -> jax.Array:
    """`fn` ([rows, N] -> [rows', N]) applied to each [rows, N] matrix of `a` = [*lead, rows, *out]."""
    lead, rows, out = a.shape[:n_lead], a.shape[n_lead], a.shape[n_lead + 1:]
    y = jax.vmap(fn)(a.reshape(-1, rows, math.prod(out)))
    return y.reshape(*lead, y.shape[1], *out)


def quantize(w: jax.Array, scheme: str, *, n_contract: int = 1, n_lead: int = 0, group: int = GROUP,
             act_fp8: bool = False, name: str = "weight", transposed: bool | None = None) -> QuantizedWeight:
    """Quantize float `w` whose axes are `n_lead` stack axes, `n_contract` contracted axes, then output axes.
    `transposed` (int8, fp8, and int4 where packed; default `TRANSPOSED`) stores the values output axes first."""
    if scheme not in STORAGE:
        raise ConfigError(f"serve.quantization={scheme!r}: choose one of none, {', '.join(STORAGE)}")
    wf = jnp.asarray(w, jnp.float32)
    axes = tuple(range(n_lead, n_lead + n_contract))
    n_out = wf.ndim - n_lead - n_contract
    if scheme != "int4":
        scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=axes, keepdims=True), _TINY) / QMAX[scheme]
        x = wf / scale
        q = x.astype(FP8) if scheme == "fp8" else jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8)
        transposed = TRANSPOSED[scheme] if transposed is None else transposed
        if transposed:
            q = _to_stored(q, n_lead, n_contract)
        return QuantizedWeight(q, scale, scheme, n_contract, n_out, 0, act_fp8 and scheme == "fp8",
                               transposed=transposed)
    lead, out = wf.shape[:n_lead], wf.shape[n_lead + n_contract:]
    c = math.prod(wf.shape[n_lead:n_lead + n_contract])
    if c % group:
        raise ConfigError(f"serve.quantization=int4: {name} {tuple(wf.shape)} contracts {c} values, not a multiple "
                          f"of the group size {group}; set serve.quant_group to an even divisor of {c}, or use int8 or "
                          "fp8")
    wg = wf.reshape(*lead, c // group, group, *out)
    scale = jnp.maximum(jnp.max(jnp.abs(wg), axis=n_lead + 1), _TINY) / QMAX["int4"]  # [*lead, groups, *out]
    q = jnp.clip(jnp.round(wg / jnp.expand_dims(scale, n_lead + 1)), -7, 7).astype(jnp.int8)
    if c % PACK_BLOCK:
        return QuantizedWeight(q.reshape(wf.shape).astype(jnp.int4), scale, scheme, n_contract, n_out, group)
    packed = _map_matrices(pack_int4, q.reshape(*lead, c, *out), n_lead)
    contract = tuple(wf.shape[n_lead:n_lead + n_contract])
    transposed = TRANSPOSED["int4"] if transposed is None else transposed
    if transposed:
        packed = _to_stored(packed, n_lead, 1)
    return QuantizedWeight(packed, scale, scheme, n_contract, n_out, group, contract_shape=contract,
                           transposed=transposed)


def _to_stored(q: jax.Array, n_lead: int, n_contract: int) -> jax.Array:
    """[*lead, *contracted, *out] -> [*lead, *out, *contracted] (the transposed storage)."""
    c = list(range(n_lead, n_lead + n_contract))
    o = list(range(n_lead + n_contract, q.ndim))
    return jnp.transpose(q, [*range(n_lead), *o, *c])


def values(w: QuantizedWeight) -> jax.Array:
    """The stored values of a per-channel `w` in the float weight's layout (a transposed one transposed back)."""
    if not w.transposed:
        return w.q
    lead = w.q.ndim - w.n_out - w.n_contract
    o = list(range(lead, lead + w.n_out))
    c = list(range(lead + w.n_out, w.q.ndim))
    return jnp.transpose(w.q, [*range(lead), *c, *o])


def int4_values(w: QuantizedWeight) -> jax.Array:
    """The stored int4 values of `w` in the float weight's shape (int8 holding [-7, 7]); packed ones unpacked."""
    if not w.packed:
        return w.q.astype(jnp.int8)
    q = jnp.moveaxis(w.q, -1, w.q.ndim - 1 - w.n_out) if w.transposed else w.q   # [*lead, c // 2, *out]
    return _map_matrices(unpack_int4, q, q.ndim - 1 - w.n_out).reshape(w.shape)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight `w` stands for, in `dtype`."""
    if not w.group:
        return (values(w).astype(jnp.float32) * w.scale).astype(dtype)
    n, shape = _lead(w), w.shape
    groups = w.scale.shape[n]
    qg = int4_values(w).astype(jnp.float32).reshape(*shape[:n], groups, w.group, *shape[len(shape) - w.n_out:])
    return (qg * jnp.expand_dims(w.scale, n + 1)).reshape(shape).astype(dtype)


def _to_output(a: jax.Array, letters: str, out: str) -> jax.Array:
    """`a` (one axis per letter of `letters`, all in `out`) transposed and expanded to broadcast against `out`."""
    order = sorted(letters, key=out.index)
    a = jnp.transpose(a, [letters.index(c) for c in order])
    return a.reshape([a.shape[order.index(c)] if c in letters else 1 for c in out])


def _parse(spec: str) -> tuple[str, str, str]:
    """(x's letters, the weight's letters, the output's letters) of a two-operand einsum spec."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    return xs, ws, out


def _einsum(w: QuantizedWeight, spec: str, x: jax.Array, dtype, out_dtype) -> jax.Array:
    xs, ws, out = _parse(spec)
    if _lead(w) or len(ws) != len(w.shape):
        raise ValueError(f"quantized weight {w.shape} does not match einsum {spec!r} (stack axes left?)")
    contracted, w_out = ws[:w.n_contract], ws[w.n_contract:]
    if (y := _kernel_matmul(w, xs, contracted, w_out, out, x, dtype, out_dtype)) is not None:
        return y
    if w.group:
        return jnp.einsum(spec, x.astype(dtype), dequantize(w, dtype), preferred_element_type=jnp.float32
                          ).astype(out_dtype)
    w_scale = _to_output(w.scale.reshape(w.scale.shape[w.n_contract:]), w_out, out)
    if w.act_fp8:
        x_axes = tuple(i for i, c in enumerate(xs) if c in contracted)
        sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=x_axes, keepdims=True), _TINY) / FP8_MAX
        xq = (x.astype(jnp.float32) / sx).astype(FP8)
        y = jnp.einsum(_stored_spec(w, xs, contracted, w_out, out, spec), xq, w.q, preferred_element_type=jnp.float32)
        x_out = "".join(c for c in xs if c not in contracted)
        sx = _to_output(sx.reshape([n for i, n in enumerate(sx.shape) if i not in x_axes]), x_out, out)
        return (y * sx * w_scale).astype(out_dtype)
    y = jnp.einsum(_stored_spec(w, xs, contracted, w_out, out, spec), x.astype(dtype), w.q.astype(dtype),
                   preferred_element_type=jnp.float32)
    return (y * w_scale).astype(out_dtype)


def _stored_spec(w: QuantizedWeight, xs: str, contracted: str, w_out: str, out: str, spec: str) -> str:
    """The einsum spec over the stored values: a transposed weight's are read as they lie, [*out, *contracted]."""
    return f"{xs},{w_out}{contracted}->{out}" if w.transposed else spec


KERNEL_MAX_ROWS = 64  # decode-sized steps; a prefill's wide dot is compute-bound and stays with XLA
# Decode steps run a gate/up weight's SwiGLU in the kernel's epilogue (`QuantizedWeight.quantized_swiglu`): one
# kernel per layer fewer, and the [M, 2 * mlp] product never leaves the registers.
FUSE_SWIGLU = True


def _kernel_matmul(w: QuantizedWeight, xs: str, contracted: str, w_out: str, out: str, x: jax.Array,
                   dtype, out_dtype, epilogue: str = "none") -> jax.Array | None:
    """The fused weight-only kernel (`kernels.quant_matmul`) where the einsum is a plain [M, K] x [K, N]
    matmul (x ends with the contracted axes, the output is x's other axes then the weight's), the weight is
    per-channel int8 or e4m3 or packed int4, and the kernel can run here; None leaves the einsum to XLA.
    `epilogue="swiglu"` drops the weight's first output axis (gate, up) from the result."""
    x_lead = xs[:len(xs) - len(contracted)]
    if not xs.endswith(contracted) or out != x_lead + w_out:
        return None
    if not (w.scheme in ("int8", "fp8") and not w.group) and not (w.scheme == "int4" and w.packed):
        return None
    shape = w.shape
    k = math.prod(shape[:w.n_contract])
    out_shape = shape[w.n_contract:]
    x2 = x.astype(dtype).reshape(-1, k)
    if x2.shape[0] > KERNEL_MAX_ROWS:
        return None
    bits = BITS[w.scheme]
    q2 = w.q.reshape(-1, k * bits // 8) if w.transposed else w.q.reshape(k * bits // 8, -1)
    scale = w.scale.reshape(-1) if not w.group else w.scale.reshape(k // w.group, -1)
    if quant_matmul_supported(x2, q2, scale, group=w.group, bits=bits, transposed=w.transposed,
                              epilogue=epilogue) is not None:
        return None  # elsewhere XLA's fusion, not the op's own reference
    y = quant_matmul(x2, q2, scale, group=w.group, bits=bits, out_dtype=out_dtype, impl="pallas",
                     transposed=w.transposed, epilogue=epilogue)
    return y.reshape(*x.shape[:len(x_lead)], *(out_shape[1:] if epilogue == "swiglu" else out_shape))
