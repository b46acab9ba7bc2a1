"""CPU checks of the Mosaic GPU flash BACKWARD (`kernels.attention.flash_mgpu_bwd`): config errors, SMEM
budget, the per-CTA q-tile ranges, Mosaic GPU lowering of fwd+bwd (D 64/128, causal/non-causal, GQA,
image blocks), and the kernel's gradients in Mosaic GPU's CPU interpreter against the float32 reference: the
barriers (TMA ring, late dQ's "dsT filled"/"dsT read"), tile ranges, mask and gradient algebra run as on the
GPU; the matmuls are plain dots there and dQ partials are summed outside instead of TMA reduce-added. The
wgmma path's numerics are checked on the GPU: tests/mmjax/kernels/test_gpu_mgpu.py.

Lowering runs the Pallas -> Mosaic GPU pipeline (layouts, wgmma operand transforms, TMA reduce-add) but not
ptxas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flash_mgpu_cpu import _random_layout, check_grads_vs_reference  # pytest puts this folder on sys.path

from mmjax.kernels.attention import flash_mgpu as fm
from mmjax.kernels.attention import flash_mgpu_bwd as mb
from mmjax.kernels.attention.reference import make_mask


@pytest.mark.parametrize("kw,match", [
    (dict(bwd_impl="triton"), "bwd_impl"),
    (dict(bwd_block_q=32), "bwd_block_q"),
    (dict(bwd_block_kv=256), "bwd_block_kv"),
    (dict(bwd_max_concurrent_steps=1), "bwd_max_concurrent_steps"),
    (dict(bwd_cta_group=0), "bwd_cta_group"),
    (dict(cta_group=-1), "cta_group"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        fm.MgpuFlashConfig(**kw).check()


@pytest.mark.parametrize("n_tiles,n_pairs,group", [(32, 64, 4), (5, 7, 3), (4, 2, 8), (1, 3, 1), (6, 6, 1 << 30)])
@pytest.mark.parametrize("descending", [False, True])
def test_cta_coords_is_a_heaviest_first_permutation(n_tiles, n_pairs, group, descending):
    pid = jnp.arange(n_tiles * n_pairs, dtype=jnp.int32)
    tile, pair = (np.asarray(a) for a in mb.cta_coords(pid, n_tiles, n_pairs, group, descending))
    assert sorted(zip(tile.tolist(), pair.tolist())) == [(t, p) for t in range(n_tiles) for p in range(n_pairs)]
    g = min(group, n_pairs)
    heavy = n_tiles - 1 if descending else 0
    for first in range(0, n_pairs, g):  # each group: its pairs only, launched heaviest tile first
        sel = (pair >= first) & (pair < first + g)
        idx = np.flatnonzero(sel)
        assert idx.max() - idx.min() + 1 == idx.size, "a group's CTAs are not contiguous in launch order"
        rank = tile[sel] if not descending else n_tiles - 1 - tile[sel]
        assert (np.diff(rank) >= 0).all() and tile[sel][0] == heavy


def test_smem_budget_and_padding():
    t = mb.BwdTiles()
    # D=128 bf16 (split dQ, double-buffered dsT): 2 ring slots fit, 3 do not; D=64 fits 4.
    assert t.steps_for(128, 2, 3) == 2
    assert t.steps_for(64, 2, 3) == 4
    with pytest.raises(ValueError, match="SMEM"):
        mb.BwdTiles(max_concurrent_steps=3).steps_for(128, 2, 3)
    assert t.split_dq(128) and not t.split_dq(64)
    cfg = fm.MgpuFlashConfig(bwd_impl="mgpu", bwd_block_kv=128)
    mq, mk = cfg.pad_multiples(cfg.bwd_config(128))
    assert mq % 64 == 0 and mk % 256 == 0


def test_bwd_bounds_cover_mask():
    rng = np.random.default_rng(1)
    b, s = 2, 1024
    seg, pos, blk = _random_layout(rng, b, s, True)
    qm = (jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(blk))
    t = mb.BwdTiles()
    bnd = np.asarray(mb.bwd_bounds(qm, qm, t, True)).reshape(b, s // 128, 4)
    mask = np.asarray(make_mask(qm[0], qm[0], qm[1], qm[1], causal=True, q_block_ids=qm[2], kv_block_ids=qm[2]))
    tiles = mask.reshape(b, s // 64, 64, s // 128, 128)
    may, full = tiles.any((2, 4)).swapaxes(1, 2), tiles.all((2, 4)).swapaxes(1, 2)  # [b, kv tile, q tile]
    lo, flo, fhi, hi = np.moveaxis(bnd, -1, 0)
    i = np.arange(s // 64)
    assert not np.any(may & ~((i >= lo[..., None]) & (i < hi[..., None])))
    assert not np.any(((i >= flo[..., None]) & (i < fhi[..., None])) & ~full)


def _case(b=1, s=300, h=4, kv=2, d=128, causal=True, blocks=False, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    seg, pos, blk = _random_layout(rng, b, s, blocks)
    lay = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), q_positions=jnp.asarray(pos),
               kv_positions=jnp.asarray(pos))
    if blocks:
        lay.update(q_block_ids=jnp.asarray(blk), kv_block_ids=jnp.asarray(blk))
    return q, k, v, lay


@pytest.mark.parametrize("d,causal,blocks,bq", [(128, True, False, 64), (64, True, True, 64),
                                                (128, False, False, 64), (64, False, False, 128)])
def test_lowers_to_mosaic_gpu(d, causal, blocks, bq):
    q, k, v, lay = _case(d=d, causal=causal, blocks=blocks)
    cfg = fm.MgpuFlashConfig(bwd_impl="mgpu", bwd_block_q=bq)
    loss = lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=causal, config=cfg, **lay).astype(
        jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2  # the forward and the one backward kernel
    assert "mmjax_flash_dq" not in text and "mmjax_flash_dkv" not in text


# ----------------------------------------------------------------------------------------------
# The interpreter: ring of 2 slots (deeper rings hang jax 0.10.2's interpreter, see test_flash_mgpu_cpu).
# D=128 runs the two-warpgroup dQ split with its one-step-late dQ; D=64 each warpgroup's own dQ partial.
# Tolerance: bf16 inputs, gradients within 5e-2 of max |reference gradient| (as the forward's vjp test).

_INTERP = fm.MgpuFlashConfig(interpret=True, block_kv=64, max_concurrent_steps=2, bwd_impl="mgpu",
                             bwd_max_concurrent_steps=2, cta_group=1, bwd_cta_group=1)


# A barrier bug deadlocks the interpreter in a wait that SIGALRM does not interrupt: the thread method ends
# the run with a stack dump instead of hanging CI (checked by dropping the last late dQ).
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("d,causal,blocks,h,kv", [(128, True, True, 2, 1), (64, True, False, 2, 1),
                                                  (128, False, False, 2, 2)])
def test_interpret_gradients_match_reference(d, causal, blocks, h, kv):
    q, k, v, lay = _case(b=1, s=130, h=h, kv=kv, d=d, causal=causal, blocks=blocks, seed=3)  # 3 tiles, last padded
    mask = make_mask(lay["q_segment_ids"], lay["kv_segment_ids"], lay["q_positions"], lay["kv_positions"],
                     causal=causal, q_block_ids=lay.get("q_block_ids"), kv_block_ids=lay.get("kv_block_ids"))
    dq = check_grads_vs_reference(q, k, v, lay, mask, causal, _INTERP)[0].astype(jnp.float32)
    empty = ~mask.any(-1)  # fully masked query rows (padding) get exactly zero dq
    assert float(jnp.max(jnp.where(empty[:, :, None, None], jnp.abs(dq), 0.0))) == 0.0
