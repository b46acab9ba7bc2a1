"""Greedy generation over the KV cache equals greedy decoding by repeated full forwards."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.config import load_config
from mmjax.model import MLLM
from mmjax.serving.generate import greedy_generate

IMAGE_ID, EOS, PAD = 3, 2, 0


def tiny_model():
    cfg = load_config(None, ["model.text.dim=32", "model.text.mlp_dim=64", "model.vision.dim=32",
                             "model.vision.mlp_dim=64", "model.vocab_size=40", "model.compute_dtype=float32",
                             "model.vision.image_size=32", "model.vision.patch_size=16"]).model
    return cfg, MLLM(cfg, image_token_id=IMAGE_ID, rngs=nnx.Rngs(params=0))


def naive_greedy(model, tokens, length, images, image_valid, steps):
    """Greedy decoding by a full forward per token, no cache. The sequence lives in a fixed-size buffer whose
    unused tail is padding (segment 0), which causal attention never lets the real tokens see: one compile."""
    size = length + steps
    forward = nnx.jit(lambda m, t, seg: m(t, jnp.arange(size)[None], seg, images, image_valid))
    buf = np.zeros((1, size), np.int32)
    buf[0, :length] = tokens[:length]
    out = []
    for s in range(length, size):
        seg = (np.arange(size) < s).astype(np.int32)[None]
        nxt = int(jnp.argmax(forward(model, jnp.asarray(buf), jnp.asarray(seg))[0, s - 1]))
        out.append(nxt)
        buf[0, s] = nxt
    return out


def test_greedy_generate_matches_full_forward_decoding():
    cfg, model = tiny_model()
    t = cfg.image_tokens
    rng = np.random.default_rng(0)
    lengths = [t + 3, t + 7]
    S = 16
    tokens = np.zeros((2, S), np.int32)
    for row, n in enumerate(lengths):
        tokens[row, 0] = 1
        tokens[row, 1:1 + t] = IMAGE_ID
        tokens[row, 1 + t:n] = rng.integers(5, 40, n - 1 - t)
    segment_ids = (np.arange(S)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    positions = np.where(segment_ids > 0, np.arange(S)[None], 0).astype(np.int32)
    images = rng.normal(size=(2, 1, 32, 32, 3)).astype(np.float32)
    valid = np.ones((2, 1), bool)
    prompt = dict(tokens=tokens, positions=positions, segment_ids=segment_ids, images=images, image_valid=valid)
    # eos_id outside the vocab so no row stops early and every step is compared
    out = jax.jit(lambda p: greedy_generate(model, p, max_new_tokens=5, eos_id=10**6, pad_id=PAD))(prompt)
    for row, n in enumerate(lengths):
        expected = naive_greedy(model, tokens[row], n, images[row:row + 1], valid[row:row + 1], 5)
        assert out[row].tolist() == expected


def test_rows_emit_pad_after_eos():
    cfg, model = tiny_model()
    t = cfg.image_tokens
    S = 12
    tokens = np.zeros((1, S), np.int32)
    tokens[0, 0] = 1
    tokens[0, 1:1 + t] = IMAGE_ID
    seg = (np.arange(S) < t + 1).astype(np.int32)[None]
    prompt = dict(tokens=tokens, positions=np.where(seg > 0, np.arange(S), 0).astype(np.int32), segment_ids=seg,
                  images=np.zeros((1, 1, 32, 32, 3), np.float32), image_valid=np.ones((1, 1), bool))
    free = greedy_generate(model, prompt, max_new_tokens=4, eos_id=10**6, pad_id=PAD)
    eos = int(free[0, 1])  # declare the second generated token to be eos
    out = greedy_generate(model, prompt, max_new_tokens=4, eos_id=eos, pad_id=PAD)
    free = free[0].tolist()
    stop = free.index(eos) + 1
    assert out[0].tolist() == free[:stop] + [PAD] * (4 - stop)
