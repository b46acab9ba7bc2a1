"""One sharding context: the kernels' `MeshSharding` variable, extended by the rules-driven `ShardingContext`.

Its batch/head axes come from the `batch` and `heads` rules, so overriding the rules moves where the custom
kernels split their inputs; a bare `MeshSharding` concerns the kernels only (no activation constraints).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mmjax import kernels
from mmjax.config import load_config
from mmjax.kernels import _sharding
from mmjax.parallel import sharding
from mmjax.parallel.rules import resolve_rules
from mmjax.parallel.sharding import ShardingContext, context_from_config

B, S, H, KV, D = 8, 4, 8, 4, 2


def mesh_2x2x2():
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 1, 1, 2)
    return Mesh(devices, ("data", "fsdp", "pipeline", "sequence", "tensor"))


def local_shapes(ctx):
    """Shapes of q and of one id array as the per-shard function sees them under `ctx`, and the output."""
    seen = []

    def per_shard(q, k, v, *, q_segment_ids, causal):
        seen.append((q.shape, k.shape, q_segment_ids.shape, causal))
        return q * 2

    q = jnp.arange(B * S * H * D, dtype=jnp.float32).reshape(B, S, H, D)
    k = v = jnp.ones((B, S, KV, D), jnp.float32)
    with kernels.use_sharding(ctx):
        out = jax.jit(lambda q, k, v: _sharding.shard_attention(per_shard, q, k, v, causal=True,
                                                                 q_segment_ids=jnp.ones((B, S), jnp.int32)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q) * 2)
    return seen


def test_axes_come_from_the_rules():
    mesh = mesh_2x2x2()
    ctx = ShardingContext(mesh, resolve_rules())
    assert (ctx.batch_axes, ctx.head_axes) == (("data", "fsdp"), ("tensor",))
    moved = ShardingContext(mesh, resolve_rules({"batch": "data", "heads": ["tensor", "fsdp"],
                                                 "kv_heads": ["tensor", "fsdp"]}))
    assert (moved.batch_axes, moved.head_axes) == (("data",), ("tensor", "fsdp"))
    # query and kv heads split differently: GQA groups would straddle shards, so heads stay whole
    assert ShardingContext(mesh, resolve_rules({"kv_heads": None})).head_axes == ()
    # the config's `parallel.rules` reach the kernels through context_from_config
    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, rules={"batch": ["fsdp"]}))
    assert context_from_config(cfg, mesh).batch_axes == ("fsdp",)


def test_kernels_split_where_the_rules_say():
    mesh = mesh_2x2x2()
    # default rules: batch over data x fsdp (4), heads over tensor (2)
    assert local_shapes(ShardingContext(mesh, resolve_rules())) == [
        ((B // 4, S, H // 2, D), (B // 4, S, KV // 2, D), (B // 4, S), True)]
    # overridden: batch over data (2), heads over tensor x fsdp (4)
    moved = ShardingContext(mesh, resolve_rules({"batch": "data", "heads": ["tensor", "fsdp"],
                                                 "kv_heads": ["tensor", "fsdp"]}))
    assert local_shapes(moved) == [((B // 2, S, H // 4, D), (B // 2, S, KV // 4, D), (B // 2, S), True)]
    # an axis shared by the batch and heads rules splits the batch only
    shared = ShardingContext(mesh, resolve_rules({"heads": ["fsdp", "tensor"], "kv_heads": ["fsdp", "tensor"]}))
    assert local_shapes(shared)[0][0] == (B // 4, S, H // 2, D)


def test_one_context_variable_seen_by_model_and_kernels():
    mesh = mesh_2x2x2()
    ctx = ShardingContext(mesh, resolve_rules())
    assert _sharding.current() is None and sharding.current() is None
    with sharding.use_sharding(ctx):
        assert _sharding.current() is ctx and sharding.current() is ctx and _sharding.active() is ctx
        with kernels.use_sharding(None):  # e.g. inside a shard_map body: nothing to split any more
            assert _sharding.current() is None and sharding.current() is None
        assert _sharding.current() is ctx
    bare = kernels.MeshSharding(mesh, batch_axes=("data",))
    with kernels.use_sharding(bare):
        assert _sharding.current() is bare and sharding.current() is None  # no rules: no activation constraints
        x = jnp.ones((B, S))
        assert sharding.constrain(x, ("batch", "length")) is x
    one_device = ShardingContext(Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), mesh.axis_names),
                                 resolve_rules())
    with kernels.use_sharding(one_device):
        assert _sharding.active() is None  # nothing to split on one device: kernels run as they are
