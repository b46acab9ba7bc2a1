"""LLaVA-1.5 projector: Linear(vision.dim -> hidden) -> GELU -> Linear(hidden -> text.dim), plus an
optional learned per-image-token position table in the decoder's space (model.projector.pos_embed)."""

from __future__ import annotations

from flax import nnx

from mmjax import kernels
from mmjax.config import ModelConfig
from mmjax.model.layers import dense, normal, param, zeros
from mmjax.parallel.sharding import constrain


class Projector(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        vdim, tdim = cfg.vision.dim, cfg.text.dim
        hidden = cfg.projector.hidden_dim or tdim
        self.compute_dtype = compute_dtype
        self.activation_impl = cfg.activation_impl
        self.fc1 = param(rngs, normal(0.02), (vdim, hidden), ("embed", "mlp"), param_dtype)
        self.fc1_bias = param(None, zeros, (hidden,), ("mlp",), param_dtype)
        self.fc2 = param(rngs, normal(0.02), (hidden, tdim), ("mlp", "embed"), param_dtype)
        self.fc2_bias = param(None, zeros, (tdim,), ("embed",), param_dtype)
        self.has_pos_embed = cfg.projector.pos_embed == "learned"
        if self.has_pos_embed:  # same scale as the token embeddings it sits beside
            self.pos_embed = param(rngs, normal(0.02), (cfg.image_tokens, tdim), (None, "embed"), param_dtype)

    def __call__(self, x):
        """[..., image_tokens, vision.dim] -> [..., image_tokens, text.dim]."""
        h = kernels.bias_gelu(dense(x, self.fc1[...], "...v,vh->...h", self.compute_dtype),
                              self.fc1_bias[...].astype(self.compute_dtype), approximate=False,
                              impl=self.activation_impl)
        h = constrain(h, ("batch",) + (None,) * (h.ndim - 2) + ("mlp",))
        out = dense(h, self.fc2[...], "...h,ht->...t", self.compute_dtype, self.fc2_bias[...])
        if self.has_pos_embed:
            out = out + self.pos_embed[...].astype(self.compute_dtype)
        return out
