"""Building blocks: parameters with logical axis names, norms, RoPE, dense helpers, layer stacks.

Logical axis names live in each `nnx.Param`'s `out_sharding` metadata (flax >= 0.12; created with
`eager_sharding=False` so no mesh is needed here). Extract them with `nnx.get_partition_spec(state)`
(a `PartitionSpec` of logical names per leaf, or mesh axes under `nnx.logical_axis_rules(...)`), or
with `logical_axes(state)` below (plain tuples). Mapping names to mesh axes is `mmjax.parallel`'s job.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mmjax import kernels
from mmjax.config import ComputeDtype, RematPolicy
from mmjax.errors import ConfigError, ModelError
from mmjax.model.fp8 import fp8_einsum

Names = tuple[str | None, ...]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str):
    """'auto' -> bfloat16 on GPU/TPU, float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else jnp.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(typing.get_args(ComputeDtype))}")
    return _DTYPES[name]


def param(rngs: nnx.Rngs | None, init: Callable, shape: Sequence[int], names: Names, dtype) -> nnx.Param:
    """An `nnx.Param` initialised by `init(key, shape, dtype)` carrying logical axis `names`."""
    shape = tuple(int(s) for s in shape)
    names = tuple(names)
    if len(names) != len(shape):
        raise ModelError(f"logical axis names {names} do not match the rank of shape {shape}")
    key = rngs.params() if rngs is not None else None
    return nnx.Param(init(key, shape, dtype), out_sharding=names, eager_sharding=False)


def normal(stddev: float = 0.02) -> Callable:
    return nnx.initializers.normal(stddev)


def ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def logical_axes(tree: Any) -> Any:
    """Tree of logical-axis-name tuples (None for leaves without names), same structure as `tree`."""

    def names(x):
        if isinstance(x, nnx.Variable):
            return tuple(x.get_metadata().get("out_sharding") or ())
        return None

    return jax.tree.map(names, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_logical_axes(state: nnx.State) -> Any:
    """Pure-dict tree of each parameter's logical axis names (a tuple; empty if unannotated)."""
    return nnx.State(logical_axes(state)).to_pure_dict()


def dense(x, w, spec: str, dtype, bias=None, *, fp8: bool = False):
    """einsum(spec, x, w) in `dtype` (params cast at use), plus an optional bias. A weight that brings its own
    `quantized_einsum` (`mmjax.quant.QuantizedWeight`) runs it: dequantization fused into the matmul. `fp8`:
    the training matmul of `model.matmul_precision=fp8` (`mmjax.model.fp8`)."""
    if hasattr(w, "quantized_einsum"):
        y = w.quantized_einsum(spec, x, dtype)
    elif fp8:
        y = fp8_einsum(spec, x, w, dtype)
    else:
        y = jnp.einsum(spec, x.astype(dtype), w.astype(dtype))
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def dense_swiglu(x, w, spec: str, dtype, *, fp8: bool = False, impl: str = "auto"):
    """swiglu(dense(x, w)) for a fused gate/up weight whose first output axis is (gate, up). A quantized weight's
    decode kernel applies the activation in its epilogue (`QuantizedWeight.quantized_swiglu`), saving the
    activation's kernel and the gate/up product's round trip through memory."""
    if hasattr(w, "quantized_swiglu") and (y := w.quantized_swiglu(spec, x, dtype)) is not None:
        return y
    return kernels.swiglu(dense(x, w, spec, dtype, fp8=fp8), impl=impl)


def swiglu_mlp(x, w_gate_up, w_down, dtype, *, fp8: bool = False, impl: str = "auto",
               constrain_hidden: Callable = lambda h: h):
    """down(swiglu(gate_up(x))) for x [B, S, E], w_gate_up [E, 2, M], w_down [M, E].

    Plain weights take `kernels.swiglu_dense`: the activation is recomputed in the backward pass rather than saved
    (one [B, S, M] residual fewer per layer). Quantized weights (the gate/up kernel's SwiGLU epilogue) and fp8
    matmuls (their own gradients) take the two steps apart. `constrain_hidden` pins the hidden values' layout:
    the activation [B, S, M] where it exists apart, else the gate/up product [B, S, 2, M]."""
    if fp8 or hasattr(w_gate_up, "quantized_einsum") or hasattr(w_down, "quantized_einsum"):
        h = constrain_hidden(dense_swiglu(x, w_gate_up, "bse,ecm->bscm", dtype, fp8=fp8, impl=impl))
        return dense(h, w_down, "bsm,me->bse", dtype, fp8=fp8)
    gate_up = constrain_hidden(dense(x, w_gate_up, "bse,ecm->bscm", dtype))
    return kernels.swiglu_dense(gate_up, w_down.astype(dtype), impl=impl)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype, compute_dtype, impl: str = "auto"):
        self.scale = param(None, ones, (dim,), ("embed",), param_dtype)
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.impl = impl

    def __call__(self, x, residual=None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) from one fused kernel."""
        return kernels.rms_norm(x, self.scale[...], eps=self.eps, residual=residual, impl=self.impl,
                                out_dtype=self.compute_dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype, compute_dtype, impl: str = "auto"):
        self.scale = param(None, ones, (dim,), ("embed",), param_dtype)
        self.bias = param(None, zeros, (dim,), ("embed",), param_dtype)
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.impl = impl

    def __call__(self, x, residual=None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) from one fused kernel."""
        return kernels.layer_norm(x, self.scale[...], self.bias[...], eps=self.eps, residual=residual,
                                  impl=self.impl, out_dtype=self.compute_dtype)


