"""The multimodal LLM: ViT -> projector -> merge into placeholder tokens -> decoder.

Batch contract: tokens/positions/segment_ids int32 [B,S]; images float32 [B,N,H,W,C]; image_valid bool
[B,N]. Every valid image fills exactly T = cfg.image_tokens consecutive `image_token_id` placeholders,
in image order; invalid images have none. Image tokens get block id (rank of their image among the
row's valid images) + 1, so they attend bidirectionally within their image; other tokens get block 0.

With `model.text_only` the model is the decoder alone (no vision tower or projector parameters) and
takes no images: `images`/`image_valid` must be None.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mmjax.config import ModelConfig
from mmjax.errors import ConfigError, ModelError
from mmjax.model.decoder import Decoder, PagedMeta
from mmjax.model.layers import resolve_dtype
from mmjax.model.projector import Projector
from mmjax.model.vision import VisionEncoder


class MLLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, image_token_id: int, rngs: nnx.Rngs):
        if not 0 <= image_token_id < cfg.vocab_size:
            raise ConfigError(f"image_token_id={image_token_id} is outside the vocabulary [0, {cfg.vocab_size}); "
                              "raise model.vocab_size or fix the tokenizer")
        self.cfg = cfg
        self.image_token_id = int(image_token_id)
        self.compute_dtype = resolve_dtype(cfg.compute_dtype)
        self.param_dtype = resolve_dtype(cfg.param_dtype)
        kw = dict(param_dtype=self.param_dtype, compute_dtype=self.compute_dtype, rngs=rngs)
        self.text_only = cfg.text_only
        self.vision = None if cfg.text_only else VisionEncoder(cfg, **kw)
        self.projector = None if cfg.text_only else Projector(cfg, **kw)
        self.decoder = Decoder(cfg, **kw)

    def embed(self, tokens, images=None, image_valid=None):
        """Token embeddings with projected image features merged in, and the attention block ids."""
        if self.text_only:
            if images is not None:
                raise ModelError("model.text_only=true builds no vision tower, but the batch has images; "
                                 "use a text dataset or set model.text_only=false")
            return self.decoder.embed(tokens), jnp.zeros_like(tokens, dtype=jnp.int32)
        if images is None or image_valid is None:
            raise ModelError("this model has a vision tower and needs `images` and `image_valid` "
                             "(set model.text_only=true for a decoder-only model)")
        b, n = images.shape[:2]
        t = self.cfg.image_tokens
        x = self.decoder.embed(tokens)
        img = self.projector(self.vision(images.astype(self.compute_dtype)))  # [B,N,T,D]
        img = img.reshape(b, n * t, img.shape[-1]).astype(x.dtype)
        is_img = tokens == self.image_token_id
        idx = jnp.cumsum(is_img, axis=1, dtype=jnp.int32) - 1  # k-th placeholder of the row
        idx = jnp.clip(idx, 0, n * t - 1)
        rank = idx // t  # which valid image (in order) this placeholder belongs to
        # Slot of the rank-th valid image: stable sort puts valid slots first, in slot order.
        order = jnp.argsort(~image_valid.astype(bool), axis=1, stable=True).astype(jnp.int32)
        slot = jnp.take_along_axis(order, rank, axis=1)
        flat = slot * t + idx % t
        gathered = jnp.take_along_axis(img, flat[:, :, None], axis=1)
        x = jnp.where(is_img[:, :, None], gathered, x)
        block_ids = jnp.where(is_img, rank + 1, 0).astype(jnp.int32)
        if self.cfg.image_attention == "causal":
            block_ids = jnp.zeros_like(block_ids)
        return x, block_ids

    def __call__(self, tokens, positions, segment_ids, images=None, image_valid=None):
        """Training forward: logits [B,S,vocab] float32."""
        x, block_ids = self.embed(tokens, images, image_valid)
        return self.decoder(x, positions, segment_ids, block_ids)

    def hidden(self, tokens, positions, segment_ids, images=None, image_valid=None):
        """Final-normed hidden states [B,S,E]; with `output_matrix()` the inputs of a fused loss."""
        x, block_ids = self.embed(tokens, images, image_valid)
        return self.decoder.hidden(x, positions, segment_ids, block_ids)

    def output_matrix(self):
        return self.decoder.output_matrix()

    # -- serving over a paged KV pool ------------------------------------------------------------

    def encode_images(self, images):
        """images [N,H,W,C] (normalised) -> projected features [N, image_tokens, E], the rows that replace
        each image's placeholder tokens. Computed once per image by the serving runner, not per step."""
        if self.text_only:
            raise ModelError("model.text_only=true builds no vision tower; this model cannot encode images")
        feats = self.projector(self.vision(images[None].astype(self.compute_dtype)))
        return feats[0]

    def forward_paged(self, tokens, positions, kv, meta: PagedMeta, image_rows=None, image_mask=None,
                      block_ids=None):
        """A serving step over flat tokens [1,T]: where `image_mask` [1,T] is set the token's embedding is
        replaced by `image_rows` [1,T,E] (from `encode_images`), `block_ids` [1,T] the image block ids
        (None: text only). Returns (logits [S,V] float32, updated pools); see `Decoder.forward_paged`."""
        x = self.decoder.embed(tokens)
        if image_rows is not None:
            x = jnp.where(image_mask[:, :, None], image_rows.astype(x.dtype), x)
        return self.decoder.forward_paged(x, positions, block_ids, kv, meta)
