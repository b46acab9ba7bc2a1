"""Fused cross-entropy, norms and bias+GELU(+dropout) vs their jnp references (forward and grads).

Pallas kernels run in interpret mode on CPU; the jax-triton kernels are GPU-only (skipped here, with the
guard's reason). Tolerances: float32 1e-5 (values) / 1e-4 (grads, relative to their scale); bfloat16 2e-2.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax import kernels
from mmjax.kernels import _dispatch
from mmjax.kernels.cross_entropy import cross_entropy_reference

RNG = np.random.default_rng(0)  # restarted for every test (conftest.py)


def arr(shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape) * scale, dtype)


def close(a, b, tol, msg=""):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=tol, err_msg=msg)


# ---------------------------------------------------------------- fused linear cross-entropy

@pytest.mark.parametrize("layout", ["ev", "ve"])
@pytest.mark.parametrize("tokens,chunk", [((2, 37), 16), ((3, 8), 64)])  # ragged tail; one padded chunk
def test_linear_cross_entropy_matches_full_logits(layout, tokens, chunk):
    e, v = 24, 300
    x = arr((*tokens, e))
    w = arr((e, v) if layout == "ev" else (v, e), 0.3)
    labels = jnp.asarray(RNG.integers(0, v, tokens), jnp.int32)
    weights = jnp.asarray(RNG.random(tokens) > 0.3, jnp.float32)
    ref = lambda x, w, wt: cross_entropy_reference(x.reshape(-1, e), w, labels.reshape(-1), wt.reshape(-1),
                                                   w_layout=layout)
    fused = lambda x, w, wt: kernels.linear_cross_entropy(x, w, labels, wt, w_layout=layout, impl="chunked",
                                                          chunk=chunk)
    (lr, gr), (lf, gf) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, weights) for f in (ref, fused))
    close(lf, lr, 1e-5)
    for name, a, b in zip(("x", "w", "weights"), gf, gr):
        close(a, b, 1e-4, name)
    # loss scaling (a non-unit cotangent) scales the saved gradients
    g2 = jax.grad(lambda x: 8.0 * fused(x, w, weights))(x)
    close(g2, 8.0 * gr[0], 1e-4)
    # evaluation path (no gradient) gives the same loss
    close(fused(x, w, weights), lr, 1e-5)



@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_linear_cross_entropy_in_a_partially_manual_shard_map(impl):
    """Both impls inside a shard_map manual over `pipeline` only, W split over the automatic `tensor` (vocab) and
    `fsdp` axes: the pipeline's last stage. A gather for the target logit aborted XLA's SPMD partitioner there."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("pipeline", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    e, v, shape = 16, 64, (2, 4, 8)
    x, w = arr((*shape, e)), arr((v, e), 0.3)
    labels = jnp.asarray(RNG.integers(0, v, shape), jnp.int32)
    weights = jnp.asarray(RNG.random(shape) > 0.3, jnp.float32)

    def per_rank(x, w, labels, weights):
        loss = lambda x, w: kernels.linear_cross_entropy(x[0], w, labels[0], weights[0], w_layout="ve", impl=impl)
        total, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
        return jax.lax.psum(total, "pipeline"), dx, jax.lax.psum(dw, "pipeline")

    rows = P("pipeline")
    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(rows, P(), rows, rows), out_specs=(P(), rows, P()),
                               axis_names={"pipeline"}, check_vma=False))
    total, dx, dw = fn(jax.device_put(x, NamedSharding(mesh, P("pipeline", "fsdp"))),
                       jax.device_put(w, NamedSharding(mesh, P("tensor", "fsdp"))), labels, weights)
    ref = lambda x, w: cross_entropy_reference(x.reshape(-1, e), w, labels.reshape(-1), weights.reshape(-1),
                                               w_layout="ve")
    want, (want_dx, want_dw) = jax.value_and_grad(ref, argnums=(0, 1))(x, w)
    close(total, want, 1e-5)
    close(dx, want_dx, 1e-4, "x")
    close(dw, want_dw, 1e-4, "w")

def test_linear_cross_entropy_bf16_and_errors():
    x, w = arr((64, 32), dtype=jnp.bfloat16), arr((32, 500), 0.2, jnp.bfloat16)
    labels = jnp.asarray(RNG.integers(0, 500, 64), jnp.int32)
    want = cross_entropy_reference(x.astype(jnp.float32), w.astype(jnp.float32), labels, jnp.ones(64))
    close(kernels.linear_cross_entropy(x, w, labels, impl="chunked", chunk=16), want, 2e-2)
    with pytest.raises(ValueError, match="does not match hidden size"):
        kernels.linear_cross_entropy(x, w.T, labels)
    with pytest.raises(ValueError, match="w_layout"):
        kernels.linear_cross_entropy(x, w, labels, w_layout="vv")


