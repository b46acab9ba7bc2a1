"""`optim.fused`: AdamW over flat buckets of parameters gives the leaf-by-leaf optimizer's updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmjax.config import ConfigError, load_config
from mmjax.training.buckets import _groups
from mmjax.training.optimizer import _decay_mask, make_optimizer


def params_like_a_model(rng):
    """Matrices (decayed), vectors (not), a stacked [layers, dim] norm scale (decayed: ndim 2), mixed dtypes."""
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return {"embed": f32(11, 6), "layers": {0: {"w": f32(6, 3, 2), "scale": f32(6), "bias": f32(3)},
                                            1: {"w": f32(6, 3, 2), "scale": f32(6), "bias": f32(3)}},
            "stacked_scale": f32(2, 6), "half": jnp.asarray(rng.standard_normal((4, 5)), jnp.bfloat16),
            "half_bias": jnp.asarray(rng.standard_normal(5), jnp.bfloat16)}


def run(cfg, params, grads):
    opt = make_optimizer(cfg)
    state = opt.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g)
    return params, state


@pytest.mark.parametrize("clip", [0.0, 1e9, 0.5])  # off; on but never reached; on and clipping every step
def test_fused_adamw_equals_leaf_by_leaf(clip):
    rng = np.random.default_rng(0)
    params = params_like_a_model(rng)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 3, p.dtype), params)
             for _ in range(6)]
    # the project's schedule: linear warm-up into cosine decay, over the steps run here
    base = ["optim.warmup_steps=2", "train.steps=6", "optim.lr=0.01", "optim.weight_decay=0.1",
            f"optim.clip_grad_norm={clip}"]
    want, _ = run(load_config(None, base), params, grads)
    got, state = run(load_config(None, [*base, "optim.fused=true"]), params, grads)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype, path
        if clip == 0.5:  # the global norm sums per bucket instead of per leaf: the last bits may differ
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-6, atol=1e-7,
                                       err_msg=str(path))
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))
    # the moments are a few flat buffers: one per dtype and weight-decay class
    adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    assert sorted(adam.mu) == ["decay_bfloat16", "decay_float32", "no_decay_bfloat16", "no_decay_float32"]
    assert adam.mu["decay_float32"].shape == (11 * 6 + 2 * 36 + 12,)


def test_buckets_follow_the_decay_mask():
    params = params_like_a_model(np.random.default_rng(1))
    leaves = jax.tree.leaves(params)
    groups = _groups(params, _decay_mask)
    decayed = jax.tree.leaves(_decay_mask(params))
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(leaves)))
    for name, idx in groups.items():
        assert {(bool(decayed[i]), leaves[i].dtype.name) for i in idx} == {(name.startswith("decay_"),
                                                                           name.split("_")[-1])}


def test_fused_refuses_a_mesh_of_several_devices():
    from mmjax.parallel.mesh import make_mesh
    from mmjax.training.init import create_train_state, model_setup

    tiny = ["model.text_only=true", "model.vocab_size=64", "model.max_seq_len=16", "model.text.dim=16",
            "model.text.mlp_dim=32", "model.text.n_layers=1", "train.global_batch_size=8", "optim.fused=true"]
    cfg = load_config(None, tiny)
    mesh = make_mesh(cfg)
    assert mesh.devices.size > 1  # the test session's 8 CPU devices
    with pytest.raises(ConfigError, match="optim.fused=true .* mesh of 8 devices"):
        create_train_state(cfg, mesh, model_setup(cfg, mesh, image_token_id=0), make_optimizer(cfg))
