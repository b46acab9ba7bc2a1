"""ViT encoder: linear patch embedding, learned positions, pre-norm blocks, final LayerNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax import kernels
from mmjax.config import ModelConfig
from mmjax.errors import ModelError
from mmjax.model.layers import LayerNorm, dense, make_stack, normal, param, remat_name, run_stack, zeros
from mmjax.parallel.sharding import constrain

RESIDUAL = ("batch", None, "act_embed")  # [B*N, patches, dim]; patches stay whole (no context parallelism)


def sincos2d(grid: int, dim: int, temperature: float = 10000.0) -> jax.Array:
    """Fixed [grid*grid, dim] position embedding: sin/cos of the row and column at dim/4 frequencies each."""
    y, x = jnp.meshgrid(jnp.arange(grid, dtype=jnp.float32), jnp.arange(grid, dtype=jnp.float32), indexing="ij")
    omega = 1.0 / temperature ** (jnp.arange(dim // 4, dtype=jnp.float32) / (dim // 4))
    y = y.reshape(-1, 1) * omega
    x = x.reshape(-1, 1) * omega
    return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP
}


class VisionLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        v = cfg.vision
        d = v.dim // v.n_heads
        self.act = v.act
        self.remat = cfg.remat
        self.compute_dtype = compute_dtype
        self.attention_impl = cfg.attention_impl
        self.activation_impl = cfg.activation_impl
        w = normal(0.02)
        norm = dict(eps=v.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype, impl=cfg.norm_impl)
        self.attn_norm = LayerNorm(v.dim, **norm)
        self.qkv = param(rngs, w, (v.dim, 3, v.n_heads, d), ("embed", None, "heads", "head_dim"), param_dtype)
        self.qkv_bias = param(None, zeros, (3, v.n_heads, d), (None, "heads", "head_dim"), param_dtype)
        self.out = param(rngs, w, (v.n_heads, d, v.dim), ("heads", "head_dim", "embed"), param_dtype)
        self.out_bias = param(None, zeros, (v.dim,), ("embed",), param_dtype)
        self.mlp_norm = LayerNorm(v.dim, **norm)
        self.fc1 = param(rngs, w, (v.dim, v.mlp_dim), ("embed", "mlp"), param_dtype)
        self.fc1_bias = param(None, zeros, (v.mlp_dim,), ("mlp",), param_dtype)
        self.fc2 = param(rngs, w, (v.mlp_dim, v.dim), ("mlp", "embed"), param_dtype)
        self.fc2_bias = param(None, zeros, (v.dim,), ("embed",), param_dtype)

    def __call__(self, x, ones, positions):
        qkv = dense(self.attn_norm(x), self.qkv[...], "bse,ecnd->bscnd", self.compute_dtype, self.qkv_bias[...])
        qkv = constrain(qkv, ("batch", None, None, "heads", "head_dim"))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attn = kernels.attention(q, k, v, q_segment_ids=ones, kv_segment_ids=ones, q_positions=positions,
                                 kv_positions=positions, causal=False, impl=self.attention_impl)
        attn = remat_name(constrain(attn, ("batch", None, "heads", "head_dim")), "attention_out", self.remat)
        # residual add + LayerNorm in one kernel: (norm(x + attn_out), x + attn_out)
        hn, x = self.mlp_norm(dense(attn, self.out[...], "bsnd,nde->bse", self.compute_dtype, self.out_bias[...]),
                              residual=x)
        x = constrain(x, RESIDUAL)
        h = dense(hn, self.fc1[...], "bse,em->bsm", self.compute_dtype)
        bias = self.fc1_bias[...].astype(self.compute_dtype)
        if self.act in ("gelu", "gelu_tanh"):  # fused bias + GELU kernel
            h = kernels.bias_gelu(h, bias, approximate=self.act == "gelu_tanh", impl=self.activation_impl)
        else:
            h = ACTIVATIONS[self.act](h + bias)
        h = constrain(h, ("batch", None, "mlp"))
        return constrain(x + dense(h, self.fc2[...], "bsm,me->bse", self.compute_dtype, self.fc2_bias[...]),
                         RESIDUAL)


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        v = cfg.vision
        self.vcfg = v
        self.compute_dtype = compute_dtype
        self.scan = cfg.vision_scan_layers
        self.remat = cfg.remat
        patch_in = v.patch_size * v.patch_size * v.channels
        self.patch_embed = param(rngs, normal(0.02), (patch_in, v.dim), (None, "embed"), param_dtype)
        self.patch_bias = param(None, zeros, (v.dim,), ("embed",), param_dtype)
        n_pos = v.num_patches + int(v.class_token)
        if v.class_token:
            self.class_embed = param(rngs, normal(0.02), (v.dim,), ("embed",), param_dtype)
        if v.pos_embed == "learned":
            self.pos_embed = param(rngs, normal(0.02), (n_pos, v.dim), (None, "embed"), param_dtype)
        norm = dict(eps=v.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype, impl=cfg.norm_impl)
        if v.pre_norm:
            self.pre_norm = LayerNorm(v.dim, **norm)
        self.layers = make_stack(
            lambda r: VisionLayer(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=r),
            v.n_layers, rngs, scan=cfg.vision_scan_layers)
        if v.final_norm:
            self.final_norm = LayerNorm(v.dim, **norm)

    def patchify(self, images):
        """[B,N,H,W,C] -> [B*N, num_patches, p*p*C] (row-major patch order, (py, px, c) inside a patch)."""
        b, n, h, w, c = images.shape
        p = self.vcfg.patch_size
        x = images.reshape(b * n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b * n, (h // p) * (w // p), p * p * c)

    def __call__(self, images):
        """images [B,N,H,W,C] float (normalised) -> [B,N,num_patches,vision_dim]."""
        b, n = images.shape[:2]
        v = self.vcfg
        if images.shape[2:] != (v.image_size, v.image_size, v.channels):
            raise ModelError(f"images have shape {images.shape}, expected [B, N, {v.image_size}, "
                             f"{v.image_size}, {v.channels}] (model.vision.image_size/channels)")
        x = dense(self.patchify(images), self.patch_embed[...], "bsp,pe->bse", self.compute_dtype,
                  self.patch_bias[...])
        if v.class_token:
            cls = jnp.broadcast_to(self.class_embed[...].astype(self.compute_dtype), (x.shape[0], 1, v.dim))
            x = jnp.concatenate([cls, x], axis=1)
        if v.pos_embed == "learned":
            pos = self.pos_embed[...]
        else:
            pos = sincos2d(v.image_size // v.patch_size, v.dim, v.pos_temperature)
        if v.class_token and v.pos_embed != "learned":
            pos = jnp.concatenate([jnp.zeros((1, v.dim), pos.dtype), pos])
        x = constrain(x + pos.astype(self.compute_dtype), RESIDUAL)
        if v.pre_norm:
            x = self.pre_norm(x)
        s = x.shape[1]
        ones = jnp.ones((b * n, s), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b * n, s))

        def body(layer, h, _):
            return layer(h, ones, positions), None

        x, _ = run_stack(self.layers, body, x, scan=self.scan, remat_policy=self.remat)
        if v.final_norm:
            x = self.final_norm(x)
        if v.class_token:  # LLaVA's "default" feature selection: patch tokens only
            x, s = x[:, 1:], s - 1
        return x.reshape(b, n, s, v.dim)
