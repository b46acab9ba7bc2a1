"""Context-parallel attention over a 4-way sequence split equals reference attention, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.kernels.attention import attention_reference, make_mask
from mmjax.parallel.context_parallel import _zigzag_perms, context_parallel_attention
from mmjax.parallel.rules import resolve_rules
from mmjax.parallel.sharding import ShardingContext

B, S, H, KV, D = 2, 32, 4, 2, 8


def packed_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, h, D)), jnp.float32) for h in (H, KV, KV))
    # row 0: three packed segments then padding; row 1: an image block (bidirectional) inside segment 1
    seg = np.zeros((B, S), np.int32)
    seg[0, :10], seg[0, 10:23], seg[0, 23:29] = 1, 2, 3
    seg[1, :] = 1
    pos = np.zeros((B, S), np.int32)
    for b in range(B):
        for s_id in set(seg[b]) - {0}:
            idx = np.where(seg[b] == s_id)[0]
            pos[b, idx] = np.arange(len(idx))
    blk = np.zeros((B, S), np.int32)
    blk[1, 5:14] = 1
    return q, k, v, jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(blk)


def mesh_2x4():
    return Mesh(np.asarray(jax.devices()).reshape(1, 2, 1, 4, 1), ("data", "fsdp", "pipeline", "sequence", "tensor"))


def test_zigzag_moves_are_permutations():
    for n in (2, 4, 8):
        for perm in _zigzag_perms(n):
            assert sorted(d for _, d in perm) == list(range(n))


@pytest.mark.parametrize("mode, balance", [("ring", True), ("ring", False), ("allgather", True)])
def test_context_parallel_matches_reference_forward_and_grad(mode, balance):
    q, k, v, seg, pos, blk = packed_inputs()
    ctx = ShardingContext(mesh_2x4(), resolve_rules(), context_parallel=mode, load_balance=balance)

    def ref(q, k, v):
        mask = make_mask(seg, seg, pos, pos, causal=True, q_block_ids=blk, kv_block_ids=blk)
        return attention_reference(q, k, v, mask)

    def cp(q, k, v):
        return context_parallel_attention(ctx, q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                          kv_positions=pos, causal=True, q_block_ids=blk, kv_block_ids=blk,
                                          impl="reference")

    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, H, D)), jnp.float32)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))
    shard = NamedSharding(ctx.mesh, P("fsdp", "sequence"))
    args = jax.device_put((q, k, v), shard)
    out_cp, grads_cp = jax.jit(lambda *a: (cp(*a), jax.grad(loss(cp), argnums=(0, 1, 2))(*a)))(*args)
    out_ref, grads_ref = jax.jit(lambda *a: (ref(*a), jax.grad(loss(ref), argnums=(0, 1, 2))(*a)))(q, k, v)
    np.testing.assert_allclose(out_cp, out_ref, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(out_ref[0, 29:]).max()) == 0.0  # padding rows stay zero
    for g_cp, g_ref in zip(grads_cp, grads_ref):
        np.testing.assert_allclose(g_cp, g_ref, rtol=1e-4, atol=1e-5)
