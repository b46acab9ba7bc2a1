"""Packed host <-> device transfers of a serving step: the pytree comes back exactly, one compile per layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.serving.transfer import MAX_PACKED_FLOATS, PackedStep, pack, unpack


def _tree(rng, s=3):
    return ({"tokens": rng.integers(-5, 100, 7).astype(np.int32), "mask": rng.random(7) > 0.5,
             "rows": jnp.ones((7, 2), jnp.bfloat16), "big": rng.random(MAX_PACKED_FLOATS + 1).astype(np.float32)},
            {"seed": np.array([0, 2**32 - 1, 123], np.uint32)[:s], "temp": rng.random(s).astype(np.float32),
             "table": rng.integers(0, 9, (s, 4)).astype(np.int32)})


def test_pack_round_trip_keeps_values_and_dtypes():
    tree = _tree(np.random.default_rng(0))
    ints, floats, passed, layout = pack(tree)
    assert ints.dtype == np.int32 and ints.size == 7 + 7 + 3 + 12 and floats.size == 3
    assert len(passed) == 2  # the device array and the float32 array over the packing limit
    back = jax.jit(unpack, static_argnums=3)(ints, floats, passed, layout)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert np.asarray(b).dtype == np.asarray(a).dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_packed_step_outputs_and_pools():
    def fn(state, pools, batch, extra):
        tokens = batch["tokens"] * state + extra["table"].sum()
        return (tokens, (tokens * 0.5).astype(jnp.float32), extra["seed"]), pools + 1

    step = PackedStep(fn)
    rng = np.random.default_rng(1)
    batch, extra = _tree(rng)
    (tokens, half, seed), pools = step(jnp.int32(2), jnp.zeros(3), batch, extra)
    want = batch["tokens"] * 2 + extra["table"].sum()
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_allclose(half, want * 0.5)
    assert seed.dtype == np.uint32 and seed[1] == 2**32 - 1
    np.testing.assert_array_equal(np.asarray(pools), 1)
    traces = step._jit._cache_size()
    step(jnp.int32(2), pools, *_tree(rng))  # same shapes: no new compile
    assert step._jit._cache_size() == traces


def test_packed_outputs_must_be_32_bit():
    step = PackedStep(lambda state, pools, x: ((x.astype(jnp.bfloat16),), pools))
    with pytest.raises(TypeError, match="32-bit"):
        step(None, jnp.zeros(1), np.ones(2, np.float32))
