"""Host <-> device traffic of a serving step in a few flat buffers instead of one transfer per array.

A step's host inputs are ~20 small arrays (tokens, positions, slot mapping, page table, lengths, and the
sampler's per-slot parameters) and its outputs 4-7 more. Passed as they are, each is its own host-to-device
or device-to-host copy, a fixed cost per call on an accelerator that a decode step (a few ms) pays every time.
`PackedStep` sends the small integer and float32 inputs as one int32 and one float32 buffer and returns every
output in one float32 buffer; the jitted function unpacks them with static slices (free inside XLA).

The layout of a buffer (which leaf sits where) is a pure function of the inputs' shapes and dtypes, so it is
a static argument of the jit: one compile per shape bucket, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_PACKED_FLOATS = 1 << 16  # larger float32 inputs (a draft model's probabilities) travel on their own

_INT_KINDS = {np.dtype(np.int32): "int32", np.dtype(np.uint32): "uint32", np.dtype(np.bool_): "bool"}


@dataclasses.dataclass(frozen=True)
class Field:
    """Where one leaf lives: `kind` int32 / uint32 / bool (in the int32 buffer), float32 (the float buffer)
    or `pass` (its own argument); its shape; its offset and size in its buffer (or index among the passed)."""

    kind: str
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Layout:
    treedef: Any
    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.treedef, self.fields)))

    def __hash__(self) -> int:  # hashed by every step's jit call (a static argument): computed once
        return self._hash


def pack(tree: Any) -> tuple[np.ndarray, np.ndarray, tuple[Any, ...], Layout]:
    """(int32 buffer, float32 buffer, leaves passed as they are, layout) of a pytree of host arrays.

    The layout depends only on the leaves' kinds and shapes, so it is built once per signature and the same
    `Layout` object comes back for every step of a bucket: the jit's static-argument lookup then hashes a cached
    value and compares by identity, and no `Field` is built per step (this runs on the host every step)."""
    leaves, treedef = jax.tree.flatten(tree)
    signature = (treedef, *[(leaf.dtype, leaf.shape) if isinstance(leaf, np.ndarray) else (type(leaf), np.shape(leaf))
                            for leaf in leaves])
    cached = _LAYOUTS.get(signature)
    if cached is None:
        cached = _LAYOUTS[signature] = _layout(leaves, treedef)
        if len(_LAYOUTS) > _MAX_LAYOUTS:  # a runaway set of shapes: start over rather than grow without end
            _LAYOUTS.clear()
    layout, kinds = cached
    ints: list[np.ndarray] = []
    floats: list[np.ndarray] = []
    passed: list[Any] = []
    for leaf, kind in zip(leaves, kinds):
        if kind == "float32":
            floats.append(leaf.ravel())
        elif kind == "pass":
            passed.append(leaf)
        else:
            ints.append(leaf.astype(np.int32).ravel() if kind == "bool" else leaf.ravel().view(np.int32))
    cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    return cat(ints, np.int32), cat(floats, np.float32), tuple(passed), layout


_LAYOUTS: dict[tuple, tuple[Layout, tuple[str, ...]]] = {}
_MAX_LAYOUTS = 4096


def _layout(leaves: list[Any], treedef: Any) -> tuple[Layout, tuple[str, ...]]:
    """The layout of `leaves` and each leaf's kind (see `Field`)."""
    fields = []
    n_int = n_float = n_passed = 0
    for leaf in leaves:
        if isinstance(leaf, np.ndarray) and leaf.dtype in _INT_KINDS:
            fields.append(Field(_INT_KINDS[leaf.dtype], leaf.shape, n_int, leaf.size))
            n_int += leaf.size
        elif isinstance(leaf, np.ndarray) and leaf.dtype == np.float32 and leaf.size <= MAX_PACKED_FLOATS:
            fields.append(Field("float32", leaf.shape, n_float, leaf.size))
            n_float += leaf.size
        else:
            fields.append(Field("pass", tuple(np.shape(leaf)), n_passed, 0))
            n_passed += 1
    return Layout(treedef, tuple(fields)), tuple(f.kind for f in fields)


