"""A tiny decoder config for kernel-wiring tests (no vision tower needed)."""

from mmjax.config import ModelConfig, TextConfig


def tiny_decoder_config(**overrides) -> ModelConfig:
    import dataclasses
    cfg = ModelConfig(vocab_size=96, max_seq_len=32, compute_dtype="float32",
                      text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48))
    return dataclasses.replace(cfg, **overrides)
