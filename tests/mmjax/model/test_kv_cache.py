"""Prefill + token-by-token decode reproduces the full forward (float32, atol 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.model import KVCache

ATOL = 1e-4
_JIT = {}


def _jitted(graphdef, name):
    key = (graphdef, name)
    if key not in _JIT:
        _JIT[key] = jax.jit(lambda state, *a: getattr(nnx.merge(graphdef, state), name)(*a),
                            compiler_options={"xla_backend_optimization_level": 0})
    return _JIT[key]


@pytest.mark.parametrize("scan_layers", [True, False])
def test_prefill_then_decode_matches_forward(helpers, scan_layers):
    cfg = helpers["tiny_config"]()
    model = helpers["random_model"](cfg, seed=20)
    if not scan_layers:
        model = helpers["scan_to_loop"](model, helpers["tiny_config"](scan_layers=False))
    prompt_lens, steps, max_len = [9, 6], 4, 16
    full = helpers["make_batch"](seed=21, s=13, images_at=((0, 2, 0), (1, 1, 1)),
                                 lengths=[p + steps for p in prompt_lens])
    want = helpers["forward"](model, full)

    s_prompt = max(prompt_lens)
    prompt = {k: (v[:, :s_prompt].copy() if v.ndim == 2 else v) for k, v in full.items()}
    for row, p in enumerate(prompt_lens):
        prompt["segment_ids"][row, p:] = 0
        prompt["positions"][row, p:] = 0
        prompt["tokens"][row, p:] = 0

    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, max_len)
    assert isinstance(cache, KVCache)
    assert cache.k.shape == (cfg.text.n_layers, 2, max_len, cfg.text.n_kv_heads, cfg.text.resolved_head_dim)
    logits, cache = _jitted(graphdef, "prefill")(
        state, *(jnp.asarray(prompt[k]) for k in ("tokens", "positions", "segment_ids", "images", "image_valid")),
        cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lens)
    for row, p in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits)[row, :p], want[row, :p], atol=ATOL)

    decode = _jitted(graphdef, "decode_step")
    for t in range(steps):
        tokens = jnp.asarray([full["tokens"][row, p + t] for row, p in enumerate(prompt_lens)], jnp.int32)
        step_logits, cache = decode(state, tokens, cache)
        assert step_logits.shape == (2, cfg.vocab_size) and step_logits.dtype == jnp.float32
        for row, p in enumerate(prompt_lens):
            np.testing.assert_allclose(np.asarray(step_logits)[row], want[row, p + t], atol=ATOL,
                                       err_msg=f"step {t} row {row}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [p + steps for p in prompt_lens])


def test_cache_is_a_pytree(helpers):
    model = helpers["random_model"](helpers["tiny_config"](), seed=22)
    cache = model.init_cache(3, 8)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 3 and cache.lengths.dtype == jnp.int32 and cache.k.dtype == jnp.float32
    moved = jax.tree.map(lambda x: x + 1, cache)
    assert isinstance(moved, KVCache) and int(moved.lengths[0]) == 1
