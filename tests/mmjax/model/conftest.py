"""Tiny configs and fast model construction for the model tests.

Real initialisation compiles one jax.random kernel per parameter shape (seconds on a loaded 2-core CPU),
so most tests build the module abstractly (`nnx.eval_shape`) and fill it from numpy; `test_init` checks
the real initialiser once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.config import ModelConfig, TextConfig, VisionConfig
from mmjax.model import MLLM
from mmjax.model.layers import params_in_layout

IMAGE_TOKEN = 3


def tiny_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(
        vocab_size=64, max_seq_len=32, compute_dtype="float32", attention_impl="auto",
        text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48),
        vision=VisionConfig(image_size=8, patch_size=4, dim=16, n_layers=2, n_heads=2, mlp_dim=24),
    )
    return dataclasses.replace(cfg, **overrides)


def random_model(cfg: ModelConfig, seed: int = 0) -> MLLM:
    """MLLM with every parameter drawn from numpy (std 0.2 so that layers visibly interact)."""
    model = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=IMAGE_TOKEN, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.2, x.dtype), state)
    nnx.update(model, state)
    return model


def scan_to_loop(scan_model: MLLM, loop_cfg: ModelConfig) -> MLLM:
    """A model of `loop_cfg` (scan_layers=False, each tower's layers as it says) holding exactly the weights of
    `scan_model`."""
    loop = nnx.eval_shape(lambda: MLLM(loop_cfg, image_token_id=IMAGE_TOKEN, rngs=nnx.Rngs(0)))
    state = nnx.state(loop, nnx.Param)
    nnx.replace_by_pure_dict(state, params_in_layout(nnx.to_pure_dict(nnx.state(scan_model, nnx.Param)),
                                                     scan=loop_cfg.layer_layout))
    nnx.update(loop, state)
    return loop


def make_batch(seed=0, b=2, s=24, n=2, cfg=None, images_at=((0, 2, 0), (1, 10, 1)), lengths=None):
    """Tokens with images: `images_at` = (row, start, slot); `lengths` = tokens per row (rest padding)."""
    cfg = cfg or tiny_config()
    rng = np.random.default_rng(seed)
    t = cfg.image_tokens
    tokens = rng.integers(4, cfg.vocab_size, (b, s)).astype(np.int32)
    valid = np.zeros((b, n), bool)
    for row, start, slot in images_at:
        tokens[row, start:start + t] = IMAGE_TOKEN
        valid[row, slot] = True
    seg = np.ones((b, s), np.int32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    if lengths is not None:
        for row, n_tok in enumerate(lengths):
            seg[row, n_tok:] = 0
            pos[row, n_tok:] = 0
            tokens[row, n_tok:] = 0
    v = cfg.vision
    images = rng.standard_normal((b, n, v.image_size, v.image_size, v.channels)).astype(np.float32)
    return dict(tokens=tokens, positions=pos, segment_ids=seg, images=images, image_valid=valid)


BATCH_KEYS = ("tokens", "positions", "segment_ids", "images", "image_valid")
_JITTED = {}


def call(module: nnx.Module, method: str, *args):
    """jit(module.method)(*args), compiled once per (module structure, method, shapes)."""
    graphdef, state = nnx.split(module)
    key = (graphdef, method)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda state, *a: getattr(nnx.merge(graphdef, state), method)(*a))
    return _JITTED[key](state, *args)


def forward(model: MLLM, batch: dict) -> np.ndarray:
    return np.asarray(call(model, "__call__", *(jnp.asarray(batch[k]) for k in BATCH_KEYS)))


@pytest.fixture(scope="session")
def helpers():
    return dict(tiny_config=tiny_config, random_model=random_model, scan_to_loop=scan_to_loop,
                make_batch=make_batch, forward=forward, call=call, batch_keys=BATCH_KEYS,
                image_token=IMAGE_TOKEN)