def rope_frequencies(d: int, theta: float, llama3: tuple[float, float, float, int] | None = None):
    """[D/2] inverse frequencies; `llama3` = (factor, low_freq_factor, high_freq_factor, original_max_len)
    rescales them as Llama 3.1/3.2 do (long wavelengths / factor, short ones kept, a smooth ramp between)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


def rope(x, positions, theta: float, llama3: tuple[float, float, float, int] | None = None):
    """Rotary embedding (HF Llama `rotate_half` layout) of x [B,S,H,D] at integer positions [B,S]."""
    d = x.shape[-1]
    inv_freq = rope_frequencies(d, theta, llama3)  # [D/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B,S,1,D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Layer stacks: stacked + lax.scan (scan=True) or a python loop (scan=False), with remat.

REMAT_POLICIES: dict[RematPolicy, Any] = {  # the names are config.RematPolicy's
    "none": None,
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
}


NAMED_REMAT = frozenset({"save_attention_out"})  # policies that pick residuals by `checkpoint_name`


def remat_name(x: jax.Array, name: str, policy: str) -> jax.Array:
    """`checkpoint_name(x, name)` where `policy` picks residuals by name; `x` itself under any other policy.

    Why not always: the name is an identity whose output is a new value, so without such a policy the backward
    saves it beside its producer's own residual (the attention output was kept twice per layer, each copy written
    into and read out of the layer scan's stack; docs/perf/train.md, "Where the copies come from")."""
    return checkpoint_name(x, name) if policy in NAMED_REMAT else x


def remat(fn: Callable, policy: str, *, prevent_cse: bool = True, static_argnums: tuple[int, ...] = ()) -> Callable:
    if policy not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={policy!r} is not one of: {', '.join(REMAT_POLICIES)}")
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=prevent_cse, static_argnums=static_argnums)


def make_stack(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs, *, scan: bool):
    """n layers: one module with every param stacked on a leading "layers" axis, or an nnx.List."""
    if not scan:
        return nnx.List([make_layer(rngs) for _ in range(n)])

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return make_layer(r)

    return make(rngs)


def stack_in_layout(layers: dict, *, scan: bool) -> dict:
    """A layer stack's params (a pure dict) in the form `make_stack(scan=scan)` builds: leaves stacked on a
    leading layers axis, or one entry per layer keyed 0..L-1. Checkpoints hold either form; converting on load
    lets a model be served or evaluated with the other layer loop than it was trained with."""
    unrolled = bool(layers) and all(str(k).isdigit() for k in layers)  # a restored checkpoint's keys are str
    if unrolled == (not scan):
        return layers
    if not scan:
        n = {len(a) for a in jax.tree.leaves(layers)}
        if len(n) != 1:
            raise ModelError(f"stacked layer params disagree on the number of layers: {sorted(n)}")
        return {i: jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n.pop())}
    by_index = {int(k): v for k, v in layers.items()}
    if sorted(by_index) != list(range(len(layers))):
        raise ModelError(f"unrolled layer params are not numbered 0..{len(layers) - 1}: {sorted(by_index)}")

    def stack(*a):
        return (np.stack if all(isinstance(x, np.ndarray) for x in a) else jnp.stack)(a)

    return jax.tree.map(stack, *(by_index[i] for i in range(len(layers))))


def params_in_layout(params: dict, *, scan: bool | dict[str, bool]) -> dict:
    """`params` (a pure dict of towers) with every tower's `layers` stack in the form `scan` builds; `scan` may
    name each tower's form (`ModelConfig.layer_layout`; a tower it leaves out is kept as it is)."""
    def form(name: str) -> bool | None:
        return scan.get(name) if isinstance(scan, dict) else scan

    return {name: ({**tower, "layers": stack_in_layout(tower["layers"], scan=form(name))}
                   if isinstance(tower, dict) and isinstance(tower.get("layers"), dict) and form(name) is not None
                   else tower)
            for name, tower in params.items()}


def run_stack(layers, body: Callable, carry, xs=None, *, scan: bool, remat_policy: str = "none"):
    """Apply `body(layer, carry, x_l) -> (carry, y_l)` over the layers; returns (carry, stacked ys).

    `xs` is a pytree whose leaves have a leading layers axis (e.g. a KV cache) or None. Layers must be
    stateless in the forward pass (only Params), which holds for every model here.
    """

    def pure(graphdef, params, carry, x):
        return body(nnx.merge(graphdef, params), carry, x)

    if scan:
        graphdef, params = nnx.split(layers)
        step = remat(lambda c, px: pure(graphdef, px[0], c, px[1]), remat_policy, prevent_cse=False)
        return jax.lax.scan(step, carry, (params, xs))
    ys = []
    # One jitted function for every layer (their graphdefs are equal): jax traces and lowers the layer once, not
    # once per layer, and XLA inlines the calls into one unrolled program (docs/perf/train.md, "Unrolled layers").
    step = jax.jit(remat(pure, remat_policy, static_argnums=(0,)), static_argnums=(0,))
    for i, layer in enumerate(layers):
        graphdef, params = nnx.split(layer)
        x_i = None if xs is None else jax.tree.map(lambda a, i=i: a[i], xs)
        carry, y = step(graphdef, params, carry, x_i)
        ys.append(y)
    ys = None if all(y is None for y in ys) else jax.tree.map(lambda *a: jnp.stack(a), *ys)
    return carry, ys