def test_linear_cross_entropy_casts_w_once_outside_the_chunk_loop():
    """bf16 hidden states with an f32 W (the trainer's case): W's cast is not inside the chunk scan, where it
    re-ran per chunk on the GPU (XLA does not hoist it: 11.9 ms of a 299 ms 1.2B step)."""
    x, w = arr((64, 32), dtype=jnp.bfloat16), arr((500, 32), 0.2)
    labels = jnp.asarray(RNG.integers(0, 500, 64), jnp.int32)
    loss = lambda x, w: kernels.linear_cross_entropy(x, w, labels, w_layout="ve", impl="chunked", chunk=16)
    for fn in (jax.grad(loss, argnums=(0, 1)), loss):  # training (loss + grads in the scan) and evaluation
        jaxpr = jax.make_jaxpr(fn)(x, w).jaxpr
        scans = [e for e in _all_eqns(jaxpr) if e.primitive.name == "scan"]
        assert scans
        for scan in scans:
            casts = [e for e in _all_eqns(scan.params["jaxpr"].jaxpr) if e.primitive.name == "convert_element_type"
                     and e.invars[0].aval.shape == w.shape]
            assert not casts, casts


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (jit, custom_vjp, scan bodies) included."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_auto_loss_chunks_only_when_logits_are_big():
    from mmjax.kernels.cross_entropy import OP
    small = _dispatch.Ctx("cpu", jnp.dtype("float32"), facts=(("tokens", 64), ("vocab", 512)))
    big = _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (9, 0), facts=(("tokens", 16384), ("vocab", 128256)))
    assert OP.select("auto", small).name == "xla" and OP.select("auto", big).name == "chunked"


def test_model_fused_loss_matches_logits_loss():
    """steps.loss_sums through Decoder.hidden + output_matrix equals the logits path, value and grads."""
    import dataclasses

    from flax import nnx

    from mmjax.config import ModelConfig, TextConfig
    from mmjax.model import MLLM
    from mmjax.training.steps import loss_sums
    cfg = ModelConfig(vocab_size=96, max_seq_len=32, compute_dtype="float32", text_only=True,
                      text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48))

    b, s = 2, 16
    batch = dict(tokens=jnp.asarray(RNG.integers(0, cfg.vocab_size, (b, s)), jnp.int32),
                 targets=jnp.asarray(RNG.integers(0, cfg.vocab_size, (b, s)), jnp.int32),
                 loss_mask=jnp.asarray(RNG.random((b, s)) > 0.2, jnp.int32),
                 segment_ids=jnp.ones((b, s), jnp.int32), positions=jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1)))
    results = {}
    for impl, chunk in (("xla", 0), ("chunked", 0), ("chunked", 8)):
        # the same seed: both impls see identical parameters
        m = MLLM(dataclasses.replace(cfg, loss_impl=impl, loss_chunk_tokens=chunk), image_token_id=0,
                 rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(m)
        f = lambda p: loss_sums(nnx.merge(graphdef, p), batch)[0]
        results[impl, chunk] = jax.value_and_grad(f)(params)
        if impl == "chunked":  # model.loss_chunk_tokens sets the chunk loop: 32 tokens in 4 chunks of 8, else 1
            assert f"length={4 if chunk else 1}" in str(jax.make_jaxpr(f)(params))
    for key in (("chunked", 0), ("chunked", 8)):
        close(results[key][0], results["xla", 0][0], 1e-5)
        for a, b_ in zip(jax.tree.leaves(results[key][1]), jax.tree.leaves(results["xla", 0][1])):
            close(a, b_, 1e-4)


# ---------------------------------------------------------------- norms

@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True])
# padded width 48 -> 64 and an odd row count; 37 row tiles of 16 x 1024: three backward programs, the last
# walking 5 tiles (the per-program dscale/dbias partial sums)
@pytest.mark.parametrize("shape", [(3, 10, 48), (4, 64), (592, 1000)])
@pytest.mark.parametrize("prefetch", [False, True], ids=["loop", "prefetch"])
def test_norms_pallas_matches_reference(kind, residual, shape, prefetch, monkeypatch):
    import dataclasses

    import mmjax.kernels.norms.pallas as norm_pallas
    monkeypatch.setattr(norm_pallas, "TILING", dataclasses.replace(norm_pallas.TILING, bwd_prefetch=prefetch))
    e = shape[-1]
    x, r, scale, bias = arr(shape), arr(shape), arr((e,)), arr((e,))
    w = arr(shape)

    def run(impl, x, r, scale, bias):
        kw = dict(eps=1e-5, residual=r if residual else None, impl=impl)
        out = kernels.rms_norm(x, scale, **kw) if kind == "rms" else kernels.layer_norm(x, scale, bias, **kw)
        outs = out if residual else (out,)
        return sum(jnp.sum(o * w) for o in outs), out

    (lr, outr), gr = jax.value_and_grad(lambda *a: run("xla", *a), argnums=(0, 1, 2, 3), has_aux=True)(
        x, r, scale, bias)
    (lp, outp), gp = jax.jit(jax.value_and_grad(lambda *a: run("pallas", *a), argnums=(0, 1, 2, 3), has_aux=True))(
        x, r, scale, bias)
    for a, b in zip(jax.tree.leaves(outp), jax.tree.leaves(outr)):
        close(a, b, 1e-5)
    for name, a, b in zip(("x", "residual", "scale", "bias"), gp, gr):
        close(a, b, 1e-4, name)


