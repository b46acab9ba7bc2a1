"""fp8 training matmuls (`model.matmul_precision=fp8`): exact where fp8 can hold the values, bounded error
elsewhere, gradients rounded to e5m2, the decoder's training loss and gradients close to the default's, and
serving's forward untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mmjax.model.fp8 import E4M3, E5M2, fp8_einsum, quantize_dequantize

SPEC = "bse,ecm->bscm"  # the decoder's gate_up matmul


def _powers_of_two(rng, shape, top: int) -> np.ndarray:
    """0 or ±2^k for k <= top, with the maximum 2^top present: values any per-tensor fp8 scale holds exactly."""
    x = rng.choice([0.0, 1.0, 2.0, 4.0], size=shape) * rng.choice([-1.0, 1.0], size=shape) * 2.0 ** (top - 2)
    x.flat[0] = 2.0 ** top
    return x.astype(np.float32)


def _einsum_and_grads(fn, x, w, cot):
    y, vjp = jax.vjp(lambda a, b: fn(SPEC, a, b, jnp.float32), x, w)
    return (y, *vjp(cot))


def _exact(spec, x, w, dtype):
    return jnp.einsum(spec, x, w, preferred_element_type=dtype)


def test_values_fp8_holds_pass_exactly():
    rng = np.random.default_rng(0)
    x, w = _powers_of_two(rng, (2, 5, 16), 3), _powers_of_two(rng, (16, 2, 8), 1)
    cot = _powers_of_two(rng, (2, 5, 2, 8), 2)
    for got, want in zip(_einsum_and_grads(fp8_einsum, x, w, cot), _einsum_and_grads(_exact, x, w, cot)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_rounding_error_is_bounded_and_gradients_are_e5m2():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 32, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 2, 48)) * 0.05).astype(np.float32)
    cot = rng.standard_normal((4, 32, 2, 48)).astype(np.float32)
    got = _einsum_and_grads(fp8_einsum, x, w, cot)
    want = _einsum_and_grads(_exact, x, w, cot)
    errors = [float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(got, want)]
    # e4m3 keeps 3 mantissa bits (<= 2^-4 relative per value), e5m2 2 bits (<= 2^-3); errors partly cancel in sums
    assert all(1e-3 < e < b for e, b in zip(errors, [2 ** -4, 2 ** -3, 2 ** -3])), errors
    # the backward GEMMs read the gradient as e5m2 and the operands as e4m3: dx is exactly that product
    g8 = quantize_dequantize(jnp.asarray(cot), E5M2)
    w8 = quantize_dequantize(jnp.asarray(w), E4M3)
    dx = jnp.einsum("bscm,ecm->bse", g8, w8)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(dx), rtol=1e-5, atol=1e-5)
    assert float(quantize_dequantize(jnp.zeros(3), E4M3).sum()) == 0.0  # an all-zero tensor stays zeros


def test_fp8_decoder_trains_close_to_default_and_serving_is_unchanged(helpers):
    base = helpers["random_model"](helpers["tiny_config"](), seed=4)
    fp8 = helpers["random_model"](helpers["tiny_config"](matmul_precision="fp8"), seed=4)
    rng = np.random.default_rng(2)
    b, s, dim = 2, 12, base.cfg.text.dim
    inputs = (jnp.asarray(rng.standard_normal((b, s, dim)), jnp.float32),
              jnp.asarray(np.broadcast_to(np.arange(s), (b, s)), jnp.int32), jnp.ones((b, s), jnp.int32))
    targets = jnp.asarray(rng.integers(0, base.cfg.vocab_size, (b, s)))

    def loss_and_grads(module):
        graphdef, state = nnx.split(module)

        def loss(state):
            logits = nnx.merge(graphdef, state)(*inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return jax.jit(jax.value_and_grad(loss))(state)

    (loss0, grads0), (loss8, grads8) = loss_and_grads(base.decoder), loss_and_grads(fp8.decoder)
    assert float(loss8) != float(loss0) and abs(float(loss8) - float(loss0)) < 0.02 * float(loss0)
    g0 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads0)])
    g8 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads8)])
    assert np.dot(g0, g8) / (np.linalg.norm(g0) * np.linalg.norm(g8)) > 0.99

    pools = fp8.decoder.init_pools(4, 4)
    from mmjax.model.decoder import PagedMeta

    t = 6
    meta = PagedMeta(jnp.arange(4, 4 + t, dtype=jnp.int32), jnp.asarray([[1, 2, 3]], jnp.int32),
                     jnp.asarray([0], jnp.int32), jnp.asarray([t], jnp.int32), jnp.asarray([t], jnp.int32),
                     jnp.asarray([t - 1], jnp.int32))
    x, pos = inputs[0][:1, :t], inputs[1][:1, :t]
    paged = [m.decoder.forward_paged(x, pos, None, pools, meta)[0] for m in (base, fp8)]
    np.testing.assert_array_equal(np.asarray(paged[0]), np.asarray(paged[1]))


def test_fp8_runs_ask_for_cublas_fp8_gemms(monkeypatch):
    """fp8 matmuls switch Triton's GEMM fusion off (it would take the fp8 dots); a flag already in XLA_FLAGS
    or given in parallel.xla_flags wins (the defaults' too); bf16 runs add only the defaults."""
    from mmjax.config import load_config
    from mmjax.parallel.distributed import DEFAULT_FLAGS, FP8_FLAGS, apply_xla_flags, xla_flags

    assert xla_flags(load_config(None, [])) == list(DEFAULT_FLAGS)
    fp8 = load_config(None, ["model.matmul_precision=fp8"])
    assert xla_flags(fp8) == [*DEFAULT_FLAGS, *FP8_FLAGS]
    user = load_config(None, ["model.matmul_precision=fp8", "parallel.xla_flags=--xla_gpu_enable_triton_gemm=true "
                              "--xla_gpu_enable_dus_accumulator_zero_init_elimination=false"])
    assert xla_flags(user) == ["--xla_gpu_enable_dus_accumulator_zero_init_elimination=false", DEFAULT_FLAGS[1],
                               "--xla_gpu_enable_triton_gemm=true"]  # a default switched off by the user
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    apply_xla_flags(fp8)
    assert "false" not in __import__("os").environ["XLA_FLAGS"]
