"""`kernels.quant_matmul`: the Pallas kernel (interpret mode on CPU) against the jnp reference, int4 packing,
shape errors and dispatch. Small shapes; the real decode shapes run on the GPU (`-m gpu`)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.kernels.quant_matmul import (
    OP,
    pack_int4,
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_supported,
    unpack_int4,
)
from mmjax.kernels.quant_matmul import kernel as qk


def make_case(m: int, k: int, n: int, *, bits: int, group: int, dtype, seed: int = 0, layers: int | None = None):
    """x, unpacked q values, scale (with a leading layers axis when `layers` is given)."""
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    qmax = 7 if bits == 4 else 127
    q = rng.integers(-qmax, qmax + 1, size=(*lead, k, n)).astype(np.int8)
    s_shape = (*lead, n) if group == 0 else (*lead, k // group, n)
    scale = (rng.random(s_shape, dtype=np.float32) + 0.5) / qmax
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return x, jnp.asarray(q), jnp.asarray(scale)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bf16: the kernel rounds x * q products into the dot at bf16 weight precision (exact for |q| <= 127
    # times a bf16 x) and the output once; tolerances cover one bf16 rounding of |y| ~ sqrt(K)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16, 20])
@pytest.mark.parametrize("bits,group,k_splits", [(8, 0, 1), (8, 0, 2), (4, 128, 1), (4, 128, 2)])
def test_kernel_matches_reference(dtype, m, bits, group, k_splits):
    k, n = 512, 64
    x, q, scale = make_case(m, k, n, bits=bits, group=group, dtype=dtype, seed=m)
    w = pack_int4(q) if bits == 4 else q
    got = qk.quant_matmul(x, w, scale, group=group, bits=bits, interpret=True, block_n=32, k_splits=k_splits,
                          block_k=128)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, quant_matmul_reference(x, q, scale, group=group), dtype)


@pytest.mark.parametrize("k_splits", [1, 2])
def test_float32_output_of_bf16_inputs(k_splits):
    """`out_dtype=float32` (logits): the float32 accumulator is written as it is, not rounded through bf16."""
    x, q, scale = make_case(3, 256, 32, bits=8, group=0, dtype=jnp.bfloat16, seed=9)
    want = quant_matmul_reference(x, q, scale, group=0, out_dtype=jnp.float32)
    got = qk.quant_matmul(x, q, scale, group=0, bits=8, interpret=True, block_n=32, block_k=128, k_splits=k_splits,
                          out_dtype=jnp.float32)
    assert got.dtype == jnp.float32 and want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert quant_matmul(x, q, scale, out_dtype=jnp.float32).dtype == jnp.float32  # the op's dispatch passes it on


@pytest.mark.parametrize("bits,group,block_k", [(8, 32, 128), (8, 256, 128), (4, 64, 256), (4, 256, 128),
                                                (4, 0, 256)])
def test_kernel_groups_and_tiles(bits, group, block_k):
    """Groups smaller than, equal to and larger than the K tile (int8 with groups, int4 per channel)."""
    x, q, scale = make_case(3, 512, 32, bits=bits, group=group, dtype=jnp.float32, seed=group)
    w = pack_int4(q) if bits == 4 else q
    got = qk.quant_matmul(x, w, scale, group=group, bits=bits, interpret=True, block_n=16, block_k=block_k,
                          k_splits=2)
    _close(got, quant_matmul_reference(x, q, scale, group=group), jnp.float32)


def test_default_tiling_and_stacked_layer():
    """Default tiles, and one layer of a stacked [L, K // 2, N] weight read in place under jit."""
    x, q, scale = make_case(2, 256, 48, bits=4, group=128, dtype=jnp.float32, layers=3)
    w = jnp.stack([pack_int4(q[i]) for i in range(3)])
    run = jax.jit(lambda x, w, s, i: qk.quant_matmul(x, w, s, group=128, bits=4, layer=i, interpret=True))
    for i in (0, 2):
        _close(run(x, w, scale, jnp.int32(i)), quant_matmul_reference(x, q[i], scale[i], group=128), jnp.float32)


@pytest.mark.parametrize("bits,group,k_splits", [(8, 0, 1), (8, 0, 2), (4, 128, 1), (4, 256, 2)])
def test_transposed_weight_of_a_stacked_layer(bits, group, k_splits):
    """A weight stored [L, N, K] (int8) or [L, N, K // 2] (packed int4, `pack_int4(q).T`): one layer read in place
    equals the [K, N] result; its own default tiling too."""
    x, q, scale = make_case(5, 512, 64, bits=bits, group=group, dtype=jnp.float32, layers=3, seed=4)
    w = jnp.stack([pack_int4(q[i]) for i in range(3)]) if bits == 4 else q
    wt = jnp.swapaxes(w, 1, 2)
    run = jax.jit(lambda x, w, s, i: qk.quant_matmul(x, w, s, group=group, bits=bits, layer=i, transposed=True,
                                                     interpret=True, block_n=32, block_k=256, k_splits=k_splits))
    for i in (0, 2):
        _close(run(x, wt, scale, jnp.int32(i)), quant_matmul_reference(x, q[i], scale[i], group=group), jnp.float32)
    got = qk.quant_matmul(x, wt[1], scale[1], group=group, bits=bits, transposed=True, interpret=True)
    _close(got, quant_matmul_reference(x, q[1], scale[1], group=group), jnp.float32)
    want_cols = 256 if bits == 4 else 512
    with pytest.raises(ValueError, match=rf"want {want_cols} columns"):
        qk.quant_matmul(x, w[0], scale[0], group=group, bits=bits, transposed=True, interpret=True)


@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_weights(transposed):
    """float8_e4m3fn weights (bits=8) take the int8 path, converted in registers; per channel and per group."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((256, 32)) * 100, jnp.float32).astype(jnp.float8_e4m3fn)
    for group, scale in ((0, jnp.full((32,), 0.01)), (128, jnp.full((2, 32), 0.02))):
        want = quant_matmul_reference(x, q, scale, group=group)
        w = q.T if transposed else q
        got = qk.quant_matmul(x, w, scale, group=group, bits=8, transposed=transposed, interpret=True, block_n=16,
                              block_k=128)
        _close(got, want, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"float8_e4m3fn with bits=8"):
        quant_matmul(x, q[:128], jnp.ones((2, 32)), group=128, bits=4)


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_bit_trick_operands_equal_the_casts_for_every_byte(dt):
    """`convert="magic"`/"f16"`: every int8 value, and both nibbles of every packed byte, become exactly the
    value a plain cast gives (the tricks are exact, not approximations)."""
    every = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(16, 16)
    np.testing.assert_array_equal(np.asarray(qk._weight_operand(every, dt, "magic"), np.float32),
                                  np.asarray(every, np.float32))
    lo, hi = qk._nibble_operands(every, dt, "magic")
    want_lo, want_hi = qk._nibble_operands(every, dt, "cast")
    assert lo.dtype == dt and hi.dtype == dt
    np.testing.assert_array_equal(np.asarray(lo, np.float32), np.asarray(want_lo, np.float32))
    np.testing.assert_array_equal(np.asarray(hi, np.float32), np.asarray(want_hi, np.float32))


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("transposed", [False, True])
def test_convert_variants_match(kind, transposed):
    """The kernel with each `convert`: "magic" gives the cast's result bit for bit (the same bf16 operands), "f16"
    matches the reference within bf16's tolerance; x beyond float16's range is clipped, not turned to inf."""
    bits, group = (4, 128) if kind == "int4" else (8, 0)
    x, q, scale = make_case(5, 256, 32, bits=bits, group=group, dtype=jnp.bfloat16, seed=11)
    if kind == "fp8":
        q = q.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    w = pack_int4(q) if bits == 4 else q
    w = w.T if transposed else w

    def run(x, convert):
        return qk.quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, convert=convert,
                               interpret=True, block_n=16, block_k=256, k_splits=1)
    cast = run(x, "cast")
    np.testing.assert_array_equal(np.asarray(run(x, "magic"), np.float32), np.asarray(cast, np.float32))
    # interpret mode runs no PTX: "ptx" takes the jnp form of its trick there (the GPU test compares the PTX)
    np.testing.assert_array_equal(np.asarray(run(x, "ptx"), np.float32), np.asarray(cast, np.float32))
    _close(run(x, "f16"), quant_matmul_reference(x, q, scale, group=group), jnp.bfloat16)
    big = x.at[0, 0].set(1e6)
    assert np.isfinite(np.asarray(run(big, "f16"), np.float32)).all()
    with pytest.raises(ValueError, match="convert must be one of"):
        run(x, "fast")


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("convert", qk.CONVERTS)
def test_kernel_lowers_to_triton_for_a_gpu(kind, convert):
    """Without a GPU, the kernel still lowers to Triton IR for one (an export for the `cuda` platform): every
    operation of each `convert` variant has a Triton lowering. PTX compilation is left to the GPU tests."""
    from jax import export
    bits, group = (4, 128) if kind == "int4" else (8, 0)
    x = jnp.zeros((16, 2048), jnp.bfloat16)
    w = jnp.zeros((3072, 2048 * bits // 8), jnp.float8_e4m3fn if kind == "fp8" else jnp.int8)
    scale = jnp.ones((3072,) if group == 0 else (2048 // group, 3072), jnp.float32)
    run = jax.jit(lambda x, w, s: qk.quant_matmul(x, w, s, group=group, bits=bits, transposed=True, convert=convert,
                                                  interpret=False))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(run, platforms=["cuda"], disabled_checks=[triton])(x, w, scale)
    assert "xla.gpu.triton" in exported.mlir_module()


def _swiglu_of(y):
    gate, up = np.split(np.asarray(y, np.float32), 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("layers", [None, 2])
def test_swiglu_epilogue_matches_the_activation_of_the_product(kind, transposed, layers):
    """`epilogue="swiglu"`: silu(gate) * up of the float32 product, the gate half's channel block and the up half's
    read by one program (both layouts, per-channel and int4 group scales, a layer of a stack); the op's XLA
    path gives the same."""
    bits, group = (4, 128) if kind == "int4" else (8, 0)
    m, k, n = 5, 256, 64
    x, q, scale = make_case(m, k, n, bits=bits, group=group, dtype=jnp.float32, seed=13, layers=layers)
    if kind == "fp8":
        q = q.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    one = (lambda a: a) if layers is None else (lambda a: a[1])  # noqa: E731
    want = _swiglu_of(quant_matmul_reference(x, one(q).astype(jnp.float32), one(scale), group=group))
    pack = (lambda a: pack_int4(a)) if bits == 4 else (lambda a: a)  # noqa: E731
    w = pack(q) if layers is None else jnp.stack([pack(q[i]) for i in range(layers)])
    w = jnp.swapaxes(w, -1, -2) if transposed else w
    got = qk.quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, epilogue="swiglu",
                          layer=None if layers is None else 1, interpret=True, block_n=16, block_k=256)
    assert got.shape == (m, n // 2) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if layers is None:
        via_op = quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, epilogue="swiglu",
                              impl="xla")
        np.testing.assert_allclose(np.asarray(via_op), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_swiglu_epilogue_rejects_what_it_cannot_do():
    x, q, scale = make_case(3, 256, 32, bits=8, group=0, dtype=jnp.float32, seed=1)
    with pytest.raises(ValueError, match="no K split"):
        qk.quant_matmul(x, q, scale, group=0, bits=8, epilogue="swiglu", interpret=True, k_splits=2, block_k=128)
    with pytest.raises(ValueError, match="even number of weight channels"):
        quant_matmul(x, q[:, :24].at[:, 23].set(0)[:, :23], scale[:23], epilogue="swiglu")
    with pytest.raises(ValueError, match="epilogue must be one of"):
        quant_matmul(x, q, scale, epilogue="gelu")


def test_swiglu_epilogue_lowers_to_triton_for_a_gpu():
    """The 1.24B decoder's gate/up shape with the epilogue lowers to Triton IR for a GPU (see the test above)."""
    from jax import export
    x = jnp.zeros((16, 2048), jnp.bfloat16)
    w, scale = jnp.zeros((16384, 2048), jnp.int8), jnp.ones((16384,), jnp.float32)
    run = jax.jit(lambda x, w, s: qk.quant_matmul(x, w, s, group=0, bits=8, transposed=True, epilogue="swiglu",
                                                  interpret=False))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(run, platforms=["cuda"], disabled_checks=[triton])(x, w, scale)
    assert exported.out_avals[0].shape == (16, 8192)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 32, 64])
def test_default_tiling_fills_the_gpu(bits, m):
    """The 1.24B decoder's decode shapes get valid tiles and, through K splits and narrower N tiles, about a
    program per SM (at M = 64 the partials' cap may leave fewer, never below half)."""
    group = 128 if bits == 4 else 0
    for k, n in ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)):
        t = qk.default_tiling(bits, m, k, n, group)
        assert qk.tiling_problem(m, k, n, bits=bits, group=group, tiling=t) is None
        programs = -(-m // t.block_m) * (n // t.block_n) * t.k_splits
        assert programs >= (qk.TARGET_PROGRAMS if m <= 32 else qk.TARGET_PROGRAMS // 2), (k, n, t)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m", [1, 32, 64])
def test_swiglu_tiling_fills_the_gpu_without_k_splits(transposed, m):
    """The swiglu epilogue takes no K split: the 1.24B gate/up shape still gets about a program per SM, from
    narrower N tiles."""
    t = qk.launch_tiling(8, m, 2048, 8192, 0, transposed=transposed, epilogue="swiglu")
    assert t.k_splits == 1 and qk.tiling_problem(m, 2048, 8192, bits=8, group=0, tiling=t) is None
    assert -(-m // t.block_m) * (8192 // t.block_n) >= qk.TARGET_PROGRAMS


@pytest.mark.parametrize("m", [1, 16, 32, 64])
def test_int4_swiglu_tiling_takes_narrow_tiles_only_for_small_steps(m):
    """int4's epilogue goes to two programs per SM (32-channel tiles) up to 16 tokens, where that ran fastest,
    and keeps the int8 rule above it, where the narrow tiles lost end to end."""
    t = qk.launch_tiling(4, m, 2048, 8192, 128, transposed=True, epilogue="swiglu")
    assert t.k_splits == 1 and qk.tiling_problem(m, 2048, 8192, bits=4, group=128, tiling=t) is None
    programs = -(-m // t.block_m) * (8192 // t.block_n)
    if m <= qk.SWIGLU_INT4_MAX_M:
        assert t.block_n == 32 and programs >= qk.SWIGLU_INT4_TARGET_PROGRAMS
    else:
        t8 = qk.launch_tiling(8, m, 2048, 8192, 0, transposed=True, epilogue="swiglu")
        assert programs == -(-m // t8.block_m) * (8192 // t8.block_n) and t.block_n > 32


def test_pack_roundtrip_and_layout():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.integers(-8, 8, size=(256, 5)), jnp.int8)
    p = pack_int4(q)
    assert p.shape == (128, 5) and p.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(unpack_int4(p)), np.asarray(q))
    # row r < 64 of a block: low nibble = row r, high nibble = row r + 64 (second block starts at packed row 64)
    b = np.asarray(p).astype(np.uint8)
    np.testing.assert_array_equal(b[70] & 0xF, np.asarray(q)[128 + 6].astype(np.uint8) & 0xF)
    np.testing.assert_array_equal(b[70] >> 4, np.asarray(q)[128 + 64 + 6].astype(np.uint8) & 0xF)
    with pytest.raises(ValueError, match=r"\(100, 5\)"):
        pack_int4(jnp.zeros((100, 5), jnp.int8))


@pytest.mark.parametrize("bad,match", [
    (dict(n=40, block_n=32), r"N=40 of x \[4, 256\], weight \[256, 40\]"),
    (dict(k_splits=4, block_k=128), r"K=256 of x \[4, 256\].*k_splits \* block_k = 4 \* 128"),
])
def test_kernel_rejects_bad_tiling(bad, match):
    n = bad.pop("n", 32)
    x, q, scale = make_case(4, 256, n, bits=8, group=0, dtype=jnp.float32)
    with pytest.raises(ValueError, match=match):
        qk.quant_matmul(x, q, scale, group=0, bits=8, interpret=True, **bad)


def test_shape_errors_name_the_shapes():
    x, q, scale = make_case(4, 256, 32, bits=8, group=0, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"weight \(256, 32\) does not match x \(4, 256\)"):
        quant_matmul(x, q, scale, bits=4, group=128)   # unpacked int4
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 32\)"):
        quant_matmul(x, q, scale, bits=8, group=128)
    with pytest.raises(ValueError, match=r"pack block 128; x \(4, 192\)"):
        quant_matmul(jnp.zeros((4, 192)), jnp.zeros((96, 32), jnp.int8), jnp.zeros((3, 32)), bits=4, group=64)


@pytest.mark.parametrize("bits", [8, 4])
def test_dispatch_on_cpu_uses_the_reference(bits):
    group = 128 if bits == 4 else 0
    x, q, scale = make_case(6, 256, 32, bits=bits, group=group, dtype=jnp.bfloat16)
    w = pack_int4(q) if bits == 4 else q
    assert "interpret" in quant_matmul_supported(x, w, scale, group=group, bits=bits)
    x3 = x.reshape(2, 3, 256)
    got = quant_matmul(x3, w, scale, group=group, bits=bits)
    want = quant_matmul_reference(x, q, scale, group=group).reshape(2, 3, 32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # named explicitly, the kernel runs in interpret mode
    _close(quant_matmul(x3, w, scale, group=group, bits=bits, impl="pallas"), want, jnp.bfloat16)
    assert OP.available() == ["pallas", "xla"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m", [1, 32, 64])
@pytest.mark.parametrize("k,n", [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)])
def test_kernel_gpu_decode_shapes(kind, transposed, m, k, n):
    """The 1.24B decoder's decode shapes in bf16 with the default tiling on the GPU, both weight layouts."""
    bits = 4 if kind == "int4" else 8
    group = 128 if bits == 4 else 0
    x, q, scale = make_case(m, k, n, bits=bits, group=group, dtype=jnp.bfloat16)
    if kind == "fp8":
        q = q.astype(jnp.float32).astype(jnp.float8_e4m3fn)  # |q| <= 127: e4m3 rounds some, the reference too
    w = pack_int4(q) if bits == 4 else q
    w = w.T if transposed else w
    assert quant_matmul_supported(x, w, scale, group=group, bits=bits, transposed=transposed) is None
    _close(quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed),
           quant_matmul_reference(x, q, scale, group=group), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("convert", ["magic", "f16", "ptx"])
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m", [1, 32])
@pytest.mark.parametrize("k,n", [(2048, 3072), (8192, 2048)])
def test_kernel_gpu_convert_variants(convert, kind, transposed, m, k, n):
    """Each `convert` variant compiles for the GPU at decode shapes and matches the reference."""
    bits = 4 if kind == "int4" else 8
    group = 128 if bits == 4 else 0
    x, q, scale = make_case(m, k, n, bits=bits, group=group, dtype=jnp.bfloat16)
    if kind == "fp8":
        q = q.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    w = pack_int4(q) if bits == 4 else q
    w = w.T if transposed else w
    got = qk.quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, convert=convert)
    _close(got, quant_matmul_reference(x, q, scale, group=group), jnp.bfloat16)
    if convert != "f16":  # exact conversions: the same operands as the plain casts, so the same result
        cast = qk.quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, convert="cast")
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(cast, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m", [1, 32, 64])
def test_kernel_gpu_swiglu_epilogue(kind, transposed, m):
    """The gate/up shape with the swiglu epilogue compiles for the GPU and equals the activation of the product."""
    bits = 4 if kind == "int4" else 8
    group = 128 if bits == 4 else 0
    x, q, scale = make_case(m, 2048, 16384, bits=bits, group=group, dtype=jnp.bfloat16)
    if kind == "fp8":
        q = q.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    w = pack_int4(q) if bits == 4 else q
    w = w.T if transposed else w
    assert quant_matmul_supported(x, w, scale, group=group, bits=bits, transposed=transposed,
                                  epilogue="swiglu") is None
    got = quant_matmul(x, w, scale, group=group, bits=bits, transposed=transposed, epilogue="swiglu")
    want = _swiglu_of(quant_matmul_reference(x, q.astype(jnp.float32), scale, group=group, out_dtype=jnp.float32))
    _close(got, want, jnp.bfloat16)


def test_sweep_times_the_swiglu_epilogue_over_its_tilings(tmp_path):
    """The sweep's quick mode (interpret mode here) runs every row it would time on a GPU, the epilogue's
    tilings included, and each row's output matches the reference."""
    from mmjax.bench import quant_matmul_sweep as sweep

    out = tmp_path / "sweep.json"
    assert sweep.main([str(out), "--quick", "--bits", "4", "--shapes", "gate_up", "--layouts", "nk", "--swiglu"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    swiglu = [r for r in rows if r["impl"] == "pallas_nk_swiglu"]
    assert {str(r["tiling"]) for r in swiglu} == {"default", str({"block_n": 32})}
    assert all(r["rel_err"] < 2e-2 for r in rows if "rel_err" in r)
