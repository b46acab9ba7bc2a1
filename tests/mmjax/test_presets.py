"""Model presets have their checkpoints' exact public shapes (parameter counts of the Hugging Face models;
LLaVA's minus the CLIP layer after feature layer -2 and the unused post-LayerNorm, plus a zero patch bias)."""

import jax
import pytest
from flax import nnx

from mmjax.config import load_config
from mmjax.model import MLLM

COUNTS = {"llama3.2_1b": 1_235_814_400, "llama3.2_3b": 3_212_749_824, "qwen2_0.5b": 494_032_768,
          "qwen2_1.5b": 1_543_714_304, "llava1.5_7b": 7_063_427_072 - 12_596_224 - 2048 + 1024,
          "smollm2_135m": 134_515_008}


@pytest.mark.parametrize("name", [*COUNTS, "siglip_qwen2_0.5b"])
def test_preset_shapes(name):
    cfg = load_config(f"models/{name}.yaml").model
    model = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=0, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sizes = {k: sum(x.size for x in jax.tree.leaves(v)) for k, v in params.items()}
    if name in COUNTS:
        assert sum(sizes.values()) == COUNTS[name]
    else:  # the Qwen2-0.5B decoder, 256 SigLIP tokens
        assert sizes["decoder"] == COUNTS["qwen2_0.5b"] and cfg.image_tokens == 256
    if name.startswith("llama3.2"):
        assert cfg.text.rope_scaling == "llama3" and cfg.text.rope_factor == 32.0


def test_finetune_config_loads():
    cfg = load_config("finetune_llava.yaml", ["data.paths=[x.json]", "data.tokenizer=t"])
    assert cfg.data.source == "llava" and cfg.optim.lr == 2e-5
