"""SwiGLU (`kernels.swiglu`): the Pallas kernels (interpret mode on CPU) and the XLA hand backward against
autodiff of the float32 reference; dispatch and errors. Tolerances: float32 1e-5 (values) / 1e-4 (grads,
relative to their scale); bfloat16 2e-2.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import kernels
from mmjax.kernels.swiglu import OP, swiglu_reference

RNG = np.random.default_rng(0)  # restarted for every test (conftest.py)


def close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=tol)


def value_and_grad(fn, h, w):
    return jax.jit(jax.value_and_grad(lambda h: jnp.sum(fn(h).astype(jnp.float32) * w)))(h)


# (3, 5, 2, 40): rows 15 (odd, one-row tiles) and a column block padded 40 -> 64; (64, 2, 1100): two column
# blocks of 1024, the second padded; (256, 2, 96): several row tiles per program grid row
@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("shape", [(3, 5, 2, 40), (64, 2, 1100), (256, 2, 96)])
def test_matches_autodiff_of_the_reference(impl, shape):
    h = jnp.asarray(RNG.standard_normal(shape) * 3, jnp.float32)
    w = jnp.asarray(RNG.standard_normal(shape[:-2] + shape[-1:]), jnp.float32)
    (lr, gr), (l_, g_) = value_and_grad(swiglu_reference, h, w), value_and_grad(
        lambda h: kernels.swiglu(h, impl=impl), h, w)
    close(l_, lr, 1e-5)
    close(g_, gr, 1e-4)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_bf16(impl):
    h = jnp.asarray(RNG.standard_normal((4, 2, 300)) * 2, jnp.bfloat16)
    w = jnp.asarray(RNG.standard_normal((4, 300)), jnp.float32)
    y = kernels.swiglu(h, impl=impl)
    assert y.dtype == jnp.bfloat16 and y.shape == (4, 300)
    close(y, swiglu_reference(h.astype(jnp.float32)), 2e-2)
    _, g = value_and_grad(lambda h: kernels.swiglu(h, impl=impl), h, w)
    _, want = value_and_grad(swiglu_reference, h.astype(jnp.float32), w)
    assert g.dtype == jnp.bfloat16
    close(g, want, 2e-2)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_backward_keeps_only_h(impl):
    """The residual is h itself (no silu intermediates): what keeps the layer scan's stacks small."""
    h = jnp.asarray(RNG.standard_normal((8, 2, 64)), jnp.float32)
    _, lin = jax.linearize(lambda h: kernels.swiglu(h, impl=impl), h)
    saved = [x for x in jax.tree.leaves(lin) if hasattr(x, "shape") and x.size > 1]
    assert sum(x.size for x in saved) == h.size, [x.shape for x in saved]


def test_auto_falls_back_to_xla_on_cpu_and_names_why(caplog, monkeypatch):
    monkeypatch.setattr(OP, "_logged", set())
    h = jnp.asarray(RNG.standard_normal((2, 2, 16)), jnp.float32)
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        y = kernels.swiglu(h)
    assert "chose 'xla'" in caplog.text and "interpret mode" in caplog.text
    close(y, swiglu_reference(h), 1e-6)


def test_rejects_a_shape_without_the_gate_up_axis_and_unknown_impls():
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, M\], got shape \(4, 3, 8\)"):
        kernels.swiglu(jnp.zeros((4, 3, 8)))
    with pytest.raises(ValueError, match="unknown swiglu implementation 'triton'"):
        kernels.swiglu(jnp.zeros((4, 2, 8)), impl="triton")


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_swiglu_dense_matches_autodiff_and_keeps_only_h_and_w(impl):
    """swiglu(h) @ w against autodiff of the float32 reference, values and both gradients; the backward keeps only
    h and w (the activation, which the weight gradient reads, is recomputed in the SwiGLU backward kernel)."""
    h = jnp.asarray(RNG.standard_normal((3, 5, 2, 40)) * 2, jnp.float32)
    w = jnp.asarray(RNG.standard_normal((40, 24)) / 6, jnp.float32)
    c = jnp.asarray(RNG.standard_normal((3, 5, 24)), jnp.float32)
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(fn(h, w) * c), argnums=(0, 1)))
    want, (want_dh, want_dw) = loss(lambda h, w: swiglu_reference(h) @ w)(h, w)
    got, (dh, dw) = loss(lambda h, w: kernels.swiglu_dense(h, w, impl=impl))(h, w)
    close(got, want, 1e-5)
    close(dh, want_dh, 1e-4)
    close(dw, want_dw, 1e-4)
    _, lin = jax.linearize(lambda h, w: kernels.swiglu_dense(h, w, impl=impl), h, w)
    saved = sorted(x.size for x in jax.tree.leaves(lin) if hasattr(x, "shape") and x.size > 1)
    assert saved == sorted([h.size, w.size]), saved


def test_swiglu_dense_bf16_and_errors():
    h = jnp.asarray(RNG.standard_normal((4, 2, 300)), jnp.bfloat16)
    w = jnp.asarray(RNG.standard_normal((300, 16)) / 10, jnp.bfloat16)
    y = kernels.swiglu_dense(h, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (4, 16)
    close(y, swiglu_reference(h.astype(jnp.float32)) @ w.astype(jnp.float32), 3e-2)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, M\], got shape \(4, 300\)"):
        kernels.swiglu_dense(h[:, 0], w)
    with pytest.raises(ValueError, match=r"weight \(299, 16\) does not match the activation's 300 channels"):
        kernels.swiglu_dense(h, w[:299])
