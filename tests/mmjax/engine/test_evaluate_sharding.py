"""Evaluation under a mesh traces inside the run's sharding context: the custom attention kernel runs per
(batch, head) shard during generation (prefill and decode) instead of replicated, with the same answers."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.config import load_config
from mmjax.engine.evaluate import make_generate_fn
from mmjax.engine.init import model_setup
from mmjax.kernels import _sharding
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.rules import batch_sharding
from mmjax.parallel.sharding import context_from_config

attention_module = importlib.import_module("mmjax.kernels.attention")  # the package, not kernels.attention()
TINY = ["model.text_only=true", "model.vocab_size=64", "model.max_seq_len=16", "model.text.dim=32",
        "model.text.mlp_dim=64", "model.text.n_layers=1", "model.text.n_heads=4", "model.text.n_kv_heads=2",
        "model.compute_dtype=float32", "model.attention_impl=pallas", "train.global_batch_size=4",
        "mesh.data=2", "mesh.tensor=2"]


def test_generation_runs_kernels_per_shard(monkeypatch):
    cfg = load_config(None, TINY)
    mesh = make_mesh(cfg, jax.devices()[:4])
    setup = model_setup(cfg, mesh, image_token_id=0)
    params = setup.make_params()
    seen = []  # (context active in the dispatcher, q shape each shard's kernel sees)
    real = attention_module.shard_attention

    def spy(fn, q, k, v, **inputs):
        def per_shard(q, k, v, **kw):
            seen.append((_sharding.active(), q.shape))
            return fn(q, k, v, **kw)

        ctx = _sharding.active()
        seen.append((ctx, None))
        return real(per_shard, q, k, v, **inputs)

    monkeypatch.setattr(attention_module, "shard_attention", spy)
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 64, (4, 8)).astype(np.int32)
    segment_ids = np.ones((4, 8), np.int32)
    segment_ids[1, 5:] = 0  # a right-padded prompt
    host = {"tokens": tokens, "positions": np.broadcast_to(np.arange(8, dtype=np.int32), (4, 8)).copy(),
            "segment_ids": segment_ids}
    prompt = {k: jax.device_put(x, batch_sharding(mesh, x.ndim)) for k, x in host.items()}
    kw = dict(max_new_tokens=3, eos_id=1, pad_id=0)

    sharded = make_generate_fn(setup.graphdef, sharding=context_from_config(cfg, mesh), **kw)(params, prompt)
    ctx = context_from_config(cfg, mesh)
    dispatched = [c for c, shape in seen if shape is None]
    per_shard = [shape for c, shape in seen if shape is not None]
    assert len(dispatched) == 2 and all(c is not None and c.mesh is mesh for c in dispatched)  # prefill, decode
    assert ctx.batch_axes == ("data", "fsdp") and ctx.head_axes == ("tensor",)
    # batch 4 over data=2, 4 query heads over tensor=2; inside the shard the context is left (no nesting)
    assert [s[0] for s in per_shard] == [2, 2] and [s[2] for s in per_shard] == [2, 2]
    assert all(c is None for c, shape in seen if shape is not None)

    seen.clear()
    plain = make_generate_fn(setup.graphdef, **kw)(params, prompt)  # no context: the kernel replicated
    assert [c for c, _ in seen] == [None, None, None, None]
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(plain))
    assert jnp.asarray(sharded).shape == (4, 3)
