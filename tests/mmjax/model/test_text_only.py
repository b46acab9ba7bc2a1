"""model.text_only: a decoder without vision tower/projector equals the MLLM's decoder on text."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.errors import ModelError
from mmjax.model import MLLM


def test_text_only_model_matches_mllm_decoder_on_text(helpers):
    full_cfg = helpers["tiny_config"]()
    full = helpers["random_model"](full_cfg, seed=1)
    text_cfg = dataclasses.replace(full_cfg, text_only=True)
    text = nnx.eval_shape(lambda: MLLM(text_cfg, image_token_id=helpers["image_token"], rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(text, nnx.Param))
    assert set(params) == {"decoder"}  # no vision tower or projector parameters at all
    params["decoder"] = nnx.to_pure_dict(nnx.state(full, nnx.Param))["decoder"]
    state = nnx.state(text, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(text, state)

    batch = helpers["make_batch"](seed=2, images_at=(), lengths=(24, 17))  # no image placeholders
    want = helpers["forward"](full, batch)
    keys = ("tokens", "positions", "segment_ids")
    got = np.asarray(helpers["call"](text, "__call__", *(jnp.asarray(batch[k]) for k in keys)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    with pytest.raises(ModelError, match="text_only"):
        text(*(jnp.asarray(batch[k]) for k in helpers["batch_keys"]))
