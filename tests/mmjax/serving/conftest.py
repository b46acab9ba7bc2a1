"""Tiny f32 models and the plain-forward greedy reference the serving runner and engine tests compare with."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.config import ModelConfig, ServeConfig, TextConfig, VisionConfig
from mmjax.model import MLLM

IMAGE_TOKEN = 3


def tiny_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(vocab_size=64, max_seq_len=64, compute_dtype="float32",
                      text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48),
                      vision=VisionConfig(image_size=8, patch_size=4, dim=16, n_layers=1, n_heads=2, mlp_dim=24))
    return dataclasses.replace(cfg, **overrides)


def random_model(cfg: ModelConfig, seed: int = 0) -> MLLM:
    """MLLM with numpy-drawn parameters (std 0.2 so layers visibly interact); no jax.random compiles."""
    model = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=IMAGE_TOKEN, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.2, x.dtype),
                         nnx.state(model, nnx.Param))
    nnx.update(model, state)
    return model


class PlainReference:
    """Greedy decoding by recomputing the whole sequence with the training forward for every token: the
    ground truth the paged engine must match. One fixed-size buffer (padding is segment 0), so one compile."""

    def __init__(self, model: MLLM, size: int, max_images: int = 2):
        self.model, self.size, self.max_images = model, size, max_images
        graphdef, state = nnx.split(model)
        self.state = state
        self._fwd = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a))

    def logits(self, tokens, images=()):
        """Logits [len(tokens), V] of the plain forward."""
        n, size = len(tokens), self.size
        buf = np.zeros((1, size), np.int32)
        buf[0, :n] = tokens
        seg = (np.arange(size) < n).astype(np.int32)[None]
        pos = np.where(seg > 0, np.arange(size), 0).astype(np.int32)
        v = self.model.cfg.vision
        imgs = np.zeros((1, self.max_images, v.image_size, v.image_size, v.channels), np.float32)
        valid = np.zeros((1, self.max_images), bool)
        for i, im in enumerate(images):
            imgs[0, i], valid[0, i] = im, True
        if self.model.text_only:
            imgs = valid = None
        out = self._fwd(self.state, buf, pos, seg, imgs, valid)
        return np.asarray(out[0, :n])

    def greedy(self, prompt, max_tokens, images=(), eos=None, stop=(IMAGE_TOKEN,)):
        """Greedy tokens until `eos`, a `stop` token (a generated image placeholder would be read as an image
        by the training forward, so the tests stop on it), `max_tokens` or the buffer's end."""
        seq = list(prompt)
        out = []
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(seq, images)[-1]))
            out.append(token)
            seq.append(token)
            if token == eos or token in stop or len(seq) >= self.size:
                break
        return out


@pytest.fixture(scope="session")
def draft_lm(tiny):
    """A tiny text-only target and a draft that agrees with it often but not always (its weights with noise)."""
    model = tiny["model"](tiny["config"](text_only=True), seed=3)
    rng = np.random.default_rng(0)
    graphdef, state = nnx.split(model)
    draft = (graphdef, jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), state))
    return dict(model=model, draft=draft, ref=tiny["reference"](model, size=40))


@pytest.fixture(scope="session")
def tiny():
    return dict(config=tiny_config, model=random_model, reference=PlainReference, image_token=IMAGE_TOKEN,
                serve=ServeConfig)