def test_norm_bf16():
    x, scale = arr((8, 128), 3.0, jnp.bfloat16), arr((128,))
    got = kernels.rms_norm(x, scale, impl="pallas")
    want = kernels.rms_norm(x.astype(jnp.float32), scale, impl="xla")
    assert got.dtype == jnp.bfloat16
    close(got, want, 2e-2)


# ---------------------------------------------------------------- bias + GELU (+ dropout)

@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.25])
# (148, 40): 37 row tiles of 4, three backward programs (the last walking 5 tiles); (36, 1100): two column blocks
@pytest.mark.parametrize("shape", [(3, 5, 40), (148, 40), (36, 1100)])
def test_bias_gelu_pallas_matches_reference(approximate, rate, shape):
    x, b, w = arr(shape), arr((shape[-1],)), arr(shape)
    seed = jnp.int32(11)
    f = lambda impl: jax.jit(jax.value_and_grad(
        lambda x, b: jnp.sum(kernels.bias_gelu(x, b, approximate=approximate, dropout_rate=rate, seed=seed,
                                               impl=impl) * w), argnums=(0, 1)))(x, b)
    (lr, gr), (lp, gp) = f("xla"), f("pallas")
    close(lp, lr, 1e-5)
    for a, b_ in zip(gp, gr):
        close(a, b_, 1e-4)
    y = np.asarray(kernels.bias_gelu(x, b, dropout_rate=rate, seed=seed, impl="pallas"))
    # zeros where GELU is not ~0 are dropped elements (below about -5.6 its tail is under 1e-7: the kernel's
    # erf rounds it to zero, XLA's keeps ~1e-8)
    live = np.abs(np.asarray(kernels.bias_gelu(x, b, impl="xla"))) > 1e-6
    dropped = float(np.mean(y[live] == 0))
    assert (dropped == 0) if rate == 0 else (0.1 < dropped < 0.4)
    if rate:  # another seed drops other elements
        y2 = kernels.bias_gelu(x, b, dropout_rate=rate, seed=12, impl="pallas")
        assert not np.array_equal(np.asarray(y) == 0, np.asarray(y2) == 0)


def test_jax_triton_skipped_on_cpu_with_reason(caplog, monkeypatch):
    from mmjax.kernels.bias_gelu import OP
    monkeypatch.setattr(OP, "_logged", set())  # "once" per process: earlier tests may have logged
    assert _dispatch.jax_triton(_dispatch.make_ctx(jnp.float32)) is not None
    x, b = arr((4, 32)), arr((32,))
    with caplog.at_level(logging.INFO, logger="mmjax.kernels"):
        y = kernels.bias_gelu(x, b, impl="auto")
    assert "jax-triton kernels run only on a CUDA GPU" in caplog.text and "chose 'xla'" in caplog.text
    close(y, jax.nn.gelu(x + b, approximate=False), 1e-6)
    with pytest.raises(ValueError, match="jax-triton kernels run only on a CUDA GPU"):
        kernels.bias_gelu(x, b, impl="triton")


# ---------------------------------------------------------------- dispatch

def test_every_op_dispatches_on_cpu_and_guards_gpu():
    cpu = _dispatch.make_ctx(jnp.bfloat16)
    old_gpu = _dispatch.Ctx("gpu", jnp.dtype("bfloat16"), (7, 5))
    for name, op in kernels.OPS.items():
        assert OP_OK(op, cpu), name
        for impl in op.available():
            if impl in ("pallas", "triton", "cudnn"):
                assert op.reason(impl, old_gpu) is not None, (name, impl)
    with pytest.raises(ValueError, match="unknown norm implementation"):
        kernels.rms_norm(arr((2, 16)), arr((16,)), impl="nope")


def OP_OK(op, ctx):
    return op.select("auto", ctx).name in ("xla", "chunked")
