"""FLOP accounting for `train/mfu` (model FLOPs utilisation).

Training FLOPs = 3 x forward FLOPs (backward = 2 x forward), the "6N" rule made explicit per part:

* **Decoder, per non-padding token**: 2 x (matmul weights touched per token): per layer the fused QKV
  projection `dim*(n_heads + 2*n_kv_heads)*head_dim`, the output projection `n_heads*head_dim*dim`, the
  SwiGLU MLP `3*dim*mlp_dim`; plus the LM head `dim*vocab`. The embedding lookup is a gather (0 FLOPs).
* **Decoder attention**: QK^T and AV cost `2 * 2 * head_dim * n_heads` per (query, key) pair per layer.
  With causal masking a token at position p attends p+1 keys, so the step's pair count is
  `sum(positions + 1)` over non-padding tokens (computed exactly inside the train step from the batch,
  which for full rows of length S is S(S+1)/2: the usual "causal halving" of S^2).
* **Vision encoder, per valid image**: patch embedding `2*P*patch_in*dim_v`, per layer QKV/out
  `2*P*4*dim_v^2`, MLP `2*P*2*dim_v*mlp_v`, bidirectional attention `2*2*P^2*dim_v` (P = patches);
  the projector `2*P*(dim_v*hidden + hidden*dim_text)`. Image slots without an image are not counted.

Norms, softmax, activations and the optimizer are not counted (they are not model FLOPs), nor is
rematerialised recompute (that would be hardware FLOPs): MFU is comparable across remat policies.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from mmjax.config import ModelConfig

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak per device (FLOP/s), matched as a substring of `jax.Device.device_kind`
# (first match wins, so the more specific names come first).
PEAK_FLOPS_BF16: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops_per_device(device: jax.Device | None = None, override: float = 0.0) -> float | None:
    """Peak bf16 FLOP/s of one device: `override` if set, else the table entry for its kind, else None."""
    if override > 0:
        return float(override)
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kind = device.device_kind
    for name, peak in PEAK_FLOPS_BF16:
        if name.lower() in kind.lower():
            return peak
    log.warning("no peak FLOP/s known for device kind %r; set observe.peak_flops_per_device for train/mfu", kind)
    return None


@dataclasses.dataclass(frozen=True)
class FlopCounts:
    """Training FLOPs (forward + backward) per unit; total = per_token*tokens + per_pair*pairs + per_image*images."""

    per_token: float
    per_attention_pair: float
    per_image: float

    def step_flops(self, tokens: float, attention_pairs: float, images: float) -> float:
        return self.per_token * tokens + self.per_attention_pair * attention_pairs + self.per_image * images


def decoder_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies through in the decoder (the N of 6N, LM head included, embedding gather not)."""
    t = cfg.text
    hd = t.resolved_head_dim
    per_layer = t.dim * (t.n_heads + 2 * t.n_kv_heads) * hd + t.n_heads * hd * t.dim + 3 * t.dim * t.mlp_dim
    return t.n_layers * per_layer + t.dim * cfg.vocab_size


def vision_forward_flops_per_image(cfg: ModelConfig) -> float:
    if cfg.text_only:
        return 0.0
    v = cfg.vision
    p = v.num_patches
    patch_in = v.patch_size * v.patch_size * v.channels
    per_layer = 2 * p * (4 * v.dim * v.dim + 2 * v.dim * v.mlp_dim) + 2 * 2 * p * p * v.dim
    hidden = cfg.projector.hidden_dim or cfg.text.dim
    projector = 2 * p * (v.dim * hidden + hidden * cfg.text.dim)
    return 2 * p * patch_in * v.dim + v.n_layers * per_layer + projector


def training_flops(cfg: ModelConfig) -> FlopCounts:
    t = cfg.text
    return FlopCounts(
        per_token=3 * 2 * decoder_params_per_token(cfg),
        per_attention_pair=3 * 2 * 2 * t.resolved_head_dim * t.n_heads * t.n_layers,
        per_image=3 * vision_forward_flops_per_image(cfg),
    )