def unpack(ints: jax.Array, floats: jax.Array, passed: tuple[Any, ...], layout: Layout) -> Any:
    """The pytree `pack` was given, as (traced) arrays."""
    leaves = []
    for f in layout.fields:
        if f.kind == "pass":
            leaves.append(passed[f.offset])
            continue
        buf = floats if f.kind == "float32" else ints
        x = jax.lax.slice_in_dim(buf, f.offset, f.offset + f.size).reshape(f.shape)
        if f.kind == "uint32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif f.kind == "bool":
            x = x != 0
        leaves.append(x)
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_outputs(outs: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[tuple[tuple[int, ...], str], ...]]:
    """One float32 vector of every output (32-bit ints bitcast, not converted) and their (shape, dtype)."""
    parts, spec = [], []
    for x in outs:
        if x.dtype.itemsize != 4:
            raise TypeError(f"packed step outputs must be 32-bit, got {x.dtype}")
        y = x if x.dtype == jnp.float32 else jax.lax.bitcast_convert_type(x, jnp.float32)
        parts.append(y.reshape(-1))
        spec.append((tuple(x.shape), jnp.dtype(x.dtype).name))
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.float32), tuple(spec)


def unpack_outputs(flat: np.ndarray, spec: tuple[tuple[tuple[int, ...], str], ...]) -> tuple[np.ndarray, ...]:
    out, at = [], 0
    for shape, dtype in spec:
        size = int(np.prod(shape, dtype=np.int64))
        out.append(flat[at:at + size].view(np.dtype(dtype)).reshape(shape))
        at += size
    return tuple(out)


class PackedStep:
    """`jax.jit` of `fn(state, pools, *inputs) -> (outputs tuple, pools[, kept])` (pools donated) called with host
    inputs and returning numpy outputs, with the transfers of the module docstring; `kept` (optional) stays on
    the device, e.g. for a later call. `put` places the buffers (e.g. replicated over a mesh); `wrap` wraps the
    traced function (the sharding context)."""

    def __init__(self, fn: Callable[..., tuple[tuple[jax.Array, ...], Any]], *,
                 wrap: Callable[[Callable], Callable] = lambda f: f, put: Callable[[Any], Any] = lambda x: x,
                 out_shardings: Any = None) -> None:
        self._fn = fn
        self._put = put
        self._out_specs: dict[Layout, tuple] = {}
        self._jit = jax.jit(wrap(self._traced), donate_argnums=(1,), static_argnums=(5,),
                            out_shardings=out_shardings)

    def _traced(self, state, pools, ints, floats, passed, layout: Layout):
        outs, pools, *kept = self._fn(state, pools, *unpack(ints, floats, passed, layout))
        flat, spec = pack_outputs(tuple(outs))
        self._out_specs[layout] = spec  # runs while tracing: the host reads the outputs with it
        return flat, pools, *kept

    def dispatch(self, state: Any, pools: Any, *inputs: Any) -> tuple[tuple[Any, ...], Any]:
        """Launch the step (asynchronously); returns (handle, the new pools): `handle[:2]` is for `outputs`,
        `handle[2]` the kept device value when `fn` returns one."""
        return self.launch(state, pools, pack(inputs))

    def launch(self, state: Any, pools: Any, packed: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        """`dispatch` of inputs `pack` already made: safe on another thread than the one that builds the next
        step's inputs, since the packed buffers are this call's own copies."""
        ints, floats, passed, layout = packed
        flat, pools, *kept = self._jit(state, pools, *self._put((ints, floats, passed)), layout)
        # queued now, behind this step's kernels: the host reads it later without a copy of its own (which would
        # wait for the transfer's round trip after the next step's launch)
        flat.copy_to_host_async()
        return (flat, layout, *kept), pools

    def outputs(self, handle: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
        """The step's outputs on the host (one device-to-host copy; waits for the step)."""
        flat, layout = handle[:2]
        return unpack_outputs(np.asarray(flat), self._out_specs[layout])

    def __call__(self, state: Any, pools: Any, *inputs: Any) -> tuple[tuple[np.ndarray, ...], Any]:
        handle, pools = self.dispatch(state, pools, *inputs)
        return self.outputs(handle), pools
